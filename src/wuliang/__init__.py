"""wuliang: training and serving for large-scale recommendation models.

TensorFlow runs the dense towers; a C++ parameter server holds the embeddings.
See README.md and docs/architecture.md. Names are imported on first use, so
``import wuliang`` stays cheap (and TensorFlow-free) for processes that need
only the engine or the reader::

    import wuliang as wl
    table = wl.EmbeddingTable("item", dim=16, optimizer=wl.optimizers.Adagrad(0.05))
    est = wl.Estimator(tower, [wl.SparseFeature("item_id", table)], label="click")
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = (
    "admission",
    "embedding",
    "checkpoint",
    "eviction",
    "export",
    "hooks",
    "initializers",
    "metrics",
    "optimizers",
    "ps_server",
    "reader",
    "serving",
)
_NAMES = {
    "Context": "wuliang.context",
    "Session": "wuliang.session",
    "Estimator": "wuliang.estimator",
    "EmbeddingTable": "wuliang.embedding.features",
    "SparseFeature": "wuliang.embedding.features",
    "DenseFeature": "wuliang.embedding.features",
    "Sizes": "wuliang.embedding.features",
}

__all__ = ["__version__", *_SUBMODULES, *_NAMES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"wuliang.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'wuliang' has no attribute {name!r}")
