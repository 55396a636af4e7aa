"""The tower's state: the dense half of a model, as checkpoints and exports see it.

A ``Session`` owns one ``TowerState``: the tower and its optimizer, the
features it reads, and the traced step functions. Checkpoints and exports
take it together with the parameter server (``wuliang.checkpoint``,
``wuliang.export``), so neither reaches into the session:

* ``trackables()`` / ``checkpoint()``: the objects holding the tower's
  variables by stable names, and a ``tf.train.Checkpoint`` of them and the
  tower optimizer's state (``dense/model.*`` in a checkpoint);
* ``model_description()``: what serving needs besides the SavedModel (each
  feature's table, pooling and string hashing, the dense features), for
  manifests (``wuliang.ps_server.storage.ModelDescription``);
* ``write_saved_model(path)``: the tower as a SavedModel
  (``wuliang.saved_model``);
* a pending restore: a checkpoint restores the tower at the session's next
  step, once its variables exist (``schedule_restore``, ``restore_pending``);
  until then the tower's state is that checkpoint's (``restored_version``).

Trackables: a tower that is a Keras model or layer or a ``tf.Module`` is
tracked as is (``tower``). A plain function is tracked through the objects it
closes over or reads as globals (``inspect.getclosurevars``): each Keras
layer/model, ``tf.Module`` or variable under the name the code gives it, so a
new process (or a second model in this one) restores by those names. A
function that reaches no such object falls back to the variables its traced
steps capture, ordered by name (stable only in a fresh process). Variables
the objects own that TensorFlow's object graph does not reach (a Keras 3
model keeps layers held in a Python list outside it) are added by position,
in the objects' own variable order (``untracked_variables``), so that no
variable is left out of a checkpoint.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from wuliang.embedding.features import DenseFeature, SparseFeature
from wuliang.ps_server.storage import DenseInput, ModelDescription, SparseInput, Version
from wuliang.saved_model import variables_of, write_saved_model

DENSE_PREFIX = "dense/model"  # the tower's checkpoint inside a checkpoint folder


class TowerState:
    """The dense half of one model (see the module docstring).

    Args:
        functions: the model's ``embedding.bridge.StepFunctions``.
        sparse, dense: the model's features.
        optimizer: the Keras optimizer of the tower's variables.
    """

    def __init__(
        self,
        functions: Any,
        sparse: Sequence[SparseFeature],
        dense: Sequence[DenseFeature],
        optimizer: Any,
    ) -> None:
        self.functions = functions
        self.sparse = list(sparse)
        self.dense = list(dense)
        self.optimizer = optimizer
        # sparse feature -> the field its string values hash with (a reader's
        # ``hashed_features``), recorded in the model description
        self.hash_fields: dict[str, str] = {}
        self._restore: str | None = None  # checkpoint prefix, read at the next step
        self._restore_version: Version | None = None  # the checkpoint it is in
        self._restored_tower: str | None = None  # prefix whose tower variables are in

    @property
    def tower(self) -> Any:
        """The user's tower object."""
        return self.functions.tower

    def model_description(self) -> ModelDescription:
        """Each feature's table, pooling and string hashing; the dense features."""
        return ModelDescription(
            sparse=tuple(
                SparseInput(
                    f.name,
                    f.table.name,
                    f.combiner,
                    f.max_len,
                    self.hash_fields.get(f.name),
                    tuple(b.name for b in f.table.blocks()[1:]),
                )
                for f in self.sparse
            ),
            dense=tuple(DenseInput(d.name, d.dim) for d in self.dense),
        )

    def trackables(self) -> dict[str, Any]:
        """The objects holding the tower's variables, by stable names."""
        import tensorflow as tf

        tower = self.tower
        try:
            tf.train.Checkpoint(tower=tower)
            return _with_untracked({"tower": tower})
        except (ValueError, TypeError):
            pass
        objects = _trackables_of(tower) if callable(tower) else {}
        if objects:
            return _with_untracked({f"tower_{name}": value for name, value in objects.items()})
        own = {id(v) for v in getattr(self.optimizer, "variables", [])}
        variables = sorted(
            (v for v in self.functions.variables() if id(v) not in own), key=lambda v: v.name
        )
        return {"variables": variables}

    def checkpoint(self) -> Any:
        """A ``tf.train.Checkpoint`` of the tower and its optimizer."""
        import tensorflow as tf

        return tf.train.Checkpoint(optimizer=self.optimizer, **self.trackables())

    def write_saved_model(self, path: str | Path) -> None:
        """Writes the tower as a SavedModel into the (new or empty) folder."""
        write_saved_model(self, path)

    # -- restoring -------------------------------------------------------------

    def schedule_restore(self, version: Version) -> None:
        """Restores the tower and its optimizer from a checkpoint's TF
        checkpoint (``dense/model.*``; of a remote checkpoint, a local copy)
        at the next step, once traced (so that every variable exists)."""
        folder, _, name = DENSE_PREFIX.rpartition("/")
        self._restore = str(version.local_folder(folder) / name)
        self._restore_version = version
        self._restored_tower = None

    @property
    def pending_restore(self) -> str | None:
        """The checkpoint prefix the next step restores from (None: none)."""
        return self._restore

    def restored_version(self) -> Version | None:
        """The checkpoint whose tower the next step restores, which holds the
        tower's state until then; or None."""
        if self._restore is None:
            return None
        return self._restore_version

    def restore_pending(self, inputs: Any, rows: Sequence[np.ndarray], train: bool) -> None:
        """A scheduled restore: trace (variables exist), then read. A
        training step reads the tower and its optimizer and clears it; an
        evaluation reads the tower's variables only, once, and keeps the
        rest for the first training step (the optimizer's variables exist
        only once that is traced), so nothing is left unread and TensorFlow
        has nothing to warn about."""
        import tensorflow as tf

        if self._restore is None or (train and inputs.labels is None):
            return
        if not train and self._restored_tower == self._restore:
            return
        self.functions.trace(inputs, rows, train)
        if train:
            status = self.checkpoint().read(self._restore)
            status.assert_existing_objects_matched()
            self._restore = self._restored_tower = None
            self._restore_version = None
            return
        status = tf.train.Checkpoint(**self.trackables()).read(self._restore)
        status.assert_existing_objects_matched()
        status.expect_partial()  # the optimizer's values wait for a training step
        self._restored_tower = self._restore


