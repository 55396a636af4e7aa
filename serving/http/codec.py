"""JSON in and out of the HTTP/JSON transport (TensorFlow Serving's REST
shapes): request bodies to feature arrays and keys, results to JSON-ready
values. Each value's type is checked before it becomes an array, so a string
where a number belongs, a float key, a bool, a nested list or a number
outside float32 is an ``InvalidArgument`` naming the field, row and feature.
Keys follow ``features`` (integers, strings of digits, and the raw strings
of features trained on hashed strings).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from wuliang.ps_server.storage import ModelDescription, SparseInput
from wuliang.serving.errors import InvalidArgument
from wuliang.serving.features import describe, parse_keys, sparse_keys
from wuliang.serving.predict import FeatureInput

__all__ = [
    "PredictRequest",
    "document",
    "lookup_keys",
    "per_row",
]

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_NUMBER = frozenset((int, float))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number (NaN and Infinity are refused)")


def document(body: bytes, fields: Mapping[str, str]) -> dict[str, Any]:
    """The request body as a JSON object; ``fields``: the names it may hold."""
    if not body:
        raise InvalidArgument("the request body is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidArgument(
            f"the request body is not UTF-8 (byte {error.start}: {error.reason})"
        ) from None
    try:
        document = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise InvalidArgument("the request body's JSON nests too deeply") from None
    except ValueError as error:  # JSONDecodeError, NaN, an integer of 4,300+ digits
        raise InvalidArgument(f"the request body is not valid JSON: {error}") from None
    if type(document) is not dict:
        raise InvalidArgument(f"the request body must be a JSON object, got {describe(document)}")
    unknown = sorted(set(document) - set(fields))
    if unknown:
        known = ", ".join(f"{name!r} ({why})" for name, why in fields.items())
        raise InvalidArgument(f"unknown field {unknown[0]!r} in the request; fields: {known}")
    return document


def _floats(
    values: list[Any], what: str, per_row: int = 1, offsets: list[int] | None = None
) -> np.ndarray:
    """JSON numbers as float32, each finite and within float32's range;
    ``per_row`` values make a row, or ``offsets`` (CSR) say which values a
    row has (errors name the row)."""
    if not set(map(type, values)) <= _NUMBER:
        i = next(i for i, v in enumerate(values) if type(v) not in _NUMBER)
        raise InvalidArgument(
            f"{what}, row {_row(i, per_row, offsets)}: expected a number, got {describe(values[i])}"
        )
    try:
        array = np.array(values, np.float64)
    except OverflowError:  # an integer beyond a double
        i = next(i for i, v in enumerate(values) if type(v) is int and abs(v) > _FLOAT32_MAX)
        raise InvalidArgument(
            f"{what}, row {_row(i, per_row, offsets)}: {values[i]} is outside float32's range"
        ) from None
    bad = np.flatnonzero(~(np.abs(array) <= _FLOAT32_MAX))  # inf (1e999) or beyond float32
    if len(bad):
        i = int(bad[0])
        raise InvalidArgument(
            f"{what}, row {_row(i, per_row, offsets)}: {values[i]} is not a finite float32"
        )
    return array.astype(np.float32)


def _row(index: int, per_row: int, offsets: list[int] | None) -> int:
    """The row of a value: ``per_row`` values a row, or as CSR ``offsets`` say."""
    if offsets is None:
        return index // per_row
    return int(np.searchsorted(offsets, index, side="right")) - 1


def _sparse(feature: SparseInput, column: list[Any]) -> FeatureInput:
    """One sparse feature's per-row values as CSR keys (and weights)."""
    name = feature.name
    what = f"sparse feature {name!r}"
    keys: list[Any] = []
    offsets = [0]
    weights: list[Any] | None = None
    for row, value in enumerate(column):
        kind = type(value)
        if kind is list:
            keys.extend(value)
        elif kind is dict:
            unknown = sorted(set(value) - {"keys", "weights"})
            if unknown or "keys" not in value:
                raise InvalidArgument(
                    f"{what}, row {row}: an object must hold 'keys' and optionally 'weights', "
                    f"got {describe(value)}"
                )
            row_keys = value["keys"]
            row_keys = row_keys if type(row_keys) is list else [row_keys]
            row_weights = value.get("weights")
            if row_weights is not None:
                if type(row_weights) is not list or len(row_weights) != len(row_keys):
                    raise InvalidArgument(
                        f"{what}, row {row}: 'weights' must be a list of {len(row_keys)} "
                        f"numbers (one per key), got {describe(row_weights)}"
                    )
                if weights is None:
                    weights = [1.0] * len(keys)
                weights.extend(row_weights)
            keys.extend(row_keys)
        else:  # a key (_keys checks it)
            keys.append(value)
        if weights is not None and len(weights) < len(keys):  # unweighted: 1 each
            weights.extend([1.0] * (len(keys) - len(weights)))
        offsets.append(len(keys))
    values = sparse_keys(keys, feature, what, offsets)
    weight_array = None
    if weights is not None:
        weight_array = _floats(weights, f"{what} weights", offsets=offsets)
    return FeatureInput(values, np.array(offsets, np.int64), weight_array)


def _dense(name: str, column: list[Any], dim: int) -> FeatureInput:
    """One dense feature's per-row values as float32 [rows, dim]."""
    what = f"dense feature {name!r}"
    flat: list[Any] = []
    for row, value in enumerate(column):
        kind = type(value)
        if kind is list and len(value) == dim:
            flat.extend(value)
        elif (kind is int or kind is float) and dim == 1:
            flat.append(value)
        else:
            raise InvalidArgument(
                f"{what}, row {row}: expected {'a number or ' if dim == 1 else ''}a list of "
                f"{dim} number{'s' if dim > 1 else ''}, got {describe(value)}"
            )
    return FeatureInput(_floats(flat, what, dim).reshape(len(column), dim))


