"""Training benchmark: wuliang vs TF-native embeddings vs a dense-only ceiling.

One model, three ways to feed its embeddings, for the Adagrad and the Adam
embedding optimizer. The data are synthetic Criteo-shaped rows
(``wuliang.reader.datagen``: C1…C26 single-valued uint64 keys, ids
Zipf(1.1) over about 1e9 ids per field; I1…I13 float32; a 0/1 label),
written once as Parquet into ``--data-dir`` and reused. The model: 26
embeddings of dim 16 and the 13 dense features, concatenated (429 inputs),
into a Keras MLP 512-256-128-1 (relu), binary cross-entropy, batches of
4096. The tower is updated by the same Keras optimizer in every contender:
``keras.optimizers.Adagrad(0.01)`` in the Adagrad run, ``Adam(1e-3)`` in the
Adam run; its initial weights are the same (``keras.utils.set_random_seed``).

* ceiling:   the tower alone. Per step the embeddings are a random float32
             ``[4096, 416]`` tensor made beforehand (one of 8, cycled), fed
             as a constant; the step computes the loss, the gradients with
             respect to that tensor and the tower, and applies the tower's
             update, in one ``tf.function``: what the machine does with no
             embedding cost at all.
* tf_native: what a TensorFlow user writes. One shared ``tf.Variable`` table
             of 4,194,304 × 16 (truncated normal, stddev 1/4); each field's
             key goes to bucket ``(key XOR salt[field]) & (4194304 - 1)``
             inside the ``tf.function`` (the datagen keys are already hashes
             of (field, id), so this is a salted Hashing(4194304); a Keras
             ``Hashing`` layer would cost more, through strings);
             ``tf.nn.embedding_lookup``, and the sparse-aware
             ``tf.compat.v1.train.AdagradOptimizer(0.05,
             initial_accumulator_value=0.1)`` / ``AdamOptimizer(1e-3,
             epsilon=1e-7)`` applied to the table's ``IndexedSlices``
             gradient inside the same ``tf.function`` as the tower's update
             (TF2 eager, no graph session).
* wuliang:   ``Session.train(ParquetReader(...))`` with a
             ``Context(background="idle")`` (embedded engine, default
             pipeline; ``--staleness`` to choose; the background threads
             under ``SCHED_IDLE``, an opt-in that suits a trainer alone on
             its machine, as here: ``--background normal`` for the default),
             one ``EmbeddingTable`` per field (dim 16, ``Adagrad(0.05)`` or
             ``Adam(1e-3)``, the default initializer), a ``SparseFeature``
             per C field and a ``DenseFeature`` per I field; the tower is a
             function that concatenates them in the same order
             (``wuliang.embedding.concat``: the 26 lookups as one reshape)
             and calls the Keras MLP.

All three see the same batches in the same order: wuliang reads the Parquet
files through its reader (its real pipeline, timed); the other two get the
same rows read into numpy beforehand (not timed) and fed per step. Each
contender first runs ``--warmup`` steps (tracing, first allocations; not
timed). The timed steps (``--steps``; TF-native Adam: ``--native-adam-steps``,
its steps being slow and all alike) are split into ``--rounds`` rounds; in
each round every contender in turn runs one untimed step and then its share
of timed steps, first to last in odd rounds and last to first in even ones.
This VM's speed drifts by over 10% within minutes even with no steal time,
so contenders taking turns see the same machine on average, where running
each once, one after the other, put the drift into every ratio. wuliang
trains as a user does, in one ``Session.train`` call over all its rounds (in
a thread of its own): at the last step of each round the engine syncs (that
step's push applied, nothing of the next round pulled) and the training
waits in a hook while the others take their turn; a round is timed from the
end of its untimed step until its last push is applied; every step fetches
its loss. Contenders run one at a time, so each has the whole machine;
TensorFlow keeps its default thread pools throughout.

Per optimizer the result has the samples/s of each contender (over all
rounds, and per round in ``rounds_samples_per_s``), wuliang's ratio to the
ceiling and its speedup over TF-native; the process CPU time
per timed step of each (all threads: on a busy machine a steadier measure of
the work done than wall time) and the steal time per step (CPU the
hypervisor gave to other guests meanwhile, from /proc/stat: when it is not
near 0 the host slowed that contender and the ratios are not to be trusted;
run again); the mean loss of each contender's first and
last 10 steps and of the 10 steps before the last one all of them ran
(``common``: same batches; all should fall); and where wuliang's steps spend
their time: the per-stage timings its hooks see (``read``, ``prepare``,
``wait_push`` and ``pull`` in the pipeline's thread, ahead of the step;
``wait_update``, the main thread waiting for the previous step's push to
write the rows this step shares with it (staleness 0), and ``compute``, the
TensorFlow step, in the main thread), its mean step time
and the ceiling's. ``--timeline DIR`` also writes wuliang's Chrome trace
(``wuliang.hooks.Timeline``, pushes included) per optimizer.

``--remote N`` adds a fourth contender, ``wuliang_remote``: the same
``Session.train`` with ``Context(ps=[...])`` over N ``wuliang ps`` processes
on loopback (2 shard threads each, started fresh per optimizer), taking its
turn with the others. The servers share this machine's cores with the
trainer, so the figure is a floor for servers on their own machines. Its
result adds ``wuliang_remote_samples_per_s``, ``remote_to_embedded`` (its
samples/s over the embedded wuliang's), its stage timings and the servers'
CPU time per step (of its rounds, their untimed step included).

``--gpu-cache-rows N`` adds ``wuliang_cached``: the same ``Session.train``
with ``Context(gpu_cache_rows=N)`` (a GPU hot cache of N rows per table in
front of the embedded engine: cupy where a GPU is present, numpy in host
memory otherwise), taking its turn with the others. Its result adds
``wuliang_cached_samples_per_s``, ``cache_on_vs_off`` (its samples/s over
wuliang's without the cache), the cache's hit rate per key occurrence and
its stage timings. With ``--remote N`` too it also adds
``wuliang_remote_cached``: the cache in front of N servers of its own (a
host cache before remote servers, on a machine without a GPU), with
``remote_cache_on_vs_off`` (its samples/s over ``wuliang_remote``'s) and
the bytes of data messages a step sends and receives, with the cache
(``remote_cached_wire_bytes_per_step``) and without
(``remote_wire_bytes_per_step``).

``--disk DIR`` adds ``wuliang_disk``: the same ``Session.train`` with the
engine's disk tier (``Context(disk_dir=DIR, memory_gb=...)``, row files
under DIR) and a budget of a quarter (``--disk-budget-share``) of the rows
the tables end with (the data's distinct keys per field, 160 bytes a
row), taking its turn with the others. In the same run the disk's own
random-read rate is measured at the tier's depth (512-byte and 4 KiB
reads, through io_uring as the tier reads where the kernel allows it, 3 s
each, the better taken). Its result adds
``wuliang_disk_samples_per_s``, ``disk_vs_ram`` (its samples/s over
wuliang's in RAM), the cold rows it read per step (ahead of the pulls and
in them), ``disk_ms_per_step`` (those reads at the disk's rate) and
``step_vs_bound``: its step time over max(the in-RAM step, the disk time
of its cold reads). The last line printed is one JSON object:
``{"adagrad": {...}, "adam": {...}}``.

    python benchmarks/train_bench.py          # 200 timed steps, 4 rounds (TF-native Adam: 50)
    python benchmarks/train_bench.py --quick  # 30 timed steps, 3 rounds (TF-native Adam: 10)
    python benchmarks/train_bench.py --optimizers adam --staleness 1 --timeline /tmp/tl

TensorFlow: ``pip install '.[bench]'`` (tensorflow-cpu).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ info lines

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from bench_data import cores, parquet_files  # benchmarks/, the script's folder
from bench_model import DIM, TOWER, make_tower, tower_optimizer
from ps_remote import PsProcess

from wuliang.hooks import SessionRunArgs, SessionRunHook, Timeline
from wuliang.reader import ParquetReader
from wuliang.reader.datagen import DENSE, LABEL, SINGLE

BUCKETS = 4_194_304  # 2**22: the TF-native table
NUM_RANDOM = 8  # distinct random embedding tensors of the ceiling, cycled
LOSS_WINDOW = 10  # steps averaged for the first and last loss
TARGETS = {
    "adagrad": {"ratio_to_ceiling": 0.90, "speedup_vs_tf_native": 1.25},
    "adam": {"ratio_to_ceiling": 0.90, "speedup_vs_tf_native": 5.0},
}


@dataclass
class Run:
    """What one contender did over its warm-up and timed steps."""

    name: str
    samples_per_s: float
    cpu_ms_per_step: float  # CPU time of the whole process (all threads) per timed step
    losses: list[float]  # every step's, warm-up included
    extra: dict[str, Any] = field(default_factory=dict)
    steal_ms_per_step: float | None = None  # the hypervisor's: the machine was busy elsewhere

    def loss_summary(self, common: int) -> dict[str, float]:
        """Mean loss of the first and the last LOSS_WINDOW steps, and of the
        LOSS_WINDOW steps before step `common` (the same batches for all)."""
        n = min(LOSS_WINDOW, max(1, len(self.losses) // 2))
        return {
            "first": round(float(np.mean(self.losses[:n])), 5),
            "last": round(float(np.mean(self.losses[-n:])), 5),
            "common": round(float(np.mean(self.losses[max(0, common - n) : common])), 5),
            "steps": len(self.losses),
        }


# -- data ------------------------------------------------------------------------------


@dataclass
class Batches:
    """The rows as numpy, cut into the batches the reader yields (same order)."""

    keys: list[np.ndarray]  # int64 [B, 26]: the uint64 keys, reinterpreted
    dense: list[np.ndarray]  # float32 [B, 13]
    labels: list[np.ndarray]  # float32 [B]


def read_batches(files: list[Path], batch: int, count: int) -> Batches:
    table = pq.read_table(files, columns=[*SINGLE, *DENSE, LABEL])
    keys = np.stack([table[c].to_numpy() for c in SINGLE], axis=1).view(np.int64)
    dense = np.stack([table[c].to_numpy() for c in DENSE], axis=1).astype(np.float32)
    labels = table[LABEL].to_numpy().astype(np.float32)
    cut = [slice(i * batch, (i + 1) * batch) for i in range(count)]
    return Batches(
        [np.ascontiguousarray(keys[s]) for s in cut],
        [np.ascontiguousarray(dense[s]) for s in cut],
        [np.ascontiguousarray(labels[s]) for s in cut],
    )


# -- model -----------------------------------------------------------------------------


def bce(tf: Any, labels: Any, logits: Any) -> Any:
    """wuliang's binary_crossentropy: mean sigmoid cross-entropy of the logits."""
    logits = tf.squeeze(logits, axis=-1)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))


