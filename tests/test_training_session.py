"""Session and Estimator: fetches, train/eval modes, multi-task, learning,
independent contexts, determinism, pipeline shutdown and staleness."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

import wuliang as wl
from wuliang import hooks
from wuliang.ps_server import Normal
from wuliang.reader import Csr, CsrBatch, ParquetReader

B = 8
KEYS = 40


def table(name: str = "emb", dim: int = 4, lr: float = 0.1) -> wl.EmbeddingTable:
    return wl.EmbeddingTable(name, dim, optimizer=wl.optimizers.SGD(lr), initializer=Normal(0.3))


def make_batch(rng: np.random.Generator, size: int = B, labels: bool = True) -> CsrBatch:
    """user: one key per row; hist: 0..3 keys per row (some rows empty); x: one float."""
    user = Csr(rng.integers(1, KEYS, size).astype(np.uint64), np.arange(size + 1, dtype=np.int64))
    lengths = rng.integers(0, 4, size)
    hist = Csr(
        rng.integers(1, KEYS, lengths.sum()).astype(np.uint64),
        np.r_[0, np.cumsum(lengths)].astype(np.int64),
    )
    x = rng.standard_normal((size, 1)).astype(np.float32)
    y = (rng.random(size) < 0.5).astype(np.float32) if labels else None
    return CsrBatch({"user": user, "hist": hist}, x, y, size, {"x": slice(0, 1)})


def batches(n: int, seed: int = 0, size: int = B) -> list[CsrBatch]:
    rng = np.random.default_rng(seed)
    return [make_batch(rng, size) for _ in range(n)]


class Tower:
    """Dense(1) over [user, hist, x]; exposes user_vec as a named output."""

    def __init__(self, seed: int = 1, width: int = 9) -> None:
        self.layer = keras.layers.Dense(
            1, kernel_initializer=keras.initializers.GlorotUniform(seed)
        )
        self.layer.build((None, width))

    def __call__(self, emb: dict[str, tf.Tensor], dense: dict[str, tf.Tensor]) -> Any:
        logits = self.layer(tf.concat([emb["user"], emb["hist"], dense["x"]], axis=1))
        return logits, {"user_vec": emb["user"] * 2.0}


def features(user: wl.EmbeddingTable, hist: wl.EmbeddingTable | None = None) -> list[Any]:
    return [
        wl.SparseFeature("user", user),
        wl.SparseFeature("hist", hist or user, combiner="mean"),
        wl.DenseFeature("x"),
    ]


def session(tower: Any = None, context: wl.Context | None = None, **kwargs: Any) -> wl.Session:
    return wl.Session(
        tower or Tower(),
        kwargs.pop("feats", None) or features(table()),
        context or wl.Context(num_shards=2),
        optimizer=kwargs.pop("optimizer", None) or keras.optimizers.SGD(0.05),
        **kwargs,
    )


def rows(s: wl.Session, name: str = "emb") -> dict[int, np.ndarray]:
    out = {}
    for chunk in s.context.engine.export(name):
        out.update({int(k): w.copy() for k, w in zip(chunk.keys, chunk.weights, strict=True)})
    return out


def kernel(s: wl.Session) -> list[np.ndarray]:
    return [np.array(w) for w in s.functions.tower.layer.get_weights()]


class RecordLoss(hooks.SessionRunHook):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def before_run(self, run_context: hooks.SessionRunContext) -> hooks.SessionRunArgs:
        return hooks.SessionRunArgs(["loss"])

    def after_run(
        self, run_context: hooks.SessionRunContext, run_values: hooks.SessionRunValues
    ) -> None:
        self.losses.append(float(run_values.results["loss"]))


def wuliang_threads() -> list[str]:
    """wuliang's threads, but a parameter server's call threads (its
    ``*_async`` calls), which live until the server is closed."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith("wuliang") and not t.name.startswith("wuliang-ps-call")
    )


# --- Session.run ----------------------------------------------------------------


