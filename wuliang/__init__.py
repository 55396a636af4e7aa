"""wuliang: training and serving for large-scale recommendation models.

TensorFlow runs the dense towers; a C++ parameter server holds the embeddings.
See DESIGN.md and README.md. Sub-packages are imported on first use, so
``import wuliang`` stays cheap for processes that need only the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("admission", "eviction", "initializers", "optimizers", "ps_server", "reader")

__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"wuliang.{name}")
    raise AttributeError(f"module 'wuliang' has no attribute {name!r}")
