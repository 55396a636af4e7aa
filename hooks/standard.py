"""The standard hooks: Logging, StopAtStep, ProgressBar, NanGuard, Summary,
Timeline, Eval and SizeStats."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from wuliang.hooks.base import (
    HookSession,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from wuliang.hooks.metrics import auc
from wuliang.hooks.periodic import PeriodicSyncHook, results

log = logging.getLogger("wuliang")


def _ensure_log_handler() -> None:
    """Hook output is visible without any logging setup (and not twice with one)."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class _EverySteps(SessionRunHook):
    def __init__(self, every_steps: int) -> None:
        if not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps must be an int >= 1, got {every_steps!r}")
        self.every_steps = every_steps

    def due(self, step: int) -> bool:
        return (step + 1) % self.every_steps == 0


class Logging(_EverySteps):
    """Logs step, the fetched values and samples/s every ``every_steps``
    training steps. The fetches are also asked at the first step, so that a
    bad name fails at once."""

    def __init__(self, every_steps: int = 100, fetches: Sequence[str] = ("loss",)) -> None:
        super().__init__(every_steps)
        self.fetches = list(fetches)
        self._since = 0.0
        self._samples = 0
        self._checked = False

    def begin(self) -> None:
        _ensure_log_handler()
        self._since = time.perf_counter()
        self._samples = 0

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        if not run_context.train or (self._checked and not self.due(run_context.step)):
            return SessionRunArgs()
        self._checked = True
        return SessionRunArgs(self.fetches)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if not run_context.train:
            return
        self._samples += run_context.batch.size
        if not self.due(run_context.step):
            return
        now = time.perf_counter()
        rate = self._samples / max(now - self._since, 1e-9)
        values = ", ".join(f"{k} = {_short(v)}" for k, v in run_values.results.items())
        log.info("step %d: %s (%.0f samples/s)", run_context.step + 1, values, rate)
        self._since, self._samples = now, 0


class SizeStats(_EverySteps):
    """Every ``every_steps`` training steps (default 1000), each sized
    table's keys and bytes per size (``Context.size_stats``) and the keys
    grown and shrunk per step since the last report: logged (INFO) and kept
    in ``results`` as ``(step, {table: report})``, where a report is
    ``size_stats``' with ``grown_per_step`` and ``shrunk_per_step`` added.
    The counters are read without syncing the pipeline (no stall): a
    report leaves out the pushes still in flight, the next one has them."""

    def __init__(self, every_steps: int = 1000) -> None:
        super().__init__(every_steps)
        self.results: list[tuple[int, dict[str, dict[str, Any]]]] = results()
        self._last: dict[str, tuple[int, int, int]] = {}  # table -> step, grown, shrunk

    def begin(self) -> None:
        _ensure_log_handler()

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if not run_context.train or not self.due(run_context.step):
            return
        context = run_context.session.context
        step = run_context.step + 1
        reports = {}
        for name in context.sized:
            report = context.size_stats(name)
            grown, shrunk = sum(report["grown"].values()), sum(report["shrunk"].values())
            since, grown_then, shrunk_then = self._last.get(name, (0, 0, 0))
            steps = max(step - since, 1)
            report["grown_per_step"] = (grown - grown_then) / steps
            report["shrunk_per_step"] = (shrunk - shrunk_then) / steps
            self._last[name] = (step, grown, shrunk)
            reports[name] = report
            keys = ", ".join(f"{size}: {s['keys']:,}" for size, s in report["sizes"].items())
            log.info("step %d: table %s keys by size %s; %.2f grown, %.2f shrunk a step", step,
                     name, keys, report["grown_per_step"], report["shrunk_per_step"])  # fmt: skip
        if reports:
            self.results.append((step, reports))


def _short(value: Any) -> str:
    if np.ndim(value) == 0:
        return f"{float(value):.5g}"
    return f"array{np.shape(value)}"


class StopAtStep(SessionRunHook):
    """Stops at global step ``last_step``, or after ``num_steps`` more steps."""

    def __init__(self, last_step: int | None = None, num_steps: int | None = None) -> None:
        if (last_step is None) == (num_steps is None):
            raise ValueError("StopAtStep needs exactly one of last_step and num_steps")
        self.last_step = last_step
        self.num_steps = num_steps

    def after_create_session(self, session: HookSession) -> None:
        if self.num_steps is not None:
            self.last_step = session.global_step + self.num_steps

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        assert self.last_step is not None
        if run_context.step + 1 >= self.last_step:
            run_context.request_stop()


class ProgressBar(SessionRunHook):
    """A tqdm progress bar of the global training step, with the loss: a
    resumed run starts at the step it resumed from; ``total``: the steps of
    this run (the bar ends at that many past the start)."""

    def __init__(self, total: int | None = None, desc: str = "train") -> None:
        self.total = total
        self.desc = desc
        self._bar: Any = None

    def after_create_session(self, session: HookSession) -> None:
        from tqdm import tqdm

        start = session.global_step  # restored by now
        total = None if self.total is None else start + self.total
        self._bar = tqdm(
            total=total, initial=start, desc=self.desc, unit="step", dynamic_ncols=True
        )

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        return SessionRunArgs(["loss"] if run_context.train else [])

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if not run_context.train:
            return
        self._bar.update(1)
        loss = run_values.results.get("loss")
        if loss is not None:
            self._bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)

    def end(self, session: HookSession) -> None:
        if self._bar is not None:
            self._bar.close()