def test_run_fetches_every_name() -> None:
    s = session()
    batch = batches(1)[0]
    out = s.run(batch, ["loss", "predictions", "logits", "user", "hist", "user_vec"])
    assert set(out) == {"loss", "predictions", "logits", "user", "hist", "user_vec"}
    assert np.ndim(out["loss"]) == 0 and np.isfinite(out["loss"])
    assert out["predictions"].shape == (B,)
    assert out["logits"].shape == (B, 1)
    np.testing.assert_allclose(out["predictions"], tf.sigmoid(out["logits"][:, 0]), rtol=1e-6)
    assert out["user"].shape == (B, 4) and out["hist"].shape == (B, 4)
    np.testing.assert_allclose(out["user_vec"], 2.0 * out["user"], rtol=1e-6)
    empty = np.diff(batch.sparse["hist"].offsets) == 0
    assert empty.any()
    np.testing.assert_array_equal(out["hist"][empty], 0.0)  # empty rows pool to zero
    p = 1.0 / (1.0 + np.exp(-out["logits"][:, 0].astype(np.float64)))
    y = batch.labels
    bce = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    np.testing.assert_allclose(out["loss"], bce, rtol=1e-5)

    loss = s.run(batch, "loss")  # one name: the bare value
    assert not isinstance(loss, dict) and np.ndim(loss) == 0
    predictions = s.run(batch, "predictions", train=False)
    assert isinstance(predictions, np.ndarray) and predictions.shape == (B,)
    assert s.fetchable() == ["loss", "predictions", "logits", "user", "hist", "user_vec"]

    step = s.global_step
    with pytest.raises(KeyError) as info:
        s.run(batch, ["loss", "nope"])
    assert s.global_step == step  # checked before the step runs
    message = str(info.value)
    assert "'nope'" in message
    for name in ("loss", "predictions", "logits", "user", "hist", "user_vec"):
        assert name in message


def test_unknown_fetch_on_the_first_run_trains_nothing() -> None:
    """Before the first step the tower's outputs are unknown, so names are checked
    after it ran; a failing run must still leave the model as it was."""
    s = session()
    before = kernel(s)
    with pytest.raises(KeyError, match="nope"):
        s.run(batches(1)[0], ["loss", "nope"])
    assert s.global_step == 0
    # An unknown fetch name fails before the step trains anything.
    for got, want in zip(kernel(s), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_train_false_changes_nothing_train_true_does() -> None:
    s = session()
    first, second = batches(2, seed=3)
    s.run(first, "loss")  # rows exist now
    assert s.global_step == 1
    rows_before, kernel_before = rows(s), kernel(s)
    out = s.run(second, ["loss", "predictions"], train=False)
    assert np.isfinite(out["loss"]) and out["predictions"].shape == (B,)
    assert s.global_step == 1
    after = rows(s)
    assert sorted(after) == sorted(rows_before)  # no new rows for unseen keys
    for key, row in rows_before.items():
        np.testing.assert_array_equal(after[key], row)
    for got, want in zip(kernel(s), kernel_before, strict=True):
        np.testing.assert_array_equal(got, want)

    s.run(second, "loss", train=True)
    assert s.global_step == 2
    after = rows(s)
    keys = set(second.sparse["user"].values.tolist()) | set(second.sparse["hist"].values.tolist())
    assert keys <= set(after)
    changed = {k for k in keys if k in rows_before and not np.array_equal(after[k], rows_before[k])}
    assert changed == keys & set(rows_before)
    assert any(not np.array_equal(g, w) for g, w in zip(kernel(s), kernel_before, strict=True))


def test_training_without_labels_is_a_clear_error() -> None:
    s = session()
    unlabeled = make_batch(np.random.default_rng(1), labels=False)
    with pytest.raises(ValueError, match="labels"):
        s.run(unlabeled, "loss", train=True)
    with pytest.raises(ValueError, match="labels"):
        s.train([unlabeled])
    assert wuliang_threads() == []
    # without labels, inference still works
    assert s.run(unlabeled, "predictions", train=False).shape == (B,)
    with pytest.raises(ValueError, match="labels"):
        s.evaluate([unlabeled])


def test_missing_labels_after_the_first_step_is_a_clear_error() -> None:
    s = session()
    s.run(batches(1)[0], "loss")
    unlabeled = make_batch(np.random.default_rng(1), labels=False)
    # (Before a83a78a: once the train step was traced, the labels were no longer
    # checked; TF raised "TypeError: Binding inputs to tf.function failed ...".)
    with pytest.raises(ValueError, match="labels"):
        s.run(unlabeled, "loss", train=True)


# --- multi-task -----------------------------------------------------------------


def write_parquet(path: Path, n: int, seed: int, multi_task: bool = False) -> Path:
    """user (single key), hist (list of keys), x; click depends on user and x;
    like on user only."""
    rng = np.random.default_rng(seed)
    effect = np.random.default_rng(99).normal(0.0, 1.5, KEYS + 1)
    user = rng.integers(1, KEYS + 1, n)
    x = rng.standard_normal(n).astype(np.float32)
    lengths = rng.integers(0, 4, n)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    hist = rng.integers(1, KEYS + 1, offsets[-1]).astype(np.uint64)
    click = rng.random(n) < 1.0 / (1.0 + np.exp(-(effect[user] + 1.5 * x)))
    columns = {
        "user": pa.array(user.astype(np.uint64)),
        "hist": pa.ListArray.from_arrays(pa.array(offsets), pa.array(hist)),
        "x": pa.array(x),
        "click": pa.array(click.astype(np.float32)),
    }
    if multi_task:
        like = rng.random(n) < 1.0 / (1.0 + np.exp(effect[user]))
        columns["like"] = pa.array(like.astype(np.float32))
    pq.write_table(pa.table(columns), path)
    return path


class MultiTaskTower:
    def __init__(self) -> None:
        init = keras.initializers.GlorotUniform
        self.click = keras.layers.Dense(1, kernel_initializer=init(1))
        self.like = keras.layers.Dense(1, kernel_initializer=init(2))

    def __call__(self, emb: dict[str, tf.Tensor], dense: dict[str, tf.Tensor]) -> Any:
        h = tf.concat([emb["user"], emb["hist"], dense["x"]], axis=1)
        return {"click": self.click(h), "like": self.like(h)}


def test_multi_task(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "mt.parquet", 100, seed=1, multi_task=True)
    s = session(MultiTaskTower(), loss={"click": "binary_crossentropy", "like": "mse"})
    with ParquetReader(path, 32, ["user", "hist", "x"], label=["click", "like"]) as reader:
        batch = next(iter(reader))
        assert isinstance(batch.labels, dict) and set(batch.labels) == {"click", "like"}
        out = s.run(batch, ["loss", "predictions", "logits"])
        assert set(out["predictions"]) == {"click", "like"} == set(out["logits"])
        for name in ("click", "like"):
            assert out["predictions"][name].shape == (32,)
        click_logits = out["logits"]["click"][:, 0].astype(np.float64)
        like_logits = out["logits"]["like"][:, 0].astype(np.float64)
        np.testing.assert_allclose(
            out["predictions"]["click"], 1 / (1 + np.exp(-click_logits)), rtol=1e-5
        )
        np.testing.assert_allclose(out["predictions"]["like"], like_logits, rtol=1e-6)
        y, z = batch.labels["click"], batch.labels["like"]
        p = 1 / (1 + np.exp(-click_logits))
        want = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)) + np.mean((like_logits - z) ** 2)
        np.testing.assert_allclose(out["loss"], want, rtol=1e-5)

        record = RecordLoss()
        result = s.train(reader, hooks=[record])
        assert result["steps"] == 4 and result["samples"] == 100
        assert len(record.losses) == 4 and np.isfinite(record.losses).all()
        predictions = list(s.predict(reader))
        assert [p["click"].shape for p in predictions] == [(32,), (32,), (32,), (4,)]
        assert all(set(p) == {"click", "like"} for p in predictions)