def _columns(
    document: dict[str, Any], names: list[str], check_rows: Callable[[int], None]
) -> tuple[dict, int, bool]:
    """The features of a prediction request, one list of per-row values each:
    (columns, rows, row format); ``check_rows`` bounds the rows before the
    values are read."""
    if ("instances" in document) == ("inputs" in document):
        raise InvalidArgument(
            "a prediction needs exactly one of 'instances' (row format: one object per row) "
            "and 'inputs' (column format: feature name -> one value per row)"
        )
    known = f"features: {', '.join(names)}"
    if "instances" in document:
        instances = document["instances"]
        if type(instances) is not list:
            raise InvalidArgument(
                f"'instances' must be an array of rows, got {describe(instances)}"
            )
        rows = len(instances)
        check_rows(rows)
        columns: dict[str, list[Any]] = {name: [] for name in names}
        if len(names) == 1 and rows and type(instances[0]) is not dict:
            # one input: each instance is its value, as TF Serving reads it
            columns[names[0]] = instances
            instances = []
        for row, instance in enumerate(instances):
            if type(instance) is not dict:
                raise InvalidArgument(
                    f"instances[{row}] must be an object (feature name -> value), got "
                    f"{describe(instance)}"
                )
            try:
                for name, column in columns.items():
                    column.append(instance[name])
            except KeyError as error:
                raise InvalidArgument(
                    f"instances[{row}] has no feature {error.args[0]!r} ({known})"
                ) from None
            if len(instance) != len(names):
                extra = sorted(set(instance) - set(names))[0]
                raise InvalidArgument(
                    f"instances[{row}]: the model has no feature {extra!r} ({known})"
                )
        row_format = True
    else:
        inputs = document["inputs"]
        if len(names) == 1 and type(inputs) is list:  # one input: its values, as TF Serving
            inputs = {names[0]: inputs}
        if type(inputs) is not dict:
            raise InvalidArgument(
                f"'inputs' must be an object (feature name -> one value per row), got "
                f"{describe(inputs)}"
            )
        unknown = sorted(set(inputs) - set(names))
        if unknown:
            raise InvalidArgument(f"inputs: the model has no feature {unknown[0]!r} ({known})")
        missing = [name for name in names if name not in inputs]
        if missing:
            raise InvalidArgument(f"inputs: feature {missing[0]!r} is missing ({known})")
        columns = {}
        rows = -1
        for name in names:
            column = inputs[name]
            if type(column) is not list:
                raise InvalidArgument(
                    f"inputs[{name!r}] must be an array of one value per row, got "
                    f"{describe(column)}"
                )
            check_rows(len(column))
            if rows >= 0 and len(column) != rows:
                raise InvalidArgument(
                    f"inputs[{name!r}] has {len(column)} rows, inputs[{names[0]!r}] has {rows}"
                )
            rows = len(column)
            columns[name] = column
        row_format = False
    if rows == 0:
        raise InvalidArgument("the request has no rows")
    return columns, rows, row_format


def per_row(values: np.ndarray) -> np.ndarray:
    """An output's values, a number per row when it has one per row."""
    if values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    return np.ascontiguousarray(values, np.float32)


def lookup_keys(body: bytes, check_keys: Callable[[int], None]) -> np.ndarray:
    """The keys of a lookup body ``{"keys": [...]}`` as uint64 (integers and
    strings of digits); ``check_keys`` bounds their number before they are read."""
    doc = document(body, {"keys": "an array of keys"})
    if "keys" not in doc:
        raise InvalidArgument("a lookup needs 'keys': an array of keys")
    keys = doc["keys"]
    if type(keys) is not list:
        raise InvalidArgument(f"'keys' must be an array of keys, got {describe(keys)}")
    check_keys(len(keys))
    return parse_keys(keys, "keys")


class PredictRequest:
    """A prediction body, decoded with the model description of the version
    that answers it: ``decode`` is the ``Service.predict`` decoder, and
    ``row_format`` says in which format to answer (``instances`` or ``inputs``)."""

    def __init__(self, body: bytes, check_rows: Callable[[int], None]) -> None:
        self.body = body
        self.check_rows = check_rows
        self.row_format = True

    def decode(self, description: ModelDescription) -> tuple[dict[str, FeatureInput], int]:
        signature = description.signature
        doc = document(
            self.body,
            {
                "instances": "row format",
                "inputs": "column format",
                "signature_name": f"optional, {signature!r}",
            },
        )
        if doc.get("signature_name", signature) != signature:
            raise InvalidArgument(
                f"signature_name must be {signature!r}, got {describe(doc['signature_name'])}"
            )
        names = description.feature_names
        columns, rows, self.row_format = _columns(doc, names, self.check_rows)
        features = {f.name: _sparse(f, columns[f.name]) for f in description.sparse}
        features.update({f.name: _dense(f.name, columns[f.name], f.dim) for f in description.dense})
        return features, rows

    def answer(self, outputs: Mapping[str, np.ndarray], version: int) -> dict[str, Any]:
        """The JSON-ready answer: ``predictions`` (row format) or ``outputs``."""
        shown = {name: per_row(values) for name, values in sorted(outputs.items())}
        model_version = str(version)
        if self.row_format:
            if len(shown) == 1:
                (predictions,) = shown.values()
            else:
                names = list(shown)
                rows = zip(*shown.values(), strict=True)
                predictions = [dict(zip(names, row, strict=True)) for row in rows]
            return {"predictions": predictions, "model_version": model_version}
        return {
            "outputs": next(iter(shown.values())) if len(shown) == 1 else shown,
            "model_version": model_version,
        }
