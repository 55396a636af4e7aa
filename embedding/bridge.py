"""The TensorFlow bridge: pulled rows in, loss and row gradients out.

For a batch, the reader's key preparation gives per table the unique keys
and per feature the inverse index of each value into them. The trainer pulls
the unique rows ``U[table]`` (float32 ``[U, dim]``) and feeds them, with the
inverse indices, to one ``tf.function``::

    U[table] ─gather(inverse)─► values ─pool per row (segment ids)─► [B, dim] ┐
                                  (sequence: scatter to [B, L, dim])          ├─► tower ─► loss
    dense features ───────────────────────────────────────────────────────────┘
    returns loss, logits, predictions, pooled embeddings, tower outputs,
    dL/d(looked-up values) ─host: scatter-add by index─► dL/dU[table]

Tables of the same dimension are packed: their pulled rows sit one after
the other in one ``[sum U, dim]`` input (each pulled straight into its
slice), so the backward pass densifies one gradient per dimension, not one
per table. A feature with at most one value per row and no weights (most
ID features) skips pooling: all such features of a dimension are looked up
by one gather of a ``[B, F]`` index matrix; an empty row points at a zero
row kept after each group's pulled rows.

``U`` is an input of the function, not a variable, and like the index
matrices it is handed to TensorFlow without a copy (64-byte aligned numpy
buffers shared through DLPack, ``as_tensor``; with the GPU hot cache, device
arrays: ``embedding/rows.py``). The tape watches each
lookup's output (``gather(U, index)``), so TensorFlow returns dL/d(values)
per looked-up value, a dense tensor; they are summed into the rows they
were read from (``StepFunctions.row_gradients``: C++ ``scatter_add_rows`` on
the host, or on the device with the cache) off the step's critical path,
ready to push for the same unique keys.
Differentiating with respect to ``U`` itself would make TensorFlow densify
an ``IndexedSlices`` by ``unsorted_segment_sum``, which costs more CPU than
the rest of the embedding work together (figures in docs/performance.md).
The dense variables (whatever the tower reads) are updated
inside the same function by a Keras optimizer. No custom op: stock
TensorFlow 2.x, public API only. Every input has a dynamic first dimension,
so batches of any size (and any number of unique keys) reuse one trace.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from wuliang.embedding.features import DenseFeature, SparseFeature
from wuliang.embedding.ops import concat
from wuliang.embedding.rows import RowMemory, aligned_empty, as_tensor
from wuliang.reader.batch import CsrBatch
from wuliang.reader.prepare import PreparedKeys

LOSSES = ("binary_crossentropy", "mse", "softmax_crossentropy")
_NO_POSITIONS = np.zeros(0, dtype=np.int32)  # pooled features need none


def _aligned_copy(values: np.ndarray, dtype: Any) -> np.ndarray:
    out = aligned_empty(values.shape, dtype)
    out[...] = values
    return out


@dataclass(frozen=True)
class Layout:
    """How tables are packed: one group of tables per embedding dimension."""

    groups: tuple[tuple[int, tuple[str, ...]], ...]  # (dim, tables)

    @staticmethod
    def of(sparse: Sequence[SparseFeature]) -> Layout:
        by_dim: dict[int, list[str]] = {}
        for f in sparse:
            tables = by_dim.setdefault(f.table.dim, [])
            if f.table.name not in tables:
                tables.append(f.table.name)
        return Layout(tuple((dim, tuple(tables)) for dim, tables in by_dim.items()))

    def group_of(self, table: str) -> int:
        for g, (_, tables) in enumerate(self.groups):
            if table in tables:
                return g
        raise KeyError(table)

    def bases(self, prepared: PreparedKeys) -> tuple[list[int], dict[str, int]]:
        """Pulled rows per group, and the first row of each table in its group.
        Each group's input has one more row, all zeros, after the pulled ones."""
        sizes, bases = [], {}
        for _, tables in self.groups:
            rows = 0
            for t in tables:
                bases[t] = rows
                rows += len(prepared.tables[t].uniques)
            sizes.append(rows)
        return sizes, bases


