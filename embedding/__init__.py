"""Embedding tables and features, and the TensorFlow bridge.

Import as ``wuliang.embedding`` (``EmbeddingTable``, ``SparseFeature`` and
``DenseFeature`` are also at ``wuliang.*``). The bridge (``bridge.py``) and
``concat`` (``ops.py``, for towers) need TensorFlow and are imported on first
use. ``wuliang.embedding.pooling`` pools looked-up rows as the bridge does, in
numpy, for serving without TensorFlow.
"""

from typing import Any

from wuliang.embedding.features import DenseFeature, EmbeddingTable, Sizes, SparseFeature

__all__ = ["DenseFeature", "EmbeddingTable", "Sizes", "SparseFeature", "concat"]


def __getattr__(name: str) -> Any:
    if name == "concat":
        from wuliang.embedding.ops import concat

        return concat
    raise AttributeError(f"module 'wuliang.embedding' has no attribute {name!r}")