def test_evaluate_of_a_multi_task_model_is_a_clear_error(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "mt.parquet", 40, seed=1, multi_task=True)
    s = session(MultiTaskTower(), loss={"click": "binary_crossentropy", "like": "mse"})
    reader = ParquetReader(path, 20, ["user", "hist", "x"], label=["click", "like"])
    # evaluate() of a multi-task model points to predict().
    with reader, pytest.raises(ValueError, match="predict"):
        s.evaluate(reader)


def test_multi_task_with_one_loss_for_every_task(tmp_path: Path) -> None:
    """Labels are a dict and the tower returns a dict of logits; one loss name then
    applies to every task (StepFunctions supports a single LossFn for multi-task)."""
    path = write_parquet(tmp_path / "mt.parquet", 40, seed=1, multi_task=True)
    s = session(MultiTaskTower(), loss="binary_crossentropy")
    with ParquetReader(path, 20, ["user", "hist", "x"], label=["click", "like"]) as reader:
        batch = next(iter(reader))
    # Dict labels with one loss for every task: multi-task by the tower's dict.
    out = s.run(batch, ["loss", "predictions"])
    assert set(out["predictions"]) == {"click", "like"}
    assert np.isfinite(out["loss"])


# --- Estimator --------------------------------------------------------------------


def test_estimator_learns_and_predicts(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "train.parquet", 3000, seed=2)
    keras.utils.set_random_seed(2)

    def tower(emb: dict[str, tf.Tensor], dense: dict[str, tf.Tensor]) -> tf.Tensor:
        return layer(tf.concat([emb["user"], emb["hist"], dense["x"]], axis=1))

    layer = keras.layers.Dense(1)
    adagrad = wl.EmbeddingTable("emb", 4, optimizer=wl.optimizers.Adagrad(0.2))
    est = wl.Estimator(
        tower,
        features(adagrad),
        label="click",
        context=wl.Context(num_shards=2),
        optimizer=keras.optimizers.Adam(0.02),
    )
    columns = ["user", "hist", "x"]
    before = est.evaluate(ParquetReader(path, 500, columns, label="click"))
    result = est.train(ParquetReader(path, 100, columns, label="click", epochs=3))
    assert result["steps"] == 90 and est.global_step == 90
    metrics = est.evaluate(ParquetReader(path, 500, columns, label="click"))
    assert metrics["examples"] == 3000
    assert metrics["auc"] > 0.7 > before["auc"] + 0.05, (before, metrics)
    assert metrics["loss"] < before["loss"]
    assert 0.5 < metrics["calibration"] < 1.5

    predicted = list(est.predict(ParquetReader(path, 1000, columns)))
    assert [p.shape for p in predicted] == [(1000,)] * 3
    assert all(((p > 0) & (p < 1)).all() for p in predicted)
    with pytest.raises(ValueError, match="label"):
        est.evaluate(ParquetReader(path, 500, columns, label="x"))


