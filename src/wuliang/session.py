"""Session: one model's steps, driven by ``run(feed, fetch)`` with hooks.

``Session(tower, features, context)`` creates the model's tables in the
context's parameter server, traces the TensorFlow step (``embedding.bridge``)
and runs it:

* ``run(feed=batch, fetch=[...], train=True)``: one step on one ``CsrBatch``,
  synchronously (prepare, pull, TF, push), returning the fetched values by
  name — for debugging and custom loops;
* ``train(reader, steps)``, ``evaluate(reader)``, ``predict(reader)``: loops
  over a reader through the prefetching pipeline (``wuliang.pipeline``).

Fetch names: ``loss``, ``predictions``, ``logits``, every sparse feature's
name (its pooled embedding ``[B, dim]``, or ``(values, mask)`` of a sequence
feature), and the names of the outputs the tower returns. Hooks see every
step (``wuliang.hooks``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from wuliang import checkpoint
from wuliang.context import Context, Trace
from wuliang.dense import SharedTower, tower_specs
from wuliang.embedding.bridge import (
    Layout,
    LossFn,
    StepFunctions,
    StepInputs,
    batch_inputs,
    embedding_of,
    ends_in_probabilities,
)
from wuliang.embedding.features import Feature, split_features
from wuliang.embedding.kernels import index_in
from wuliang.embedding.rows import RowMemory
from wuliang.hooks.base import SessionRunArgs, SessionRunContext, SessionRunHook, SessionRunValues
from wuliang.hooks.evict import Evict
from wuliang.hooks.metrics import Metrics
from wuliang.hooks.standard import NanGuard
from wuliang.job import Job
from wuliang.nonfinite import NonFiniteGuard
from wuliang.pipeline import Pipeline, Step
from wuliang.ps_server import Handle, PullPart, PushPart, PushResult
from wuliang.ps_server.storage import location
from wuliang.reader.batch import CsrBatch
from wuliang.reader.prepare import KeyPreparer, PreparedKeys
from wuliang.stopping import StopOnSignal
from wuliang.tower import TowerState

STANDARD_FETCHES = ("loss", "predictions", "logits")
Link = tuple[list[np.ndarray], dict[str, np.ndarray], threading.Event | None]
LINK_WAIT_SECONDS = 600.0  # a push waits for the next step's pull of sized tables
log = logging.getLogger("wuliang")


def _assembled(
    handle: Handle[None], blocks: list[tuple[Any, int, int, Any]], pulled: threading.Event
) -> Handle[None]:
    """The pull of sized tables: done once each block's rows are copied into
    their columns of the table's rows (zeros past a key's size); ``pulled``
    is set then too (or on failure)."""
    future: Future[None] = Future()

    def copy(done: Handle[None]) -> None:
        try:
            done.wait()
            for out, start, stop, block in blocks:
                out[:, start:stop] = block
        except BaseException as error:  # the pull's error is the step's
            future.set_exception(error)
        else:
            future.set_result(None)
        finally:
            pulled.set()

    handle.add_done_callback(copy)
    return Handle(future)


class Session:
    """Runs a model's steps. See the module docstring.

    Args:
        tower: ``tower(embeddings, dense) -> logits`` (a Keras model or layer,
            a ``tf.Module`` or a function) with dicts of the pooled sparse
            features and the dense features by name; a Keras model or layer
            whose ``call`` takes one input (``keras.Sequential``, a functional
            model with one input) gets them concatenated, in the order of
            ``features``. Returns logits, a dict of logits per task for
            multi-task models, or ``(logits, outputs)`` with named outputs.
            ``training=`` is passed when the tower takes it.
        features: ``SparseFeature`` s and ``DenseFeature`` s.
        context: where the tables and the step live (default: a new one).
        hooks: hooks that see every step of this session.
        loss: a name (``binary_crossentropy``, ``mse``, ``softmax_crossentropy``),
            a callable ``(labels, logits) -> scalar``, or a dict of them per task.
        optimizer: a Keras optimizer for the tower's variables (default Adam(1e-3)).
        from_logits: whether the tower returns logits (True) or probabilities
            (False: it ends in a sigmoid, or a softmax for
            ``softmax_crossentropy``; the loss takes them as probabilities
            and predictions are the output itself). None (the default): a
            Keras Sequential or functional tower whose last layer is a
            sigmoid or softmax (``Dense(1, activation="sigmoid")``, the usual
            Keras habit) returns probabilities, any other tower logits.
    """

    def __init__(
        self,
        tower: Callable[..., Any],
        features: Sequence[Feature],
        context: Context | None = None,
        *,
        hooks: Sequence[SessionRunHook] = (),
        loss: str | Callable | Mapping[str, str | Callable] = "binary_crossentropy",
        optimizer: Any = None,
        from_logits: bool | None = None,
    ) -> None:
        import keras

        self.context = context or Context()
        features = list(features)
        self.sparse, self.dense, tables = split_features(features)
        for table in tables.values():
            self.context.create_table(table)
        self.tables = list(tables)
        # sized tables: each block's server table and its columns of the rows
        self._blocks = {n: t.block_columns for n, t in tables.items() if t.sizes is not None}
        # a server that takes columns of the rows pulls and pushes the blocks in place
        self._in_place = bool(self.context.ps.takes_column_rows)
        self.preparer = (
            KeyPreparer(
                {f.name: f.table.name for f in self.sparse},
                self.context.num_shards,
                {f.name: f.max_len for f in self.sparse if f.is_sequence and f.max_len},
                num_servers=self.context.ps.num_servers,
            )
            if self.sparse
            else None
        )
        logits = _from_logits(tower, loss, from_logits)
        losses: LossFn | dict[str, LossFn] = (
            {k: LossFn(v, logits) for k, v in loss.items()}
            if isinstance(loss, Mapping)
            else LossFn(loss, logits)
        )
        self.optimizer = optimizer if optimizer is not None else keras.optimizers.Adam(1e-3)
        self.layout = Layout.of(self.sparse)
        self.functions = StepFunctions(
            tower,
            self.sparse,
            self.dense,
            self.layout,
            losses,
            self.optimizer,
            order=[f.name for f in features],
        )
        # the rows' memory: the GPU cache's device arrays where TensorFlow has a GPU too
        self.memory = self.functions.memory = RowMemory.for_server(self.context.ps)
        self._cached = getattr(self.context.ps, "kernels", None) is not None  # a GPU cache
        self._prefetching: dict[int, Handle[int]] = {}  # id(prepared) -> its prefetch
        # prepared keys of a step -> its sized tables are in its rows (_pulled_event)
        self._pulled: dict[int, threading.Event] = {}
        self._pulled_lock = threading.Lock()
        self.tower = TowerState(self.functions, self.sparse, self.dense, self.optimizer)
        self._shared: SharedTower | None = None  # the tower on the servers, from the first step
        if self.context.shares_tower:  # several trainers: the tower lives on the servers
            every = self.context.tower_sync_steps
            self.functions.apply_tower = every > 1  # k > 1: the trainer's optimizer applies
            for spec in tower_specs(self.optimizer, every).values():  # refuses what cannot map
                self.context.create_tower_table(spec)
        self.hooks = list(hooks)
        evicting = [b.name for t in tables.values() for b in t.blocks() if b.evicts]
        every = self.context.evict_every_steps
        self._own_evict: Evict | None = None
        if evicting and every and not any(isinstance(h, Evict) for h in self.hooks):
            self._own_evict = Evict(every_steps=every, tables=evicting)
            self.hooks.insert(0, self._own_evict)  # before checkpoints
        self.trace = Trace()
        self.guard = NonFiniteGuard(self.context.non_finite)
        self._output_names: set[str] | None = None
        self._hooks_begun = False
        self._failed = False  # a step raised: close() does not end the session hooks
        self._resume_position: dict[str, Any] | None = None  # for the next train()
        self.restored: Path | None = None  # the checkpoint restored last
        self.stopped_by: str | None = None  # the signal that stopped the last train()
        self.data_time: int | None = None  # the newest partition's time trained (unix s)

    # -- public ----------------------------------------------------------------

    @property
    def global_step(self) -> int:
        return self.context.global_step

    @property
    def non_finite(self) -> dict[str, int]:
        """Non-finite values skipped with ``Context(non_finite="drop")``: losses
        (``"loss"``), tower updates (``"tower"``) and row gradients per table."""
        return dict(self.guard.counts)

    def fetchable(self) -> list[str]:
        """Every name ``run`` can fetch (tower outputs once a step has run)."""
        names = [*STANDARD_FETCHES, *(f.name for f in self.sparse)]
        return names + sorted(self._output_names or ())

    def save_checkpoint(
        self,
        model_dir: str | os.PathLike,
        position: Any = None,
        keep: int | None = 5,
        keep_daily: int | None = None,
    ) -> Path:
        """Writes ``model_dir/ckpt-<global step>`` (``wuliang.checkpoint``),
        keeping the newest ``keep`` and, with ``keep_daily=D``, one a day for
        D days. Between ``run`` calls or from a hook's ``after_run`` when
        ``run_context.synced``; ``position``: the reader position to resume at.
        In a cluster (the chief): the job's step, every trainer's position,
        the other trainers held meanwhile so it is one cut (``wuliang.job``)."""
        with self._cut(hold=True):
            return checkpoint.save(self.context, self.tower, model_dir, position, keep, keep_daily)

    @contextlib.contextmanager
    def _cut(self, hold: bool) -> Iterator[None]:
        """The chief of a cluster, around a checkpoint or an export: with
        ``hold``, the other trainers held still (their caches' changes sent)
        until it ends; then the job's step and the tower synced."""
        job = self.context.job
        held = job.hold_trainers() if hold and job is not None and job.is_chief else None
        try:
            self._sync_cluster()
            yield
        finally:
            if held is not None:
                job.release(held)

    def _sync_cluster(self) -> None:
        """Before a checkpoint or an export in a cluster: the job's step now,
        and the tower's variables as the servers hold them."""
        self.context.sync_step()
        if self._shared is not None:
            self._shared.pull()

    def restore_checkpoint(self, path: str | os.PathLike) -> bool:
        """Restores a checkpoint (a ``ckpt-<step>`` folder, or the newest in a
        model_dir); returns whether it did. The next ``train`` resumes its
        reader where the checkpoint's left off (when it is a ``ParquetReader``
        over the same files). In a cluster only the chief restores, and only
        before the job is ready: once it is, the servers' rows are newer than
        any checkpoint (a trainer that restarts takes them as they are)."""
        job = self.context.job
        if job is not None and not job.is_chief:
            log.debug("trainer %d of the job does not restore: the chief does", job.trainer)
            return False
        if job is not None and (mark := job.ready()) is not None:
            log.info(
                "the job is running on the parameter servers (%s): nothing restored, "
                "training goes on from their rows",
                mark,
            )
            return False
        target = location(path)  # a folder, or a URI of an object store
        if not (target / "manifest.json").is_file():
            latest = checkpoint.latest_checkpoint(target)
            if latest is None:
                raise FileNotFoundError(f"no checkpoint in {target}")
            target = latest
        self._resume_position = checkpoint.restore(self.context, self.tower, target)
        self.restored = target
        return True

    def export(self, export_dir: str | os.PathLike, kind: str = "auto") -> Any:
        """Writes the next version of ``export_dir`` from this model
        (``wuliang.export``: a delta of the newest version, or full with
        ``kind="full"``); returns its ``ExportResult``. Between ``run`` calls
        or from a hook's ``after_run`` when ``run_context.synced``."""
        from wuliang.export import LiveSource, export

        # caches of shared rows hold changes of up to cache_sync_steps
        # steps: the version waits for every trainer's
        with self._cut(hold=getattr(self.context.ps, "sync_steps", None) is not None):
            return export(LiveSource(self.context, self.tower), export_dir, kind)

    def prune_exports(
        self,
        export_dir: str | os.PathLike,
        keep_versions: int | None = None,
        keep_bytes: int | None = None,
    ) -> Any:
        """Removes export_dir's oldest versions, never LATEST's chain
        (``wuliang.export.prune``); returns its ``PruneResult``."""
        from wuliang.export import prune

        return prune(export_dir, keep_versions=keep_versions, keep_bytes=keep_bytes)

    def publish(self, export_dir: str | os.PathLike, redis_url: str, model: str | None) -> Any:
        """Puts export_dir's newest version into Redis (or a Redis Cluster),
        as ``wuliang publish`` does; returns its ``PublishResult``."""
        from wuliang.serving.redis.publish import publish

        return publish(export_dir, redis_url, model)

    def run(
        self, feed: CsrBatch, fetch: str | Sequence[str] = ("loss",), train: bool = True
    ) -> Any:
        """One step on one batch; returns the fetched values (a dict by name,
        or the value itself when ``fetch`` is one name)."""
        if not isinstance(feed, CsrBatch):
            raise TypeError(f"feed must be a CsrBatch, got {type(feed).__name__}")
        names = [fetch] if isinstance(fetch, str) else list(fetch)
        self._begin()
        source = _Steps(self, train)
        prepared, inputs, rows = source.prepare(feed)
        if self._output_names is None and any(n not in self.fetchable() for n in names):
            # Learn the tower's output names without training, then check.
            self._pull(prepared, rows, False, None).wait()  # a lookup: nothing counted
            probe = self.functions.evaluate(inputs, rows, labels=False)
            self._output_names = set(probe["outputs"])
        self._check_fetches(names, strict=True)
        if train:  # every run step is synced: the periodic hooks act when due
            for hook in self.hooks:
                hook.sync_after_batch(self.global_step, feed)
        try:
            step = Step(0, self.global_step, feed, prepared, inputs, rows, sync=True)
            source.pull(prepared, rows, self.global_step if train else None).wait()
            results, _ = self._step(step, self.hooks, names, train, _Direct(source))
        except BaseException:
            self._failed = True
            raise
        return results[fetch] if isinstance(fetch, str) else results

    def train(
        self, reader: Any, steps: int | None = None, hooks: Sequence[SessionRunHook] = ()
    ) -> dict[str, float]:
        """Trains on the reader's batches (all, or ``steps``) through the
        pipeline. SIGTERM (in the main thread) stops it after the step being
        trained, as the end of the data does, and sets ``stopped_by``
        (``wuliang.stopping``)."""
        extra = list(hooks)
        own = self.hooks
        if self._own_evict is not None and any(isinstance(h, Evict) for h in extra):
            own = [h for h in own if h is not self._own_evict]  # the caller's replaces it
        hooks = [*own, *extra]
        _check_gates(hooks)
        if steps is not None and (not isinstance(steps, int) or steps < 0):
            raise ValueError(f"steps must be an int >= 0 or None, got {steps!r}")
        self._begin(extra)
        ctx = self.context
        self.prepare_reader(reader, train=True)
        self._attach_preparer(reader)
        self._record_hashing(reader)
        if steps == 0:
            for hook in extra:
                hook.end(self)
            return {"steps": 0, "samples": 0, "samples_per_s": 0.0}
        job = ctx.job
        if job is not None:
            self._join(job)
        resume = self._resume_position is not None and hasattr(reader, "start")
        if resume:  # this pass continues where the checkpoint left off; later ones do not
            previous, reader.start = reader.start, self._resume_position
        self._resume_position = None
        batches = iter(reader)
        if resume:
            reader.start = previous
        if steps is not None:  # nothing read (or pulled) past the last step
            batches = _limit(batches, steps)

        def sync_after(step: int, batch: CsrBatch) -> bool:
            wanted = [hook.sync_after_batch(step, batch) for hook in hooks]  # ask every hook
            return any(wanted)

        pipeline = Pipeline(
            batches,
            _Steps(self, train=True),
            train=True,
            depth=ctx.prefetch,
            staleness=ctx.staleness,
            trace=self.trace,
            first_step=self.global_step,
            sync_after=sync_after,
            background=ctx.background,
            step_floor=None if job is None else (lambda: ctx.global_step),
            read_ahead=ctx.ps.prefetches,
            on_partition=self._data_clock,
        )
        done = samples = 0
        start = time.perf_counter()
        finished = False
        self.stopped_by = None
        try:
            with StopOnSignal(reader) as signalled:
                for step in pipeline:
                    _, stop = self._step(step, hooks, (), True, pipeline)
                    step.released.set_result(None)
                    done += 1
                    samples += step.batch.size
                    if stop or signalled or (steps is not None and done >= steps):
                        break
            finished = True
            self.stopped_by = signalled.signal
        except BaseException:
            self._failed = True
            raise
        finally:
            pipeline.close()  # raises a pending push error
        # As TensorFlow's MonitoredSession: no end() after a failed step, so
        # a Checkpoint hook does not save what the failure left (a NaN tower).
        if finished and done == 0 and self.stopped_by is None:  # never silently: says why
            if resume:
                log.warning(
                    "resumed at step %d; the reader is at its end: nothing to train "
                    "(a new run needs new data, or a new model_dir to start over)",
                    self.global_step,
                )
            else:
                log.warning("the reader yielded no batches: nothing trained")
        if finished and self._shared is not None:  # the tower's last change, on the servers
            self._shared.pull()
        if finished:
            for hook in extra:
                hook.end(self)
        if self.stopped_by is not None:
            log.warning("%s: stopped after step %d", self.stopped_by, self.global_step)
        elapsed = time.perf_counter() - start
        return {"steps": done, "samples": samples, "samples_per_s": samples / max(elapsed, 1e-9)}

    def evaluate(self, reader: Any, steps: int | None = None) -> dict[str, float]:
        """Metrics over the reader: exact AUC, log loss, calibration, loss."""
        metrics = Metrics()
        for step, out in self._inference(reader, steps, with_labels=True):
            labels = step.batch.labels
            if isinstance(labels, dict) or isinstance(out["predictions"], dict):
                raise ValueError(
                    "evaluate() handles one label; use predict() for multi-task models"
                )
            metrics.update(labels, out["predictions"].numpy(), float(out["loss"].numpy()))
        result = metrics.result()
        if not result["examples"]:
            log.warning("evaluate: the reader yielded no examples: the metrics are NaN")
        return result

    def predict(self, reader: Any, steps: int | None = None) -> Iterator[Any]:
        """Predictions per batch (float32 [B], or a dict per task)."""
        for _, out in self._inference(reader, steps, with_labels=False):
            yield _numpy(out["predictions"])

    def close(self) -> None:
        """Ends the session's hooks (not after a failed step, as TensorFlow's
        MonitoredSession: a Checkpoint hook would save what the failure left)."""
        if self._hooks_begun and not self._failed:
            for hook in self.hooks:
                hook.end(self)
        self._hooks_begun = False
        self._failed = False

    # -- internals -------------------------------------------------------------

    def _begin(self, extra: Sequence[SessionRunHook] = ()) -> None:
        """Begins the session's hooks (once) and ``extra`` (a train call's):
        every ``begin``, then every ``restore_session`` (a checkpoint is
        restored), then every ``after_create_session``."""
        hooks = [*([] if self._hooks_begun else self.hooks), *extra]
        self._hooks_begun = True
        for hook in hooks:
            hook.begin()
        for hook in hooks:
            hook.restore_session(self)
        for hook in hooks:
            hook.after_create_session(self)

    def _join(self, job: Job) -> None:
        """A trainer of a cluster, before its first step: the chief (having
        restored, or not) marks the job ready unless the tower still has to
        go onto the servers (its first step does that); a worker waits for
        the mark. Either takes the job's step and its own reader position
        from the job board."""
        if job.is_chief:
            job.release()  # a hold of this chief's before it restarted
            if not self.context.shares_tower and job.ready() is None:
                job.mark_ready(restored=None if self.restored is None else str(self.restored))
        else:
            mark = job.wait_ready()
            log.info("trainer %d joins the job (%s)", job.trainer, mark)
        self.context.sync_step()
        position = job.position()
        if position is not None:
            log.info("trainer %d resumes its reader where the job board has it", job.trainer)
            self._resume_position = position

    def _data_clock(self, partition: Any) -> None:
        """Training a partition: the servers' clock (rows' times, TTLs in
        seconds) is the data's, the newest partition's time trained, so a
        replay of old partitions evicts nothing live and a trainer that was
        down does not evict what it has not had the data to refresh."""
        seconds = partition.seconds
        if self.data_time is not None and seconds <= self.data_time:
            return  # a late partition: the data clock does not go back
        self.data_time = seconds
        self.context.ps.set_clock(seconds)

    def _pull_tower(self, inputs: StepInputs, rows: list[np.ndarray]) -> None:
        """A shared tower's variables from the servers before a step; at the
        first step the chief puts its tower there (or takes theirs) and marks
        the job ready (``wuliang.dense``)."""
        if self._shared is None:
            self.functions.trace(inputs, rows, train=True)  # the variables exist
            trainable = list(self.functions.tower_variables)
            owned = [*self.optimizer.variables, *trainable]  # Keras's and TF's objects
            known = {id(v) for v in owned} | {id(getattr(v, "value", v)) for v in owned}
            others = sorted(  # batch-norm statistics: the same order in every trainer
                (v for v in self.functions.variables()
                 if id(v) not in known and v.dtype.is_floating),
                key=lambda v: v.name,
            )  # fmt: skip
            job = self.context.job
            assert job is not None
            self._shared = SharedTower(
                self.context.ps, trainable, others, job.is_chief, self.context.tower_sync_steps
            )
            if job.is_chief:
                how = self._shared.start()
                if job.ready() is None:
                    job.mark_ready(
                        restored=None if self.restored is None else str(self.restored), tower=how
                    )
                log.info("the tower's %d variables are on the parameter servers (%s)",
                         len(trainable), how)  # fmt: skip
                return
            self._shared.pull()  # a worker's first step: the servers' tower
            return
        self._shared.before_step()

    def _check_fetches(self, names: Sequence[str], strict: bool) -> None:
        valid = set(self.fetchable())
        unknown = [n for n in names if n not in valid]
        if unknown and (strict or any(not isinstance(n, str) for n in unknown)):
            raise KeyError(
                f"cannot fetch {', '.join(map(repr, unknown))}; "
                f"valid names: {', '.join(self.fetchable())}"
            )

    def _check_hook_fetches(
        self,
        hook: SessionRunHook,
        names: Sequence[str],
        inputs: StepInputs,
        rows: list[np.ndarray],
    ) -> None:
        """Before the step runs: a hook's fetch names are valid for this batch."""
        if self._output_names is None and any(n not in self.fetchable() for n in names):
            probe = self.functions.evaluate(inputs, rows, labels=False)  # the tower's outputs
            self._output_names = set(probe["outputs"])
        who = f"hook {type(hook).__name__}"
        if "loss" in names and inputs.labels is None:
            raise KeyError(f"{who} asked to fetch 'loss', but the batch has no labels")
        try:
            self._check_fetches(names, strict=True)
        except KeyError as error:
            raise KeyError(f"{who}: {error.args[0]}") from None

    def prepare_reader(
        self, reader: Any, label: str | Sequence[str] | None = None, train: bool = True
    ) -> None:
        """Tells a reader what this model reads, or checks it up front: a
        ``ParquetReader`` without features reads the model's (and
        ``label``); one with features must read every feature of the model
        (as ids for a sparse feature, as numbers for a dense one) and, to
        train, a label. ValueError naming what is missing."""
        use = getattr(reader, "read_model", None)
        if use is not None:
            use(
                sparse=[f.name for f in self.sparse],
                dense=[f.name for f in self.dense],
                label=label,
            )
        read = getattr(reader, "labels", None)
        wanted = [] if label is None else [label] if isinstance(label, str) else list(label)
        if wanted and read is not None and sorted(read) != sorted(wanted):
            raise ValueError(f"the reader reads label(s) {list(read)}, the model expects {wanted}")
        if train and read is not None and not read:
            raise ValueError("training needs labels: the reader reads none (label=...)")

    def _attach_preparer(self, reader: Any) -> None:
        """Lets a ParquetReader prepare keys in its own threads, scheduled as
        the context's background threads unless it says otherwise."""
        if getattr(reader, "prepare", "absent") is None and self.preparer is not None:
            reader.prepare = self.preparer
        if getattr(reader, "background", "absent") is None:
            reader.background = self.context.background

    def _record_hashing(self, reader: Any) -> None:
        """Which sparse features the reader makes from strings, and with
        which field: the model description records it, so that serving
        hashes a client's raw strings the same way."""
        hashed = getattr(reader, "hashed_features", None) or {}
        self.tower.hash_fields.update(
            {f.name: hashed[f.name] for f in self.sparse if f.name in hashed}
        )

    def _prepare(self, batch: CsrBatch) -> tuple[PreparedKeys, StepInputs]:
        if not batch.validated:  # hand-built, or from a reader that does not validate
            batch.validate()
        prepared = batch.prepared
        if not isinstance(prepared, PreparedKeys) or (
            self.preparer is not None
            and (
                prepared.num_shards != self.context.num_shards
                or prepared.num_servers != self.preparer.num_servers
                or prepared.max_lens != self.preparer.max_lens
                or any(
                    prepared.feature_tables.get(name) != table
                    for name, table in self.preparer.feature_tables.items()
                )
            )
        ):  # not prepared, or prepared for another model
            prepared = self.preparer(batch) if self.preparer is not None else _NO_KEYS
        return prepared, batch_inputs(batch, prepared, self.sparse, self.dense, self.layout)

    def _rows_for(self, prepared: PreparedKeys) -> list[np.ndarray]:
        """Per group of tables, the batch's packed rows (unfilled; the last
        row, of empty single-valued features, zero)."""
        sizes, _ = self.layout.bases(prepared)
        rows = []
        for (dim, _), size in zip(self.layout.groups, sizes, strict=True):
            packed = self.memory.empty((size + 1, dim))
            packed[size] = 0.0
            rows.append(packed)
        return rows

    def _pull(
        self, prepared: PreparedKeys, rows: list[np.ndarray], train: bool, step: int | None
    ) -> Handle[None]:
        """Starts pulling each table into its slice of the packed rows;
        ``step``: the batch's global step (see ``ParameterServer.pull_many``).
        A GPU cache gets each key's occurrences in the batch for its policy."""
        prefetch = self._prefetching.pop(id(prepared), None)
        if prefetch is not None:  # its cold rows come in first: the pull reads none itself
            with contextlib.suppress(Exception):
                prefetch.wait()
        _, bases = self.layout.bases(prepared)
        counts = self._occurrences(prepared) if train and self._cached else {}
        parts = []
        assemble: list[tuple[Any, int, int, Any]] = []  # a sized table's blocks into its rows
        for (_, tables), packed in zip(self.layout.groups, rows, strict=True):
            for table in tables:
                keys = prepared.tables[table]
                base = bases[table]
                out = packed[base : base + len(keys.uniques)]
                for name, start, stop in self._blocks.get(table, ((table, 0, 0),)):
                    block_out = out
                    if stop and self._in_place:  # the block's columns of the rows
                        block_out = out[:, start:stop]
                    elif stop:
                        block_out = self.memory.empty((len(keys.uniques), stop - start))
                        assemble.append((out, start, stop, block_out))
                    parts.append(
                        PullPart(
                            name, keys.uniques, block_out, keys.shard_offsets, counts.get(table)
                        )
                    )
        handle = self.context.ps.pull_many_async(parts, train=train, step=step)
        if not assemble:
            return handle
        return _assembled(handle, assemble, self._pulled_event(prepared))

    def _pulled_event(self, prepared: PreparedKeys) -> threading.Event:
        """Set once the batch's sized tables are assembled in its rows: the
        previous step's push puts its linked rows there only after."""
        key = id(prepared)
        with self._pulled_lock:
            event = self._pulled.get(key)
            if event is None:  # forgotten with the batch's keys
                event = self._pulled[key] = threading.Event()
                weakref.finalize(prepared, self._pulled.pop, key, None)
            return event

    def _prefetch(self, prepared: PreparedKeys) -> None:
        """With a disk tier, starts reading the batch's cold rows into the
        server's memory (on a thread of its own, while earlier steps pull,
        push and compute). Its error, if any, is the pull's: that pull reads
        the rows again."""
        ps = self.context.ps
        if not ps.prefetches:
            return
        parts = [
            PullPart(name, keys.uniques, None, keys.shard_offsets)
            for table, keys in prepared.tables.items()
            for name, _, _ in self._blocks.get(table, ((table, 0, 0),))
        ]
        if len(self._prefetching) > 8:  # batches prefetched and never pulled (a stopped loop)
            self._prefetching.clear()
        self._prefetching[id(prepared)] = ps.prefetch_many_async(parts)

    def _occurrences(self, prepared: PreparedKeys) -> dict[str, np.ndarray]:
        """Per table, each unique key's occurrences in the batch (float32)."""
        counts: dict[str, np.ndarray] = {}
        for index in prepared.features.values():
            n = len(prepared.tables[index.table].uniques)
            found = np.bincount(index.inverse, minlength=n).astype(np.float32)
            counts[index.table] = counts[index.table] + found if index.table in counts else found
        return counts

    def _link(self, previous: PreparedKeys, prepared: PreparedKeys, rows: list[np.ndarray]) -> Link:
        """Where the previous step's push writes each of its rows into this
        step's packed rows (-1: not in this step), per table (staleness 0);
        with sized tables, the event of this step's pull having assembled them."""
        _, bases = self.layout.bases(prepared)
        dest = {
            table: index_in(previous.tables[table].uniques, keys.uniques, bases[table])
            for table, keys in prepared.tables.items()
        }
        if not self._blocks or self._in_place:
            return rows, dest, None
        pulled = self._pulled_event(prepared)
        pulled.clear()  # this step's pull (issued after the link) sets it again
        return rows, dest, pulled

    def _push(
        self,
        prepared: PreparedKeys,
        inputs: StepInputs,
        gather_grads: Any,
        step: int,
        link: Link | None = None,
        linked_done: Callable[[], None] | None = None,
    ) -> PushResult | None:
        """Sums the lookups' gradients per row, then pushes each table's slice;
        with a link, first the keys the next step shares (their updated rows
        go into its rows; then ``linked_done()``), then the others.
        ``gather_grads`` None: a step not applied, nothing pushed."""
        if gather_grads is None:
            if linked_done is not None:
                linked_done()
            return None
        row_grads = self.functions.row_gradients(inputs, gather_grads)
        stats = self._row_stats(prepared, inputs)
        parts = []
        linked_blocks: list[tuple[Any, Any, int, int, Any]] = []
        for g, ((_, tables), packed) in enumerate(zip(self.layout.groups, row_grads, strict=True)):
            for table in tables:
                keys = prepared.tables[table]
                base = inputs.table_base[table]
                grads = packed[base : base + len(keys.uniques)]
                self.guard.check_rows(  # before any push
                    table, keys.uniques, grads, step, self.memory.finite_rows
                )
                updated = None if link is None else link[0][g]
                rows = None if link is None else link[1][table]
                shows, clicks = stats.get(table, (None, None))
                blocks = self._blocks.get(table)
                if blocks is None:
                    parts.append(
                        PushPart(
                            table,
                            keys.uniques,
                            grads,
                            keys.shard_offsets,
                            updated,
                            rows,
                            shows=shows,
                            clicks=clicks,
                        )
                    )
                    continue
                parts.extend(
                    self._block_parts(
                        table, blocks, keys, grads, updated, rows, shows, clicks, linked_blocks
                    )
                )
        ps = self.context.ps
        if link is None:
            return ps.push_many(parts, unique=True, step=step)
        first = ps.push_many(parts, unique=True, only="updated", step=step)
        if linked_blocks and not link[2].wait(LINK_WAIT_SECONDS):
            # the next step's blocks go in its rows before these go over them
            raise TimeoutError(
                f"step {step}: the next step's pull of sized tables did not complete within "
                f"{LINK_WAIT_SECONDS} s"
            )
        for updated, rows, start, stop, block_updated in linked_blocks:
            into = rows >= 0
            updated[rows[into], start:stop] = block_updated[into]
        if linked_done is not None:
            linked_done()
        return first + ps.push_many(parts, unique=True, only="rest", step=step)

    def _block_parts(
        self,
        table: str,
        blocks: list[tuple[str, int, int]],
        keys: Any,
        grads: Any,
        updated: Any,
        rows: np.ndarray | None,
        shows: np.ndarray | None,
        clicks: np.ndarray | None,
        linked_blocks: list[tuple[Any, Any, int, int, Any]],
    ) -> list[PushPart]:
        """A sized table's push, one part per block: its columns of the
        gradients; shows and clicks to the base block (they drive the sizes).
        With a link the updated rows go to the block's columns of the next
        step's rows: in place on a server that takes columns
        (``takes_column_rows``), else through a buffer of the block's that
        ``_push`` copies once the next step's pull has put its blocks in."""
        xp = self.memory.xp
        parts = []
        n = len(keys.uniques)
        buffered_rows = None  # the copy path's: key i's updated row at row i of its buffer
        if not self._in_place and updated is not None and rows is not None:
            buffered_rows = np.where(rows >= 0, np.arange(n, dtype=np.int32), -1).astype(np.int32)
        for name, start, stop in blocks:
            if self._in_place:  # the blocks' columns, read and written where they are
                block_grads = grads[:, start:stop]
                block_updated = None if updated is None else updated[:, start:stop]
                block_rows = rows
            else:
                block_grads = xp.ascontiguousarray(grads[:, start:stop])
                block_updated, block_rows = None, buffered_rows
                if buffered_rows is not None:
                    block_updated = self.memory.empty((n, stop - start))
                    linked_blocks.append((updated, rows, start, stop, block_updated))
            base = name == table
            parts.append(
                PushPart(
                    name,
                    keys.uniques,
                    block_grads,
                    keys.shard_offsets,
                    block_updated,
                    block_rows,
                    shows=shows if base else None,
                    clicks=clicks if base else None,
                )
            )
        return parts

    def _row_stats(
        self, prepared: PreparedKeys, inputs: StepInputs
    ) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
        """Per table, each unique key's shows (its occurrences in the batch)
        and, for a table with a ``stats_label``, clicks (that label summed
        over the examples it occurs in; with one label, that label), for the
        rows' decayed statistics (``EmbeddingTable(stats_label=)``)."""
        shows = {t: c for t, c in self._occurrences(prepared).items() if t in self.context.tables}
        clicks: dict[str, np.ndarray] = {}
        labels = inputs.labels
        for index in prepared.features.values():
            table = self.context.tables.get(index.table)
            if table is None:
                continue
            n = len(prepared.tables[index.table].uniques)
            label = table.stats_label
            if label is None or labels is None:
                continue
            values = labels.get(label) if isinstance(labels, dict) else labels
            if values is None or index.offsets[-1] != len(index.inverse):
                continue  # a label this batch lacks; a trimmed sequence: shows only
            example = np.repeat(np.arange(len(index.offsets) - 1), np.diff(index.offsets))
            summed = np.bincount(index.inverse, weights=np.asarray(values)[example], minlength=n)
            got = clicks.get(index.table)
            clicks[index.table] = summed.astype(np.float32) + (0 if got is None else got)
        return {t: (v, clicks.get(t)) for t, v in shows.items()}

    def _step(
        self,
        item: Step,
        hooks: Sequence[SessionRunHook],
        fetch: Sequence[str],
        train: bool,
        pusher: Pipeline | _Direct,
    ) -> tuple[dict[str, Any], bool]:
        """The TF step with hooks around it; returns (fetched, stop requested).
        ``pusher`` takes the step's gradients (``push``) and, for a sync step,
        waits until they are applied (``wait_applied``) before the hooks'
        ``after_run``, which then see the step synced."""
        step = self.global_step
        batch, inputs, rows = item.batch, item.inputs, item.rows
        context = SessionRunContext(self, step, batch, train)
        wanted = list(fetch)
        asked: list[list[str]] = []
        for hook in hooks:
            args = hook.before_run(context)
            names = list(args.fetches) if isinstance(args, SessionRunArgs) else []
            asked.append(names)
            if names:
                self._check_hook_fetches(hook, names, inputs, rows)
            wanted += names
        start = time.perf_counter()
        self.tower.restore_pending(inputs, rows, train)
        if train and self.context.shares_tower:
            self._pull_tower(inputs, rows)
        run = self.functions.train if train else self.functions.evaluate
        out = run(inputs, rows)
        if self._output_names is None:
            self._output_names = set(out["outputs"])
        computed = time.perf_counter()
        self.trace.record("compute", step, start, computed)
        if train:
            skip = self.guard.check_step(
                out["loss"],
                out["tower_finite"],
                self.functions.tower_variable_names,
                step,
                stop_on_loss=any(isinstance(h, NanGuard) and not h.fail for h in hooks),
            )
            grads = None if skip else out["gather_grads"]  # None: nothing pushed
            if not skip:  # in a cluster, waits while the chief cuts a checkpoint
                parts = 1 if self._shared is None else 2
                self.context.advance(getattr(batch, "position", None), parts)
            pusher.push(item, (inputs, grads))
            if not skip and self.context.job is not None:  # the cut waits for the push
                item.applied.add_done_callback(lambda _: self.context.push_done())
            if not skip and self._shared is not None:  # a shared tower: always in a cluster
                grads = out.get("tower_grads")
                try:
                    self._shared.after_step(None if grads is None else list(grads), item.number)
                finally:
                    self.context.push_done()
        timings = {**item.timings, "compute": computed - start}
        if train and item.sync:
            pusher.wait_applied(item)
        context.synced = item.sync
        fetched = {name: self._fetch(out, name, inputs) for name in dict.fromkeys(wanted)}
        for hook, names in zip(hooks, asked, strict=True):
            values = SessionRunValues({n: fetched[n] for n in names}, timings)
            hook.after_run(context, values)
        return {n: fetched[n] for n in fetch}, context.stop_requested

    def _fetch(self, out: dict[str, Any], name: str, inputs: StepInputs) -> Any:
        if name == "loss" and "loss" not in out:
            raise KeyError("cannot fetch 'loss': the batch has no labels")
        if name in STANDARD_FETCHES:
            return _numpy(out[name])
        embedding = embedding_of(out, name, inputs, self.layout, self.sparse)
        if embedding is not None:
            return _numpy(embedding)
        if name in out["outputs"]:
            return _numpy(out["outputs"][name])
        raise KeyError(f"cannot fetch {name!r}; valid names: {', '.join(self.fetchable())}")

    def _inference(
        self, reader: Any, steps: int | None, with_labels: bool
    ) -> Iterator[tuple[Any, dict[str, Any]]]:
        if steps is not None and (not isinstance(steps, int) or steps < 0):
            raise ValueError(f"steps must be an int >= 0 or None, got {steps!r}")
        self.prepare_reader(reader, train=False)
        self._attach_preparer(reader)
        if self._shared is not None:  # the servers' tower, not this trainer's last pull
            self._shared.pull()
        pipeline = Pipeline(
            iter(reader),
            _Steps(self, train=False),
            train=False,
            depth=self.context.prefetch,
            staleness=self.context.staleness,
            trace=self.trace,
            first_step=self.global_step,
            background=self.context.background,
        )
        try:
            for n, step in enumerate(pipeline):
                if steps is not None and n >= steps:
                    break
                if with_labels and step.inputs.labels is None:
                    raise ValueError("evaluate() needs labels: the reader has no label column")
                self.tower.restore_pending(step.inputs, step.rows, train=False)
                yield step, self.functions.evaluate(step.inputs, step.rows, labels=with_labels)
        finally:
            pipeline.close()


def _from_logits(tower: Any, loss: Any, from_logits: bool | None) -> bool:
    """Whether the tower returns logits (see ``Session``'s ``from_logits``)."""
    if from_logits is not None and not isinstance(from_logits, bool):
        raise TypeError(f"from_logits must be True, False or None, got {from_logits!r}")
    probabilities = ends_in_probabilities(tower)
    cross_entropy = isinstance(loss, str) and loss != "mse"
    if from_logits is None:
        if probabilities and cross_entropy:
            log.info(
                "the tower ends in a %s: its output is taken as probabilities, not logits "
                "(from_logits=False)",
                getattr(tower.layers[-1].activation, "__name__", "sigmoid"),
            )
        return not (probabilities and cross_entropy)
    if from_logits and probabilities and cross_entropy:
        raise ValueError(
            "from_logits=True, but the tower's last layer is a "
            f"{tower.layers[-1].activation.__name__}: its output is probabilities. Remove the "
            "activation (Dense(1) returns logits) or pass from_logits=False"
        )
    return from_logits


class _Steps:
    """What a step is for this session's model (the pipeline's ``StepSource``):
    its keys prepared and packed rows, a pull of its tables, the link into
    the next step's rows, a push of its gradients."""

    def __init__(self, session: Session, train: bool) -> None:
        self.session = session
        self.train = train

    def prepare(self, batch: CsrBatch) -> tuple[PreparedKeys, StepInputs, list[np.ndarray]]:
        prepared, inputs = self.session._prepare(batch)
        return prepared, inputs, self.session._rows_for(prepared)

    def pull(self, prepared: PreparedKeys, rows: list[np.ndarray], step: int | None) -> Handle:
        return self.session._pull(prepared, rows, self.train, step if self.train else None)

    def prefetch(self, prepared: PreparedKeys) -> None:
        self.session._prefetch(prepared)

    def link(self, previous: PreparedKeys, prepared: PreparedKeys, rows: list[np.ndarray]) -> Any:
        return self.session._link(previous, prepared, rows)

    def push(
        self,
        prepared: PreparedKeys,
        grads: Any,
        step: int,
        link: Any,
        linked: Callable[[], None],
    ) -> PushResult | None:
        return self.session._push(prepared, *grads, step=step, link=link, linked_done=linked)


class _Direct:
    """``Session.run``'s pusher: the push runs at once, on the caller's thread."""

    def __init__(self, source: _Steps) -> None:
        self.source = source

    def push(self, step: Step, grads: Any) -> None:
        try:
            with self.source.session.trace.span("push", step.number):
                result = self.source.push(step.prepared, grads, step.number, None, lambda: None)
        except BaseException as error:
            step.applied.set_exception(error)
            raise
        step.applied.set_result(result)

    def wait_applied(self, step: Step) -> None:
        pass


def _limit(batches: Iterator[Any], n: int) -> Iterator[Any]:
    """The first n batches; closing it closes the reader's iterator."""
    try:
        for _ in range(n):
            batch = next(batches, None)
            if batch is None:
                return
            yield batch
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _check_gates(hooks: Sequence[SessionRunHook]) -> None:
    """A hook gated by another (``IncrementalExport(gate=...)``) runs after it."""
    for k, hook in enumerate(hooks):
        gate = getattr(hook, "gate", None)
        if gate is None:
            continue
        if not any(h is gate for h in hooks[:k]):
            where = "after it" if any(h is gate for h in hooks) else "missing"
            raise ValueError(
                f"{type(hook).__name__}'s gate {type(gate).__name__} must come before it in "
                f"the hooks (it is {where}): it scores a partition before the export asks"
            )


def _numpy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_numpy(v) for v in value)
    return value.numpy() if hasattr(value, "numpy") else value


_NO_KEYS = PreparedKeys(tables={}, features={}, num_shards=1, feature_tables={})