@dataclass
class FeatureInputs:
    """A pooled or sequence feature of a batch, as the step function takes it."""

    inverse: np.ndarray  # int32 [nnz]: row in its group's packed rows
    segments: np.ndarray  # int32 [nnz]: batch row of each value
    weights: np.ndarray  # float32 [nnz]
    positions: np.ndarray  # int32 [nnz]: position in its row (sequence features, else empty)


@dataclass
class StepInputs:
    """A batch turned into the step function's inputs (numpy, no TF yet)."""

    size: int
    group_rows: list[int]  # pulled rows per group (the zero row follows them)
    table_base: dict[str, int]  # first row of each table in its group
    single: tuple[bool, ...]  # per sparse feature: looked up by the [B, F] gather
    row_index: list[np.ndarray]  # per group: int32 [B, F_g]; an empty row -> the zero row
    features: dict[str, FeatureInputs]  # the other sparse features
    dense: dict[str, np.ndarray]  # float32 [B, dim] per dense feature
    labels: np.ndarray | dict[str, np.ndarray] | None


def batch_inputs(
    batch: CsrBatch,
    prepared: PreparedKeys,
    sparse: Sequence[SparseFeature],
    dense: Sequence[DenseFeature],
    layout: Layout,
) -> StepInputs:
    """Index arrays of a prepared batch (numpy; runs ahead of the step)."""
    group_rows, table_base = layout.bases(prepared)
    features = {}
    single = []
    row_index: list[list[tuple[np.ndarray, int, np.ndarray | None]]] = [[] for _ in layout.groups]
    for f in sparse:
        index = prepared.features[f.name]
        base = table_base[f.table.name]
        offsets = index.offsets
        lengths = np.diff(offsets)
        if (
            not f.is_sequence
            and index.weights is None
            and (len(lengths) == 0 or lengths.max() <= 1)
        ):
            # (inverse, base, which rows have a value: None when all do)
            every = len(index.inverse) == batch.size
            row_index[layout.group_of(f.table.name)].append(
                (index.inverse, base, None if every else lengths == 1)
            )
            single.append(True)
            continue
        single.append(False)
        segments = np.repeat(np.arange(batch.size, dtype=np.int32), lengths)
        inverse = index.inverse + np.int32(base)
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
        dense_inputs[f.name] = _aligned_copy(columns, np.float32)
    matrices = []
    for zero_row, columns in zip(group_rows, row_index, strict=True):
        matrix = aligned_empty((batch.size, len(columns)), np.int32)
        for j, (inverse, base, present) in enumerate(columns):
            if present is None:
                np.add(inverse, np.int32(base), out=matrix[:, j])
            else:  # rows without a value read the zero row
                matrix[:, j] = zero_row
                matrix[present, j] = inverse + base
        matrices.append(matrix)
    return StepInputs(
        batch.size,
        group_rows,
        table_base,
        tuple(single),
        matrices,
        features,
        dense_inputs,
        batch.labels,
    )


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


