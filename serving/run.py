"""``wuliang serve``: one serving process, gRPC and HTTP, until SIGINT/SIGTERM.

It loads the newest valid version of the export directory (``ModelStore``),
starts the gRPC server (``--port``, default 8500, TF Serving's) and the HTTP
server (``--http-port``, default 8501; 0: any free port, -1: none), prints
one line naming the model, the version and both addresses, and follows the
directory every ``--poll-secs``. Both bind 127.0.0.1 unless told otherwise.
With ``--token-file`` every request needs that token; with ``--tls-cert``
and ``--tls-key`` both servers speak TLS.
"""

from __future__ import annotations

import signal
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wuliang.serving.grpc_server import GrpcServer
from wuliang.serving.service import Service
from wuliang.serving.store import ModelStore


@dataclass
class ServeOptions:
    exports: Path | None
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8500
    http_port: int = 8501  # -1: no HTTP server
    poll_secs: float = 10.0
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    precision: str = "fp32"
    missing: str = "zeros"
    max_keys: int = 100_000
    max_rows: int = 10_000
    shards: int = 2
    redis: str | None = None


@dataclass
class Running:
    """A started serving process: its service and servers."""

    service: Service
    grpc: GrpcServer
    http: object | None

    def stop(self) -> None:
        if self.http is not None:
            self.http.stop()  # type: ignore[attr-defined]
        self.grpc.stop()
        self.service.close()


def read_token(path: Path) -> str:
    """The token in a file (surrounding whitespace dropped); ValueError when empty."""
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def open_store(options: ServeOptions) -> Any:
    """The served model: an export directory in an embedded engine, or (with
    ``--redis``) the published copy in Redis, towers from the export
    directory when there is one."""
    exports = options.exports
    if options.redis is None:
        if exports is None:
            raise ValueError("--exports is required (or --redis)")
        if not exports.is_dir():
            raise FileNotFoundError(f"export directory {exports} does not exist")
        return ModelStore(
            exports,
            options.model,
            missing=options.missing,
            precision=options.precision,
            poll_secs=options.poll_secs,
            num_shards=options.shards,
        ).start()
    from wuliang.serving.redis_model import RedisModelStore

    if options.missing != "zeros" or options.precision != "fp32":
        raise ValueError("with --redis, keys without a row read as zeros and vectors are fp32")
    name = options.model or (exports.resolve().name if exports is not None else None)
    if name is None:
        raise ValueError("--redis needs --model (or --exports, whose name it is)")
    if exports is not None and not exports.is_dir():
        raise FileNotFoundError(f"export directory {exports} does not exist")
    return RedisModelStore(options.redis, name, exports, poll_secs=options.poll_secs).start()


def start(options: ServeOptions) -> Running:
    """Loads the model and starts both servers."""
    if (options.tls_cert is None) != (options.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    token = read_token(options.token_file) if options.token_file is not None else None
    store = open_store(options)
    service = Service([store], token=token, max_keys=options.max_keys, max_rows=options.max_rows)
    tls = None
    if options.tls_cert is not None and options.tls_key is not None:
        tls = (options.tls_key.read_bytes(), options.tls_cert.read_bytes())
    try:
        grpc_server = GrpcServer(service, options.host, options.port, tls=tls)
    except BaseException:
        service.close()
        raise
    http = None
    if options.http_port >= 0:
        from wuliang.serving.http_server import HttpServer

        context = None
        if options.tls_cert is not None and options.tls_key is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(options.tls_cert, options.tls_key)
        try:
            http = HttpServer(service, options.host, options.http_port, tls=context)
        except BaseException:
            grpc_server.stop()
            service.close()
            raise
    return Running(service, grpc_server, http)


def serve(options: ServeOptions) -> int:
    """Runs until SIGINT or SIGTERM; prints the addresses once serving."""
    running = start(options)
    store = next(iter(running.service.stores.values()))
    http = f", http {options.host}:{running.http.port}" if running.http is not None else ""  # type: ignore[attr-defined]
    print(
        f"serving model {store.name!r} version {store.version} from "
        f"{options.redis or options.exports}: "
        f"grpc {options.host}:{running.grpc.port}{http}",
        flush=True,
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    running.stop()
    return 0