# --- independent contexts, determinism ------------------------------------------------


def model_a(context: wl.Context) -> wl.Session:
    return wl.Session(
        Tower(seed=5),
        features(table("shared", 4), table("a_only", 4)),
        context,
        optimizer=keras.optimizers.Adam(0.01),
    )


def model_b(context: wl.Context) -> wl.Session:
    """The same table name "shared" with another dim, and its own second table."""
    return wl.Session(
        Tower(seed=6, width=8 + 2 + 1),
        features(table("shared", 8), table("b_only", 2)),
        context,
        optimizer=keras.optimizers.Adam(0.01),
    )


def test_two_contexts_train_interleaved_without_interfering() -> None:
    data = batches(6, seed=8)
    alone_record = RecordLoss()
    model_a(wl.Context(num_shards=2)).train(data, hooks=[alone_record])

    a, b = model_a(wl.Context(num_shards=2)), model_b(wl.Context(num_shards=2))
    a_record, b_record = RecordLoss(), RecordLoss()
    for batch in data:
        a.train([batch], hooks=[a_record])
        b.train([batch], hooks=[b_record])
    assert a_record.losses == alone_record.losses  # staleness 0: bit for bit
    assert np.isfinite(b_record.losses).all()
    assert a.global_step == b.global_step == 6
    assert sorted(a.context.engine.tables()) == ["a_only", "shared"]
    assert sorted(b.context.engine.tables()) == ["b_only", "shared"]
    assert a.context.engine.spec("shared").dim == 4
    assert b.context.engine.spec("shared").dim == 8
    assert {len(r) for r in rows(b, "shared").values()} == {8}


def test_same_seeds_same_losses() -> None:
    def run_once() -> list[float]:
        keras.utils.set_random_seed(123)
        layer = keras.layers.Dense(1)  # initialized from the global seed

        def tower(emb: dict[str, tf.Tensor], dense: dict[str, tf.Tensor]) -> tf.Tensor:
            return layer(tf.concat([emb["user"], emb["hist"], dense["x"]], axis=1))

        s = wl.Session(
            tower,
            features(wl.EmbeddingTable("emb", 4, optimizer=wl.optimizers.Adagrad(0.1))),
            wl.Context(num_shards=2),
        )
        record = RecordLoss()
        s.train(batches(6, seed=4), hooks=[record])
        return record.losses

    first, second = run_once(), run_once()
    assert len(first) == 6
    assert first == second


def test_reserved_table_trains_the_same() -> None:
    def run_once(reserve_rows: int) -> tuple[list[float], dict[str, int]]:
        keras.utils.set_random_seed(123)
        layer = keras.layers.Dense(1)

        def tower(emb: dict[str, tf.Tensor], dense: dict[str, tf.Tensor]) -> tf.Tensor:
            return layer(tf.concat([emb["user"], emb["hist"], dense["x"]], axis=1))

        table = wl.EmbeddingTable("emb", 4, reserve_rows=reserve_rows)
        s = wl.Session(tower, features(table), wl.Context(num_shards=2))
        held = s.context.engine.stats("emb")
        record = RecordLoss()
        s.train(batches(6, seed=4), hooks=[record])
        return record.losses, held

    grown, empty = run_once(0)
    reserved, held = run_once(50_000)
    assert empty["row_bytes"] == 0
    assert held["rows"] == 0 and held["row_bytes"] >= 50_000 * 4 * 4 * 2
    assert reserved == grown


