"""Estimator: train, evaluate and predict a model over readers.

A thin, TF-Estimator-shaped face over ``Session``::

    est = Estimator(tower, features, label="click", context=Context())
    est.train(ParquetReader(train_files, 4096, columns, label="click"),
              hooks=[hooks.Logging(every_steps=100)])
    est.evaluate(ParquetReader(test_files, 4096, columns, label="click"))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from wuliang.context import Context
from wuliang.embedding.features import Feature
from wuliang.hooks.base import SessionRunHook
from wuliang.session import Session


class Estimator:
    """Trains and evaluates ``tower`` on ``features`` (see ``Session`` for the args).

    Args:
        label: the label column (or a list of them for multi-task models); the
            readers passed in must read it.
    """

    def __init__(
        self,
        tower: Callable[..., Any],
        features: Sequence[Feature],
        *,
        label: str | Sequence[str] | None = None,
        context: Context | None = None,
        hooks: Sequence[SessionRunHook] = (),
        loss: str | Callable | Mapping[str, str | Callable] = "binary_crossentropy",
        optimizer: Any = None,
    ) -> None:
        self.labels = [] if label is None else [label] if isinstance(label, str) else list(label)
        self.hooks = list(hooks)  # run by every train() call, with its own hooks
        self.session = Session(tower, features, context, loss=loss, optimizer=optimizer)

    @property
    def context(self) -> Context:
        return self.session.context

    @property
    def global_step(self) -> int:
        return self.session.global_step

    def _check_reader(self, reader: Any) -> None:
        read = getattr(reader, "labels", None)
        if self.labels and read is not None and sorted(read) != sorted(self.labels):
            raise ValueError(
                f"the reader reads label(s) {read}, the estimator expects {self.labels}"
            )

    def train(
        self, reader: Any, steps: int | None = None, hooks: Sequence[SessionRunHook] = ()
    ) -> dict[str, float]:
        """Trains on every batch of the reader (or ``steps`` of them)."""
        self._check_reader(reader)
        return self.session.train(reader, steps, [*self.hooks, *hooks])

    def evaluate(self, reader: Any, steps: int | None = None) -> dict[str, float]:
        """auc (exact), logloss, calibration, loss … over the reader."""
        self._check_reader(reader)
        return self.session.evaluate(reader, steps)

    def predict(self, reader: Any, steps: int | None = None) -> Iterator[Any]:
        return self.session.predict(reader, steps)
