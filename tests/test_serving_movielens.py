"""The MovieLens example's model served over gRPC: predictions of the test
split equal the trainer's, for the same raw inputs (1e-5)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
from repo_data import MOVIELENS, REPO

from wuliang.reader import ParquetReader
from wuliang.serving.client import Client
from wuliang.serving.grpc.server import GrpcServer
from wuliang.serving.service import Service
from wuliang.serving.store import ModelStore


def movielens() -> Any:
    spec = importlib.util.spec_from_file_location("movielens", REPO / "examples" / "movielens.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_served_predictions_equal_the_trainers(tmp_path: Path) -> None:
    ml = movielens()
    args = ml.parse_args(
        ["--data", str(MOVIELENS), "--work-dir", str(tmp_path), "--epochs", "1",
         "--max-ratings", "8000", "--no-export"]
    )  # fmt: skip
    files = ml.convert(args.data, args.work_dir)
    train, test, train_rows, test_rows = ml.split_by_time(
        files, args.work_dir / "split", ml.TRAIN_FRACTION, args.max_ratings
    )
    _, estimator = ml.train_wuliang(args, train, test, train_rows)
    session = estimator.session
    exports = tmp_path / "exports"
    session.export(exports, kind="full")
    names = list(ml.FEATURES)
    # Keys the trainer never saw read as their initial vectors there: so here.
    store = ModelStore(exports, "movielens", missing="initial", poll_secs=0).start()
    service = Service([store])
    server = GrpcServer(service, port=0)
    try:
        with Client(f"127.0.0.1:{server.port}", model="movielens") as client:
            served, trained = [], []
            for batch in ParquetReader(test, 500, names, label="label"):
                features = {
                    name: (batch.sparse[name].values.view(np.uint64), batch.sparse[name].offsets)
                    for name in names
                }
                outputs, version = client.predict(features, rows=batch.size)
                assert version == 1
                served.append(outputs["predictions"])
                trained.append(session.run(batch, "predictions", train=False))
        served_all, trained_all = np.concatenate(served), np.concatenate(trained)
        assert len(served_all) == test_rows
        np.testing.assert_allclose(served_all, trained_all, rtol=1e-5, atol=1e-6)
    finally:
        server.stop()
        service.close()
        estimator.context.close()