# --- the pipeline ---------------------------------------------------------------------


def failing_reader(good: int) -> Iterator[CsrBatch]:
    yield from batches(good, seed=5)
    raise ValueError("boom")


def test_reader_error_is_raised_and_threads_end() -> None:
    s = session()
    with pytest.raises(ValueError, match="boom"):
        s.train(failing_reader(3))
    assert 2 <= s.global_step <= 3
    assert wuliang_threads() == []
    before = s.global_step
    s.train(batches(2))  # the session still trains
    assert s.global_step == before + 2
    assert wuliang_threads() == []


def test_reader_error_after_good_batches_trains_them_first() -> None:
    """3 good batches, then the reader fails: the 3 steps are as if the reader had
    ended after them (a step is applied whole, or not at all)."""
    s = session()
    with pytest.raises(ValueError, match="boom"):
        s.train(failing_reader(3))
    reference = session()
    reference.train(batches(3, seed=5))
    # The batches read before a reader error are trained and pushed, then it raises.
    assert s.global_step == 3
    want = rows(reference)
    got = rows(s)
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        np.testing.assert_allclose(got[key], row, rtol=1e-6)


class FailAt(hooks.SessionRunHook):
    def __init__(self, step: int) -> None:
        self.step = step

    def after_run(
        self, run_context: hooks.SessionRunContext, run_values: hooks.SessionRunValues
    ) -> None:
        if run_context.step == self.step:
            raise RuntimeError("hook failed")


def test_hook_error_is_raised_and_threads_end() -> None:
    s = session()
    data = batches(6, seed=6)
    with pytest.raises(RuntimeError, match="hook failed"):
        s.train(data, hooks=[FailAt(2)])
    assert s.global_step == 3  # the failing step was counted (and pushed)
    assert wuliang_threads() == []
    pushed = s.context.engine.stats("emb")["pushed_keys"]
    keys = {k for b in data[:3] for f in ("user", "hist") for k in b.sparse[f].values.tolist()}
    assert pushed >= len(keys)


def test_failed_train_closes_the_parquet_reader_iteration(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "d.parquet", 400, seed=3)
    s = session()
    reader = ParquetReader(path, 8, ["user", "hist", "x"], label="click")
    try:
        with pytest.raises(RuntimeError, match="hook failed") as info:
            s.train(reader, hooks=[FailAt(1)])
        # A failed train() also stops the reader's own threads.
        assert info.value is not None
        assert wuliang_threads() == []
    finally:
        reader.close()
    assert wuliang_threads() == []


def test_staleness_one_trains() -> None:
    s = session(context=wl.Context(num_shards=2, staleness=1, prefetch=3))
    data = batches(10, seed=7)
    s.run(data[0], "loss")
    before = rows(s)
    record = RecordLoss()
    result = s.train(data[1:], hooks=[record])
    assert result["steps"] == 9 == len(record.losses)
    assert np.isfinite(record.losses).all()
    assert s.global_step == 10
    after = rows(s)
    assert any(not np.array_equal(after[k], before[k]) for k in before)
    assert wuliang_threads() == []


@pytest.mark.parametrize("maps", ["more_tables", "fewer_tables"])
def test_a_reader_shared_by_two_sessions(tmp_path: Path, maps: str) -> None:
    """A ParquetReader given to Session.train gets that session's KeyPreparer; a
    later session with another feature -> table map must not use those keys: it
    trains exactly as on a reader of its own."""
    path = write_parquet(tmp_path / "d.parquet", 64, seed=4)
    columns = ["user", "hist", "x"]
    one, two = features(table("emb")), features(table("emb"), table("other"))
    first_features, second_features = (one, two) if maps == "more_tables" else (two, one)
    first = session(feats=first_features)
    second = session(feats=second_features)
    alone = session(feats=second_features)
    with ParquetReader(path, 16, columns, label="click") as reader:
        first.train(reader)
        # Keys prepared for another model's feature -> table map are prepared again.
        second.train(reader)
    with ParquetReader(path, 16, columns, label="click") as reader:
        alone.train(reader)
    assert second.global_step == alone.global_step == 4
    want, got = rows(alone), rows(second)
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        np.testing.assert_allclose(got[key], row, rtol=1e-6)


