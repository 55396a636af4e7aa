"""A serving process for tests: gRPC and HTTP over one export, in a process
of its own (so its memory is its own to measure).

    python tests/serving_process.py EXPORT_DIR [--max-rows N] [--max-keys N]
        [--max-body-bytes N]

Serves the export as model ``m``, prints one JSON line ``{"grpc": port,
"http": port, "pid": pid}`` and serves until its stdin closes, then stops
both servers and exits 0. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from wuliang.serving.grpc.server import GrpcServer
from wuliang.serving.http.server import HttpServer
from wuliang.serving.service import Service
from wuliang.serving.store import ModelStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("export_dir")
    parser.add_argument("--max-rows", type=int, default=10_000)
    parser.add_argument("--max-keys", type=int, default=100_000)
    parser.add_argument("--max-body-bytes", type=int, default=16 << 20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    store = ModelStore(args.export_dir, "m", poll_secs=0).start()
    service = Service(
        [store],
        max_rows=args.max_rows,
        max_keys=args.max_keys,
        max_request_bytes=args.max_body_bytes,
    )
    grpc_server = GrpcServer(service)
    http_server = HttpServer(service)
    ports = {"grpc": grpc_server.port, "http": http_server.port, "pid": os.getpid()}
    print(json.dumps(ports), flush=True)
    sys.stdin.read()  # until the parent closes it (or dies)
    http_server.stop()
    grpc_server.stop()
    service.close()


if __name__ == "__main__":
    main()
