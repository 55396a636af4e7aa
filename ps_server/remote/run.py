"""``wuliang ps``: one parameter-server process, until SIGTERM or SIGINT.

It starts an engine of ``--threads`` shard threads behind the gRPC service
of ``ps.proto`` (``PsServer``), binds ``--host`` (127.0.0.1 unless told
otherwise) and ``--port``, prints one line with its address once it
listens, and on SIGTERM or SIGINT stops taking calls, lets those in flight
finish and exits 0. With ``--token-file`` every call must carry the token;
with ``--tls-cert`` and ``--tls-key`` it speaks TLS. Without ``--port`` it
serves at its own address in ``TF_CONFIG`` (``wuliang.ps_server.cluster``).
With ``--restore DIR`` it first takes back its part of the newest checkpoint
of DIR (``wuliang.ps_server.remote.recover``): a server that comes back.
With ``--disk-dir D [--memory-gb G]`` rows beyond G GiB of RAM live in
row files under D (the engine's disk tier, docs/disk_tier.md). With
``--parent-pid P`` it also stops, as on SIGTERM, once process P is no
longer its parent (P exited): test harnesses start servers that way, so
that none outlives a harness that was killed.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from wuliang.ps_server.cluster import Cluster
from wuliang.ps_server.rpc.signals import StopSignals

__all__ = ["PsOptions", "listen_address", "place", "run", "start"]


@dataclass
class PsOptions:
    """The options of ``wuliang ps`` (``wuliang ps --help`` explains each)."""

    port: int
    _: KW_ONLY
    host: str = "127.0.0.1"
    threads: int = 2
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_message_mb: int = 64
    rpc_threads: int = 16
    restore: Path | None = None  # a model directory: restore this server's part at start
    server_index: int | None = None  # with restore: which server of num_servers this is
    num_servers: int | None = None
    parent_pid: int | None = None  # stop once this process is no longer the parent
    disk_dir: Path | None = None  # the engine's disk tier (docs/disk_tier.md)
    memory_gb: float | None = None  # its RAM for rows (default 1)


def place(options: PsOptions, environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(this server's index, the number of servers): the options', else
    ``TF_CONFIG``'s (its ps task index and the number of ps tasks)."""
    if options.server_index is not None or options.num_servers is not None:
        if options.server_index is None or options.num_servers is None:
            raise ValueError("--server-index and --num-servers go together")
        if not 0 <= options.server_index < options.num_servers:
            raise ValueError(
                f"--server-index {options.server_index} is not one of "
                f"--num-servers {options.num_servers}"
            )
        return options.server_index, options.num_servers
    cluster = Cluster.from_env(environ)
    if cluster is None or cluster.task_type != "ps":
        raise ValueError(
            "--restore needs to know which server this is: --server-index and --num-servers, "
            "or TF_CONFIG naming a ps task"
        )
    return cluster.task_index, len(cluster.ps)


def listen_address(
    port: int | None, host: str | None, environ: Mapping[str, str] | None = None
) -> tuple[str, int]:
    """Where to listen: ``--host`` (127.0.0.1) and ``--port``; without
    ``--port``, the port of this task's address in ``TF_CONFIG`` (a ``ps``
    task), on every interface unless ``--host`` says otherwise (the address
    is the pod's name, reached from other machines)."""
    if port is not None:
        return host or "127.0.0.1", port
    cluster = Cluster.from_env(environ)
    if cluster is None:
        raise ValueError("--port is required (or TF_CONFIG naming this process a ps task)")
    if cluster.task_type != "ps":
        raise ValueError(
            f"TF_CONFIG names this process {cluster.task_type} {cluster.task_index}, not a "
            "parameter server (task type ps); give --port to run one anyway"
        )
    return host or "0.0.0.0", cluster.port


def check_options(options: PsOptions) -> None:
    """ValueError for options that do not go together (usage errors)."""
    if (options.tls_cert is None) != (options.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if options.memory_gb is not None and options.disk_dir is None:
        raise ValueError("--memory-gb is the disk tier's budget: it needs --disk-dir")
    if options.memory_gb is not None and not options.memory_gb > 0:
        raise ValueError(f"--memory-gb must be > 0, got {options.memory_gb}")
    if options.parent_pid is not None and options.parent_pid < 1:
        raise ValueError(f"--parent-pid must be a process id >= 1, got {options.parent_pid}")
    if options.restore is not None:
        place(options)


def start(options: PsOptions):
    """The engine and its server, listening."""
    from wuliang.ps_server.engine import Engine
    from wuliang.ps_server.remote.server import PsServer
    from wuliang.ps_server.rpc.auth import read_token
    from wuliang.ps_server.rpc.tls import ServerTls

    check_options(options)
    token = read_token(options.token_file) if options.token_file is not None else None
    tls = None
    if options.tls_cert is not None and options.tls_key is not None:
        tls = ServerTls.from_files(options.tls_cert, options.tls_key)
    engine = Engine(
        options.threads,
        disk_dir=options.disk_dir,
        memory_bytes=int((options.memory_gb or 0) * (1 << 30)),
    )
    try:
        part = None
        if options.restore is not None:  # before listening: no client sees it half restored
            from wuliang.ps_server.remote.recover import restore_own_part

            part = restore_own_part(engine, options.restore, *place(options))
        server = PsServer(
            engine,
            options.host,
            options.port,
            token=token,
            tls=tls,
            max_message_mb=options.max_message_mb,
            threads=options.rpc_threads,
        )
    except BaseException:
        engine.close()
        raise
    if part is not None:
        server.service.behind = True  # until the client raises it to the job's version
        server.service.restored_step = part.step
    return server


def run(options: PsOptions) -> int:
    """Serves until SIGTERM or SIGINT (or, with ``parent_pid``, until that
    process is no longer the parent); prints the address once listening."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # before the line that says it runs; waits in short sleeps, not on an Event:
    # a signal taken by another thread does not wake a main thread blocked on one
    stop = StopSignals(options.parent_pid)
    server = start(options)
    scheme = "grpc+tls" if options.tls_cert is not None else "grpc"
    print(
        f"parameter server listening on {scheme} {options.host}:{server.port} "
        f"({options.threads} shard threads)",
        flush=True,
    )
    reason = stop.wait()
    # A stop that hangs says where: every thread's stack on stderr after 15 s.
    faulthandler.dump_traceback_later(15.0, exit=False)
    server.stop(grace=5.0)
    faulthandler.cancel_dump_traceback_later()
    print(f"parameter server stopped ({reason})", file=sys.stderr, flush=True)
    return 0