class NanGuard(SessionRunHook):
    """Fails (or stops) training when the loss is NaN or infinite (checked
    in every run with labels, evaluation runs too).

    A training session already fails at a non-finite loss by default
    (``Context(non_finite="raise")``, see ``wuliang.nonfinite``), before the
    step is applied; ``NanGuard(fail=False)`` makes it stop training instead,
    without an error and without applying that step, and checks evaluation
    runs too.
    """

    def __init__(self, fail: bool = True) -> None:
        self.fail = fail

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        return SessionRunArgs(["loss"] if run_context.labeled else [])

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if "loss" not in run_values.results:
            return
        loss = float(run_values.results["loss"])
        if math.isfinite(loss):
            return
        message = f"loss is {loss} at step {run_context.step + 1}"
        if self.fail:
            raise FloatingPointError(message)
        _ensure_log_handler()
        log.error("%s: stopping", message)
        run_context.request_stop()


class Summary(_EverySteps):
    """TensorBoard event files in ``logdir``: loss, AUC of the last interval's
    predictions, samples/s and rows per embedding table (training steps)."""

    def __init__(self, logdir: str | os.PathLike, every_steps: int = 100) -> None:
        super().__init__(every_steps)
        self.logdir = Path(logdir)
        self._writer: Any = None
        self._losses: list[float] = []
        self._scores: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._samples = 0
        self._since = 0.0

    def begin(self) -> None:
        import tensorflow as tf

        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = tf.summary.create_file_writer(str(self.logdir))
        self._since = time.perf_counter()

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        return SessionRunArgs(["loss", "predictions"] if run_context.train else [])

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        import tensorflow as tf

        if not run_context.train:
            return
        results = run_values.results
        self._losses.append(float(results["loss"]))
        labels = run_context.batch.labels
        predictions = results["predictions"]
        if (
            isinstance(labels, np.ndarray)
            and isinstance(predictions, np.ndarray)
            and predictions.ndim == 1
        ):
            self._scores.append(predictions)
            self._labels.append(labels)
        self._samples += run_context.batch.size
        if not self.due(run_context.step):
            return
        step = run_context.step + 1
        now = time.perf_counter()
        with self._writer.as_default(step=step):
            tf.summary.scalar("loss", float(np.mean(self._losses)))
            tf.summary.scalar("samples_per_s", self._samples / max(now - self._since, 1e-9))
            if self._scores:
                value = auc(np.concatenate(self._labels), np.concatenate(self._scores))
                if not math.isnan(value):
                    tf.summary.scalar("auc", value)
            for table, stats in run_context.session.context.ps.stats().items():
                tf.summary.scalar(f"rows/{table}", stats["rows"])
        self._writer.flush()
        self._losses, self._scores, self._labels = [], [], []
        self._samples, self._since = 0, now

    def end(self, session: HookSession) -> None:
        if self._writer is not None:
            self._writer.close()


class Timeline(SessionRunHook):
    """A Chrome-trace JSON (open in Perfetto or chrome://tracing) of the read,
    prepare, pull, compute and push stages of the steps in [first_step,
    first_step + num_steps), one lane per pipeline thread."""

    def __init__(self, path: str | os.PathLike, first_step: int = 10, num_steps: int = 20) -> None:
        self.path = Path(path)
        self.first_step = first_step
        self.last_step = first_step + num_steps
        self._session: Any = None

    def after_create_session(self, session: HookSession) -> None:
        self._session = session
        session.trace.enable()

    def end(self, session: HookSession) -> None:
        events = [e for e in session.trace.events() if self.first_step <= e[1] < self.last_step]
        session.trace.disable()
        if not events:
            return
        origin = min(e[2] for e in events)
        lanes = {lane: i for i, lane in enumerate(dict.fromkeys(e[4] for e in events))}
        trace = [
            {"name": lane, "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
            for lane, tid in lanes.items()
        ]
        trace[:0] = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "wuliang"}}]
        for stage, step, start, end, lane in events:
            trace.append(
                {
                    "name": stage,
                    "cat": "step",
                    "ph": "X",
                    "pid": 1,
                    "tid": lanes[lane],
                    "ts": (start - origin) * 1e6,
                    "dur": max(end - start, 0.0) * 1e6,
                    "args": {"step": step},
                }
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
        os.replace(tmp, self.path)


class Eval(PeriodicSyncHook):
    """Evaluates on another reader every ``every_steps`` steps or every
    ``every_secs`` seconds, and at the end (when steps ran since the last
    evaluation); logs the metrics and keeps them in ``history``. It runs with
    the engine in sync (every push of the step applied), so the figures do
    not depend on the pipeline's timing.

    Args:
        reader: a reader, or a function returning a fresh one each time.
        every_steps: how often, in steps.
        every_secs: how often, in seconds.
        steps: evaluate at most this many batches (None: the whole reader).
    """

    def __init__(
        self,
        reader: Any | Callable[[], Any],
        *,
        every_steps: int | None = 1000,
        every_secs: float | None = None,
        steps: int | None = None,
    ) -> None:
        super().__init__(every_steps, every_secs)
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be an int >= 1 or None, got {steps!r}")
        self.reader = reader
        self.steps = steps
        self.history: list[tuple[int, dict[str, float]]] = []

    def begin(self) -> None:
        super().begin()
        _ensure_log_handler()

    def trigger(self, session: HookSession) -> None:
        reader = self.reader() if callable(self.reader) else self.reader
        metrics = session.evaluate(reader, steps=self.steps)
        self.history.append((session.global_step, metrics))
        text = ", ".join(f"{k} = {v:.5g}" for k, v in metrics.items())
        log.info("eval at step %d: %s", session.global_step, text)
