"""Context: all the state of one model's training, and nothing global.

A ``Context`` owns the parameter server (``ps``: any ``ParameterServer``,
chosen by address), the tables created in it, the global step and the
pipeline settings. Two contexts in one process share nothing, so two models
train side by side without interfering.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from wuliang.embedding.features import EmbeddingTable
from wuliang.job import Job
from wuliang.nonfinite import check_policy
from wuliang.ps_server import Engine, ParameterServer, address_kind, parameter_server
from wuliang.ps_server.cluster import Cluster
from wuliang.ps_server.spec import TableSpec
from wuliang.ps_server.threads import check_background

log = logging.getLogger("wuliang")


class Trace:
    """Per-stage timings of the steps (read, prepare, pull, compute, push), kept
    only while some hook (``Timeline``) enables it."""

    def __init__(self, capacity: int = 200_000) -> None:
        self._events: deque[tuple[str, int, float, float, str]] = deque(maxlen=capacity)
        self._enabled = 0
        self._lock = threading.Lock()

    def enable(self) -> None:
        with self._lock:
            self._enabled += 1

    def disable(self) -> None:
        with self._lock:
            self._enabled = max(0, self._enabled - 1)
            if not self._enabled:
                self._events.clear()

    @property
    def enabled(self) -> bool:
        return self._enabled > 0

    def record(self, stage: str, step: int, start: float, end: float) -> None:
        if self._enabled:
            self._events.append((stage, step, start, end, threading.current_thread().name))

    @contextmanager
    def span(self, stage: str, step: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(stage, step, start, time.perf_counter())

    def events(self) -> list[tuple[str, int, float, float, str]]:
        return list(self._events)


class Context:
    """The state of one model: parameter server, tables, step, settings.

    Args:
        ps: the parameter server's address (``wuliang.ps_server.
            parameter_server``): ``"embedded"``, the engine in this process;
            a list of ``"host:port"`` for remote servers; or a
            ``ParameterServer`` made beforehand (a ``RemoteServer`` with a
            token or TLS), which the context then owns and closes. Default:
            the ``ps`` tasks of ``TF_CONFIG`` when it names any (a trainer
            of a cluster, ``wuliang.ps_server.cluster``), else embedded.
        num_shards: shard threads of an embedded engine (default: the number
            of CPUs, at most 16).
        disk_dir: the embedded engine's disk tier (docs/disk_tier.md): rows
            beyond ``memory_gb`` GiB of RAM live in row files in this
            directory on a local disk; None (the default): all in RAM.
            Remote servers take ``wuliang ps --disk-dir``.
        memory_gb: the disk tier's RAM for rows (default 1).
        gpu_cache_rows: rows of each table to keep in a GPU hot cache in
            front of the parameter server (``wuliang.ps_server.cache.
            CachedServer``: cupy where a GPU is present, else numpy); None
            (the default): no cache. docs/gpu_cache.md. In a job of several
            trainers each keeps its own cache of shared rows (Geo-SGD, see
            ``cache_sync_steps``).
        host_cache_rows: the same cache with its rows in this process's
            memory (numpy arrays): a host cache in front of remote servers,
            serving a trainer's hot rows without a round trip to them (in
            front of an embedded engine, whose rows are in this process
            already, it only adds work). Not with ``gpu_cache_rows``.
        cache_sync_steps: with a cache in a job of several
            trainers: every k training steps (and whenever a row leaves
            the cache) each trainer's cache merges the change it made to
            its rows into the servers' rows, and reads them back with the
            other trainers' changes in (k: how stale a trainer's copy of a
            hot row may get; docs/gpu_cache.md, "Several trainers").
        staleness: 0: a step pulls rows only after the previous step's push
            is applied (exact); 1: the pull of step i may run while step i-1
            trains, so rows can be one update old (faster).
        prefetch: batches read, prepared and pulled ahead of the step.
        evict_every_steps: how often a session applies the eviction policies
            of its tables (``EmbeddingTable(eviction=...)``) while training:
            it adds a ``hooks.Evict`` of its own unless given one; None: only
            an explicit ``hooks.Evict`` or ``engine.evict()`` evicts.
        background: scheduling of the threads that feed TensorFlow (the
            embedded engine's shard workers, the pipeline's and the reader's
            threads): ``"normal"`` (the default) or ``"idle"`` (Linux
            ``SCHED_IDLE``: they never preempt TensorFlow's threads, which
            shortens steps when the trainer has the machine to itself, but
            they starve on a machine shared with other busy processes, and a
            process cannot undo the policy). See ``wuliang.ps_server.threads``.
        non_finite: a NaN or infinite loss or gradient while training:
            ``"raise"`` stops training with ``NonFiniteError`` naming the
            loss, tower variable or table and the step; ``"drop"`` skips
            such updates, counts and logs them. See ``wuliang.nonfinite``.
        tower_sync_steps: with several trainers of a cluster, the tower's
            variables live on the servers (``wuliang.dense``): 1 (the
            default) pulls them before every step and has the servers
            apply each step's gradients with the tower's optimizer; k > 1
            lets each trainer's optimizer apply them and adds each trainer's
            change to the servers' values every k steps (Paddle's GEO
            mode: k times less traffic, some AUC: see ``docs/cluster.md``).
            Every trainer of a job must use the same.
    """

    def __init__(
        self,
        ps: str | Sequence[str] | ParameterServer | None = None,
        *,
        num_shards: int | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        memory_gb: float | None = None,
        gpu_cache_rows: int | None = None,
        host_cache_rows: int | None = None,
        staleness: int = 0,
        prefetch: int = 2,
        evict_every_steps: int | None = 1000,
        background: str = "normal",
        non_finite: str = "raise",
        tower_sync_steps: int = 1,
        cache_sync_steps: int = 8,
    ) -> None:
        self.cluster = Cluster.from_env()  # None: not part of a cluster
        if ps is None:
            ps = list(self.cluster.ps) if self.cluster and self.cluster.ps else "embedded"
        if not isinstance(ps, ParameterServer):
            address_kind(ps)  # a bad address fails before anything starts
        elif num_shards is not None:
            raise ValueError("num_shards is for an address: the given parameter server has its own")
        if staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 or 1, got {staleness!r}")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
        if evict_every_steps is not None and (
            not isinstance(evict_every_steps, int) or evict_every_steps < 1
        ):
            raise ValueError(
                f"evict_every_steps must be an int >= 1 or None, got {evict_every_steps!r}"
            )
        if not isinstance(tower_sync_steps, int) or tower_sync_steps < 1:
            raise ValueError(f"tower_sync_steps must be an int >= 1, got {tower_sync_steps!r}")
        self.tower_sync_steps = tower_sync_steps
        self.background = check_background(background)
        self.non_finite = check_policy(non_finite)
        if num_shards is not None and not (isinstance(num_shards, int) and num_shards >= 1):
            raise ValueError(f"num_shards must be an int >= 1 or None, got {num_shards!r}")
        cache_options = {"gpu_cache_rows": gpu_cache_rows, "host_cache_rows": host_cache_rows}
        for name, rows in cache_options.items():
            bad = isinstance(rows, bool) or not isinstance(rows, int) or rows < 1
            if rows is not None and bad:
                raise ValueError(f"{name} must be an int >= 1 or None, got {rows!r}")
        if gpu_cache_rows is not None and host_cache_rows is not None:
            raise ValueError("give gpu_cache_rows or host_cache_rows, not both")
        if (
            isinstance(cache_sync_steps, bool)
            or not isinstance(cache_sync_steps, int)
            or cache_sync_steps < 1
        ):
            raise ValueError(f"cache_sync_steps must be an int >= 1, got {cache_sync_steps!r}")
        if disk_dir is not None or memory_gb is not None:
            self.ps: ParameterServer = _tiered_engine(ps, num_shards, disk_dir, memory_gb)
        else:
            self.ps = ps if isinstance(ps, ParameterServer) else parameter_server(ps, num_shards)
        cache_rows = gpu_cache_rows if host_cache_rows is None else host_cache_rows
        if cache_rows is not None:
            from wuliang.ps_server.cache import CachedServer

            several = self.cluster is not None and self.cluster.num_trainers > 1
            sync_steps = cache_sync_steps if several else None
            xp = "auto" if host_cache_rows is None else "numpy"
            if host_cache_rows is not None and isinstance(self.ps, Engine):
                log.warning(
                    "host_cache_rows in front of an embedded engine: its rows are in this "
                    "process already, so the cache only adds work (it serves remote servers)"
                )
            self.ps = CachedServer(self.ps, rows=cache_rows, xp=xp, sync_steps=sync_steps)
            if host_cache_rows is None:
                _warn_without_gpus(self.ps.array_module_name)
        self.ps.set_background(self.background)
        listen = getattr(self.ps, "add_restart_listener", None)
        if listen is not None:
            listen(self._server_restarted)
        self.staleness = staleness
        self.prefetch = prefetch
        self.evict_every_steps = evict_every_steps
        self.global_step = 0
        self.tables: dict[str, EmbeddingTable] = {}  # the server's tables (a sized one's blocks)
        self.sized: dict[str, EmbeddingTable] = {}  # sized tables, by name
        self.tower_tables: dict[str, TableSpec] = {}  # a shared tower's (wuliang.dense)
        # a trainer of a cluster: the job's step, ready mark and positions (wuliang.job)
        self.job: Job | None = None
        if self.cluster is not None and self.cluster.is_trainer:
            if isinstance(self.ps, Engine):  # tables in this process: nothing is shared
                if self.cluster.num_trainers > 1:
                    log.warning(
                        "TF_CONFIG names %d trainers but this one trains with an embedded "
                        "engine: each trains a model of its own (give the job ps tasks, or "
                        "Context(ps=[...]) the servers)",
                        self.cluster.num_trainers,
                    )
            else:
                self._refuse_shared_cache(
                    self.cluster.num_trainers, made=not isinstance(ps, ParameterServer)
                )
                self.job = Job(self.ps, self.cluster)
                if getattr(self.ps, "sync_steps", None) is not None:
                    self.job.flush = self.ps.flush  # a cut waits for the cache's changes

    def _refuse_shared_cache(self, trainers: int, made: bool) -> None:
        """A cache that writes its rows back whole (``sync_steps=None``)
        would write them over whatever other trainers pushed meanwhile: in a
        job of several trainers, the cache must merge its changes.
        ``made``: the context made the server (from an address), so it
        closes it; a caller's stays open."""
        from wuliang.ps_server.cache import CachedServer

        if isinstance(self.ps, CachedServer) and trainers > 1 and self.ps.sync_steps is None:
            if made:
                self.ps.close()
            raise ValueError(
                f"this job has {trainers} trainers on one set of parameter servers, and the "
                "given CachedServer writes its rows back whole, over the other trainers' "
                "updates: give it sync_steps=k (it then merges its changes; docs/gpu_cache.md)"
            )

    @property
    def is_chief(self) -> bool:
        """Whether this trainer restores, checkpoints, evicts and exports
        (every trainer that is not part of a cluster)."""
        return self.job is None or self.job.is_chief

    @property
    def shares_tower(self) -> bool:
        """Whether the tower's variables live on the parameter servers:
        several trainers of one cluster (``wuliang.dense``)."""
        return self.job is not None and self.job.trainers > 1

    @property
    def engine(self) -> ParameterServer:
        """The parameter server (``ps``), by its former name."""
        return self.ps

    @property
    def num_shards(self) -> int:
        return self.ps.num_shards

    def create_table(self, table: EmbeddingTable) -> None:
        """Creates the table in the parameter server, or checks it matches.
        A sized table is its blocks (``EmbeddingTable.blocks``), each a table
        of the server and of ``tables``; ``sized`` keeps the table itself."""
        if table.sizes is not None:
            known_sized = self.sized.get(table.name)
            if known_sized is not None and known_sized != table:
                raise ValueError(
                    f"table {table.name!r} already exists in this context with another spec"
                )
            for block in table.blocks():
                self.create_table(block)
            self.sized[table.name] = table
            return
        known = self.tables.get(table.name)
        if known is None:
            self.ps.create_table(table.spec())
            self.tables[table.name] = table
        elif known != table:
            raise ValueError(
                f"table {table.name!r} already exists in this context with another spec"
            )

    def size_stats(self, name: str) -> dict[str, Any]:
        """A sized table's keys and bytes per size, and the keys grown and
        shrunk into each size since the blocks were created: ``{"sizes":
        {size: {"keys", "bytes"}}, "grown": {size: n}, "shrunk": {size: n}}``
        (a block's bytes counted at the size it starts; the keys at a size
        are its block's rows less the next block's)."""
        table = self.sized.get(name)
        if table is None:
            raise KeyError(
                f"no sized table {name!r} (sized tables: {', '.join(self.sized) or 'none'})"
            )
        columns = table.block_columns
        stats = [self.ps.stats(block) for block, _, _ in columns]
        sizes = [stop for _, _, stop in columns]
        out: dict[str, Any] = {"sizes": {}, "grown": {}, "shrunk": {}}
        for i, (size, block) in enumerate(zip(sizes, stats, strict=True)):
            after = stats[i + 1]["rows"] if i + 1 < len(stats) else 0
            out["sizes"][size] = {"keys": block["rows"] - after, "bytes": block["bytes"]}
            if i:
                out["grown"][size] = block["grown"]
                out["shrunk"][size] = block["shrunk"]
        return out

    def _server_restarted(self, address: str, step: int | None) -> None:
        if step is None:
            log.error(
                "parameter server %s came back empty at step %d: its rows are lost (start "
                "servers with --restore MODEL_DIR to take back their part of a checkpoint)",
                address,
                self.global_step,
            )
        else:
            log.warning(
                "parameter server %s came back with its part of the checkpoint of step %d; "
                "the job is at step %d: the updates of %d steps to its rows are lost",
                address,
                step,
                self.global_step,
                max(0, self.global_step - step),
            )

    def create_tower_table(self, spec: TableSpec) -> None:
        """Creates a table of a tower shared through the parameter servers
        (``wuliang.dense``); checkpoints hold it beside the embedding tables."""
        if spec.name not in self.tower_tables:
            self.ps.create_table(spec)
            self.tower_tables[spec.name] = spec

    def advance(self, position: object = None, parts: int = 1) -> int:
        """Counts one training step, before its push (each call to the
        parameter server that stamps rows passes the step it belongs to). In
        a cluster the step is the job's: counted on the job board with the
        reader ``position`` after the step, and raised to the job's as far as
        it is known; the push's ``parts`` each end with ``push_done`` (a
        checkpoint's cut waits for them, ``wuliang.job``)."""
        self.global_step += 1
        if self.job is not None:
            self.job.note_step(position, parts)
            self.global_step = max(self.global_step, self.job.step)
        return self.global_step

    def push_done(self) -> None:
        """One part of a counted step's push is applied (or failed)."""
        if self.job is not None:
            self.job.push_done()

    def sync_step(self) -> int:
        """In a cluster: counts what is unsent and takes the job's step now
        (before a checkpoint or an export names it)."""
        if self.job is not None:
            self.global_step = max(self.global_step, self.job.sync())
        return self.global_step

    def close(self) -> None:
        if self.job is not None:
            self.job.close()
        self.ps.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tiered_engine(
    ps: object, num_shards: int | None, disk_dir: object, memory_gb: float | None
) -> ParameterServer:
    """The embedded engine with a disk tier; ValueError naming what is wrong."""
    from wuliang.ps_server import Engine
    from wuliang.ps_server.factory import default_shards

    if ps != "embedded":
        raise ValueError(
            f"disk_dir / memory_gb are the embedded engine's (ps={ps!r}): remote servers "
            "take wuliang ps --disk-dir / --memory-gb"
        )
    if disk_dir is None:
        raise ValueError("memory_gb is the disk tier's budget: it needs disk_dir")
    if memory_gb is not None and (
        isinstance(memory_gb, bool) or not isinstance(memory_gb, int | float) or not memory_gb > 0
    ):
        raise ValueError(f"memory_gb must be a number > 0, got {memory_gb!r}")
    memory = int(memory_gb * (1 << 30)) if memory_gb is not None else 0
    shards = num_shards if num_shards is not None else default_shards()
    return Engine(shards, disk_dir=os.fspath(disk_dir), memory_bytes=memory)  # type: ignore[arg-type]


def _warn_without_gpus(array_module: str) -> None:
    """Says, where TensorFlow sees no GPU, what the GPU cache does instead."""
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        return  # no towers in this process
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return
    where = (
        "the cache's rows are on the GPU (cupy) and are copied to the host for each step"
        if array_module == "cupy"
        else "no GPU for the cache either: its rows are numpy arrays in host memory, which "
        "only adds work to each step"
    )
    log.warning(
        "Context(gpu_cache_rows=...): TensorFlow sees no GPU, so the towers run on the CPU; "
        "%s. For a GPU: pip install 'wuliang[gpu]' (TensorFlow with CUDA and cupy for the "
        "same CUDA; docs/gpu_cache.md)",
        where,
    )
