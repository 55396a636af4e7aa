"""The floor of a shed answer on this machine: ``python benchmarks/shed_floor.py
[--rate R]``.

How fast can a Python server answer "overloaded" at all, under a given
load? A bare server (a subprocess of this script; ``overload_bench.py``
starts it too, for its ``shed_p99_vs_floor``) answers *every* call as
shed, doing nothing else:

* gRPC: a grpcio sync server, pool of 2 threads (as ``wuliang serve`` 's
  pools), whose handlers for ``/wuliang.serving.Serving/Lookup`` and
  ``/tensorflow.serving.PredictionService/Predict`` abort
  RESOURCE_EXHAUSTED with ``grpc-retry-pushback-ms`` (no parsing);
* HTTP: an aiohttp server on one event loop whose every ``POST`` reads the
  body and answers 503 with ``Retry-After`` and a JSON body.

Alone, this script sends it ``overload_bench.py`` 's predictions
(TensorFlow Serving's gRPC Predict and REST predict of 100 rows) in an
open loop of ``--rate`` a second per API for ``--seconds`` s, from
``serving_load.py`` 's load processes, and prints one JSON line: per API,
shed answers/s and p50/p99 ms, and the server's and clients' CPU per
answer. A real server's shed answers cannot beat these: its shed
ones also wait behind the work it admitted. ``--busy N`` runs N threads
computing in another process meanwhile, as a tower's TensorFlow keeps the
cores of a real server busy: the same bare server's refusals then.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

RATE = 800.0  # open-loop predictions a second, per API
SECONDS = 5.0
ROWS = 1_000_000  # the key range of the requests (as overload_bench.py's)


def serve() -> None:
    """The bare shedding server: prints ``grpc PORT http PORT``, runs until SIGTERM."""
    import grpc
    from aiohttp import web

    def abort(_request: bytes, context: grpc.ServicerContext) -> bytes:
        context.set_trailing_metadata((("grpc-retry-pushback-ms", "10"),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded: shed floor")

    handlers = [
        grpc.method_handlers_generic_handler(
            service, {method: grpc.unary_unary_rpc_method_handler(abort)}
        )
        for service, method in (
            ("wuliang.serving.Serving", "Lookup"),
            ("tensorflow.serving.PredictionService", "Predict"),
        )
    ]
    server = grpc.server(ThreadPoolExecutor(2), handlers=handlers)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def shed(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(
            {"error": "overloaded: shed floor", "retry_after_ms": 10},
            status=503,
            headers={"Retry-After": "1"},
        )

    app = web.Application()
    app.router.add_post("/{tail:.*}", shed)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    http_port = runner.addresses[0][1]
    signal.signal(signal.SIGTERM, lambda *_: loop.call_soon_threadsafe(loop.stop))
    print(f"grpc {grpc_port} http {http_port}", flush=True)
    loop.run_forever()
    loop.run_until_complete(runner.cleanup())
    server.stop(0)


def busy(threads: int) -> None:
    """Keeps ``threads`` threads computing (matrix products, the GIL
    released, as a tower's TensorFlow keeps the cores) until killed."""
    import numpy as np

    def spin() -> None:
        a = np.random.default_rng(0).random((256, 256))
        while True:
            a @ a

    for _ in range(threads):
        threading.Thread(target=spin, daemon=True).start()
    threading.Event().wait()


def floor(rate: float = RATE, seconds: float = SECONDS, busy_threads: int = 0) -> dict[str, Any]:
    """The figures of the module docstring; ``busy_threads``: that many
    threads computing in another process meanwhile."""
    from overload_bench import APIS, LOAD_PROCS, PREDICT, TRANSPORTS, requests
    from serving_load import LoadProcess, run_load, summary
    from serving_setup import stop

    child = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True
    )
    loads: dict[str, list[LoadProcess]] = {}
    burner = None
    if busy_threads:
        burner = subprocess.Popen([sys.executable, __file__, "--burn", str(busy_threads)])
    try:
        assert child.stdout is not None
        words = child.stdout.readline().split()
        ports = {"grpc": int(words[1]), "http": int(words[3])}
        bodies = requests(ROWS)
        loads = {t: [LoadProcess() for _ in range(LOAD_PROCS)] for t in TRANSPORTS}
        out: dict[str, Any] = {}
        for api in APIS:
            transport, target = PREDICT[api]
            port, procs = ports[transport], loads[transport]
            # warm-up: the server's and the load process's first calls
            run_load(procs, transport, port, target, bodies[api], 1.0, child.pid, conns=4)
            run = run_load(
                procs, transport, port, target, bodies[api], seconds, child.pid, rate=rate
            )
            s = summary([run])
            out[api] = {
                k: s[k]
                for k in ("rate", "offered_qps", "late_sends", "shed_qps", "shed_p50_ms",
                          "shed_p99_ms", "accepted_qps", "failed", "shed_without_retry",
                          "server_cpu_us", "client_cpu_us")
            }  # fmt: skip
        return {
            "shed_floor": out,
            "rate": rate,
            "seconds": seconds,
            "busy_threads": busy_threads,
            "cores": os.cpu_count(),
        }
    finally:
        for group in loads.values():
            for proc in group:
                proc.close()
        stop(child)
        if burner is not None:
            burner.kill()
            burner.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=RATE, help="predictions a second, per API")
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="N threads computing in another process meanwhile (as a tower keeps the cores)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--burn", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    if args.burn:
        busy(args.burn)
        return
    print(json.dumps(floor(args.rate, args.seconds, args.busy)))


if __name__ == "__main__":
    main()
