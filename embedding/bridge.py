"""The TensorFlow bridge: pulled rows in, loss and row gradients out.

For a batch, the reader's key preparation gives per table the unique keys
and per feature the inverse index of each value into them. The trainer pulls
the unique rows ``U[table]`` (float32 ``[U, dim]``) and feeds them, with the
inverse indices, to one ``tf.function``::

    U[table] ─gather(inverse)─► values ─pool per row (segment ids)─► [B, dim] ┐
                                  (sequence: scatter to [B, L, dim])          ├─► tower ─► loss
    dense features ───────────────────────────────────────────────────────────┘
    returns loss, logits, predictions, pooled embeddings, tower outputs, dL/dU[table]

``U`` is an input of the function, not a variable, and the tape watches it:
TensorFlow differentiates with respect to the unique rows, so each row's
gradient arrives already summed over the batch, ready to push for the same
unique keys. The dense variables (whatever the tower reads) are updated
inside the same function by a Keras optimizer. No custom op: stock
TensorFlow 2.x, public API only. Every input has a dynamic first dimension,
so batches of any size (and any number of unique keys) reuse one trace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from wuliang.embedding.features import DenseFeature, SparseFeature
from wuliang.reader.batch import CsrBatch
from wuliang.reader.prepare import PreparedKeys

LOSSES = ("binary_crossentropy", "mse", "softmax_crossentropy")
_NO_POSITIONS = np.zeros(0, dtype=np.int32)  # pooled features need none


@dataclass
class FeatureInputs:
    """One sparse feature of a batch, as the step function takes it."""

    inverse: np.ndarray  # int32 [nnz]: row of the table's uniques
    segments: np.ndarray  # int32 [nnz]: batch row of each value
    weights: np.ndarray  # float32 [nnz]
    positions: np.ndarray  # int32 [nnz]: position in its row (sequence features, else empty)


@dataclass
class StepInputs:
    """A batch turned into the step function's inputs (numpy, no TF yet)."""

    size: int
    features: dict[str, FeatureInputs]
    dense: dict[str, np.ndarray]  # float32 [B, dim] per dense feature
    labels: np.ndarray | dict[str, np.ndarray] | None


def batch_inputs(
    batch: CsrBatch,
    prepared: PreparedKeys,
    sparse: Sequence[SparseFeature],
    dense: Sequence[DenseFeature],
) -> StepInputs:
    """Index arrays of a prepared batch (numpy; runs ahead of the step)."""
    features = {}
    for f in sparse:
        index = prepared.features[f.name]
        offsets = index.offsets
        lengths = np.diff(offsets)
        segments = np.repeat(np.arange(batch.size, dtype=np.int32), lengths)
        inverse = index.inverse
        weights = (
            np.ones(len(inverse), np.float32)
            if index.weights is None
            else np.asarray(index.weights, np.float32)
        )
        positions = _NO_POSITIONS
        if f.is_sequence:  # position in the row; keep the first max_len values
            positions = (np.arange(len(inverse)) - offsets[segments]).astype(np.int32)
            keep = positions < f.max_len
            if not keep.all():
                inverse, segments = inverse[keep], segments[keep]
                weights, positions = weights[keep], positions[keep]
        features[f.name] = FeatureInputs(inverse, segments, weights, positions)
    dense_inputs = {}
    for f in dense:
        try:
            columns = batch.dense_feature(f.name)
        except KeyError:
            known = ", ".join(batch.dense_columns) or "none"
            raise KeyError(f"batch has no dense feature {f.name!r} (dense: {known})") from None
        if columns.shape[1] != f.dim:
            raise ValueError(
                f"dense feature {f.name!r} has {columns.shape[1]} columns, declared dim {f.dim}"
            )
        dense_inputs[f.name] = np.ascontiguousarray(columns, dtype=np.float32)
    return StepInputs(batch.size, features, dense_inputs, batch.labels)


def pool(
    values: tf.Tensor, segments: tf.Tensor, weights: tf.Tensor, combiner: str, size: tf.Tensor
) -> tf.Tensor:
    """Pools each row's vectors: sum, mean or sqrtn of the weighted values."""
    weighted = values * weights[:, None]
    summed = tf.math.unsorted_segment_sum(weighted, segments, size)
    if combiner == "sum":
        return summed
    if combiner == "mean":
        norm = tf.math.unsorted_segment_sum(weights, segments, size)
    else:  # sqrtn
        norm = tf.sqrt(tf.math.unsorted_segment_sum(weights * weights, segments, size))
    return tf.math.divide_no_nan(summed, norm[:, None])


def sequence(
    values: tf.Tensor,
    segments: tf.Tensor,
    positions: tf.Tensor,
    weights: tf.Tensor,
    max_len: int,
    size: tf.Tensor,
) -> tuple[tf.Tensor, tf.Tensor]:
    """The rows' vectors as a zero-padded [B, max_len, dim] sequence and its mask."""
    index = tf.stack([segments, positions], axis=1)
    dim = tf.shape(values)[1]
    shape = tf.stack([size, max_len, dim])
    padded = tf.scatter_nd(index, values * weights[:, None], shape)
    mask = tf.scatter_nd(index, tf.ones_like(weights), tf.stack([size, max_len]))
    return padded, mask