def test_context_arguments() -> None:
    with pytest.raises(ValueError, match="embedded"):
        wl.Context(ps="nowhere")
    with pytest.raises(ValueError, match="'host:99999' is not a host:port"):
        wl.Context(ps=["host:99999"])
    with pytest.raises(ValueError, match="staleness"):
        wl.Context(staleness=2)
    with pytest.raises(ValueError, match="prefetch"):
        wl.Context(prefetch=0)
    with pytest.raises(ValueError, match="background must be 'idle' or 'normal', got 'low'"):
        wl.Context(background="low")


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_background_threads_run_normally_by_default() -> None:
    context = wl.Context(num_shards=2)
    assert context.background == "normal"
    assert shard_policies(context) == {os.SCHED_OTHER}
    context.close()


class RecordPolicies(hooks.SessionRunHook):
    """The scheduling policy of every wuliang thread alive at the first step
    that was not alive when the hook was made (other tests' servers' threads
    live until those are closed)."""

    def __init__(self) -> None:
        self.policies: dict[str, int] = {}
        self.before = set(threading.enumerate())

    def after_run(
        self, run_context: hooks.SessionRunContext, run_values: hooks.SessionRunValues
    ) -> None:
        if self.policies:
            return
        for t in threading.enumerate():
            if t.name.startswith("wuliang") and t.native_id is not None and t not in self.before:
                self.policies[t.name] = os.sched_getscheduler(t.native_id)


def many_files(folder: Path) -> Path:
    """Enough files that the reader's threads are still busy at the first step."""
    folder.mkdir()
    for i in range(8):
        write_parquet(folder / f"part-{i}.parquet", 64, seed=i)
    return folder


def thread_kind(name: str) -> str:
    return re.sub(r"[-_]\d+$", "", name)  # wuliang-read-1 -> wuliang-read


def shard_policies(context: wl.Context) -> set[int]:
    return {os.sched_getscheduler(tid) for tid in context.engine.worker_thread_ids()}


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
@pytest.mark.parametrize("background", ["idle", "normal"])
def test_background_threads_yield_to_tensorflow(tmp_path: Path, background: str) -> None:
    path = many_files(tmp_path / "data")
    context = wl.Context(num_shards=2, background=background)
    expected = os.SCHED_IDLE if background == "idle" else os.SCHED_OTHER
    assert shard_policies(context) == {expected}
    s = session(context=context)
    record = RecordPolicies()
    with ParquetReader(
        path, 16, ["user", "hist", "x"], label="click", prefetch=1, num_threads=2
    ) as reader:
        s.train(reader, hooks=[record])
        assert reader.background == background  # the context's, as the reader had none
    kinds = {thread_kind(name) for name in record.policies}
    assert {"wuliang-pull", "wuliang-push", "wuliang-read", "wuliang-assemble"} <= kinds
    assert set(record.policies.values()) == {expected}, record.policies
    # The main thread (TensorFlow's caller) is left alone.
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_a_reader_keeps_its_own_background(tmp_path: Path) -> None:
    path = many_files(tmp_path / "data")
    s = session(context=wl.Context(num_shards=2, background="idle"))
    record = RecordPolicies()
    columns = ["user", "hist", "x"]
    with ParquetReader(
        path, 16, columns, label="click", prefetch=1, num_threads=2, background="normal"
    ) as reader:
        s.train(reader, hooks=[record])
    reading = {"wuliang-read", "wuliang-assemble"}
    policies = {p for n, p in record.policies.items() if thread_kind(n) in reading}
    assert policies == {os.SCHED_OTHER}
    assert record.policies["wuliang-pull"] == os.SCHED_IDLE
    with pytest.raises(ValueError, match="background must be 'idle' or 'normal', got 'low'"):
        ParquetReader(path, 16, columns, background="low")


# --- more of the API ------------------------------------------------------------------


def test_train_with_zero_steps_trains_nothing() -> None:
    s = session()
    result = s.train(batches(3), steps=0)
    # steps=0 trains nothing.
    assert result["steps"] == 0
    assert s.global_step == 0


