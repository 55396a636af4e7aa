"""Initial embedding values: deterministic functions of (table seed, key)."""

from wuliang.ps_server.spec import Constant, Initializer, Normal, TruncatedNormal, Uniform, Zeros

__all__ = ["Constant", "Initializer", "Normal", "TruncatedNormal", "Uniform", "Zeros"]
