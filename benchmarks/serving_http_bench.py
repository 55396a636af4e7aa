"""HTTP serving benchmark: small lookups answered on the event loop or in a pool.

A served export (a 100,000-row table of dim 16, a bag-of-items table, one
dense feature, a one-layer tower) behind ``wuliang.serving.HttpServer``,
twice: with ``inline_bytes=4096`` (small lookups answered on the event loop)
and ``inline_bytes=0`` (every lookup through the thread pool). A client
process (aiohttp) measures, for each:

* ``lookup_1``: lookups of 8 keys, one at a time (latency of the hop);
* ``lookup_16``: lookups of 8 keys from 16 concurrent clients (throughput);
* ``mixed``: the same 16 lookup clients while 4 clients predict batches of
  256 rows (does a prediction hold up the lookups?).

Each mode runs ``--rounds`` times, alternating, and the medians are printed
(the last line: one JSON object).

    python benchmarks/serving_http_bench.py [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROWS = 100_000
DIM = 16


def make_export(folder: Path) -> Path:
    import keras

    import wuliang as wl
    from wuliang.export import SessionSource, export

    keras.utils.set_random_seed(0)
    users = wl.EmbeddingTable("users", DIM, optimizer=wl.optimizers.Adagrad(0.05))
    items = wl.EmbeddingTable("items", 8, optimizer=wl.optimizers.Adagrad(0.05))
    dense = keras.layers.Dense(1)
    features = [
        wl.SparseFeature("user", users),
        wl.SparseFeature("items", items, combiner="mean"),
        wl.DenseFeature("x"),
    ]

    def tower(e: dict, d: dict) -> Any:
        return dense(wl.embedding.concat([e["user"], e["items"], d["x"]]))

    session = wl.Session(tower, features, wl.Context(num_shards=2))
    rng = np.random.default_rng(0)
    engine = session.context.engine
    for name, dim in (("users", DIM), ("items", 8)):
        keys = np.arange(ROWS, dtype=np.uint64)
        weights = rng.standard_normal((ROWS, dim), dtype=np.float32)
        engine.load(name, keys, weights, np.full((ROWS, dim), 0.1, np.float32))
    export(SessionSource(session), folder / "exports", "full")
    session.close()
    session.context.close()
    return folder / "exports"


async def client(url: str, seconds: float, lookups: int, predicts: int) -> dict[str, Any]:
    import aiohttp

    rng = np.random.default_rng(1)
    lookup_body = json.dumps({"keys": rng.integers(0, ROWS, 8).tolist()})
    predict_body = json.dumps(
        {
            "instances": [
                {
                    "user": int(rng.integers(0, ROWS)),
                    "items": rng.integers(0, ROWS, 3).tolist(),
                    "x": float(rng.normal()),
                }
                for _ in range(256)
            ]
        }
    )
    latencies: list[float] = []
    predicted = 0
    end = time.perf_counter() + seconds
    lookup_url = f"{url}/v1/models/m/tables/users:lookup"

    async def lookup_loop(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < end:
            start = time.perf_counter()
            async with session.post(lookup_url, data=lookup_body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            latencies.append(time.perf_counter() - start)

    async def predict_loop(session: aiohttp.ClientSession) -> None:
        nonlocal predicted
        while time.perf_counter() < end:
            async with session.post(f"{url}/v1/models/m:predict", data=predict_body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            predicted += 1

    connector = aiohttp.TCPConnector(limit=lookups + predicts)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(20):  # warm-up
            async with session.post(f"{url}/v1/models/m:predict", data=predict_body) as r:
                await r.read()
        tasks = [lookup_loop(session) for _ in range(lookups)]
        tasks += [predict_loop(session) for _ in range(predicts)]
        await asyncio.gather(*tasks)
    ms = np.array(latencies) * 1000
    return {
        "lookups_per_s": round(len(latencies) / seconds),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "predicts_per_s": round(predicted / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode (medians)")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # url: run as the client
    parser.add_argument("--lookups", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--predicts", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        result = asyncio.run(client(args.client, args.seconds, args.lookups, args.predicts))
        print(json.dumps(result))
        return

    from wuliang.serving.http.server import HttpServer
    from wuliang.serving.service import Service
    from wuliang.serving.store import ModelStore

    folder = Path(tempfile.mkdtemp(prefix="serving-http-bench-"))
    exports = make_export(folder)
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(args.rounds):  # the modes alternate, so drift hits both
        for mode, inline_bytes in (("inline", 4096), ("pool", 0)):
            service = Service([ModelStore(exports, "m", poll_secs=0).start()])
            server = HttpServer(service, inline_bytes=inline_bytes)
            url = f"http://127.0.0.1:{server.port}"
            try:
                for case, lookups, predicts in (
                    ("lookup_1", 1, 0),
                    ("lookup_16", 16, 0),
                    ("mixed", 16, 4),
                ):
                    command = [sys.executable, __file__, "--client", url, "--seconds"]
                    command += [str(args.seconds), "--lookups", str(lookups)]
                    command += ["--predicts", str(predicts)]
                    run = subprocess.run(command, check=True, capture_output=True, text=True)
                    result = json.loads(run.stdout.strip().splitlines()[-1])
                    runs.setdefault(f"{mode}/{case}", []).append(result)
                    print(round_, mode, case, result, flush=True)
            finally:
                server.stop()
                service.close()
    results = {
        name: {key: float(np.median([r[key] for r in rs])) for key in rs[0]}
        for name, rs in runs.items()
    }
    print("medians:")
    for name, result in results.items():
        print(f"  {name:18s} {result}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