def test_batches_of_any_size_reuse_one_trace() -> None:
    """Every input has a dynamic first dimension: batch size and unique-key count
    do not retrace (the tower's Python body runs only while tracing)."""

    class Counting(Tower):
        calls = 0

        def __call__(self, emb: dict[str, tf.Tensor], dense: dict[str, tf.Tensor]) -> Any:
            Counting.calls += 1
            return super().__call__(emb, dense)

    def sized(rng: np.random.Generator, size: int) -> CsrBatch:
        batch = make_batch(rng, size)
        hist = [3] + [int(n) for n in rng.integers(0, 4, size - 1)]  # always multi-valued
        offsets = np.r_[0, np.cumsum(hist)].astype(np.int64)
        values = rng.integers(1, KEYS, offsets[-1]).astype(np.uint64)
        batch.sparse["hist"] = Csr(values, offsets)
        return batch

    s = session(Counting())
    rng = np.random.default_rng(12)
    s.run(sized(rng, 8), "loss")
    s.run(sized(rng, 8), "loss", train=False)
    traced = Counting.calls
    for size in (3, 1, 17):
        out = s.run(sized(rng, size), ["loss", "predictions", "hist"])
        assert out["predictions"].shape == (size,) and out["hist"].shape == (size, 4)
        assert s.run(sized(rng, size), "predictions", train=False).shape == (size,)
    s.train([sized(rng, 5), sized(rng, 2)])
    assert Counting.calls == traced


