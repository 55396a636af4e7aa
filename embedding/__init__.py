"""Embedding tables and features, and the TensorFlow bridge.

Import as ``wuliang.embedding`` (``EmbeddingTable``, ``SparseFeature`` and
``DenseFeature`` are also at ``wuliang.*``). The bridge (``bridge.py``) needs
TensorFlow and is imported on first use.
"""

from wuliang.embedding.features import DenseFeature, EmbeddingTable, SparseFeature

__all__ = ["DenseFeature", "EmbeddingTable", "SparseFeature"]