def steal_ms() -> float:
    """CPU time the hypervisor gave to other guests (all cores; /proc/stat):
    a run during which it grew was slowed by the host, not by its code."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return 1e3 * int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass
class Clocks:
    """Wall, process CPU and steal time at one moment."""

    wall: float
    cpu: float
    steal: float

    @staticmethod
    def now() -> Clocks:
        return Clocks(time.perf_counter(), time.process_time(), steal_ms())


@dataclass
class Timed:
    """A contender's timed steps, summed over the rounds."""

    steps: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    steal_ms: float = 0.0
    rates: list[float] = field(default_factory=list)  # samples/s of each round

    def add(self, steps: int, start: Clocks, end: Clocks, batch: int) -> None:
        if steps:
            self.rates.append(steps * batch / (end.wall - start.wall))
        self.steps += steps
        self.seconds += end.wall - start.wall
        self.cpu_seconds += end.cpu - start.cpu
        self.steal_ms += end.steal - start.steal

    def run(self, name: str, batch: int, losses: list[float], extra: dict[str, Any]) -> Run:
        return Run(
            name,
            self.steps * batch / self.seconds,
            1e3 * self.cpu_seconds / self.steps,
            losses,
            {"steps": self.steps, **extra},
            self.steal_ms / self.steps,
        )