def test_losses_by_name_and_callable() -> None:
    batch = batches(1, seed=13)[0]
    three = CsrBatch(
        batch.sparse, batch.dense, np.arange(B, dtype=np.float32) % 3, B, {"x": slice(0, 1)}
    )

    class Wide(Tower):
        def __init__(self, units: int) -> None:
            self.layer = keras.layers.Dense(
                units, kernel_initializer=keras.initializers.GlorotUniform(3)
            )

    s = session(Wide(3), loss="softmax_crossentropy")
    out = s.run(three, ["loss", "predictions", "logits"])
    logits = out["logits"].astype(np.float64)
    softmax = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out["predictions"], softmax, rtol=1e-5)
    want = -np.mean(np.log(softmax[np.arange(B), three.labels.astype(int)]))
    np.testing.assert_allclose(out["loss"], want, rtol=1e-5)

    s = session(Wide(1), loss="mse")
    out = s.run(batch, ["loss", "predictions", "logits"])
    np.testing.assert_allclose(out["predictions"], out["logits"][:, 0], rtol=1e-6)
    want = np.mean((out["logits"][:, 0].astype(np.float64) - batch.labels) ** 2)
    np.testing.assert_allclose(out["loss"], want, rtol=1e-5)

    def hinge(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
        return tf.reduce_mean(tf.nn.relu(1.0 - (2.0 * labels - 1.0) * logits[:, 0]))

    s = session(Wide(1), loss=hinge)
    out = s.run(batch, ["loss", "predictions", "logits"])
    np.testing.assert_array_equal(out["predictions"], out["logits"])  # no link function
    want = np.mean(np.maximum(0.0, 1.0 - (2.0 * batch.labels - 1.0) * out["logits"][:, 0]))
    np.testing.assert_allclose(out["loss"], want, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown loss"):
        session(loss="hinge")


def test_feature_and_table_errors() -> None:
    s = session()
    batch = batches(1)[0]
    no_hist = CsrBatch(
        {"user": batch.sparse["user"]}, batch.dense, batch.labels, B, {"x": slice(0, 1)}
    )
    with pytest.raises(KeyError, match="hist"):
        s.run(no_hist, "loss")
    no_x = CsrBatch(batch.sparse, batch.dense, batch.labels, B, {})
    with pytest.raises(KeyError, match="'x'"):
        s.run(no_x, "loss")
    wide_x = CsrBatch(
        batch.sparse, np.zeros((B, 2), np.float32), batch.labels, B, {"x": slice(0, 2)}
    )
    with pytest.raises(ValueError, match="'x'"):
        s.run(wide_x, "loss")
    assert s.global_step == 0
    with pytest.raises(ValueError, match="emb"):
        wl.Session(Tower(), features(table("emb", 4), table("emb", 8)))
    with pytest.raises(ValueError, match="emb"):
        session(context=s.context, feats=features(table("emb", 8)))
    with pytest.raises(TypeError):
        s.run({"user": batch.sparse["user"]}, "loss")  # type: ignore[arg-type]

    # a second session on the same context with the same table shares its rows
    s.run(batch, "loss")
    twin = session(context=s.context)
    assert twin.context.engine.tables() == ["emb"]
    np.testing.assert_array_equal(
        twin.run(batch, "user", train=False), s.run(batch, "user", train=False)
    )


class Calls(hooks.SessionRunHook):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def begin(self) -> None:
        self.calls.append("begin")

    def end(self, session: Any) -> None:
        self.calls.append("end")


def test_estimator_hooks_run_with_every_train() -> None:
    calls = Calls()
    est = wl.Estimator(
        Tower(),
        features(table()),
        label="click",
        context=wl.Context(num_shards=2),
        hooks=[calls, hooks.StopAtStep(num_steps=2)],
    )
    first = est.train(batches(5, seed=1))
    second = est.train(batches(5, seed=2))
    # (Before 8a87b95 Estimator passed them to Session as session hooks: begun
    # once, never ended, and StopAtStep(num_steps=2) counted from the first train().)
    assert calls.calls == ["begin", "end", "begin", "end"]
    assert first["steps"] == second["steps"] == 2


def test_pipelined_staleness_zero_equals_step_by_step() -> None:
    """The pipeline pulls early and the previous step's push writes the rows it
    updates into the next step's; the result is the same as pulling only after
    each push (Session.run)."""
    data = batches(12, seed=5)
    serial = session(context=wl.Context(num_shards=2, staleness=0))
    serial_losses = [float(serial.run(b, "loss")) for b in data]
    piped = session(context=wl.Context(num_shards=2, staleness=0, prefetch=3))
    recorder = RecordLoss()
    piped.train(iter(data), hooks=[recorder])
    assert recorder.losses == serial_losses
    piped_rows, serial_rows = rows(piped), rows(serial)
    assert set(piped_rows) == set(serial_rows)
    for key, row in serial_rows.items():
        np.testing.assert_array_equal(piped_rows[key], row)
    for a, b in zip(kernel(piped), kernel(serial), strict=True):
        np.testing.assert_array_equal(a, b)


def row_meta(s: wl.Session, name: str = "emb") -> dict[int, tuple[int, int]]:
    """key -> (count, step of the last update)."""
    out = {}
    for chunk in s.context.engine.export(name):
        for k, count, step in zip(chunk.keys, chunk.counts, chunk.steps, strict=True):
            out[int(k)] = (int(count), int(step))
    return out


@pytest.mark.parametrize("admit", [1, 2], ids=["every-key", "min-count-2"])
@pytest.mark.parametrize("reader_delay", [0.0, 0.05])
def test_staleness_zero_push_writes_into_the_next_steps_rows(
    monkeypatch: pytest.MonkeyPatch, reader_delay: float, admit: int
) -> None:
    """Both ways a staleness-0 step gets its shared rows are exact: linked (the
    previous push writes them into the early-pulled rows; a fast reader) and
    not linked (that push had begun before the pull, which then waits for it;
    a slow reader). With admission, a key admitted by the early pull of step
    i + 1 takes no update from the push of step i, as step by step."""
    import wuliang.session

    linked: list[bool] = []

    class Recording(wuliang.session.Pipeline):
        def __iter__(self) -> Iterator[Any]:
            for item in super().__iter__():
                linked.append(item.linked_in)
                yield item

    def admitting_table() -> wl.EmbeddingTable:
        return wl.EmbeddingTable(
            "emb",
            4,
            optimizer=wl.optimizers.SGD(0.1),
            initializer=Normal(0.3),
            admission=wl.admission.MinCount(admit),
        )

    monkeypatch.setattr(wuliang.session, "Pipeline", Recording)
    data = batches(10, seed=7)
    serial = session(context=wl.Context(num_shards=2), feats=features(admitting_table()))
    serial_losses = [float(serial.run(b, "loss")) for b in data]

    def read() -> Iterator[CsrBatch]:
        for b in data:
            time.sleep(reader_delay)
            yield b

    piped = session(context=wl.Context(num_shards=2, prefetch=3), feats=features(admitting_table()))
    recorder = RecordLoss()
    piped.train(read(), hooks=[recorder])
    assert recorder.losses == serial_losses
    piped_rows, serial_rows = rows(piped), rows(serial)
    assert set(piped_rows) == set(serial_rows)
    for key, row in serial_rows.items():
        np.testing.assert_array_equal(piped_rows[key], row)
    assert row_meta(piped) == row_meta(serial)
    if admit > 1:
        assert serial.context.engine.stats("emb")["dropped_pending"] > 0
    assert len(linked) == 10 and not linked[0]
    if reader_delay:  # the first steps trace: the puller may still get ahead
        assert not all(linked[1:])
    else:
        assert any(linked)