class LossFn:
    """A loss by name (``binary_crossentropy``, ``mse``, ``softmax_crossentropy``)
    or a callable ``(labels, logits) -> scalar``; and how logits become
    predictions."""

    def __init__(self, loss: str | Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> None:
        if isinstance(loss, str) and loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; use one of {', '.join(LOSSES)} or a callable")
        if not isinstance(loss, str) and not callable(loss):
            raise TypeError(f"loss must be a name or a callable, got {loss!r}")
        self.loss = loss

    def __call__(self, labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
        if self.loss == "binary_crossentropy":
            logits = _squeeze_last(logits)
            return tf.reduce_mean(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
            )
        if self.loss == "mse":
            return tf.reduce_mean(tf.square(_squeeze_last(logits) - labels))
        if self.loss == "softmax_crossentropy":
            return tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=tf.cast(labels, tf.int32), logits=logits
                )
            )
        return self.loss(labels, logits)  # type: ignore[operator]

    def predictions(self, logits: tf.Tensor) -> tf.Tensor:
        if self.loss == "binary_crossentropy":
            return tf.sigmoid(_squeeze_last(logits))
        if self.loss == "softmax_crossentropy":
            return tf.nn.softmax(logits)
        return _squeeze_last(logits) if self.loss == "mse" else logits


def _squeeze_last(x: tf.Tensor) -> tf.Tensor:
    if x.shape.rank is not None and x.shape.rank == 2 and x.shape[-1] == 1:
        return tf.squeeze(x, axis=-1)
    return x


