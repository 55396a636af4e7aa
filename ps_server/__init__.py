"""The parameter-server engine: embedding tables in a sharded C++ hash map.

Import as ``wuliang.ps_server``. See ``docs/ps_engine.md`` for the design.
"""

from wuliang.ps_server.engine import (
    Engine,
    PullPart,
    PushPart,
    PushResult,
    RowChunk,
    UnknownTableError,
    as_keys,
    server_of,
    shard_of,
)
from wuliang.ps_server.spec import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Admission,
    Constant,
    Eviction,
    Initializer,
    Normal,
    Optimizer,
    TableSpec,
    TruncatedNormal,
    Uniform,
    Zeros,
)

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "Adam",
    "Admission",
    "Constant",
    "Engine",
    "Eviction",
    "Initializer",
    "Normal",
    "Optimizer",
    "PullPart",
    "PushPart",
    "PushResult",
    "RowChunk",
    "TableSpec",
    "TruncatedNormal",
    "Uniform",
    "UnknownTableError",
    "Zeros",
    "as_keys",
    "server_of",
    "shard_of",
]
