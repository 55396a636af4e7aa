"""The version format below the façade: every spec class round-trips through
``to_dict``/``from_dict``, a manifest records each table's whole spec and a
process with nothing but the directory recreates the tables, versions of the
first format still read (a checked-in checkpoint and export chain), and a
version's files are hashed once per apply."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from repo_data import REPO

import wuliang as wl
from wuliang.ps_server import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Admission,
    Constant,
    Engine,
    Eviction,
    Initializer,
    Normal,
    Optimizer,
    TableSpec,
    TruncatedNormal,
    Uniform,
    Zeros,
    parameter_server,
)
from wuliang.ps_server.storage import (
    CorruptVersionError,
    DenseInput,
    Manifest,
    ModelDescription,
    SparseInput,
    Version,
    VersionWriter,
    version,
)
from wuliang.reader import ParquetReader
from wuliang.serving.store import ModelStore
from wuliang.serving.versions import apply_chain

OLD = REPO / "tests" / "data" / "version_v1"

SPECS = [
    SGD(0.3, clip_norm=2.0),
    Adagrad(0.05, initial_accumulator=0.2, epsilon=1e-6),
    Adam(0.002, beta1=0.8, beta2=0.99, epsilon=1e-8, clip_norm=1.5),
    FTRL(0.1, l1=0.01, l2=0.5, beta=2.0, initial_accumulator=0.3),
    Normal(stddev=0.2, mean=0.1),
    TruncatedNormal(),
    TruncatedNormal(stddev=0.03, mean=-0.5),
    Uniform(-0.2, 0.4),
    Constant(0.25),
    Zeros(),
    Admission(min_count=3, pending_capacity=1000),
    Eviction(ttl_steps=10, ttl_seconds=20, min_count=2, max_rows=99),
    TableSpec(
        "item",
        24,
        optimizer=FTRL(0.2, l1=0.1),
        initializer=Uniform(-0.01, 0.01),
        seed=2**64 - 1,
        admission=Admission(min_count=2),
        eviction=Eviction(ttl_steps=1000, max_rows=5),
        nan_policy="raise",
        reserve_rows=123,
        precision="int8",
        serving=True,
    ),
    TableSpec("user", 8),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: type(s).__name__)
def test_every_spec_round_trips_through_json(spec: Any) -> None:
    data = json.loads(json.dumps(spec.to_dict()))
    again = type(spec).from_dict(data)
    assert again == spec and type(again) is type(spec)
    base = Optimizer if isinstance(spec, Optimizer) else Initializer
    if isinstance(spec, Optimizer | Initializer):  # the base dispatches on the kind
        assert base.from_dict(data) == spec


def test_from_dict_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="unknown optimizer kind 'Lion'"):
        Optimizer.from_dict({"kind": "Lion"})
    with pytest.raises(ValueError, match="expected a Adagrad, got kind 'SGD'"):
        Adagrad.from_dict({"kind": "SGD"})
    with pytest.raises(ValueError, match="unknown field 'momentum'"):
        Optimizer.from_dict({"kind": "SGD", "momentum": 0.9})
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        Optimizer.from_dict({"kind": "SGD", "learning_rate": -1})
    with pytest.raises(ValueError, match=r"table 'x': eviction: .*unknown field 'ttl'"):
        TableSpec.from_dict({"name": "x", "dim": 4, "eviction": {"ttl": 3}})
    with pytest.raises(ValueError, match="dim must be an int"):
        TableSpec.from_dict({"name": "x", "dim": "4"})
    # Missing fields take their defaults.
    assert TableSpec.from_dict({"name": "x", "dim": 4}) == TableSpec("x", 4)


def test_a_version_recreates_its_tables_exactly(tmp_path: Path) -> None:
    specs = [s for s in SPECS if isinstance(s, TableSpec)]
    model = ModelDescription(
        sparse=(SparseInput("item_id", "item", "mean", hash_field="item_id"),),
        dense=(DenseInput("age", 2),),
    )
    with Engine(2) as engine:
        for spec in specs:
            engine.create_table(spec)
        with VersionWriter(tmp_path, "ckpt-1", "checkpoint") as writer:
            for spec in specs:
                writer.write_table(engine.spec(spec.name), engine.export(spec.name), state=True)
            writer.commit(step=7, engine_version=3, model=model, reader_position={"batches": 2})
    got = Version(tmp_path / "ckpt-1")
    assert {name: entry.spec for name, entry in got.tables.items()} == {s.name: s for s in specs}
    assert got.model == model and got.step == 7 and got.engine_version == 3
    assert got.manifest.reader_position == {"batches": 2}
    # The manifest is its own inverse.
    data = json.loads((tmp_path / "ckpt-1" / "manifest.json").read_text())
    assert Manifest.from_dict(data, "m").to_dict() == data


def test_a_bad_manifest_names_the_file_and_field(tmp_path: Path) -> None:
    with Engine(1) as engine:
        engine.create_table(TableSpec("t", 4))
        with VersionWriter(tmp_path, "1", "full") as writer:
            writer.write_table(engine.spec("t"), engine.export("t"), state=False)
            writer.commit(step=0, engine_version=1, number=1)
    path = tmp_path / "1" / "manifest.json"
    good = json.loads(path.read_text())
    for change, message in (
        (lambda m: m["tables"]["t"]["spec"].update(dim=-1), r"tables\.t\.spec: .*dim"),
        (lambda m: m["tables"]["t"].pop("rows"), r"tables\.t\.rows is missing"),
        (lambda m: m.update(kind="snapshot"), "kind must be one of"),
        (lambda m: m.update(format="wuliang-version/9"), "format 'wuliang-version/9'"),
        (lambda m: m.update(model={"sparse": [{"name": "a"}]}), r"model\.sparse\[0\]\.table"),
    ):
        bad = json.loads(json.dumps(good))
        change(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(CorruptVersionError, match=message) as caught:
            Version(tmp_path / "1")
        assert str(path) in str(caught.value)


# -- versions of the first format -------------------------------------------------


def old_model() -> tuple[wl.Session, wl.Context]:
    """The model that wrote tests/data/version_v1 (its README)."""
    keras.utils.set_random_seed(1)
    users = wl.EmbeddingTable(
        "users",
        4,
        optimizer=wl.optimizers.Adagrad(0.1),
        initializer=wl.initializers.Normal(0.02),
        seed=3,
    )
    items = wl.EmbeddingTable(
        "items", 2, optimizer=wl.optimizers.Adam(0.01), admission=Admission(min_count=2)
    )
    features = [
        wl.SparseFeature("user", users),
        wl.SparseFeature("items", items, combiner="mean"),
        wl.DenseFeature("x"),
    ]
    context = wl.Context(num_shards=3)
    return wl.Session(keras.Sequential([keras.layers.Dense(1)]), features, context), context


def rows_by_key(chunks: Any) -> tuple[np.ndarray, np.ndarray]:
    """(keys, weights) of rows chunks, sorted by key."""
    chunks = list(chunks)
    keys = np.concatenate([c.keys for c in chunks])
    weights = np.concatenate([c.weights for c in chunks])
    order = np.argsort(keys)
    return keys[order], weights[order]


def old_reader() -> ParquetReader:
    return ParquetReader(OLD / "data.parquet", 16, ["user", "items", "x"], label="label")


def test_a_first_format_checkpoint_reads_restores_and_exports(tmp_path: Path) -> None:
    ckpt = Version(OLD / "model" / "ckpt-2")
    users = ckpt.tables["users"].spec
    assert users.optimizer == Adagrad(0.1) and users.initializer == Normal(0.02)
    assert users.seed == 3 and ckpt.tables["users"].state_dim == 4
    assert ckpt.tables["items"].spec.optimizer == Adam(0.01)
    assert ckpt.model == ModelDescription(
        sparse=(SparseInput("user", "users"), SparseInput("items", "items", "mean")),
        dense=(DenseInput("x"),),
    )
    session, context = old_model()
    model_dir = tmp_path / "model"
    shutil.copytree(OLD / "model", model_dir)
    session.restore_checkpoint(model_dir)
    assert session.global_step == 2
    for name in ("users", "items"):
        keys, weights = rows_by_key(ckpt.read_rows(name))
        np.testing.assert_array_equal(context.ps.pull(name, keys, train=False), weights)
    session.train(old_reader(), steps=2)  # the tower restores too
    assert session.global_step == 4
    exported = session.export(tmp_path / "exports", kind="full")
    assert Version(exported.path).tables["users"].spec == context.ps.spec("users")
    context.close()


def test_first_format_rows_read_without_show_and_click_statistics() -> None:
    """Part files written before the ``shows`` and ``clicks`` columns read
    them as zeros, and load so."""
    ckpt = Version(OLD / "model" / "ckpt-2")
    for name in ("users", "items"):
        chunks = list(ckpt.read_rows(name))
        assert chunks
        for chunk in chunks:
            for column in (chunk.shows, chunk.clicks):
                assert column.dtype == np.float32 and column.shape == (len(chunk),)
                assert not column.any()
        spec = ckpt.tables[name].spec
        with parameter_server("embedded", num_shards=2) as ps:
            ps.create_table(spec)
            files = [f for f in ckpt.files_under(f"tables/{name}") if "part-" in f]
            assert ps.load_rows(ckpt.path, name, files) == sum(len(c) for c in chunks)
            assert ps.top_keys(name, 3)[1].tolist() == [0.0] * min(3, sum(map(len, chunks)))


def test_a_first_format_export_chain_serves(tmp_path: Path) -> None:
    exports = tmp_path / "exports"
    shutil.copytree(OLD / "export", exports)
    with Engine(2) as engine:
        applied = apply_chain(engine, exports)
        assert [v.number for v in applied] == [1, 2] and applied[-1].parent == 1
        assert engine.spec("users").initializer == Normal(0.02)  # format 1 recorded it
        removed = applied[-1].removed_keys("users")
        assert not engine.contains("users", removed).any()
    with ModelStore(exports, "old", poll_secs=0) as store:
        assert store.version == 2
        keys, weights = rows_by_key(applied[-1].read_rows("items"))
        got = store.lookup("items", keys)
        assert got.version == 2 and got.found.all()
        np.testing.assert_array_equal(got.rows, weights)
        assert store.served().tower is not None
        assert store.served().model.sparse_by_name["items"].combiner == "mean"


# -- hashing each file once -------------------------------------------------------


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files sha256 is computed of, in order."""
    seen: list[Path] = []
    real = version.sha256_file

    def counting(path: Path) -> str:
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(version, "sha256_file", counting)
    return seen


