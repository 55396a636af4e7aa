"""Estimator: train, evaluate, predict and export a model over readers.

A TF-Estimator-shaped face over ``Session``::

    est = Estimator(tower, features, label="click", model_dir="runs/ctr")
    est.train(ParquetReader(train_files, 4096))     # the reader reads what the model needs
    est.evaluate(ParquetReader(test_files, 4096))   # the saved model, in a new process too
    est.export("exports/")

As with TF's Estimator, an estimator with a ``model_dir`` is the model in
that directory: ``train``, ``evaluate``, ``predict``, ``export`` and
``save_checkpoint`` first restore its newest checkpoint when that is newer
than what the estimator holds (the log names the checkpoint and its step),
and ``train`` saves checkpoints there (every ``checkpoint_every_secs`` and
at the end; a ``hooks.Checkpoint`` of the same folder may replace that
default). A ``hooks.Checkpoint`` given without ``model_dir`` names it.

Readers: a ``ParquetReader`` built without ``features`` reads the model's
features (and the estimator's label); one built with them is checked up
front, so a missing feature is an error naming it before any batch is read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from wuliang import checkpoint
from wuliang.context import Context
from wuliang.embedding.features import Feature
from wuliang.hooks.base import SessionRunHook
from wuliang.hooks.checkpoint import Checkpoint
from wuliang.ps_server.storage import Location, location
from wuliang.session import Session

log = logging.getLogger("wuliang")


class Estimator:
    """Trains, evaluates and exports ``tower`` on ``features`` (see ``Session``
    for ``tower``, ``features``, ``context``, ``loss``, ``optimizer`` and
    ``from_logits``).

    Args:
        label: the label column (or a list of them for multi-task models).
        model_dir: where the model lives (see the module docstring); None:
            only in memory, unless a ``hooks.Checkpoint`` names a folder.
        hooks: run by every ``train`` call, beside that call's own.
        checkpoint_every_secs: how often ``train`` saves into ``model_dir``
            (it also saves at the end).
    """

    def __init__(
        self,
        tower: Callable[..., Any],
        features: Sequence[Feature],
        *,
        label: str | Sequence[str] | None = None,
        model_dir: str | os.PathLike | None = None,
        context: Context | None = None,
        hooks: Sequence[SessionRunHook] = (),
        loss: str | Callable | Mapping[str, str | Callable] = "binary_crossentropy",
        optimizer: Any = None,
        from_logits: bool | None = None,
        checkpoint_every_secs: float = 600.0,
    ) -> None:
        self.label = label
        self.hooks = list(hooks)
        self.model_dir = _model_dir(model_dir, self.hooks)
        self.checkpoint_every_secs = checkpoint_every_secs
        self.session = Session(
            tower, features, context, loss=loss, optimizer=optimizer, from_logits=from_logits
        )

    @property
    def context(self) -> Context:
        return self.session.context

    @property
    def global_step(self) -> int:
        return self.session.global_step

    def latest_checkpoint(self) -> Location | None:
        """The newest checkpoint in ``model_dir`` (None: none, or no model_dir)."""
        return None if self.model_dir is None else checkpoint.latest_checkpoint(self.model_dir)

    def train(
        self, reader: Any, steps: int | None = None, hooks: Sequence[SessionRunHook] = ()
    ) -> dict[str, float]:
        """Trains on every batch of the reader (or ``steps`` of them), from
        the newest checkpoint in ``model_dir``, saving into it."""
        hooks = [*self.hooks, *hooks]
        if self.model_dir is not None:
            _check_agrees(self.model_dir, hooks)
            if not any(isinstance(h, Checkpoint) for h in hooks):
                every = self.checkpoint_every_secs
                hooks.append(Checkpoint(self.model_dir, every_secs=every, restore=False))
        self._restore_newest()
        self.session.prepare_reader(reader, self.label, train=True)
        return self.session.train(reader, steps, hooks)

    def evaluate(self, reader: Any, steps: int | None = None) -> dict[str, float]:
        """auc (exact), logloss, calibration, loss … of the model over the reader."""
        self._restore_newest()
        self.session.prepare_reader(reader, self.label, train=False)
        return self.session.evaluate(reader, steps)

    def predict(self, reader: Any, steps: int | None = None) -> Iterator[Any]:
        """The model's predictions per batch (float32 [B], or a dict per task)."""
        self._restore_newest()
        self.session.prepare_reader(reader, None, train=False)
        return self.session.predict(reader, steps)

    def export(self, export_dir: str | os.PathLike, kind: str = "auto") -> Any:
        """Writes the next version of ``export_dir`` (a delta of its newest,
        or full: ``kind="full"``) from the model; returns its ``ExportResult``."""
        self._restore_newest()
        return self.session.export(export_dir, kind)

    def save_checkpoint(self, model_dir: str | os.PathLike | None = None) -> Location:
        """Writes ``ckpt-<step>`` into ``model_dir`` (default: the estimator's)."""
        target = model_dir if model_dir is not None else self.model_dir
        if target is None:
            raise ValueError("save_checkpoint needs a folder: Estimator(model_dir=...) or an arg")
        self._restore_newest()
        return self.session.save_checkpoint(target)

    def _restore_newest(self) -> None:
        """Restores model_dir's newest checkpoint when it is newer than the
        model held: a later step (another process trained), or any step when
        this estimator holds nothing restored or trained yet."""
        newest = self.latest_checkpoint()
        if newest is None:
            return
        step = int(newest.name.removeprefix(checkpoint.CHECKPOINT_PREFIX))
        held = self.session.global_step
        wanted = step > held or (held == 0 and self.session.restored is None)
        if wanted and self.session.restore_checkpoint(newest):
            log.info("restored %s (step %d)", newest, step)


def _model_dir(model_dir: str | os.PathLike | None, hooks: Sequence[Any]) -> Location | None:
    """The estimator's model_dir (a folder, or a URI of an object store): the
    argument, or the folder of its Checkpoint hook; ValueError when both are
    given and differ."""
    folders = {location(h.model_dir).resolve() for h in hooks if isinstance(h, Checkpoint)}
    if model_dir is not None:
        _check_agrees(location(model_dir), hooks)
        return location(model_dir)
    if len(folders) > 1:
        raise ValueError(
            f"Checkpoint hooks name different folders ({', '.join(sorted(map(str, folders)))}); "
            "give the estimator one model_dir"
        )
    hook = next((h for h in hooks if isinstance(h, Checkpoint)), None)
    return None if hook is None else location(hook.model_dir)


def _check_agrees(model_dir: Location, hooks: Sequence[Any]) -> None:
    for hook in hooks:
        if (
            isinstance(hook, Checkpoint)
            and location(hook.model_dir).resolve() != model_dir.resolve()
        ):
            raise ValueError(
                f"a Checkpoint hook saves into {hook.model_dir}, but the estimator's "
                f"model_dir is {model_dir}: one model, one folder"
            )
