"""What an online server imports works without TensorFlow or the export writer;
``wuliang.serving`` exports its public names, loading them on first use (so
importing it is cheap); the read side of exports keeps its old names in
wuliang.export."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import wuliang.export
import wuliang.serving.versions
from wuliang.ps_server import storage
from wuliang.ps_server.storage import CorruptVersionError

# Run in a fresh interpreter where importing TensorFlow or Keras fails.
NO_TF = textwrap.dedent(
    """
    import sys
    sys.modules["tensorflow"] = None  # import tensorflow -> ImportError
    sys.modules["keras"] = None

    import numpy as np

    import wuliang.embedding.pooling as pooling
    import wuliang.serving
    from wuliang.embedding import EmbeddingTable, SparseFeature
    from wuliang.ps_server import Engine
    from wuliang.reader import Csr, CsrBatch, KeyPreparer
    from wuliang.ps_server.storage import latest, versions
    from wuliang.serving.versions import apply_chain

    feature = SparseFeature("f", EmbeddingTable("t", 2), "mean")
    csr = Csr(np.array([3, 4, 3], np.uint64), np.array([0, 2, 2, 3]))
    batch = CsrBatch({"f": csr}, np.zeros((3, 0), np.float32), None, 3)
    prepared = KeyPreparer({"f": "t"})(batch)
    rows = {"t": np.ones((len(prepared.tables["t"].uniques), 2), np.float32)}
    print(pooling.pool_features([feature], prepared, rows)["f"].tolist())
    assert versions(sys.argv[1]) == [] and latest(sys.argv[1]) is None
    with Engine(num_shards=1) as engine:
        try:
            apply_chain(engine, sys.argv[1])
        except FileNotFoundError as e:
            print("no export:", e)
    imported = sorted(
        m for m in ("wuliang.export", "wuliang.embedding.bridge", "wuliang.saved_model",
                    "wuliang.checkpoint", "wuliang.session")
        if m in sys.modules
    )
    print("imported:", imported)
    """
)


def test_pooling_and_the_model_store_import_without_tensorflow(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", NO_TF, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]"
    assert lines[1] == f"no export: {tmp_path} has no export"
    assert lines[2] == "imported: []"  # neither the writer nor anything of TensorFlow's


PUBLIC = textwrap.dedent(
    """
    import sys
    sys.modules["tensorflow"] = None  # import tensorflow -> ImportError

    import wuliang.serving
    heavy = sorted(m for m in ("grpc", "aiohttp", "redis", "numpy") if m in sys.modules)
    print("after import:", heavy)
    from wuliang.serving import (
        Client, GrpcServer, HttpServer, ModelStore, RedisModelStore, ServedModel,
        ServerTls, Service, ServingClientError, publish,
    )
    assert Client.__module__ == "wuliang.serving.client"
    store = ModelStore("/nonexistent", "m", poll_secs=0)
    assert isinstance(store, ServedModel)
    store.close()
    missing = [n for n in wuliang.serving.__all__ if not hasattr(wuliang.serving, n)]
    print("missing:", missing)
    print("tensorflow:", "tensorflow" in sys.modules and sys.modules["tensorflow"] is not None)
    """
)


def test_wuliang_serving_exports_its_names_lazily(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", PUBLIC], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "after import: []",  # nothing heavy until a name is used
        "missing: []",
        "tensorflow: False",
    ]
    assert wuliang.serving.__doc__ is not None and "wuliang serve" in wuliang.serving.__doc__


def test_the_export_module_keeps_the_read_side_names() -> None:
    for name in ("LATEST", "versions", "latest", "chain"):
        assert getattr(wuliang.export, name) is getattr(storage, name), name
    for name in ("apply", "apply_chain"):
        assert getattr(wuliang.export, name) is getattr(wuliang.serving.versions, name), name
    assert wuliang.serving.versions.apply_chain.__module__ == "wuliang.serving.versions"


def test_reading_a_missing_or_broken_export_dir(tmp_path: Path) -> None:
    versions = storage
    assert versions.versions(tmp_path / "missing") == []
    with pytest.raises(FileNotFoundError, match="has no export"):
        versions.chain(tmp_path)
    (tmp_path / "LATEST").write_text("not a number\n")
    with pytest.raises(CorruptVersionError, match="does not name a version"):
        versions.chain(tmp_path)
    (tmp_path / "LATEST").write_text("3\n")
    with pytest.raises(CorruptVersionError, match=r"export version .*3 is missing"):
        versions.chain(tmp_path)
