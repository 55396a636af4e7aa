"""The parameter server: embedding tables in a sharded C++ hash map.

Import as ``wuliang.ps_server``. ``ParameterServer`` is the interface that
everything above it uses (``interface``); ``parameter_server(address)``
picks the implementation (``factory``); ``Engine`` is the embedded one. See
``docs/ps_engine.md`` for the design.
"""

from wuliang.ps_server.engine import Engine
from wuliang.ps_server.factory import address_kind, parameter_server, register_backend
from wuliang.ps_server.interface import (
    Exchanged,
    ExchangePart,
    Handle,
    LookupResult,
    ParameterServer,
    PullPart,
    PushPart,
    PushResult,
    RowChunk,
    TableUpdate,
    UnknownTableError,
    as_keys,
)
from wuliang.ps_server.routing import server_of, shard_of
from wuliang.ps_server.spec import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Admission,
    Constant,
    Eviction,
    Grow,
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
    "ExchangePart",
    "Exchanged",
    "Grow",
    "Handle",
    "Initializer",
    "LookupResult",
    "Normal",
    "Optimizer",
    "ParameterServer",
    "PullPart",
    "PushPart",
    "PushResult",
    "RowChunk",
    "TableSpec",
    "TableUpdate",
    "TruncatedNormal",
    "Uniform",
    "UnknownTableError",
    "Zeros",
    "address_kind",
    "as_keys",
    "parameter_server",
    "register_backend",
    "server_of",
    "shard_of",
]
