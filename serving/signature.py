"""A served version's ``serving_default`` signature, as TensorFlow Serving
describes a model (its metadata), for the gRPC ``GetModelMetadata`` and
``GET /v1/models/{model}/metadata``.

The signature is of what a client sends and gets back, not of the
SavedModel inside the export (whose inputs are pooled embeddings):

* each sparse feature: ``DT_INT64`` ids, or ``DT_STRING`` for a feature
  trained on hashed strings (raw strings are hashed as training hashed
  them), shape ``[-1, -1]``: a row's ids, padded with ``PAD_ID`` (-1) or
  ``PAD_STRING`` (the empty string) to the longest row (a ``[-1]`` tensor,
  one id per row, is accepted too);
* each dense feature: ``DT_FLOAT``, ``[-1, dim]``;
* each output of the tower (``predictions``, or ``predictions_<task>``):
  ``DT_FLOAT`` with the tower's shape (``[-1, 1]``, ``[-1]`` …).

``Signature.json()`` is TensorFlow Serving's JSON of a ``SignatureDef``
(proto3 JSON: int64 sizes as strings, enums by name, every field written).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wuliang.serving.model import ServedVersion

__all__ = ["METHOD", "PAD_ID", "PAD_STRING", "Signature", "TensorSpec", "signature"]

METHOD = "tensorflow/serving/predict"
PAD_ID = -1  # pads a row of int64 ids (as unsigned: the type's largest value)
PAD_STRING = b""  # pads a row of strings


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # TensorFlow's name: "DT_FLOAT", "DT_INT64", "DT_STRING"
    shape: tuple[int, ...]  # -1: any size

    def json(self, name: str) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "tensor_shape": {
                "dim": [{"size": str(size), "name": ""} for size in self.shape],
                "unknown_rank": False,
            },
            "name": name,
        }


@dataclass(frozen=True)
class Signature:
    name: str  # "serving_default"
    inputs: dict[str, TensorSpec] = field(default_factory=dict)
    outputs: dict[str, TensorSpec] = field(default_factory=dict)

    def json(self) -> dict[str, Any]:
        """The ``SignatureDef`` as TensorFlow Serving writes it in JSON."""
        return {
            "inputs": {n: s.json(f"{self.name}_{n}:0") for n, s in sorted(self.inputs.items())},
            "outputs": {n: s.json(f"{n}:0") for n, s in sorted(self.outputs.items())},
            "method_name": METHOD,
            "defaults": {},
        }


def signature(served: ServedVersion) -> Signature:
    """The signature of a served version (see the module docstring)."""
    description = served.model
    inputs = {
        f.name: TensorSpec("DT_INT64" if f.hash_field is None else "DT_STRING", (-1, -1))
        for f in description.sparse
    }
    inputs.update({f.name: TensorSpec("DT_FLOAT", (-1, f.dim)) for f in description.dense})
    tower = served.tower
    outputs = {}
    if tower is not None:
        shapes = getattr(tower, "outputs", {"predictions": [-1]})
        outputs = {name: TensorSpec("DT_FLOAT", tuple(shape)) for name, shape in shapes.items()}
    return Signature(description.signature, inputs, outputs)