class StepFunctions:
    """The train and eval ``tf.function`` s of one model.

    Args:
        tower: ``tower(embeddings, dense) -> logits``, or a dict of logits per
            task, or ``(logits, outputs)`` where outputs is a dict of named
            tensors to fetch. ``embeddings[name]`` is ``[B, dim]`` for pooled
            features and ``(values [B, L, dim], mask [B, L])`` for sequences;
            ``dense[name]`` is ``[B, dim]``. A Keras model or layer, a
            ``tf.Module`` or a plain function over variables it owns.
        sparse, dense: the features; table dims come from ``sparse``.
        tables: table names in the order the rows are fed.
        loss: one ``LossFn``, or one per task.
        optimizer: a Keras optimizer for the dense variables.
    """

    def __init__(
        self,
        tower: Callable[..., Any],
        sparse: Sequence[SparseFeature],
        dense: Sequence[DenseFeature],
        tables: Sequence[str],
        loss: LossFn | Mapping[str, LossFn],
        optimizer: Any,
        multi_task: bool,
    ) -> None:
        self.tower = tower
        self.sparse = list(sparse)
        self.dense = list(dense)
        self.tables = list(tables)
        self.loss = loss
        self.optimizer = optimizer
        self.multi_task = multi_task
        self.dense_variables: list[tf.Variable] | None = None
        dims = {f.table.name: f.table.dim for f in self.sparse}
        row_specs = tuple(tf.TensorSpec([None, dims[t]], tf.float32) for t in self.tables)
        feature_specs = tuple(
            (
                tf.TensorSpec([None], tf.int32),
                tf.TensorSpec([None], tf.int32),
                tf.TensorSpec([None], tf.float32),
                tf.TensorSpec([None], tf.int32),
            )
            for _ in self.sparse
        )
        dense_specs = tuple(tf.TensorSpec([None, f.dim], tf.float32) for f in self.dense)
        size_spec = tf.TensorSpec([], tf.int32)
        self._label_names: list[str] | None = None
        self._signature = (row_specs, feature_specs, dense_specs, size_spec)
        self._train: Any = None
        self._eval: Any = None

    # -- tracing -----------------------------------------------------------

    def _label_specs(self, labels: np.ndarray | dict[str, np.ndarray] | None) -> Any:
        if labels is None:
            raise ValueError("training needs labels: the batch has none (reader label=...)")
        if isinstance(labels, dict):
            self._label_names = sorted(labels)
            return tuple(tf.TensorSpec([None], tf.float32) for _ in self._label_names)
        self._label_names = None
        return tf.TensorSpec([None], tf.float32)

    def _forward(
        self, rows: tuple, features: tuple, dense: tuple, size: tf.Tensor
    ) -> tuple[Any, dict[str, tf.Tensor], dict[str, Any]]:
        table_rows = dict(zip(self.tables, rows, strict=True))
        embeddings: dict[str, Any] = {}
        for f, (inverse, segments, weights, positions) in zip(self.sparse, features, strict=True):
            values = tf.gather(table_rows[f.table.name], inverse)
            if f.is_sequence:
                assert f.max_len is not None
                embeddings[f.name] = sequence(values, segments, positions, weights, f.max_len, size)
            else:
                assert f.combiner is not None
                embeddings[f.name] = pool(values, segments, weights, f.combiner, size)
        dense_inputs = {f.name: x for f, x in zip(self.dense, dense, strict=True)}
        result = self.tower(embeddings, dense_inputs)
        outputs: dict[str, tf.Tensor] = {}
        if isinstance(result, tuple):
            result, outputs = result
            outputs = dict(outputs)
        return result, outputs, embeddings

    def _loss_and_predictions(self, logits: Any, labels: Any) -> tuple[tf.Tensor, Any]:
        if self.multi_task:
            if not isinstance(logits, dict):
                raise ValueError("the labels are a dict (multi-task): the tower must return a dict")
            assert self._label_names is not None
            label_map = dict(zip(self._label_names, labels, strict=True))
            missing = sorted(set(label_map) - set(logits))
            if missing:
                raise ValueError(f"the tower returned no logits for label(s) {missing}")
            total = tf.constant(0.0)
            predictions = {}
            for name in self._label_names:
                loss = self.loss[name] if isinstance(self.loss, Mapping) else self.loss
                total += loss(label_map[name], logits[name])
                predictions[name] = loss.predictions(logits[name])
            return total, predictions
        assert isinstance(self.loss, LossFn)
        return self.loss(labels, logits), self.loss.predictions(logits)

    def train(self, rows: tuple, features: tuple, dense: tuple, size: int, labels: Any) -> dict:
        if self._train is None:
            label_spec = self._label_specs(labels)
            self._train = tf.function(
                self._train_step, input_signature=(*self._signature, label_spec)
            )
        return self._train(rows, features, dense, np.int32(size), self._labels_in(labels))

    def evaluate(self, rows: tuple, features: tuple, dense: tuple, size: int, labels: Any) -> dict:
        if labels is None:
            if self._eval is None or self._eval[0] != "nolabels":
                fn = tf.function(self._predict_step, input_signature=self._signature)
                self._eval = ("nolabels", fn)
            return self._eval[1](rows, features, dense, np.int32(size))
        if self._eval is None or self._eval[0] != "labels":
            label_spec = self._label_specs(labels)
            fn = tf.function(self._eval_step, input_signature=(*self._signature, label_spec))
            self._eval = ("labels", fn)
        return self._eval[1](rows, features, dense, np.int32(size), self._labels_in(labels))

    def _labels_in(self, labels: Any) -> Any:
        if isinstance(labels, dict):
            assert self._label_names is not None
            return tuple(labels[n] for n in self._label_names)
        return labels

    def _train_step(
        self, rows: tuple, features: tuple, dense: tuple, size: tf.Tensor, labels: Any
    ) -> dict:
        with tf.GradientTape() as tape:
            tape.watch(rows)
            logits, outputs, embeddings = self._forward(rows, features, dense, size)
            loss, predictions = self._loss_and_predictions(logits, labels)
        variables = [v for v in tape.watched_variables() if v.trainable]  # rows are not variables
        grads = tape.gradient(loss, [*rows, *variables])
        row_grads = [tf.convert_to_tensor(g) for g in grads[: len(rows)]]
        dense_grads = grads[len(rows) :]
        pairs = [(g, v) for g, v in zip(dense_grads, variables, strict=True) if g is not None]
        if pairs:
            self.optimizer.apply_gradients(pairs)
        self.dense_variables = variables
        return {
            "loss": loss,
            "logits": logits,
            "predictions": predictions,
            "embeddings": embeddings,
            "outputs": outputs,
            "row_grads": tuple(row_grads),
        }

    def _eval_step(
        self, rows: tuple, features: tuple, dense: tuple, size: tf.Tensor, labels: Any
    ) -> dict:
        logits, outputs, embeddings = self._forward(rows, features, dense, size)
        loss, predictions = self._loss_and_predictions(logits, labels)
        return {
            "loss": loss,
            "logits": logits,
            "predictions": predictions,
            "embeddings": embeddings,
            "outputs": outputs,
        }

    def _predict_step(self, rows: tuple, features: tuple, dense: tuple, size: tf.Tensor) -> dict:
        logits, outputs, embeddings = self._forward(rows, features, dense, size)
        loss_fn = self.loss if isinstance(self.loss, LossFn) else None
        if isinstance(logits, dict):
            predictions = {
                k: (self.loss[k] if isinstance(self.loss, Mapping) else self.loss).predictions(v)
                for k, v in logits.items()
            }
        else:
            assert loss_fn is not None
            predictions = loss_fn.predictions(logits)
        return {
            "logits": logits,
            "predictions": predictions,
            "embeddings": embeddings,
            "outputs": outputs,
        }

    def feed(self, inputs: StepInputs, rows: Mapping[str, np.ndarray]) -> tuple:
        """The positional arguments of a step: (rows, features, dense, size)."""
        features = tuple(
            (fi.inverse, fi.segments, fi.weights, fi.positions)
            for fi in (inputs.features[f.name] for f in self.sparse)
        )
        dense = tuple(inputs.dense[f.name] for f in self.dense)
        return tuple(rows[t] for t in self.tables), features, dense, inputs.size