def files_of(path: Path) -> list[Path]:
    return sorted(path / f for f in Version(path).manifest.files)


def test_serving_hashes_each_file_once_per_apply(tmp_path: Path, hashed: list[Path]) -> None:
    exports = tmp_path / "exports"
    shutil.copytree(OLD / "export", exports)
    (exports / "LATEST").write_text("1\n")
    shutil.rmtree(exports / "2")
    with ModelStore(exports, "old", poll_secs=0) as store:
        assert store.version == 1
        assert sorted(hashed) == files_of(exports / "1")
        hashed.clear()
        shutil.copytree(OLD / "export" / "2", exports / "2")
        assert store.refresh() == [2]
        assert sorted(hashed) == files_of(exports / "2")


def test_restoring_a_checkpoint_hashes_each_file_once(tmp_path: Path, hashed: list[Path]) -> None:
    session, context = old_model()
    session.restore_checkpoint(OLD / "model" / "ckpt-2")
    assert sorted(hashed) == files_of(OLD / "model" / "ckpt-2")
    context.close()


# -- how raw strings hash, recorded -------------------------------------------------


def test_the_model_description_records_how_string_features_hash(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    cities = np.array(["paris", "lima", "oslo", "kyiv"])[rng.integers(0, 4, 64)]
    pq.write_table(
        pa.table(
            {
                "city": cities,
                "user": rng.integers(0, 9, 64),
                "label": rng.integers(0, 2, 64).astype(np.float32),
            }
        ),
        tmp_path / "data.parquet",
    )

    def model() -> tuple[wl.Session, wl.Context]:
        table = wl.EmbeddingTable("t", 4)
        features = [wl.SparseFeature("city", table), wl.SparseFeature("user", table)]
        context = wl.Context(num_shards=2)
        return wl.Session(keras.Sequential([keras.layers.Dense(1)]), features, context), context

    reader = ParquetReader(tmp_path / "data.parquet", 16, ["city", "user"], label="label")
    assert reader.hashed_features == {"city": "city"}
    session, context = model()
    session.train(reader)
    ckpt = session.save_checkpoint(tmp_path / "model")
    described = Version(ckpt).model
    assert described is not None
    assert described.sparse_by_name["city"].hash_field == "city"
    assert described.sparse_by_name["user"].hash_field is None
    context.close()
    again, context = model()  # a restored model exports what it was trained on
    again.restore_checkpoint(tmp_path / "model")
    exported = again.export(tmp_path / "exports")
    assert Version(exported.path).model.sparse_by_name["city"].hash_field == "city"
    context.close()
