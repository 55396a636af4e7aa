"""The GPU hot cache: ``CachedServer``, a ``ParameterServer`` that keeps
the hottest rows of each table on the device (cupy where a GPU is present,
numpy otherwise) in front of any other parameter server.

* ``server``: ``CachedServer`` (the per-step flow, write-back);
* ``index``: ``SlotIndex``, every cached table's key → slot index and the
  policy (decayed show counts or LRU), set-associative, on the device;
* ``kernels``: the device kernels (the index's, gather, scatter, the
  engine's optimizer updates) with their CPU twins, and the array module;
* ``key_index``: ``KeyIndex``, a host hash map (serving's snapshots).

See docs/gpu_cache.md.
"""

from wuliang.ps_server.cache.index import POLICIES, Plan, SlotIndex
from wuliang.ps_server.cache.kernels import array_module, gpu_available
from wuliang.ps_server.cache.key_index import KeyIndex
from wuliang.ps_server.cache.server import CachedServer

__all__ = [
    "POLICIES",
    "CachedServer",
    "KeyIndex",
    "Plan",
    "SlotIndex",
    "array_module",
    "gpu_available",
]
