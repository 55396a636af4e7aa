"""A published model in Redis or a Redis Cluster, for a fleet of serving
replicas (``docs/export.md``, "Redis store for a fleet").

Modules:

* ``publish``: ``wuliang publish``, a version of an export directory
  written into Redis (full copies, deltas on top, retention);
* ``keys``: the key layout (generations of cells, sentinels, the pointer);
  ``cells``: a cell's entries, decoded and rewritten with numpy;
* ``nodes``: one Redis or a cluster's nodes, one pipelined round per node;
* ``replica``: ``RedisStore``, a replica's reader following the pointer,
  with its hot-row cache ``cache``;
* ``model``: ``RedisModelStore``, the ``ServedModel`` a replica serves.
"""