class StepLoop:
    """A contender stepping through the numpy batches in order: ``play``
    runs `untimed` then `timed` steps from where the last call stopped."""

    def __init__(self, name: str, step: Callable[[int], Any], batch: int) -> None:
        self.name = name
        self.batch = batch
        self.step = step  # batch index -> loss (the step has finished)
        self.losses: list[float] = []
        self.timed = Timed()

    def play(self, untimed: int, timed: int) -> None:
        first = len(self.losses)
        for i in range(first, first + untimed):
            self.losses.append(float(self.step(i)))
        start = Clocks.now()
        for i in range(first + untimed, first + untimed + timed):
            self.losses.append(float(self.step(i)))
        self.timed.add(timed, start, Clocks.now(), self.batch)

    def result(self, batch: int) -> Run:
        return self.timed.run(self.name, batch, self.losses, {})


def progress(run: Run, steps: int, ceiling: Run | None, note: str = "") -> None:
    loss = run.loss_summary(len(run.losses))
    ratio = f" = {run.samples_per_s / ceiling.samples_per_s:.2f} of ceiling" if ceiling else ""
    print(
        f"  {run.name:10s} {run.samples_per_s / 1e3:7.1f}K samples/s{ratio} "
        f"({steps} steps, CPU {run.cpu_ms_per_step:.0f} ms/step"
        f"{f', steal {run.steal_ms_per_step:.0f}' if run.steal_ms_per_step else ''}; "
        f"loss {loss['first']:.4f} -> {loss['last']:.4f}){note}",
        flush=True,
    )


# -- contenders ------------------------------------------------------------------------