class Tower:
    """How a step calls the user's tower.

    * A functional Keras model whose inputs are named after features (the
      usual Keras form: ``keras.Input(shape=(dim,), name="user_id")``, as a
      dict or a list) gets a dict of those features by name, each ``[B,
      dim]`` (pooled sparse features, dense features); every input must name
      a feature, with its dim.
    * Any other Keras model or layer whose ``call`` takes one input (a
      ``keras.Sequential``, a functional model with one unnamed input, a
      ``Dense`` layer) gets one ``[B, sum of dims]`` tensor: the pooled
      sparse features and the dense features concatenated in the order the
      features were declared (``order``).
    * Anything else (a Keras model whose ``call`` takes two inputs, a
      ``tf.Module``, a function) is called ``tower(embeddings, dense)`` with
      two dicts by feature name.

    Either way ``training=`` is passed (True in the training step, False
    elsewhere) when the tower accepts it, so dropout and batch normalisation
    behave as in Keras's ``fit`` and ``predict``.
    """

    def __init__(
        self,
        tower: Callable[..., Any],
        sparse: Sequence[SparseFeature],
        dense: Sequence[DenseFeature],
        order: Sequence[str] | None = None,
    ) -> None:
        if not callable(tower):
            raise TypeError(f"the tower must be callable, got {tower!r}")
        self.fn = tower
        self.order = list(order) if order is not None else [f.name for f in (*sparse, *dense)]
        params = _call_parameters(tower)
        self.takes_training = params is not None and "training" in params
        positional = [
            p
            for name, p in (params or {}).items()
            if name not in ("training", "mask")
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.one_input = _is_keras_layer(tower) and len(positional) == 1
        self.named: list[str] | None = None  # the features a named-input model takes
        if not self.one_input:
            return
        inputs = _functional_inputs(tower)
        if inputs is not None:
            self.named = _named_inputs(tower, inputs, sparse, dense)
            if self.named is not None:
                return
        if inputs is not None and len(inputs) > 1:
            raise ValueError(
                f"the tower is a functional Keras model with {len(inputs)} inputs "
                f"({', '.join(repr(_input_name(t)) for t in inputs)}), not named after "
                f"features ({', '.join(map(repr, self.order))}): name each input after the "
                'feature it takes (keras.Input(shape=(dim,), name="<feature>")), or give the '
                "model one input (the features concatenated)"
            )
        sequences = [f.name for f in sparse if f.is_sequence]
        if sequences:
            raise ValueError(
                f"a one-input Keras tower gets the pooled features concatenated, but "
                f"{', '.join(map(repr, sequences))} is a sequence feature (combiner=None): "
                "write a tower(embeddings, dense) that takes its (values, mask)"
            )

    def __call__(self, embeddings: dict[str, Any], dense: dict[str, Any], training: bool) -> Any:
        kwargs = {"training": training} if self.takes_training else {}
        if self.named is not None:
            inputs = {**embeddings, **dense}
            return self.fn({name: inputs[name] for name in self.named}, **kwargs)
        if self.one_input:
            inputs = {**embeddings, **dense}
            return self.fn(concat([inputs[name] for name in self.order]), **kwargs)
        return self.fn(embeddings, dense, **kwargs)


def _variable_name(variable: Any) -> str:
    """A Keras variable's path (``dense/kernel``), else its TF name without ``:0``."""
    name = getattr(variable, "path", None) or variable.name
    return name[:-2] if name.endswith(":0") else name


def _is_keras_layer(tower: Any) -> bool:
    import keras

    return isinstance(tower, keras.layers.Layer)


def _functional_inputs(model: Any) -> list[Any] | None:
    """The inputs of a functional Keras model (None: not functional)."""
    try:
        inputs = model.inputs
    except (AttributeError, TypeError, ValueError):
        return None
    return list(inputs) if inputs else None


def _input_name(tensor: Any) -> str:
    return str(getattr(tensor, "name", "") or "")


def _named_inputs(
    model: Any, inputs: list[Any], sparse: Sequence[SparseFeature], dense: Sequence[DenseFeature]
) -> list[str] | None:
    """The feature each input of a functional model takes, when the inputs
    are named after features; None when no input is. ValueError naming the
    input when only some are, or a dim differs."""
    dims = {f.name: f.table.dim for f in sparse if not f.is_sequence}
    dims.update({f.name: f.dim for f in dense})
    names = [_input_name(t) for t in inputs]
    if not any(name in dims for name in names):
        return None
    unknown = [name for name in names if name not in dims]
    if unknown:
        sequences = [f.name for f in sparse if f.is_sequence and f.name in unknown]
        why = (
            " (a sequence feature: write a tower(embeddings, dense) that takes its values and mask)"
            if sequences
            else ""
        )
        raise ValueError(
            f"the tower's input {unknown[0]!r} names no feature{why}; its inputs are matched "
            f"to features by name (features: {', '.join(dims)})"
        )
    for name, tensor in zip(names, inputs, strict=True):
        width = tuple(getattr(tensor, "shape", ()) or ())[1:]
        if width not in ((dims[name],), (None,)):
            raise ValueError(
                f"the tower's input {name!r} has shape {(None, *width)}; feature {name!r} "
                f"gives [B, {dims[name]}]"
            )
    return names


def _call_parameters(tower: Any) -> Mapping[str, inspect.Parameter] | None:
    """The parameters of what calling the tower runs (a Keras layer's call)."""
    target = tower.call if _is_keras_layer(tower) else tower
    try:
        return inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin or C callable
        return None


class TowerOutputError(ValueError):
    """The tower's output does not fit the loss (its shape)."""


class LossFn:
    """A loss by name (``binary_crossentropy``, ``mse``, ``softmax_crossentropy``)
    or a callable ``(labels, logits) -> scalar``; and how the tower's output
    becomes predictions.

    ``from_logits=False``: the tower's output is already probabilities (it
    ends in a sigmoid, or a softmax for ``softmax_crossentropy``): the loss
    takes them as such (Keras's cross-entropy, which recovers the logits of
    a Keras sigmoid or softmax output for a stable loss) and the predictions
    are the output itself."""

    def __init__(
        self, loss: str | Callable[[tf.Tensor, tf.Tensor], tf.Tensor], from_logits: bool = True
    ) -> None:
        if isinstance(loss, str) and loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; use one of {', '.join(LOSSES)} or a callable")
        if not isinstance(loss, str) and not callable(loss):
            raise TypeError(f"loss must be a name or a callable, got {loss!r}")
        self.loss = loss
        self.from_logits = from_logits
        self.shape_error: str | None = None  # found while tracing (TensorFlow wraps it)

    def __call__(self, labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
        if self.loss == "binary_crossentropy":
            logits = self._one_per_example(logits)
            if not self.from_logits:
                import keras

                return tf.reduce_mean(
                    keras.losses.binary_crossentropy(labels[:, None], logits[:, None])
                )
            return tf.reduce_mean(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
            )
        if self.loss == "mse":
            return tf.reduce_mean(tf.square(self._one_per_example(logits) - labels))
        if self.loss == "softmax_crossentropy":
            if not self.from_logits:
                import keras

                return tf.reduce_mean(
                    keras.losses.sparse_categorical_crossentropy(tf.cast(labels, tf.int32), logits)
                )
            return tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=tf.cast(labels, tf.int32), logits=logits
                )
            )
        return self.loss(labels, logits)  # type: ignore[operator]

    def _one_per_example(self, logits: tf.Tensor) -> tf.Tensor:
        """[B, 1] or [B] as [B]; TowerOutputError for any other shape (at
        trace time, before any step runs)."""
        shape = logits.shape
        if shape.rank == 1 or (shape.rank == 2 and shape[-1] in (1, None)):
            return _squeeze_last(logits)
        self.shape_error = (
            f"the tower returns shape {_shape_text(shape)}; with loss {self.loss!r} it must "
            "return one value per example, [B, 1] or [B] (e.g. end it in Dense(1))"
        )
        raise TowerOutputError(self.shape_error)

    def predictions(self, logits: tf.Tensor) -> tf.Tensor:
        if self.loss == "binary_crossentropy":
            logits = self._one_per_example(logits)
            return logits if not self.from_logits else tf.sigmoid(logits)
        if self.loss == "softmax_crossentropy":
            return logits if not self.from_logits else tf.nn.softmax(logits)
        return self._one_per_example(logits) if self.loss == "mse" else logits


