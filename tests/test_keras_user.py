"""What a Keras or TF Estimator user expects: a saved model is the model, a
tower ending in a sigmoid trains as probabilities, a wrong output shape is
one clear error before any step, named Keras inputs match features, the
reader reads what the model needs (or says what it lacks up front), a
restore for evaluation and a checkpoint print nothing of TensorFlow's, a
resumed progress bar counts from the global step, an empty evaluation says
so, and a run resumed with more epochs reads them whole."""

from __future__ import annotations

import gc
import io
import logging
import traceback
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import wuliang as wl
from wuliang.embedding.bridge import TowerOutputError
from wuliang.reader import ParquetReader

ROWS = 512


def write_clicks(path: Path, rows: int = ROWS, seed: int = 0) -> Path:
    """Click logs as a user has them: string ids, a price, an integer
    category, a learnable label."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 40, rows)
    items = rng.integers(0, 60, rows)
    price = rng.gamma(2.0, 30.0, rows).astype(np.float32)
    label = ((users % 3 == 0) | (items % 4 == 0)).astype(np.float32)
    pq.write_table(
        pa.table(
            {
                "user": [f"u{u}" for u in users],
                "item": [f"i{i}" for i in items],
                "price": price,
                "category": (items % 5).astype(np.int64),
                "click": label,
            }
        ),
        path,
        row_group_size=100,
    )
    return path


@pytest.fixture(scope="module")
def clicks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_clicks(tmp_path_factory.mktemp("clicks") / "clicks.parquet")


def features() -> list[Any]:
    table = wl.EmbeddingTable("ids", 8, optimizer=wl.optimizers.Adagrad(0.1))
    return [
        wl.SparseFeature("user", table),
        wl.SparseFeature("item", table),
        wl.DenseFeature("price"),
    ]


def sigmoid_tower() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1, activation="sigmoid")]
    )


def logit_tower() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])


def reader(path: Path, **kwargs: Any) -> ParquetReader:
    return ParquetReader(path, 64, **kwargs)


# -- a saved model is the model --------------------------------------------------------


def test_an_estimator_with_a_model_dir_is_the_saved_model(
    clicks: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tmp_path / "model"
    trained = wl.Estimator(logit_tower(), features(), label="click", model_dir=model_dir)
    trained.train(reader(clicks, epochs=3))
    want = trained.evaluate(reader(clicks))
    assert trained.latest_checkpoint() == model_dir / f"ckpt-{trained.global_step}"
    with caplog.at_level(logging.INFO, logger="wuliang"):
        fresh = wl.Estimator(logit_tower(), features(), label="click", model_dir=model_dir)
        got = fresh.evaluate(reader(clicks))
    assert got == want  # not a fresh model's (a fresh tower scores near 0.5)
    assert f"restored {model_dir / f'ckpt-{trained.global_step}'}" in caplog.text
    assert f"(step {trained.global_step})" in caplog.text
    # A Checkpoint hook names the folder as well; predictions and exports too.
    by_hook = wl.Estimator(
        logit_tower(), features(), label="click", hooks=[wl.hooks.Checkpoint(model_dir)]
    )
    assert by_hook.model_dir == model_dir
    scores = np.concatenate(list(by_hook.predict(reader(clicks))))
    assert len(scores) == ROWS
    exported = by_hook.export(tmp_path / "exports")
    assert exported.step == trained.global_step
    # Training goes on from the checkpoint, into the same folder.
    more = wl.Estimator(logit_tower(), features(), label="click", model_dir=model_dir)
    more.train(reader(clicks, epochs=4))  # the reader resumes after the 3 epochs read
    assert more.global_step == trained.global_step // 3 * 4
    assert more.latest_checkpoint() == model_dir / f"ckpt-{more.global_step}"


class ListTower(keras.Model):
    """Layers kept in a Python list, which Keras 3 keeps out of TensorFlow's
    object graph (a plain ``tf.train.Checkpoint`` of it leaves them out)."""

    def __init__(self) -> None:
        super().__init__()
        keras.utils.set_random_seed(3)
        self.hidden = [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(8)]
        self.logit = keras.layers.Dense(1)

    def call(self, embeddings: dict[str, Any], dense: dict[str, Any]) -> Any:
        x = keras.ops.concatenate([embeddings["user"], embeddings["item"], dense["price"]], -1)
        for layer in self.hidden:
            x = layer(x)
        return self.logit(x)


def test_layers_in_a_list_are_in_the_checkpoint(clicks: Path, tmp_path: Path) -> None:
    trained = wl.Estimator(ListTower(), features(), label="click", model_dir=tmp_path / "m")
    trained.train(reader(clicks, epochs=2))
    want = trained.evaluate(reader(clicks))
    scores = np.concatenate(list(trained.predict(reader(clicks))))
    fresh = wl.Estimator(ListTower(), features(), label="click", model_dir=tmp_path / "m")
    assert fresh.evaluate(reader(clicks)) == want
    np.testing.assert_array_equal(np.concatenate(list(fresh.predict(reader(clicks)))), scores)


INPUTS = {"ids": ("user", "item")}  # a module-level dict of settings, as users keep them


def test_a_function_tower_reading_a_dict_of_settings_exports(clicks: Path, tmp_path: Path) -> None:
    """A dict of plain settings in a function tower's globals is trackable
    to TensorFlow but holds no variables: checkpoints and exports pass it
    over instead of failing on it."""
    mlp = logit_tower()

    def tower(embeddings: dict[str, Any], dense: dict[str, Any]) -> Any:
        x = keras.ops.concatenate([embeddings[name] for name in INPUTS["ids"]], -1)
        return mlp(keras.ops.concatenate([x, dense["price"]], -1))

    trained = wl.Estimator(tower, features(), label="click", model_dir=tmp_path / "m")
    trained.train(reader(clicks))
    assert sum(trained.export(tmp_path / "exports").rows.values()) > 0
    want = trained.evaluate(reader(clicks))
    mlp = logit_tower()  # a fresh tower, restored from the checkpoint
    assert (
        wl.Estimator(tower, features(), label="click", model_dir=tmp_path / "m").evaluate(
            reader(clicks)
        )
        == want
    )


def test_a_checkpoint_hook_of_another_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one model, one folder"):
        wl.Estimator(
            logit_tower(),
            features(),
            label="click",
            model_dir=tmp_path / "a",
            hooks=[wl.hooks.Checkpoint(tmp_path / "b")],
        )


def test_an_estimator_saves_checkpoints_on_request(clicks: Path, tmp_path: Path) -> None:
    est = wl.Estimator(logit_tower(), features(), label="click")
    est.train(reader(clicks), steps=3)
    with pytest.raises(ValueError, match="needs a folder"):
        est.save_checkpoint()
    assert est.save_checkpoint(tmp_path / "m") == tmp_path / "m" / "ckpt-3"


# -- probabilities are not logits ------------------------------------------------------


def test_a_tower_ending_in_a_sigmoid_trains_as_probabilities(clicks: Path) -> None:
    session = wl.Session(sigmoid_tower(), features())
    batch = next(iter(reader(clicks, features=["user", "item", "price"], label="click")))
    out = session.run(batch, ["logits", "predictions", "loss"], train=False)
    probabilities = out["logits"].reshape(-1)  # the tower's output
    np.testing.assert_allclose(out["predictions"], probabilities, rtol=1e-6)  # no second sigmoid
    labels = batch.labels

    def cross_entropy(p: np.ndarray) -> float:
        p = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
        return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))

    # (saturated outputs: the loss uses their logits, the clip here costs ~1%)
    assert out["loss"] == pytest.approx(cross_entropy(probabilities), rel=0.01)
    twice = cross_entropy(1 / (1 + np.exp(-probabilities)))  # taken as logits
    assert abs(out["loss"] - twice) > 0.1


def test_sigmoid_and_logit_towers_learn_alike(clicks: Path) -> None:
    aucs = {}
    ids = features()[:2]
    for name, tower in (("sigmoid", sigmoid_tower()), ("logits", logit_tower())):
        est = wl.Estimator(tower, ids, label="click")
        est.train(reader(clicks, epochs=8))
        aucs[name] = est.evaluate(reader(clicks))["auc"]
    assert aucs["sigmoid"] > 0.7 and abs(aucs["sigmoid"] - aucs["logits"]) < 0.05, aucs


def test_from_logits_contradicting_a_sigmoid_is_refused() -> None:
    with pytest.raises(ValueError, match=r"last layer is a sigmoid.*from_logits=False"):
        wl.Session(sigmoid_tower(), features(), from_logits=True)
    session = wl.Session(logit_tower(), features(), from_logits=False)  # taken as said
    assert not session.functions.loss.from_logits


# -- the tower's shape, its inputs ------------------------------------------------------


def test_a_wrong_output_shape_is_one_clear_error(clicks: Path) -> None:
    tower = keras.Sequential([keras.layers.Dense(2)])
    est = wl.Estimator(tower, features(), label="click")
    with pytest.raises(TowerOutputError, match=r"shape \[B, 2\].*\[B, 1\] or \[B\]") as caught:
        est.train(reader(clicks))
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert not any("autograph" in f.filename or "tensorflow" in f.filename for f in frames)


def test_named_keras_inputs_take_their_features(clicks: Path) -> None:
    keras.utils.set_random_seed(4)
    inputs = {
        "user": keras.Input(shape=(8,), name="user"),
        "item": keras.Input(shape=(8,), name="item"),
        "price": keras.Input(shape=(1,), name="price"),
    }
    scaled = keras.layers.Lambda(lambda x: keras.ops.log1p(x))(inputs["price"])
    hidden = keras.layers.Dense(16, activation="relu")(
        keras.layers.Concatenate()([inputs["user"], inputs["item"], scaled])
    )
    tower = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    est = wl.Estimator(tower, features(), label="click")
    est.train(reader(clicks, epochs=4))
    assert est.evaluate(reader(clicks))["auc"] > 0.7
    wrong = keras.Model(
        {"user": inputs["user"], "age": keras.Input(shape=(1,), name="age")},
        keras.layers.Dense(1)(inputs["user"]),
    )
    with pytest.raises(ValueError, match="input 'age' names no feature"):
        wl.Session(wrong, features())
    narrow = keras.Input(shape=(4,), name="user")
    with pytest.raises(ValueError, match=r"input 'user' has shape \(None, 4\).*\[B, 8\]"):
        wl.Session(keras.Model(narrow, keras.layers.Dense(1)(narrow)), features())


# -- the reader reads what the model needs -----------------------------------------------


def test_the_reader_reads_what_the_model_needs(clicks: Path) -> None:
    unlisted = ParquetReader(clicks, 64)  # no features, no label
    est = wl.Estimator(logit_tower(), features(), label="click")
    assert est.train(unlisted)["samples"] == ROWS
    assert unlisted.features == ["user", "item", "price"] and unlisted.labels == ["click"]
    lacking = ParquetReader(clicks, 64, ["user", "price"], label="click")
    with pytest.raises(ValueError, match=r"feature\(s\) 'item'.*features=\['user', 'price'\]"):
        est.train(lacking)
    with pytest.raises(ValueError, match="the reader has no features"):
        next(iter(ParquetReader(clicks, 64)))


def test_an_integer_column_as_a_dense_feature_says_what_to_do(clicks: Path) -> None:
    table = wl.EmbeddingTable("ids", 8)
    model = [wl.SparseFeature("user", table), wl.DenseFeature("category")]
    est = wl.Estimator(logit_tower(), model, label="click")
    with pytest.raises(ValueError, match=r"DenseFeature 'category': the column is int64.*as ids"):
        est.train(ParquetReader(clicks, 64))
    swapped = [wl.SparseFeature("user", table), wl.SparseFeature("price", table)]
    with pytest.raises(ValueError, match=r"SparseFeature 'price'.*as numbers"):
        wl.Estimator(logit_tower(), swapped, label="click").train(ParquetReader(clicks, 64))


# -- quiet, and the small things -------------------------------------------------------


def tensorflow_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name in ("tensorflow", "absl")]


def test_restoring_for_evaluation_and_saving_print_nothing_of_tensorflows(
    clicks: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tmp_path / "model"
    with caplog.at_level(logging.INFO):
        est = wl.Estimator(logit_tower(), features(), label="click", model_dir=model_dir)
        est.train(reader(clicks))
        est.save_checkpoint()
        gc.collect()
        assert tensorflow_lines(caplog) == []  # no "Assets written to", no renamed inputs
        fresh = wl.Estimator(logit_tower(), features(), label="click", model_dir=model_dir)
        fresh.evaluate(reader(clicks))
        del fresh
        gc.collect()  # unrestored values are reported when the checkpoint object goes
    assert tensorflow_lines(caplog) == []


def test_a_resumed_progress_bar_counts_from_the_global_step(
    clicks: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "model"
    wl.Estimator(logit_tower(), features(), label="click", model_dir=model_dir).train(
        reader(clicks)
    )
    shown = io.StringIO()
    import tqdm

    real = tqdm.tqdm
    monkeypatch.setattr(tqdm, "tqdm", lambda *a, **k: real(*a, **{**k, "file": shown}))
    resumed = wl.Estimator(logit_tower(), features(), label="click", model_dir=model_dir)
    bar = wl.hooks.ProgressBar(total=8)
    resumed.train(reader(clicks, epochs=2), hooks=[bar])
    assert bar._bar.initial == 8 and bar._bar.n == 16 and bar._bar.total == 16
    assert "16/16" in shown.getvalue()


def test_evaluating_nothing_says_so(
    clicks: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(clicks).slice(0, 0), empty)
    est = wl.Estimator(logit_tower(), features(), label="click")
    with caplog.at_level(logging.WARNING, logger="wuliang"):
        result = est.evaluate(reader(empty))
    assert result["examples"] == 0 and np.isnan(result["auc"])
    assert "no examples" in caplog.text


def test_a_run_resumed_with_more_epochs_reads_them_whole(clicks: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    for epochs, seen in ((1, ROWS), (2, ROWS), (2, 0)):
        est = wl.Estimator(logit_tower(), features(), label="click", model_dir=model_dir)
        done = est.train(reader(clicks, epochs=epochs, shuffle_buffer=300, seed=1))
        assert done["samples"] == seen, (epochs, done)
