"""TensorFlow helpers for towers.

``concat(tensors)`` is ``tf.concat(tensors, axis=-1)`` for ``[B, d]``
embeddings, minus the cost of the lookup layout: the step looks up all
single-valued features of one dimension with one gather ``[B, F, dim]`` and
hands the tower its ``F`` columns (``tf.unstack``). Concatenating those
columns again copies them forward and splits the gradient backward, a cost
in proportion to the batch's embeddings; ``concat`` sees a run of
consecutive columns of one unstack and takes it as a reshape of the gathered
tensor instead, which costs nothing. The result is the same tensor values,
in the same order, for any tensors (other tensors are concatenated as is)::

    def tower(embeddings, dense):
        x = wuliang.embedding.concat([embeddings[n] for n in FIELDS] + [dense["x"]])
        return mlp(x)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf


def _column_of(t: Any) -> tuple[Any, int] | None:
    """(the unstacked [B, F, d] tensor, column) when t is column of an
    ``unstack(x, axis=1)`` in a graph; else None."""
    op = getattr(t, "op", None)
    if op is None or tf.executing_eagerly() or op.type != "Unpack":
        return None
    try:
        if op.get_attr("axis") != 1 or op.inputs[0].shape.rank != 3:
            return None
    except (ValueError, AttributeError):
        return None
    return op.inputs[0], t.value_index


def concat(tensors: Sequence[Any], axis: int = -1) -> tf.Tensor:
    """``tf.concat(tensors, axis)`` of rank-2 tensors; runs of consecutive
    columns of one lookup are taken from the lookup without copying."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("concat needs at least one tensor")
    if axis not in (-1, 1):
        return tf.concat(tensors, axis)
    parts: list[Any] = []
    i = 0
    while i < len(tensors):
        found = _column_of(tensors[i])
        if found is None:
            parts.append(tensors[i])
            i += 1
            continue
        source, first = found
        n = 1
        while i + n < len(tensors):
            nxt = _column_of(tensors[i + n])
            if nxt is None or nxt[0] is not source or nxt[1] != first + n:
                break
            n += 1
        columns = source if first == 0 and n == source.shape[1] else source[:, first : first + n]
        width = n * source.shape[2] if source.shape[2] is not None else -1
        parts.append(tf.reshape(columns, [-1, width]))
        i += n
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)
