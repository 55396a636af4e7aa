"""``wuliang serve``: one serving process, gRPC and HTTP, until SIGINT/SIGTERM.

``start(options)`` checks the token and TLS files, makes the model's store
(``ModelStore`` over an export directory, or with ``--redis`` the
``RedisModelStore`` of a published model), binds the gRPC server (``--port``,
default 8500, TF Serving's) and the HTTP server (``--http-port``, default
8501; 0: any free port, -1: none), and only then loads the newest version:
a busy port or a bad certificate fails at once, before a long load. Until
the first version is served (an empty export directory, a model not yet
published) both servers answer UNAVAILABLE and the health checks
NOT_SERVING, and the store keeps looking for one. ``--model-config FILE``
serves the models of TensorFlow Serving's model config file instead, each a
``VersionedModel`` (its policy and labels), and re-reads the file on SIGHUP
and every ``--model-config-poll-secs`` (``wuliang.serving.model_config``). ``--gpu-cache-rows N``
keeps the N hottest rows of each table on the device for predictions
(``wuliang.serving.device_cache``; export directories only). ``serve(options)`` also
logs (INFO, to stderr) each version applied and each refusal, prints one
line naming the model, its version (or that it waits for the first) and
both addresses (``grpc+tls`` and ``https`` when they speak TLS), and runs
until SIGINT or SIGTERM. Both servers bind 127.0.0.1 unless told otherwise.

The process keeps Python's cyclic garbage collector off the objects it
serves from (``freeze_heap``): once started, and after every version
applied or change of models, it collects once and moves everything alive
to the collector's permanent generation. Otherwise every full collection
walks TensorFlow's and the models' millions of objects, holding the GIL
for 90 to 130 ms, every few seconds under load: the p99 of every request
(``benchmarks/overload_bench.py``: HTTP lookups at 128 connections, p99
102 ms before, 12.7 ms after).
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from wuliang.ps_server.rpc.auth import read_token
from wuliang.ps_server.rpc.signals import StopSignals
from wuliang.ps_server.rpc.tls import ServerTls
from wuliang.ps_server.storage import location
from wuliang.serving.device_cache import check_cache_rows
from wuliang.serving.grpc.server import GrpcServer
from wuliang.serving.model import ServedModel
from wuliang.serving.model_config import ModelConfigWatcher
from wuliang.serving.overload import DEFAULT_MAX_QUEUE, DEFAULT_MAX_QUEUE_MS, Shedding
from wuliang.serving.predict import PREDICT_THREADS
from wuliang.serving.service import MAX_REQUEST_BYTES, Service
from wuliang.serving.store import ModelStore
from wuliang.serving.tfs.config import ModelEntry
from wuliang.serving.versioned import VersionedModel

__all__ = ["Running", "ServeOptions", "read_token", "serve", "start"]

log = logging.getLogger("wuliang.serving")


@dataclass
class ServeOptions:
    """The options of ``wuliang serve`` (``wuliang serve --help`` explains each)."""

    exports: Path | None
    _: KW_ONLY
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8500
    http_port: int = 8501  # -1: no HTTP server
    poll_secs: float = 1.0
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    precision: str = "fp32"
    missing: str = "zeros"
    max_keys: int = 100_000
    max_rows: int = 10_000
    max_request_bytes: int = MAX_REQUEST_BYTES
    shards: int = 2
    redis: str | None = None
    gpu_cache_rows: int = 0  # rows of each table on the device (0: off)
    disk_dir: Path | None = None  # the engine's disk tier: rows beyond memory_gb there
    memory_gb: float | None = None
    model_config: Path | None = None  # TensorFlow Serving's model config file
    model_config_poll_secs: float = 0.0  # 0: re-read on SIGHUP only
    predict_threads: int = PREDICT_THREADS  # per transport
    max_queue: int = DEFAULT_MAX_QUEUE  # requests that may wait in a queue (0: no bound)
    max_queue_ms: float = DEFAULT_MAX_QUEUE_MS  # the longest wait admitted while overloaded


@dataclass
class Running:
    """A started serving process: its service and servers."""

    service: Service
    grpc: GrpcServer
    http: object | None  # an HttpServer (imported only when serving HTTP)
    tls: ServerTls | None = None
    config: ModelConfigWatcher | None = None  # with --model-config

    def stop(self) -> None:
        if self.config is not None:
            self.config.close()
        if self.http is not None:
            self.http.stop()  # type: ignore[attr-defined]
        self.grpc.stop()
        self.service.close()

    def addresses(self, host: str) -> str:
        """``grpc HOST:PORT, http HOST:PORT`` (``grpc+tls``, ``https`` with TLS)."""
        shown = f"[{host}]" if ":" in host else host
        tls = self.tls is not None
        out = f"{'grpc+tls' if tls else 'grpc'} {shown}:{self.grpc.port}"
        if self.http is not None:
            out += f", {'https' if tls else 'http'} {shown}:{self.http.port}"  # type: ignore[attr-defined]
        return out


def check_options(options: ServeOptions) -> None:
    """ValueError for options that do not go together (the command line
    reports these as usage errors)."""
    if options.model_config is not None:
        given = [
            flag
            for flag, value in (
                ("--exports", options.exports),
                ("--model", options.model),
                ("--redis", options.redis),
            )
            if value is not None
        ]
        if given:
            raise ValueError(
                f"--model-config names the models and their export directories; leave out "
                f"{', '.join(given)}"
            )
    elif options.model_config_poll_secs:
        raise ValueError("--model-config-poll-secs goes with --model-config")
    elif options.redis is None and options.exports is None:
        raise ValueError("--exports is required (or --redis, or --model-config)")
    if (options.tls_cert is None) != (options.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    check_cache_rows(options.gpu_cache_rows, "--gpu-cache-rows")
    shedding(options)
    if options.memory_gb is not None and options.disk_dir is None:
        raise ValueError("--memory-gb is the disk tier's budget: it goes with --disk-dir")
    if options.memory_gb is not None and not options.memory_gb > 0:
        raise ValueError(f"--memory-gb must be > 0, got {options.memory_gb}")
    if options.disk_dir is not None and options.redis is not None:
        raise ValueError(
            "--disk-dir keeps an export directory's rows beyond --memory-gb on disk; with "
            "--redis the rows stay in Redis (leave --disk-dir out)"
        )
    if options.redis is not None:
        if options.missing != "zeros" or options.precision != "fp32":
            raise ValueError(
                "with --redis, keys without a row read as zeros and vectors are fp32 "
                "(--missing zeros, --precision fp32)"
            )
        if options.model is None and options.exports is None:
            raise ValueError("--redis needs --model (or --exports, whose name it is)")
        if options.gpu_cache_rows:
            raise ValueError(
                f"--gpu-cache-rows {options.gpu_cache_rows} needs an export directory served "
                "by the embedded engine; with --redis rows come through its own host cache "
                "(leave --gpu-cache-rows out or 0)"
            )


def shedding(options: ServeOptions) -> Shedding:
    """The queues' bounds (``--max-queue``, ``--max-queue-ms``); ValueError
    for values out of range."""
    return Shedding(options.max_queue, options.max_queue_ms)


def make_store(options: ServeOptions) -> ServedModel:
    """The served model, not started: an export directory in an embedded
    engine, or (with ``--redis``) the published copy in Redis, towers from
    the export directory when there is one."""
    check_options(options)
    exports = options.exports
    if exports is not None and not exports.is_dir():
        what = "is not a directory" if exports.exists() else "does not exist"
        raise FileNotFoundError(f"export directory {exports} {what}")
    if options.redis is None:
        assert exports is not None
        return ModelStore(
            exports,
            options.model,
            missing=options.missing,
            precision=options.precision,
            poll_secs=options.poll_secs,
            num_shards=options.shards,
            gpu_cache_rows=options.gpu_cache_rows,
            disk_dir=options.disk_dir,
            memory_gb=options.memory_gb,
        )
    from wuliang.serving.redis.model import RedisModelStore

    name = options.model or (exports.resolve().name if exports is not None else "")
    return RedisModelStore(options.redis, name, exports, poll_secs=options.poll_secs)


def make_versioned(options: ServeOptions, entry: ModelEntry) -> VersionedModel:
    """A model of the config file, with the server's store options; a
    missing local export directory is an error naming the model."""
    exports = location(entry.base_path)
    if isinstance(exports, Path) and not exports.is_dir():
        what = "is not a directory" if exports.exists() else "does not exist"
        raise FileNotFoundError(f"model {entry.name!r}: base_path {exports} {what}")
    return VersionedModel(
        exports,
        entry.name,
        policy=entry.policy,
        labels=entry.labels,
        poll_secs=options.poll_secs,
        missing=options.missing,
        precision=options.precision,
        num_shards=options.shards,
        gpu_cache_rows=options.gpu_cache_rows,
        disk_dir=options.disk_dir,
        memory_gb=options.memory_gb,
    )


def start(options: ServeOptions) -> Running:
    """Binds both servers, then loads the model (see the module docstring).

    Raises:
        ValueError: options that do not go together, an empty token file, a
            bad certificate or key (``TlsError``).
        OSError: a missing export directory or unreadable file, a port that
            cannot be bound (the message names it), Redis unreachable.
    """
    check_options(options)
    token = read_token(options.token_file) if options.token_file is not None else None
    tls = None
    if options.tls_cert is not None and options.tls_key is not None:
        tls = ServerTls.from_files(options.tls_cert, options.tls_key)
    config = None
    if options.model_config is not None:
        config = ModelConfigWatcher(
            options.model_config,
            lambda entry: make_versioned(options, entry),
            options.model_config_poll_secs,
        )
        stores: list[ServedModel] = list(config.models())
    else:
        stores = [make_store(options)]
    service = Service(
        stores,
        token=token,
        max_keys=options.max_keys,
        max_rows=options.max_rows,
        max_request_bytes=options.max_request_bytes,
    )
    grpc_server = http = None
    try:
        try:
            grpc_server = GrpcServer(
                service,
                options.host,
                options.port,
                tls=tls,
                predict_threads=options.predict_threads,
                shedding=shedding(options),
            )
        except OSError as error:
            raise OSError(f"{error} (--port {options.port})") from None
        if options.http_port >= 0:
            from wuliang.serving.http.server import HttpServer

            try:
                http = HttpServer(
                    service,
                    options.host,
                    options.http_port,
                    tls=tls,
                    workers=options.predict_threads,
                    shedding=shedding(options),
                )
            except OSError as error:
                raise OSError(f"{error} (--http-port {options.http_port})") from None
        for store in stores:
            store.start()
    except BaseException:
        if http is not None:
            http.stop()
        if grpc_server is not None:
            grpc_server.stop(None)
        service.close()
        raise
    if config is not None:
        config.attach(service)
    return Running(service, grpc_server, http, tls, config)


def freeze_heap() -> None:
    """Collects the garbage there is, then moves every object alive to the
    garbage collector's permanent generation, which its collections skip;
    objects of a version retired later are collected at the next call."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def serve(options: ServeOptions) -> int:
    """Runs until SIGINT or SIGTERM; prints the addresses once listening."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("wuliang")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    # in short sleeps, not on an Event: a signal another thread takes would not wake it
    stop = StopSignals()
    hangups: list[int] = []  # SIGHUPs before the watcher exists: re-read once it does
    if options.model_config is not None:
        signal.signal(signal.SIGHUP, lambda signum, frame: hangups.append(signum))
    running = start(options)
    freeze_heap()
    running.service.listeners.append(freeze_heap)  # versions applied, models changed
    if running.config is not None:
        signal.signal(signal.SIGHUP, running.config.hangup)
        if hangups:
            running.config.hangup()
        served = ", ".join(
            f"{name!r} {_versions(store)}" for name, store in sorted(running.service.stores.items())
        )
        print(
            f"serving models {served} from {options.model_config}: "
            f"{running.addresses(options.host)}",
            flush=True,
        )
    else:
        store = next(iter(running.service.stores.values()))
        print(
            f"serving model {store.name!r} {_versions(store)} from {store.source}: "
            f"{running.addresses(options.host)}",
            flush=True,
        )
    log.info("stopping (%s received)", stop.wait())
    running.stop()
    return 0


def _versions(store: ServedModel) -> str:
    """``version 3``, ``versions 2, 3`` or ``(waiting for its first version)``."""
    listed = getattr(store, "served_versions", None)
    numbers = listed() if listed is not None else ([store.version] if store.version else [])
    if not numbers:
        return "(waiting for its first version)"
    return f"version{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}"