def _with_untracked(objects: dict[str, Any]) -> dict[str, Any]:
    """``objects`` plus, under ``untracked_variables``, the variables they own
    that TensorFlow's object graph does not reach (a Keras 3 model's layers
    kept in a Python list or dict), in the objects' own variable order."""
    import tensorflow as tf

    root = tf.train.Checkpoint(**objects)  # the view holds it weakly
    reached = {id(o) for o in tf.train.TrackableView(root).descendants()}
    owned: dict[int, Any] = {}
    for value in objects.values():
        if isinstance(value, tf.Variable):
            continue
        for variable in variables_of(value):
            owned.setdefault(id(variable), variable)
    untracked = [v for i, v in owned.items() if i not in reached]
    return {**objects, "untracked_variables": untracked} if untracked else objects


def _trackables_of(fn: Any) -> dict[str, Any]:
    """The trackable objects a function reaches by name (closure, globals)."""
    import tensorflow as tf

    try:
        found = inspect.getclosurevars(fn)
    except TypeError:  # not a Python function (a callable object, a builtin)
        return {}
    objects = {}
    for name, value in sorted({**found.globals, **found.nonlocals}.items()):
        if isinstance(value, type) or inspect.ismodule(value):
            continue
        try:
            tf.train.Checkpoint(probe=value)
        except (ValueError, TypeError):
            continue
        if variables_of(value):  # not plain data (a dict of settings is trackable too)
            objects[name] = value
    return objects