def _traced(fn: Any, losses: Any, *args: Any) -> Any:
    """``fn(*args)``; a ``TowerOutputError`` found while tracing (which
    AutoGraph re-raises as its own error) is raised alone, without
    TensorFlow's tracing frames around it."""
    try:
        return fn(*args)
    except Exception:
        for loss in losses.values() if isinstance(losses, Mapping) else [losses]:
            if loss.shape_error is not None:
                raise TowerOutputError(loss.shape_error) from None
        raise


def _shape_text(shape: tf.TensorShape) -> str:
    if shape.rank is None:
        return "of unknown rank"
    return "[" + ", ".join("B" if i == 0 else str(d) for i, d in enumerate(shape.as_list())) + "]"


def ends_in_probabilities(tower: Any) -> bool:
    """Whether a Keras tower's last layer is a sigmoid or softmax (a
    ``Dense(..., activation="sigmoid")``, an ``Activation("sigmoid")``): the
    usual Keras habit, whose output is probabilities, not logits. False for
    anything that is not a Sequential or functional Keras model."""
    import keras

    if not isinstance(tower, keras.Sequential) and _functional_inputs(tower) is None:
        return False
    layers = tower.layers
    if not layers:
        return False
    activation = getattr(layers[-1], "activation", None)
    return getattr(activation, "__name__", "") in ("sigmoid", "softmax")


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
            ``tf.Module`` or a plain function over variables it owns; a
            one-input Keras model gets the features concatenated (``Tower``).
        sparse, dense: the features.
        layout: how the tables are packed (``Layout.of(sparse)``).
        loss: one ``LossFn``, or one per task.
        optimizer: a Keras optimizer for the dense variables.
        order: the features' names as declared (default: sparse, then dense).

    One concrete function is traced per set of features that take the
    single-value gather (``StepInputs.single``) and label structure: in
    practice one for training and one for evaluation.
    """

    def __init__(
        self,
        tower: Callable[..., Any],
        sparse: Sequence[SparseFeature],
        dense: Sequence[DenseFeature],
        layout: Layout,
        loss: LossFn | Mapping[str, LossFn],
        optimizer: Any,
        order: Sequence[str] | None = None,
    ) -> None:
        self.tower = tower
        self.call_tower = Tower(tower, sparse, dense, order)
        self.sparse = list(sparse)
        self.dense = list(dense)
        self.layout = layout
        self.loss = loss
        self.optimizer = optimizer
        self._label_names: list[str] | None = None
        self._functions: dict[tuple, Any] = {}
        self.tower_variable_names: list[str] = []  # order of the step's "tower_finite"
        # False: the training step returns the tower's gradients ("tower_grads",
        # in the order of tower_variables) instead of applying them (a tower
        # shared through the parameter servers, wuliang.dense); set before tracing
        self.apply_tower = True
        self.tower_variables: list[tf.Variable] = []  # the trainable ones the step reaches
        self.memory = RowMemory()  # where the rows and row gradients live (embedding.rows)

    # -- tracing -----------------------------------------------------------

    def _signature(self, single: tuple[bool, ...]) -> tuple:
        rows = tuple(tf.TensorSpec([None, dim], tf.float32) for dim, _ in self.layout.groups)
        counts = [0] * len(self.layout.groups)
        for f, is_single in zip(self.sparse, single, strict=True):
            counts[self.layout.group_of(f.table.name)] += is_single
        row_index = tuple(tf.TensorSpec([None, n], tf.int32) for n in counts)
        features = tuple(
            (
                tf.TensorSpec([None], tf.int32),
                tf.TensorSpec([None], tf.int32),
                tf.TensorSpec([None], tf.float32),
                tf.TensorSpec([None], tf.int32),
            )
            for f, is_single in zip(self.sparse, single, strict=True)
            if not is_single
        )
        dense = tuple(tf.TensorSpec([None, f.dim], tf.float32) for f in self.dense)
        return rows, row_index, features, dense, tf.TensorSpec([], tf.int32)

    def _label_spec(self, labels: np.ndarray | dict[str, np.ndarray] | None) -> Any:
        if labels is None:
            return None
        if isinstance(labels, dict):
            self._label_names = sorted(labels)
            return tuple(tf.TensorSpec([None], tf.float32) for _ in self._label_names)
        self._label_names = None
        return tf.TensorSpec([None], tf.float32)

    def _function(self, kind: str, single: tuple[bool, ...], labels: Any) -> Any:
        key = (kind, single, None if labels is None else isinstance(labels, dict))
        fn = self._functions.get(key)
        if fn is None:
            label_spec = self._label_spec(labels)
            body = {"train": self._train_step, "eval": self._eval_step}[kind]
            step = functools.partial(body, single)
            if labels is None:
                step = functools.partial(body, single, labels=None)
                fn = tf.function(step, input_signature=self._signature(single))
            else:
                fn = tf.function(step, input_signature=(*self._signature(single), label_spec))
            self._functions[key] = fn
        return fn

    def _forward(
        self,
        single: tuple[bool, ...],
        rows: tuple,
        row_index: tuple,
        features: tuple,
        dense: tuple,
        size: tf.Tensor,
        tape: tf.GradientTape | None = None,
    ) -> tuple[Any, dict[str, tf.Tensor], dict[str, Any], list[tf.Tensor], int]:
        """Returns logits, outputs, embeddings, every gather's output (in
        ``gather_indices`` order; watched by the tape when one is given) and
        how many of them are [B, F, dim] lookups of single-valued features."""
        embeddings: dict[str, Any] = {}
        gathered: list[tf.Tensor] = []

        def lookup(rows: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
            values = tf.gather(rows, index)
            if tape is not None:
                tape.watch(values)
            gathered.append(values)
            return values

        by_group: list[list[SparseFeature]] = [[] for _ in self.layout.groups]
        for f, is_single in zip(self.sparse, single, strict=True):
            if is_single:
                by_group[self.layout.group_of(f.table.name)].append(f)
        for g, group_features in enumerate(by_group):
            if not group_features:
                continue
            looked_up = lookup(rows[g], row_index[g])  # [B, F, dim]
            for f, column in zip(group_features, tf.unstack(looked_up, axis=1), strict=True):
                embeddings[f.name] = column
        packed = len(gathered)
        pooled = iter(features)
        for f, is_single in zip(self.sparse, single, strict=True):
            if is_single:
                continue
            inverse, segments, weights, positions = next(pooled)
            values = lookup(rows[self.layout.group_of(f.table.name)], inverse)
            if f.is_sequence:
                assert f.max_len is not None
                embeddings[f.name] = sequence(values, segments, positions, weights, f.max_len, size)
            else:
                assert f.combiner is not None
                embeddings[f.name] = pool(values, segments, weights, f.combiner, size)
        embeddings = {f.name: embeddings[f.name] for f in self.sparse}  # declared order
        dense_inputs = {f.name: x for f, x in zip(self.dense, dense, strict=True)}
        result = self.call_tower(embeddings, dense_inputs, training=tape is not None)
        outputs: dict[str, tf.Tensor] = {}
        if isinstance(result, tuple):
            result, outputs = result
            outputs = dict(outputs)
        return result, outputs, embeddings, gathered, packed

    def _loss_and_predictions(self, logits: Any, labels: Any) -> tuple[tf.Tensor | None, Any]:
        """Loss (None without labels) and predictions of the logits. A dict of
        logits is a multi-task model: it needs a dict of labels, one per task."""
        if not isinstance(logits, dict):
            if self._label_names is not None and labels is not None:
                raise ValueError("the labels are a dict (multi-task): the tower must return a dict")
            loss = self._task_loss(None)
            return (None if labels is None else loss(labels, logits)), loss.predictions(logits)
        predictions = self.predictions(logits)
        if labels is None:
            return None, predictions
        if self._label_names is None:
            raise ValueError(
                "the tower returns a dict of logits (multi-task): read a dict of labels"
            )
        label_map = dict(zip(self._label_names, labels, strict=True))
        missing = sorted(set(label_map) - set(logits))
        if missing:
            raise ValueError(f"the tower returned no logits for label(s) {missing}")
        total = tf.constant(0.0)
        for name in self._label_names:
            total += self._task_loss(name)(label_map[name], logits[name])
        return total, predictions

    def predictions(self, logits: Any) -> Any:
        """Predictions of the tower's logits (a dict per task for a dict)."""
        if isinstance(logits, dict):
            return {k: self._task_loss(k).predictions(v) for k, v in logits.items()}
        return self._task_loss(None).predictions(logits)

    def _task_loss(self, task: str | None) -> LossFn:
        if not isinstance(self.loss, Mapping):
            return self.loss
        if task is None or task not in self.loss:
            raise ValueError(f"no loss for task {task!r}: the losses are for {sorted(self.loss)}")
        return self.loss[task]

    # -- running -------------------------------------------------------------

    def trace(self, inputs: StepInputs, rows: Sequence[np.ndarray], train: bool) -> None:
        """Traces the step for these inputs without running it (its variables,
        the optimizer's included, exist afterwards)."""
        if train:
            fn = self._function("train", inputs.single, inputs.labels)
            fn.get_concrete_function(*self._feed(inputs, rows), self._labels_in(inputs.labels))
        else:
            fn = self._function("eval", inputs.single, None)
            fn.get_concrete_function(*self._feed(inputs, rows))

    def variables(self) -> list[tf.Variable]:
        """The variables the traced steps capture (tower and optimizer), in a
        stable order: the training step's capture order (a function of the
        code), then any others the evaluation step has."""
        seen: dict[int, tf.Variable] = {}
        for key in sorted(self._functions, key=lambda k: (k[0] != "train", repr(k))):
            for v in self._functions[key].get_concrete_function().variables:
                seen.setdefault(id(v), v)
        return list(seen.values())

    def gather_indices(self, inputs: StepInputs) -> list[tuple[int, np.ndarray]]:
        """(group, flat row index) of each lookup ``_forward`` makes, in order."""
        found = [
            (g, index.reshape(-1))
            for g, index in enumerate(inputs.row_index)
            if index.shape[1]  # the group's single-valued features: one [B, F] gather
        ]
        for f, is_single in zip(self.sparse, inputs.single, strict=True):
            if not is_single:
                found.append((self.layout.group_of(f.table.name), inputs.features[f.name].inverse))
        return found

    def row_gradients(self, inputs: StepInputs, gather_grads: Sequence[Any]) -> list[Any]:
        """dL/dU per group ([pulled rows + 1, dim], the last row the zero row's),
        in the rows' memory: each lookup's gradients summed into the rows it
        read, in order (``RowMemory.scatter_add_rows``)."""
        memory = self.memory
        out = [
            memory.zeros((rows + 1, dim))
            for (dim, _), rows in zip(self.layout.groups, inputs.group_rows, strict=True)
        ]
        lookups = self.gather_indices(inputs)
        if len(lookups) != len(gather_grads):
            raise ValueError(f"{len(gather_grads)} lookup gradients for {len(lookups)} lookups")
        for (g, index), grad in zip(lookups, gather_grads, strict=True):
            values = memory.from_tf(grad).reshape(len(index), -1)
            memory.scatter_add_rows(out[g], index, values)
        return out

    def train(self, inputs: StepInputs, rows: Sequence[np.ndarray]) -> dict:
        if inputs.labels is None:
            raise ValueError("training needs labels: the batch has none (reader label=...)")
        fn = self._function("train", inputs.single, inputs.labels)
        return _traced(fn, self.loss, *self._feed(inputs, rows), self._labels_in(inputs.labels))

    def evaluate(self, inputs: StepInputs, rows: Sequence[np.ndarray], labels: bool = True) -> dict:
        """Forward only; loss too when ``labels`` and the batch has them."""
        given = inputs.labels if labels else None
        fn = self._function("eval", inputs.single, given)
        args = self._feed(inputs, rows)
        if given is None:
            return _traced(fn, self.loss, *args)
        return _traced(fn, self.loss, *args, self._labels_in(given))

    def _labels_in(self, labels: Any) -> Any:
        if isinstance(labels, dict):
            self._label_names = sorted(labels)
            return tuple(labels[n] for n in self._label_names)
        return labels

    def _feed(self, inputs: StepInputs, rows: Sequence[np.ndarray]) -> tuple:
        features = tuple(
            (fi.inverse, fi.segments, fi.weights, fi.positions)
            for fi in (inputs.features[f.name] for f in self.sparse if f.name in inputs.features)
        )
        dense = tuple(as_tensor(inputs.dense[f.name]) for f in self.dense)
        return (
            tuple(self.memory.to_tf(r) for r in rows),
            tuple(as_tensor(index) for index in inputs.row_index),
            features,
            dense,
            np.int32(inputs.size),
        )

    def _train_step(
        self,
        single: tuple,
        rows: tuple,
        row_index: tuple,
        features: tuple,
        dense: tuple,
        size: tf.Tensor,
        labels: Any,
    ) -> dict:
        with tf.GradientTape() as tape:
            logits, outputs, embeddings, gathered, packed = self._forward(
                single, rows, row_index, features, dense, size, tape
            )
            loss, predictions = self._loss_and_predictions(logits, labels)
        variables = [v for v in tape.watched_variables() if v.trainable]  # rows are not variables
        grads = tape.gradient(loss, [*gathered, *variables])
        # dL/d(looked-up values); None: the lookup does not reach the loss.
        gather_grads = tuple(
            tf.zeros_like(x) if g is None else g
            for x, g in zip(gathered, grads[: len(gathered)], strict=True)
        )
        pairs = [
            (g, v) for g, v in zip(grads[len(gathered) :], variables, strict=True) if g is not None
        ]
        # A non-finite gradient is not applied (zeros in its place); the host
        # reads which variables had one (``tower_finite``) and raises or counts.
        finite = [tf.reduce_all(tf.math.is_finite(g)) for g, _ in pairs]
        self.tower_variables = variables
        if not self.apply_tower:
            by_variable = {
                id(v): (ok, tf.convert_to_tensor(g))
                for ok, (g, v) in zip(finite, pairs, strict=True)
            }
            tower_grads = tuple(
                tf.zeros_like(v)
                if id(v) not in by_variable
                else tf.where(by_variable[id(v)][0], by_variable[id(v)][1], tf.zeros_like(v))
                for v in variables
            )
        elif pairs:
            self.optimizer.apply_gradients(
                [
                    (tf.where(ok, g, tf.zeros_like(g)), v)
                    for ok, (g, v) in zip(finite, pairs, strict=True)
                ]
            )
        self.tower_variable_names = [_variable_name(v) for _, v in pairs]
        return {
            "tower_finite": tf.stack(finite) if finite else tf.ones([0], tf.bool),
            "loss": loss,
            "logits": logits,
            "predictions": predictions,
            **_embedding_outputs(embeddings, gathered[:packed], single, self.sparse),
            "outputs": outputs,
            "gather_grads": gather_grads,
            **({} if self.apply_tower else {"tower_grads": tower_grads}),
        }

    def _eval_step(
        self,
        single: tuple,
        rows: tuple,
        row_index: tuple,
        features: tuple,
        dense: tuple,
        size: tf.Tensor,
        labels: Any,
    ) -> dict:
        logits, outputs, embeddings, gathered, packed = self._forward(
            single, rows, row_index, features, dense, size
        )
        loss, predictions = self._loss_and_predictions(logits, labels)
        out = {
            "logits": logits,
            "predictions": predictions,
            **_embedding_outputs(embeddings, gathered[:packed], single, self.sparse),
            "outputs": outputs,
        }
        if loss is not None:
            out["loss"] = loss
        return out