def ceiling_loop(tf: Any, kind: str, data: Batches, args: argparse.Namespace) -> StepLoop:
    model = make_tower(args.seed)
    optimizer = tower_optimizer(kind)
    width = len(SINGLE) * DIM
    rng = np.random.default_rng(args.seed)
    randoms = [
        tf.constant(rng.standard_normal((args.batch, width), dtype=np.float32) * 0.25)
        for _ in range(NUM_RANDOM)
    ]

    @tf.function(
        input_signature=[
            tf.TensorSpec([None, width], tf.float32),
            tf.TensorSpec([None, len(DENSE)], tf.float32),
            tf.TensorSpec([None], tf.float32),
        ]
    )
    def train_step(embeddings: Any, dense: Any, labels: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(embeddings)
            loss = bce(tf, labels, model(tf.concat([embeddings, dense], axis=1)))
        variables = model.trainable_variables
        grads = tape.gradient(loss, [embeddings, *variables])
        optimizer.apply_gradients(zip(grads[1:], variables, strict=True))
        return loss, grads[0]

    def step(i: int) -> Any:
        loss, _ = train_step(randoms[i % NUM_RANDOM], data.dense[i], data.labels[i])
        return loss.numpy()

    return StepLoop("ceiling", step, args.batch)


def tf_native_loop(tf: Any, kind: str, data: Batches, args: argparse.Namespace) -> StepLoop:
    model = make_tower(args.seed)
    optimizer = tower_optimizer(kind)
    table = tf.Variable(
        tf.random.truncated_normal([BUCKETS, DIM], stddev=DIM**-0.5, seed=args.seed),
        name="embeddings",
    )
    if kind == "adagrad":
        sparse_opt = tf.compat.v1.train.AdagradOptimizer(0.05, initial_accumulator_value=0.1)
    else:
        sparse_opt = tf.compat.v1.train.AdamOptimizer(1e-3, epsilon=1e-7)
    salts = tf.constant(
        (np.arange(1, len(SINGLE) + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(
            np.int64
        )
    )
    mask = tf.constant(BUCKETS - 1, tf.int64)

    @tf.function(
        input_signature=[
            tf.TensorSpec([None, len(SINGLE)], tf.int64),
            tf.TensorSpec([None, len(DENSE)], tf.float32),
            tf.TensorSpec([None], tf.float32),
        ]
    )
    def train_step(keys: Any, dense: Any, labels: Any) -> Any:
        buckets = tf.bitwise.bitwise_and(tf.bitwise.bitwise_xor(keys, salts), mask)
        with tf.GradientTape() as tape:
            embeddings = tf.nn.embedding_lookup(table, buckets)  # [B, 26, 16]
            flat = tf.reshape(embeddings, [-1, len(SINGLE) * DIM])
            loss = bce(tf, labels, model(tf.concat([flat, dense], axis=1)))
        variables = model.trainable_variables
        grads = tape.gradient(loss, [table, *variables])  # the table's: IndexedSlices
        sparse_opt.apply_gradients([(grads[0], table)])
        optimizer.apply_gradients(zip(grads[1:], variables, strict=True))
        return loss

    def step(i: int) -> Any:
        return train_step(data.keys[i], data.dense[i], data.labels[i]).numpy()

    return StepLoop("tf_native", step, args.batch)


class WuliangLoop:
    """wuliang through its real pipeline, trained as a user would: one
    ``Session.train`` call over all of its rounds, in a thread of its own.
    The last step of each round syncs the engine (its push applied, nothing
    of the next round pulled) and the training waits in a hook until the
    next ``play``; reader, pipeline and engine keep their state meanwhile.
    A round is timed from the end of its untimed step until its last step's
    push is applied. ``plan``: every ``play`` call's (untimed, timed)."""

    def __init__(
        self,
        tf: Any,
        kind: str,
        files: list[Path],
        data: Batches,
        args: argparse.Namespace,
        reserve: dict[str, int],
        plan: list[tuple[int, int]],
        ps: list[Any] | None = None,
        gpu_cache_rows: int | None = None,
        disk: tuple[Path, float] | None = None,
    ) -> None:
        from wuliang import Context, DenseFeature, EmbeddingTable, Session, SparseFeature
        from wuliang.embedding import concat
        from wuliang.optimizers import Adagrad, Adam

        if any(untimed < 1 for untimed, _ in plan):
            raise ValueError("wuliang's rounds start with an untimed step (the pipeline fills)")
        model = make_tower(args.seed)
        settings: dict[str, Any] = {"background": args.background}
        if args.staleness is not None:
            settings["staleness"] = args.staleness
        self.servers = ps or []  # wuliang ps processes: remote tables, their CPU time metered
        if ps:
            settings["ps"] = [server.address for server in ps]
        if gpu_cache_rows:
            settings["gpu_cache_rows"] = gpu_cache_rows
        if disk is not None:
            settings["disk_dir"], settings["memory_gb"] = disk
        self.context = Context(**settings)
        emb_opt = Adagrad(0.05) if kind == "adagrad" else Adam(1e-3)
        tables = {
            name: EmbeddingTable(name, DIM, optimizer=emb_opt, reserve_rows=reserve.get(name, 0))
            for name in SINGLE
        }
        features: list[Any] = [SparseFeature(name, tables[name]) for name in SINGLE]
        features += [DenseFeature(name) for name in DENSE]

        def tower(embeddings: dict, dense: dict) -> Any:
            inputs = [embeddings[n] for n in SINGLE] + [dense[n] for n in DENSE]
            return model(concat(inputs))

        self.session = Session(tower, features, self.context, optimizer=tower_optimizer(kind))
        self.name = (
            "wuliang_remote_cached" if ps and gpu_cache_rows
            else "wuliang_remote" if ps
            else "wuliang_cached" if gpu_cache_rows
            else "wuliang_disk" if disk is not None
            else "wuliang"
        )  # fmt: skip
        self.kind, self.data, self.args = kind, data, args
        self.server_cpu_s = 0.0  # of the rounds with timed steps, their untimed steps included
        self.wire_bytes = 0  # pull and push messages to and from the servers, the same rounds
        self.server_steps = 0
        self.plan = plan
        self.rounds = _Rounds(plan)
        self.played = 0  # plan entries done
        self.reader = ParquetReader(
            [str(f) for f in files], args.batch, features=[*SINGLE, *DENSE], label=LABEL
        )
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.timings: list[dict[str, float]] = []  # of the timed steps
        self.uniques: list[int] = []
        self.step_seconds: list[float] = []  # the timed steps' periods
        self.timed = Timed()

    @property
    def losses(self) -> list[float]:
        return self.rounds.losses

    def _train(self) -> None:
        hooks: list[Any] = [self.rounds]
        if self.args.timeline is not None:  # 20 steps of the first timed round
            untimed, timed = self.plan[1] if len(self.plan) > 1 else self.plan[0]
            first = self.plan[0][0] + untimed
            path = self.args.timeline / f"wuliang-{self.kind}.json"
            hooks.append(Timeline(path, first_step=first, num_steps=min(timed, 20)))
        try:
            total = self.rounds.bounds[-1]
            result = self.session.train(self.reader, steps=total, hooks=hooks)
            if result["steps"] != total and not self.rounds.stop:
                raise AssertionError(f"wuliang ran {result['steps']} steps, expected {total}")
        except BaseException as error:  # re-raised by play()
            self.error = error
        finally:
            self.rounds.paused.release()  # a play() waiting for its round wakes up

    def play(self, untimed: int, timed: int) -> None:
        if (untimed, timed) != self.plan[self.played]:
            raise AssertionError(f"play({untimed}, {timed}) is not round {self.plan[self.played]}")
        first = self.rounds.bounds[self.played]  # global step of the round's first batch
        self.played += 1
        if self.thread is None:
            self.thread = threading.Thread(target=self._train, name="bench-wuliang")
            self.thread.start()
        cpu0 = sum(server.cpu_seconds() for server in self.servers)
        wire0 = self._wire()
        self.rounds.go.release()
        self.rounds.paused.acquire()
        if timed and self.servers:
            self.server_cpu_s += sum(server.cpu_seconds() for server in self.servers) - cpu0
            self.wire_bytes += self._wire() - wire0
            self.server_steps += untimed + timed
        if self.played == len(self.plan):
            self.thread.join()
        if self.error is not None:
            raise self.error
        meter = self.rounds
        if len(meter.losses) != first + untimed + timed:
            raise AssertionError(f"wuliang stopped after {len(meter.losses)} steps")
        expected = self.data.keys[first][:, 0].view(np.uint64)
        if not np.array_equal(meter.first_c1[first], expected):
            raise AssertionError(f"wuliang's batch {first} differs from the numpy contenders'")
        if timed:
            clocks = meter.clocks[first + untimed - 1 : first + untimed + timed]
            self.timed.add(timed, clocks[0], clocks[-1], self.args.batch)
            self.timings += meter.timings[first + untimed : first + untimed + timed]
            self.uniques += meter.uniques[first + untimed : first + untimed + timed]
            self.step_seconds += list(np.diff([c.wall for c in clocks]))

    def _wire(self) -> int:
        """Bytes of data messages sent and received so far (remote servers;
        behind a cache, its inner client's)."""
        ps = getattr(self.context.ps, "_inner", self.context.ps)
        counted = getattr(ps, "data_bytes", None)
        return 0 if counted is None else sum(counted().values())

    def result(self, batch: int) -> Run:
        stages = {
            f"{stage}_ms": round(1e3 * float(np.mean([t.get(stage, 0.0) for t in self.timings])), 2)
            for stage in ("read", "prepare", "wait_push", "pull", "wait_update", "compute")
        }
        stages["step_ms"] = round(1e3 * float(np.mean(self.step_seconds)), 2)
        stages["main_thread_other_ms"] = round(stages["step_ms"] - stages["compute_ms"], 2)
        rows = sum(s["rows"] for s in self.context.engine.stats().values())
        extra: dict[str, Any] = {
            "uniques_per_step": round(float(np.mean(self.uniques))) if self.uniques else None,
            "new_rows_per_step": round(rows / len(self.losses)),
            "staleness": self.context.staleness,
            "prefetch": self.context.prefetch,
            "engine_shards": self.context.num_shards,
            "engine_rows": rows,
            "stages": stages,
        }
        if self.servers:
            extra["servers"] = len(self.servers)
            extra["server_cpu_ms_per_step"] = round(1e3 * self.server_cpu_s / self.server_steps, 1)
            extra["wire_bytes_per_step"] = round(self.wire_bytes / self.server_steps)
        cache_stats = getattr(self.context.ps, "cache_stats", None)
        if cache_stats is not None:
            counted = cache_stats().values()
            hits = sum(c["hit_occurrences"] for c in counted)
            occurrences = max(1, sum(c["occurrences"] for c in counted))
            extra["cache_hit_rate"] = round(hits / occurrences, 4)
            extra["cache_device"] = self.context.ps.kernels.device
        if self.context.ps.prefetches:  # the disk tier
            stats = self.context.engine.stats().values()
            extra["cold_reads_per_step"] = round(
                sum(t["cold_reads"] + t["cold_prefetched"] for t in stats) / len(self.losses)
            )
            extra["cold_reads_waited_per_step"] = round(
                sum(t["cold_reads"] for t in stats) / len(self.losses)
            )
            extra["cold_rows"] = sum(t["cold_rows"] for t in stats)
            extra["demoted_per_step"] = round(sum(t["demoted"] for t in stats) / len(self.losses))
            extra["demoted_between_calls_per_step"] = round(
                sum(t.get("demoted_between_calls", 0) for t in stats) / len(self.losses)
            )
            extra["disk_error"] = next((t["disk_error"] for t in stats if t["disk_error"]), "")
        return self.timed.run(self.name, batch, self.losses, extra)

    def close(self) -> None:
        if self.thread is not None and self.thread.is_alive():  # a failure elsewhere
            self.rounds.stop = True
            self.rounds.go.release()
            self.thread.join()
        self.reader.close()
        self.context.close()


class _Rounds(SessionRunHook):
    """Meters every step (loss, end clocks, stage timings, unique keys, the
    first C1 values of each round) and, after the last step of each entry of
    the plan, with the engine synced, waits until ``go`` is released."""

    def __init__(self, plan: list[tuple[int, int]]) -> None:
        self.bounds = np.cumsum([0, *(u + t for u, t in plan)]).tolist()  # round i: [b_i, b_i+1)
        self.starts = set(self.bounds[:-1])  # global steps beginning a round
        self.ends = {b - 1 for b in self.bounds[1:]}
        self.last = self.bounds[-1] - 1
        self.go = threading.Semaphore(0)  # released by play()
        self.paused = threading.Semaphore(0)  # released when a round is done
        self.stop = False
        self.losses: list[float] = []
        self.clocks: list[Clocks] = []
        self.uniques: list[int] = []
        self.timings: list[dict[str, float]] = []
        self.first_c1: dict[int, np.ndarray] = {}

    def begin(self) -> None:
        self.go.acquire()  # the first play()

    def sync_after(self, step: int) -> bool:
        return step in self.ends

    def before_run(self, run_context: Any) -> Any:
        batch = run_context.batch
        if run_context.step in self.starts:
            self.first_c1[run_context.step] = np.array(batch.sparse["C1"].values, copy=True)
        if batch.prepared is not None:
            self.uniques.append(sum(len(k.uniques) for k in batch.prepared.tables.values()))
        return SessionRunArgs(["loss"])

    def after_run(self, run_context: Any, run_values: Any) -> None:
        self.losses.append(float(run_values.results["loss"]))
        self.clocks.append(Clocks.now())
        self.timings.append(dict(run_values.timings))
        step = run_context.step
        if step in self.ends:
            if not run_context.synced:
                raise AssertionError(f"step {step} ends a round but its push was not waited for")
            if step != self.last:
                self.paused.release()
                self.go.acquire()
        if self.stop:
            run_context.request_stop()


def ratio(a: float, b: float) -> float:
    return round(a / b, 3)


def split(total: int, parts: int) -> list[int]:
    """`total` in `parts` near-equal parts."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


DISK_ROW_BYTES = 64 + 96  # a dim-16 row with Adagrad's or Adam's state in the engine's pool


def disk_read_rate(folder: Path) -> float:
    """The disk's best random-read rate under ``folder`` at the tier's
    depth: 512-byte and 4 KiB reads with O_DIRECT, as many in flight as the
    tier keeps (io_uring's ring where allowed, else 32 threads)."""
    from wuliang.ps_server import _engine

    return max(
        _engine.disk_random_reads(str(folder), 256 << 20, size, 32, 3.0)[0] for size in (512, 4096)
    )


def vocabulary(data: Batches) -> dict[str, int]:
    """Distinct keys per field in the batches the run reads."""
    keys = np.concatenate(data.keys)
    return {name: int(np.unique(keys[:, i]).size) for i, name in enumerate(SINGLE)}


def bench_optimizer(
    tf: Any,
    kind: str,
    files: list[Path],
    data: Batches,
    args: argparse.Namespace,
    reserve: dict[str, int],
) -> dict[str, Any]:
    native_steps = min(args.native_adam_steps, args.steps) if kind == "adam" else args.steps
    tower = "keras.optimizers.Adagrad(0.01)" if kind == "adagrad" else "keras.optimizers.Adam(1e-3)"
    print(f"{kind}: tower {tower}", flush=True)
    contenders: list[Any] = [
        ceiling_loop(tf, kind, data, args),
        tf_native_loop(tf, kind, data, args),
    ]
    timed = {
        "ceiling": split(args.steps, args.rounds),
        "tf_native": split(native_steps, args.rounds),
        "wuliang": split(args.steps, args.rounds),
        "wuliang_remote": split(args.steps, args.rounds),
        "wuliang_cached": split(args.steps, args.rounds),
        "wuliang_remote_cached": split(args.steps, args.rounds),
        "wuliang_disk": split(args.steps, args.rounds),
    }
    plan = [(args.warmup, 0), *((1, n) for n in timed["wuliang"])]  # as played below
    start = time.perf_counter()
    # Made last: closed below (engine threads).
    wuliang = WuliangLoop(tf, kind, files, data, args, reserve, plan)
    setup_s = time.perf_counter() - start
    contenders.append(wuliang)
    servers: list[Any] = []
    try:
        if args.remote:  # fresh servers per optimizer: the tables' specs differ
            servers = [PsProcess.start() for _ in range(args.remote)]
            remote = WuliangLoop(tf, kind, files, data, args, reserve, plan, ps=servers)
            contenders.append(remote)
        if args.gpu_cache_rows:
            cached = WuliangLoop(
                tf, kind, files, data, args, reserve, plan, gpu_cache_rows=args.gpu_cache_rows
            )
            contenders.append(cached)
        if args.remote and args.gpu_cache_rows:  # the host cache in front of servers of its own
            own = [PsProcess.start() for _ in range(args.remote)]
            servers = servers + own  # the remote contender meters its own list
            contenders.append(
                WuliangLoop(tf, kind, files, data, args, reserve, plan, ps=own,
                            gpu_cache_rows=args.gpu_cache_rows)
            )  # fmt: skip
        disk_budget_gb = 0.0
        if args.disk:
            rows = sum(vocabulary(data).values())
            disk_budget_gb = rows * DISK_ROW_BYTES * args.disk_budget_share / (1 << 30)
            tiered = WuliangLoop(
                tf, kind, files, data, args, reserve, plan, disk=(args.disk, disk_budget_gb)
            )
            contenders.append(tiered)
        for c in contenders:
            c.play(args.warmup, 0)
            gc.collect()
        for r in range(args.rounds):
            for c in contenders if r % 2 == 0 else contenders[::-1]:
                c.play(1, timed[c.name][r])  # one untimed step: wuliang's pipeline fills
                gc.collect()
            rates = ", ".join(f"{c.name} {c.timed.rates[-1] / 1e3:.1f}K" for c in contenders)
            print(f"  round {r + 1}/{args.rounds}: {rates} samples/s", flush=True)
        ceiling, native, ours, *others = (c.result(args.batch) for c in contenders)
    finally:
        for c in contenders[2:]:
            c.close()
        for server in servers:
            server.stop()
    progress(ceiling, args.steps, None)
    progress(native, native_steps, ceiling)
    stages = ours.extra["stages"]
    progress(
        ours,
        args.steps,
        ceiling,
        f"; per step {stages['step_ms']:.0f} ms: compute {stages['compute_ms']:.0f}, "
        f"pull {stages['pull_ms']:.0f}, prepare {stages['prepare_ms']:.0f} (ahead)",
    )
    for other in others:
        if other.name == "wuliang_disk":
            note = (
                f"; {other.extra['cold_reads_per_step']} cold rows read per step "
                f"({other.extra['cold_reads_waited_per_step']} waited for); = "
                f"{other.samples_per_s / ours.samples_per_s:.2f} of all in RAM"
            )
        elif other.name == "wuliang_remote_cached":
            remote = next(o for o in others if o.name == "wuliang_remote")
            note = (
                f"; cache hit rate {other.extra['cache_hit_rate']}; "
                f"{other.extra['wire_bytes_per_step'] / 1e6:.2f} MB on the wire a step against "
                f"{remote.extra['wire_bytes_per_step'] / 1e6:.2f}; = "
                f"{other.samples_per_s / remote.samples_per_s:.2f} of remote without the cache"
            )
        elif other.name == "wuliang_cached":
            note = (
                f"; cache hit rate {other.extra['cache_hit_rate']} on "
                f"{other.extra['cache_device']}; = {other.samples_per_s / ours.samples_per_s:.2f}"
                " of no cache"
            )
        else:
            note = (
                f"; {other.extra['servers']} servers' CPU "
                f"{other.extra['server_cpu_ms_per_step']:.0f} ms/step; = "
                f"{other.samples_per_s / ours.samples_per_s:.2f} of embedded"
            )
        progress(other, args.steps, ceiling, note)
    common = min(len(c.losses) for c in contenders)  # every contender ran these batches
    stages["ceiling_step_ms"] = round(1e3 * args.batch / ceiling.samples_per_s, 2)
    result: dict[str, Any] = {
        "ceiling_samples_per_s": round(ceiling.samples_per_s),
        "rounds_samples_per_s": {c.name: [round(x) for x in c.timed.rates] for c in contenders},
        "tf_native_samples_per_s": round(native.samples_per_s),
        "wuliang_samples_per_s": round(ours.samples_per_s),
        "ratio_to_ceiling": ratio(ours.samples_per_s, ceiling.samples_per_s),
        "tf_native_ratio_to_ceiling": ratio(native.samples_per_s, ceiling.samples_per_s),
        "speedup_vs_tf_native": ratio(ours.samples_per_s, native.samples_per_s),
        "cpu_ms_per_step": {r.name: round(r.cpu_ms_per_step, 1) for r in (ceiling, native, ours)},
        "steal_ms_per_step": {
            r.name: round(r.steal_ms_per_step or 0.0, 1) for r in (ceiling, native, ours)
        },
        "losses": {r.name: r.loss_summary(common) for r in (ceiling, native, ours)},
        "wuliang_stages_ms": stages,
        "wuliang_uniques_per_step": ours.extra["uniques_per_step"],
        "wuliang_new_rows_per_step": ours.extra["new_rows_per_step"],
        "embedding_optimizer": {
            "wuliang": "Adagrad(0.05)" if kind == "adagrad" else "Adam(1e-3)",
            "tf_native": "tf.compat.v1.train.AdagradOptimizer(0.05, initial_accumulator_value=0.1)"
            if kind == "adagrad"
            else "tf.compat.v1.train.AdamOptimizer(1e-3, epsilon=1e-7)",
        },
        "tower_optimizer": tower,
        "steps": args.steps,
        "tf_native_steps": native_steps,
        "warmup_steps": args.warmup,
        "rounds": args.rounds,
        "batch": args.batch,
        "staleness": ours.extra["staleness"],
        "prefetch": ours.extra["prefetch"],
        "engine_shards": ours.extra["engine_shards"],
        "reader_threads": wuliang.reader.num_threads,
        "wuliang_tables": len(SINGLE),
        "wuliang_rows": ours.extra["engine_rows"],
        "wuliang_reserved_rows": sum(reserve.values()),
        "wuliang_setup_s": round(setup_s, 2),
        "tf_native_buckets": BUCKETS,
        "cores": cores(),
        "tf_version": tf.__version__,
    }
    for other in others:
        if other.name == "wuliang_disk":
            rate = disk_read_rate(args.disk)
            disk_ms = 1e3 * other.extra["cold_reads_per_step"] / rate
            ram_ms = stages["step_ms"]
            step_ms = other.extra["stages"]["step_ms"]
            result.update(
                wuliang_disk_samples_per_s=round(other.samples_per_s),
                disk_vs_ram=ratio(other.samples_per_s, ours.samples_per_s),
                disk_budget_gb=round(disk_budget_gb, 4),
                disk_budget_share=args.disk_budget_share,
                disk_cold_rows=other.extra["cold_rows"],
                cold_reads_per_step=other.extra["cold_reads_per_step"],
                cold_reads_waited_per_step=other.extra["cold_reads_waited_per_step"],
                demoted_per_step=other.extra["demoted_per_step"],
                demoted_between_calls_per_step=other.extra["demoted_between_calls_per_step"],
                disk_reads_per_s=round(rate),
                disk_ms_per_step=round(disk_ms, 2),
                step_vs_bound=round(step_ms / max(ram_ms, disk_ms), 3),
                disk_error=other.extra["disk_error"],
                disk_stages_ms=other.extra["stages"],
            )
        elif other.name == "wuliang_remote_cached":
            remote = next(o for o in others if o.name == "wuliang_remote")
            result.update(
                wuliang_remote_cached_samples_per_s=round(other.samples_per_s),
                remote_cache_on_vs_off=ratio(other.samples_per_s, remote.samples_per_s),
                remote_cached_wire_bytes_per_step=other.extra["wire_bytes_per_step"],
                remote_cached_hit_rate=other.extra["cache_hit_rate"],
                remote_cached_stages_ms=other.extra["stages"],
            )
        elif other.name == "wuliang_cached":
            result.update(
                wuliang_cached_samples_per_s=round(other.samples_per_s),
                cache_on_vs_off=ratio(other.samples_per_s, ours.samples_per_s),
                gpu_cache_rows=args.gpu_cache_rows,
                cache_hit_rate=other.extra["cache_hit_rate"],
                cache_device=other.extra["cache_device"],
                cached_stages_ms=other.extra["stages"],
            )
        else:
            result.update(
                wuliang_remote_samples_per_s=round(other.samples_per_s),
                remote_to_embedded=ratio(other.samples_per_s, ours.samples_per_s),
                remote_servers=other.extra["servers"],
                remote_server_cpu_ms_per_step=other.extra["server_cpu_ms_per_step"],
                remote_wire_bytes_per_step=other.extra["wire_bytes_per_step"],
                remote_stages_ms=other.extra["stages"],
            )
        result["cpu_ms_per_step"][other.name] = round(other.cpu_ms_per_step, 1)
        result["steal_ms_per_step"][other.name] = round(other.steal_ms_per_step or 0.0, 1)
        result["losses"][other.name] = other.loss_summary(common)
    targets = TARGETS[kind]
    result["targets"] = targets
    result["targets_met"] = {k: result[k] >= v for k, v in targets.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds the timed steps are split into, contenders alternating (default 4; "
        "--quick: 3)",
    )
    parser.add_argument("--quick", action="store_true", help="30 timed steps")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument(
        "--native-adam-steps",
        type=int,
        help="timed steps of TF-native Adam, whose steps are slow and alike (default 50; "
        "--quick: 10)",
    )
    parser.add_argument(
        "--optimizers", nargs="+", choices=["adagrad", "adam"], default=["adagrad", "adam"]
    )
    parser.add_argument(
        "--staleness", type=int, choices=[0, 1], help="wuliang's (default: the Context default)"
    )
    parser.add_argument(
        "--background",
        choices=["idle", "normal"],
        default="idle",
        help="wuliang's Context(background=...): idle (SCHED_IDLE, opt-in, what this "
        "benchmark measures) or normal (the library default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--remote",
        type=int,
        default=0,
        metavar="N",
        help="also train wuliang against N local wuliang ps processes (2 shard threads each), "
        "alternated with the others",
    )
    parser.add_argument(
        "--gpu-cache-rows",
        type=int,
        default=0,
        metavar="N",
        help="also train wuliang with a GPU hot cache of N rows per table (Context("
        "gpu_cache_rows=N): cupy where a GPU is present, numpy otherwise), alternated with the "
        "others; the result's cache_on_vs_off is its samples/s over wuliang's without",
    )
    parser.add_argument(
        "--disk",
        type=Path,
        metavar="DIR",
        help="also train wuliang with the engine's disk tier, row files under DIR (a directory "
        "on a local disk) and a budget of --disk-budget-share of the tables' rows",
    )
    parser.add_argument("--disk-budget-share", type=float, default=0.25, help="with --disk")
    parser.add_argument(
        "--reserve",
        choices=["vocabulary", "none"],
        default="vocabulary",
        help="wuliang's tables reserve rows for their field's distinct keys in the data "
        "(default), or grow from empty",
    )
    parser.add_argument(
        "--timeline", type=Path, help="write wuliang's Chrome trace per optimizer into this folder"
    )
    parser.add_argument(
        "--data-dir", type=Path, help="where the Parquet files are kept (default: in $TMPDIR)"
    )
    parser.add_argument(
        "--cluster",
        metavar="SxW",
        help="instead: a job of S servers, a chief and W workers under wuliang launch next "
        "to one process (cluster_bench.py); --steps: timed steps per trainer",
    )
    args = parser.parse_args()
    if args.cluster:
        import cluster_bench  # benchmarks/, the script's folder

        steps = ["--steps", str(args.steps)] if "--steps" in sys.argv else []
        cluster_bench.main(["--cluster", args.cluster, "--batch", str(args.batch), *steps])
        return
    if args.quick:
        args.steps = 30
    if args.native_adam_steps is None:
        args.native_adam_steps = 10 if args.quick else 50
    if args.rounds is None:
        args.rounds = 3 if args.quick else 4
    if args.warmup < 1 or args.rounds < 1 or min(args.steps, args.native_adam_steps) < args.rounds:
        parser.error(
            "--warmup and --rounds must be >= 1, --steps and --native-adam-steps >= --rounds"
        )
    count = args.warmup + args.rounds + args.steps
    rows = count * args.batch
    data_dir = args.data_dir or Path(tempfile.gettempdir()) / f"wuliang-train-bench-{rows}"

    import tensorflow as tf

    files, _ = parquet_files(data_dir, rows)
    data = read_batches(files, args.batch, count)
    print(
        f"model: 26 fields x dim {DIM} + {len(DENSE)} dense -> MLP "
        f"{'-'.join(map(str, TOWER))}-1; batch {args.batch}; {args.warmup} warm-up + "
        f"{args.steps} timed steps; {cores()} cores; TensorFlow {tf.__version__}",
        flush=True,
    )
    reserve = vocabulary(data) if args.reserve == "vocabulary" else {}
    result = {
        kind: bench_optimizer(tf, kind, files, data, args, reserve) for kind in args.optimizers
    }
    sys.stdout.flush()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
