"""The tower as a TensorFlow SavedModel, for serving.

Serving looks each feature's keys up in the exported tables and pools them
itself; the SavedModel holds only the dense part. Its ``serving_default``
signature takes, by name:

* each pooled sparse feature: ``[B, dim]`` float32;
* each sequence feature (``combiner=None``): ``[B, max_len, dim]`` and its
  mask ``<name>_mask`` ``[B, max_len]``;
* each dense feature: ``[B, dim]`` float32;

and returns ``predictions`` (a multi-task tower: ``predictions_<task>`` per
task), as the training step computes them (sigmoid of the logits for
``binary_crossentropy``, softmax for ``softmax_crossentropy``, the logits
themselves for ``mse`` or a custom loss). The same function is the loaded
object's ``serve(inputs: dict)``.

It takes any ``Servable`` (``wuliang.tower.TowerState`` is one) and tracks
the tower's variables the way the tower's checkpoint does (``trackables()``):
a Keras model/layer or ``tf.Module`` tower as is, a plain function through
the trackable objects it reaches by name, else the variables the traced step
captures.

Writing a SavedModel (``tf.saved_model.save``) traces and serialises the
whole object graph, which would dominate a small delta export. A tower's first write
does it and keeps the graph files; later writes of the same tower (same
variables) copy those and write only ``variables/`` (a checkpoint of the
same object graph, which is what the loader restores from), a fraction of
the cost.
Those leave out ``fingerprint.pb``, whose checkpoint hash would be stale.
"""

from __future__ import annotations

import contextlib
import logging
import re
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from wuliang.embedding.features import DenseFeature, SparseFeature
from wuliang.ps_server.storage import SIGNATURE


class Servable(Protocol):
    """What a SavedModel is made from: the step functions (``call_tower``,
    ``predictions``), the features, and the objects holding the variables."""

    functions: Any
    sparse: Sequence[SparseFeature]
    dense: Sequence[DenseFeature]

    def trackables(self) -> dict[str, Any]: ...


_VALID_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\-/]*")


def input_specs(tower: Servable) -> dict[str, Any]:
    """The signature's inputs: name -> ``tf.TensorSpec``."""
    import tensorflow as tf

    specs: dict[str, Any] = {}
    for f in tower.sparse:
        if f.is_sequence:
            specs[f.name] = tf.TensorSpec([None, f.max_len, f.table.dim], tf.float32, f.name)
            mask = f"{f.name}_mask"
            specs[mask] = tf.TensorSpec([None, f.max_len], tf.float32, mask)
        else:
            specs[f.name] = tf.TensorSpec([None, f.table.dim], tf.float32, f.name)
    for d in tower.dense:
        specs[d.name] = tf.TensorSpec([None, d.dim], tf.float32, d.name)
    for name in specs:
        if not _VALID_NAME.fullmatch(name):
            raise ValueError(
                f"feature name {name!r} cannot name a SavedModel input "
                "(use letters, digits and _ . - /)"
            )
    return specs


def serving_module(tower: Servable) -> Any:
    """A ``tf.Module`` with the tower's variables and ``serve(inputs)``."""
    import tensorflow as tf

    functions = tower.functions
    sparse, dense = tower.sparse, tower.dense
    module = tf.Module()

    def serve(inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        embeddings = {
            f.name: (inputs[f.name], inputs[f"{f.name}_mask"]) if f.is_sequence else inputs[f.name]
            for f in sparse
        }
        dense_inputs = {d.name: inputs[d.name] for d in dense}
        result = functions.call_tower(embeddings, dense_inputs, training=False)
        logits = result[0] if isinstance(result, tuple) else result
        predictions = functions.predictions(logits)
        if isinstance(predictions, dict):
            return {f"predictions_{task}": p for task, p in sorted(predictions.items())}
        return {"predictions": predictions}

    module.serve = tf.function(serve, input_signature=[input_specs(tower)])
    module.serve.get_concrete_function()  # builds the tower if no step has yet
    # The variables only: a tracked Keras model would be traced by the saver
    # through its own call(inputs), which a tower taking (embeddings, dense)
    # does not accept.
    variables: dict[int, Any] = {}
    for value in tower.trackables().values():
        for variable in variables_of(value):
            variables.setdefault(id(variable), variable)
    module.tower_variables = list(variables.values())
    return module


def variables_of(value: Any) -> list[Any]:
    """The TensorFlow variables an object holds: a variable, a Keras model
    or layer (``.variables``), or a list, tuple or dict of those."""
    import tensorflow as tf

    if isinstance(value, tf.Variable):
        return [value]
    if isinstance(value, Mapping):
        return [v for item in value.values() for v in variables_of(item)]
    if isinstance(value, list | tuple):
        return [v for item in value for v in variables_of(item)]
    return list(getattr(value, "variables", ()))


@dataclass
class _Template:
    """A tower's SavedModel apart from its variables."""

    module: Any
    variables: list[int]  # ids of the module's variables when saved
    files: dict[str, bytes]  # relative path -> content, variables/ excluded


_TEMPLATES: weakref.WeakKeyDictionary[Any, _Template] = weakref.WeakKeyDictionary()
_NOT_COPIED = ("variables/", "fingerprint.pb")


@contextlib.contextmanager
def quiet_tensorflow() -> Iterator[None]:
    """TensorFlow's INFO lines of every save ("Assets written to …", inputs
    "with unsupported characters" renamed, sharding callbacks) held back: a
    user who logs wuliang at INFO sees one line per checkpoint, not four."""
    loggers = [logging.getLogger(name) for name in ("tensorflow", "absl")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def write_saved_model(tower: Servable, path: str | Path) -> None:
    """Writes the tower as a SavedModel into the (new or empty) folder path."""
    with quiet_tensorflow():
        _write_saved_model(tower, path)


def _write_saved_model(tower: Servable, path: str | Path) -> None:
    import tensorflow as tf

    path = Path(path)
    template = _TEMPLATES.get(tower)
    if template is not None and template.variables == [id(v) for v in template.module.variables]:
        for relative, content in template.files.items():
            target = path / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        tf.train.Checkpoint(template.module).write(str(path / "variables" / "variables"))
        return
    module = serving_module(tower)
    signature = module.serve.get_concrete_function()
    tf.saved_model.save(module, str(path), signatures={SIGNATURE: signature})
    files = {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not str(p.relative_to(path)).startswith(_NOT_COPIED)
    }
    _TEMPLATES[tower] = _Template(module, [id(v) for v in module.variables], files)
