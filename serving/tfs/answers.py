"""What TensorFlow Serving's model status and metadata calls answer, for
both transports (gRPC ``GetModelStatus`` / ``GetModelMetadata`` and REST
``GET /v1/models/{model}[/versions/{v}|/labels/{l}][/metadata]``).

* Status: one entry per version of the model (every version served, and
  with a ``specific`` policy those awaited or refused), each with
  TensorFlow Serving's state (``AVAILABLE``, ``LOADING``, ``END``) and a
  status (``OK``, or the error that refused it); before the first version,
  one entry of version 0, ``LOADING``, ``UNAVAILABLE``. A version or label
  asked for narrows it to that version (NOT_FOUND when the model has no
  such version, INVALID_ARGUMENT for an unknown label).
* Metadata: the model's name, the version that answers and its
  ``serving_default`` signature (``wuliang.serving.signature``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wuliang.serving.errors import InvalidArgument, NotFound
from wuliang.serving.service import Service
from wuliang.serving.signature import Signature, signature

__all__ = ["Metadata", "VersionState", "metadata", "model_status"]

METADATA_FIELD = "signature_def"


@dataclass(frozen=True)
class VersionState:
    version: int
    state: str  # AVAILABLE, LOADING, END
    error_code: str  # OK, UNAVAILABLE, UNKNOWN
    error_message: str

    def json(self) -> dict[str, Any]:
        return {
            "version": str(self.version),
            "state": self.state,
            "status": {"error_code": self.error_code, "error_message": self.error_message},
        }


@dataclass(frozen=True)
class Metadata:
    name: str
    version: int
    signature: Signature

    def json(self) -> dict[str, Any]:
        """``GetModelMetadataResponse`` as TensorFlow Serving writes it in JSON."""
        return {
            "model_spec": {"name": self.name, "signature_name": "", "version": str(self.version)},
            "metadata": {
                "signature_def": {"signature_def": {self.signature.name: self.signature.json()}}
            },
        }


def model_status(
    service: Service, model: str, version: int | None = None, label: str | None = None
) -> list[VersionState]:
    """The states of a model's versions (see the module docstring)."""
    store = service.store(model)
    (status,) = service.status(store.name)
    if label is not None:
        labels = getattr(store, "labels", {})
        if label not in labels:
            raise InvalidArgument(
                f"Unrecognized servable version label: {label} (model {store.name!r} labels: "
                f"{', '.join(sorted(labels)) or 'none'})"
            )
        version = labels[label]
    states = []
    for entry in status["versions"]:
        number, state, error = entry["version"], entry["state"], entry["error"]
        if number == 0:
            code, error = "UNAVAILABLE", f"no version loaded yet ({status['refused']} refused)"
        else:
            code = "OK" if not error else "UNKNOWN"
        states.append(VersionState(number, state, code, error))
    if version is not None:
        states = [s for s in states if s.version == version]
        if not states:
            raise NotFound(f"Could not find version {version} of model {store.name}")
    return states


def metadata(
    service: Service, model: str, version: int | None = None, label: str | None = None
) -> Metadata:
    """The metadata of the version a request names (default: the newest)."""
    store, served = service.select(model, version, label)
    return Metadata(store.name, served.number, signature(served))
