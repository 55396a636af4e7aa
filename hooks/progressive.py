"""Progressive validation: each partition scored before it is trained on.

A model that trains on data as it lands has no held-out set that stays
relevant; the online-learning metric (McMahan et al., "Ad Click Prediction:
a View from the Trenches", KDD 2013) scores every example with the model
as it stood before training on that example. A training step's forward
pass is exactly that: its predictions come from the rows and tower before
the step's update (with the pipeline's default staleness 0, every earlier
step's update included). So ``ProgressiveValidation`` costs no extra pass:
it takes each training step's predictions, groups them by the partition
their batch belongs to (``batch.partition``, from a ``StreamReader``), and
when a partition's last batch has trained computes its exact AUC, log loss
and calibration (mean prediction / mean label). A partition is thus scored
by the model trained through every partition before it and, within it,
through the examples before each one, never by a model that has seen the
example.

Each partition's record (its name and time, the global step after it,
``examples``, ``auc``, ``logloss``, ``calibration``, ``mean_label``,
``trailing_auc``, ``held`` and the wall times ``started`` and ``finished``
of its training) goes to:

* ``records`` (the newest ``keep`` of them) and the log (INFO);
* a JSON-lines file (``jsonl=``), one line per partition, appended;
* TensorBoard (``summary_dir=``): ``progressive/auc``, ``/logloss``,
  ``/calibration``, ``/examples``, with the partition's time in unix seconds
  as the step, so the curve's x axis is data time;
* Prometheus gauges (``prometheus_port=`` serves them, or ``registry``, a
  ``prometheus_client.CollectorRegistry`` of the caller's):
  ``wuliang_progressive_auc``, ``wuliang_progressive_logloss``,
  ``wuliang_progressive_calibration``, ``wuliang_progressive_examples``,
  ``wuliang_progressive_partition_time_seconds``, and
  ``wuliang_progressive_held_total``.

The gate (``gate_auc_drop=``): a partition whose AUC falls more than that
below the mean of the ``trailing`` partitions before it is *held*: an
``IncrementalExport(gate=this hook)`` writes no version after it, and says
why in the log; the next partition that passes is exported (its delta holds
both partitions' changes). A partition of one class (no AUC) passes.

In a cluster every trainer scores its own share of each partition. A
partition cut by a restart is scored over the examples trained after the
restart (``examples`` says how many).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
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
from wuliang.hooks.metrics import Metrics
from wuliang.reader.stream import ends_partition

log = logging.getLogger("wuliang.progressive")

GAUGES = ("auc", "logloss", "calibration", "examples", "partition_time_seconds")


class ProgressiveValidation(SessionRunHook):
    """Scores each partition before training on it (see the module docstring).

    Args:
        jsonl: a file to append one JSON line per partition to.
        summary_dir: TensorBoard event files, by partition time.
        prometheus_port: serve the gauges on this port (0: none).
        registry: a ``prometheus_client.CollectorRegistry`` to put them in.
        gate_auc_drop: hold a partition's export when its AUC is more than
            this below the trailing mean (None: no gate).
        trailing: how many partitions before it the mean covers.
        task: the task to score, for a multi-task tower.
        keep: how many records ``records`` keeps.
    """

    def __init__(
        self,
        *,
        jsonl: str | os.PathLike | None = None,
        summary_dir: str | os.PathLike | None = None,
        prometheus_port: int | None = None,
        registry: Any = None,
        gate_auc_drop: float | None = None,
        trailing: int = 24,
        task: str | None = None,
        keep: int = 1000,
    ) -> None:
        if gate_auc_drop is not None and not (0 <= gate_auc_drop < 1):
            raise ValueError(f"gate_auc_drop must be in [0, 1), got {gate_auc_drop!r}")
        if not isinstance(trailing, int) or trailing < 1:
            raise ValueError(f"trailing must be an int >= 1, got {trailing!r}")
        self.jsonl = None if jsonl is None else Path(jsonl)
        self.summary_dir = None if summary_dir is None else Path(summary_dir)
        self.gate_auc_drop = gate_auc_drop
        self.trailing = trailing
        self.task = task
        self.records: deque[dict[str, Any]] = deque(maxlen=keep)
        self.held = 0  # partitions held back by the gate
        self._aucs: deque[float] = deque(maxlen=trailing)
        self._verdicts: dict[str, str | None] = {}  # partition -> why held (None: passes)
        self._current: str | None = None
        self._started = 0.0  # time.time() at the partition's first step
        self._unpartitioned = False  # warned that batches have no partition
        self._metrics = Metrics()
        self._writer: Any = None
        self._gauges: dict[str, Any] = {}
        self._held_counter: Any = None
        if prometheus_port is not None or registry is not None:
            self._serve_gauges(prometheus_port, registry)

    # -- the gate -------------------------------------------------------------

    def verdict(self, partition: str) -> str | None:
        """Why the partition's export is held, or None when it passes (or was
        not scored)."""
        return self._verdicts.get(partition)

    # -- hook -----------------------------------------------------------------

    def begin(self) -> None:
        if self.summary_dir is not None and self._writer is None:
            import tensorflow as tf

            self.summary_dir.mkdir(parents=True, exist_ok=True)
            self._writer = tf.summary.create_file_writer(str(self.summary_dir))

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        if not run_context.train:
            return None
        partition = getattr(run_context.batch, "partition", None)
        name = None if partition is None else partition.name
        if name != self._current:  # a partition begins (or one cut short by a restart goes on)
            self._metrics = Metrics()
            self._current = name
            self._started = time.time()
        return SessionRunArgs(["predictions"])

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if not run_context.train:
            return
        batch = run_context.batch
        if getattr(batch, "partition", None) is None:  # not a StreamReader's: nothing to score
            if not self._unpartitioned:
                self._unpartitioned = True
                log.warning(
                    "ProgressiveValidation scores partitions; the reader's batches have none "
                    "(read partitions with a StreamReader): nothing is scored"
                )
            return
        labels, scores = batch.labels, run_values.results["predictions"]
        if self.task is not None:
            labels, scores = labels[self.task], scores[self.task]
        elif isinstance(labels, dict) or isinstance(scores, dict):
            raise ValueError(
                "ProgressiveValidation: the model has several tasks; give task= (one of "
                f"{', '.join(sorted(scores if isinstance(scores, dict) else labels))})"
            )
        self._metrics.update(np.asarray(labels), np.asarray(scores))
        ended = ends_partition(batch)
        if ended is not None:
            self._finish(ended, run_context.step + 1)

    def end(self, session: HookSession) -> None:
        if self._writer is not None:
            self._writer.flush()

    # -- a partition scored ---------------------------------------------------

    def _finish(self, partition: Any, step: int) -> None:
        result = self._metrics.result()
        self._metrics = Metrics()
        self._current = None
        trailing = float(np.mean(self._aucs)) if self._aucs else math.nan
        value = result["auc"]
        held = None
        if (
            self.gate_auc_drop is not None
            and not math.isnan(value)
            and not math.isnan(trailing)
            and value < trailing - self.gate_auc_drop
        ):
            held = (
                f"partition {partition.name}'s progressive AUC {value:.4f} is "
                f"{trailing - value:.4f} below the mean {trailing:.4f} of the "
                f"{len(self._aucs)} before it (gate {self.gate_auc_drop:g})"
            )
            self.held += 1
        self._verdicts[partition.name] = held
        while len(self._verdicts) > self.trailing + 8:  # the recent ones are asked
            del self._verdicts[next(iter(self._verdicts))]
        if not math.isnan(value):
            self._aucs.append(value)
        record = {
            "partition": partition.name,
            "time": partition.time.isoformat(),
            "step": step,
            "examples": result["examples"],
            "auc": value,
            "logloss": result["logloss"],
            "calibration": result["calibration"],
            "mean_label": result["mean_label"],
            "trailing_auc": trailing,
            "held": held,
            "started": self._started,  # time.time() at its first step and after its last
            "finished": time.time(),
        }
        self.records.append(record)
        log.info(
            "partition %s: progressive AUC %.4f, log loss %.4f, calibration %.3f over %d "
            "examples%s",
            partition.name,
            value,
            result["logloss"],
            result["calibration"],
            result["examples"],
            f"; held: {held}" if held else "",
        )
        self._write(record, partition)

    def _write(self, record: dict[str, Any], partition: Any) -> None:
        if self.jsonl is not None:
            line = json.dumps({k: _plain(v) for k, v in record.items()}) + "\n"
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            with open(self.jsonl, "a") as f:  # one write per line
                f.write(line)
                f.flush()
        seconds = partition.seconds
        if self._writer is not None:
            import tensorflow as tf

            with self._writer.as_default(step=seconds):
                for name in ("auc", "logloss", "calibration", "examples"):
                    if not math.isnan(float(record[name])):
                        tf.summary.scalar(f"progressive/{name}", float(record[name]))
            self._writer.flush()
        if self._gauges:
            values = {**record, "partition_time_seconds": seconds}
            for name, gauge in self._gauges.items():
                gauge.set(float(values[name]))
            if record["held"]:
                self._held_counter.inc()

    def _serve_gauges(self, port: int | None, registry: Any) -> None:
        try:
            import prometheus_client as prom
        except ImportError as e:
            raise ImportError(
                "ProgressiveValidation's Prometheus gauges need prometheus-client "
                "(pip install 'wuliang[serving]')"
            ) from e
        registry = registry if registry is not None else prom.CollectorRegistry()
        self.registry = registry
        for name in GAUGES:
            self._gauges[name] = prom.Gauge(
                f"wuliang_progressive_{name}",
                f"the last partition's progressive {name.replace('_', ' ')}",
                registry=registry,
            )
        self._held_counter = prom.Counter(
            "wuliang_progressive_held",
            "partitions whose export the gate held back",
            registry=registry,
        )
        if port:
            prom.start_http_server(port, registry=registry)


def _plain(value: Any) -> Any:
    """JSON without NaN: null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
