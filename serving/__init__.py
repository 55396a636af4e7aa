"""Online serving of exported models: ``wuliang serve`` and ``wuliang publish``.

A serving process answers embedding lookups and full predictions of the
newest export over gRPC (``serving.proto``) and HTTP/JSON (TensorFlow
Serving's REST shapes), and applies each new version while it answers, each
answer from one version. ``docs/serving.md`` describes it all.

Public names (imported on first use, so ``import wuliang.serving`` stays
cheap and never imports TensorFlow or grpcio)::

    from wuliang.serving import Client, ServingClientError   # the Python client (gRPC)
    from wuliang.serving import ModelStore, RedisModelStore  # served models
    from wuliang.serving import VersionedModel, VersionPolicy  # several versions
    from wuliang.serving import Service, GrpcServer, HttpServer, ServerTls

Modules:

* ``model``: the ``ServedModel`` protocol both stores implement, and
  ``ServedVersion`` (a version's snapshot: description and tower);
* ``store``: ``ModelStore``, an export directory in an embedded engine,
  following new versions (``versions``: applying a chain to an engine);
* ``versioned``: ``VersionedModel``, the versions a ``VersionPolicy`` keeps
  (a ``ModelStore`` each) and labels; ``model_config``: several models from
  TensorFlow Serving's model config file, followed on SIGHUP;
* ``redis.model``: ``RedisModelStore``, a published model read from Redis
  (``redis.replica``: the replica's reader and its cache ``redis.cache``;
  ``redis.publish``: ``wuliang publish``; ``redis.keys``: the key layout);
* ``service``: the transport-neutral ``Service`` (tokens, limits, metrics,
  one version per request), with ``predict`` (pooling and the tower) and
  ``features`` (keys from integers, digit strings and raw strings);
* ``grpc.server``, ``http.server`` (``http.codec``), ``client``: transports
  and the Python client; ``tls``: one ``ServerTls`` for both servers;
* ``tfs``: TensorFlow Serving's gRPC API (its messages, tensors, metadata,
  model config), and ``signature``: a version's ``serving_default``;
* ``run``: the ``wuliang serve`` process; ``metrics``: Prometheus.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "Client": "wuliang.serving.client",
    "ServingClientError": "wuliang.serving.client",
    "ModelStore": "wuliang.serving.store",
    "VersionedModel": "wuliang.serving.versioned",
    "VersionPolicy": "wuliang.serving.versioned",
    "RedisModelStore": "wuliang.serving.redis.model",
    "RedisStore": "wuliang.serving.redis.replica",
    "publish": "wuliang.serving.redis.publish",
    "ServedModel": "wuliang.serving.model",
    "ServedVersion": "wuliang.serving.model",
    "Service": "wuliang.serving.service",
    "FeatureInput": "wuliang.serving.predict",
    "PredictAnswer": "wuliang.serving.predict",
    "GrpcServer": "wuliang.serving.grpc.server",
    "HttpServer": "wuliang.serving.http.server",
    "ServerTls": "wuliang.ps_server.rpc.tls",
    "TlsError": "wuliang.ps_server.rpc.tls",
    "ServingError": "wuliang.serving.errors",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'wuliang.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_NAMES])