def _embedding_outputs(
    embeddings: dict[str, Any],
    lookups: list[tf.Tensor],
    single: tuple[bool, ...],
    sparse: Sequence[SparseFeature],
) -> dict[str, Any]:
    """The step's embedding outputs: pooled and sequence features by name, the
    single-valued ones as their [B, F, dim] lookups (sliced on the host by
    ``embedding_of``), so the columns handed to the tower are not outputs and
    cost nothing when the tower does not use them one by one."""
    pooled = [f.name for f, s in zip(sparse, single, strict=True) if not s]
    return {"embeddings": {name: embeddings[name] for name in pooled}, "lookups": tuple(lookups)}


def embedding_of(
    out: dict[str, Any],
    name: str,
    inputs: StepInputs,
    layout: Layout,
    sparse: Sequence[SparseFeature],
) -> Any:
    """Feature `name`'s embedding from a step's outputs (numpy), or None."""
    if name in out["embeddings"]:
        return out["embeddings"][name]
    by_group: dict[int, list[str]] = {}
    for f, is_single in zip(sparse, inputs.single, strict=True):
        if is_single:
            by_group.setdefault(layout.group_of(f.table.name), []).append(f.name)
    for lookup, names in zip(out["lookups"], (by_group[g] for g in sorted(by_group)), strict=True):
        if name in names:
            return np.asarray(lookup)[:, names.index(name), :]
    return None
