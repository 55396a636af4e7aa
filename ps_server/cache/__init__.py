"""The GPU hot cache: ``CachedServer``, a ``ParameterServer`` that keeps
the hottest rows of each table in device arrays (cupy where a GPU is
present, numpy otherwise) in front of any other parameter server.

* ``server``: ``CachedServer`` (the per-step flow, write-back);
* ``policy``: ``HotSet``, the host-side key → slot index and the admission
  and eviction policy (decayed show counts or LRU);
* ``kernels``: the device kernels (gather, scatter, the engine's optimizer
  updates) with their numpy twins, and the array module.

See docs/gpu_cache.md.
"""

from wuliang.ps_server.cache.kernels import array_module, gpu_available
from wuliang.ps_server.cache.policy import POLICIES, HotSet, KeyIndex, Plan
from wuliang.ps_server.cache.server import CachedServer

__all__ = [
    "POLICIES",
    "CachedServer",
    "HotSet",
    "KeyIndex",
    "Plan",
    "array_module",
    "gpu_available",
]
