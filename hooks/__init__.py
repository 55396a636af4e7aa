"""Hooks: the SessionRunHook protocol (TensorFlow's names) and standard hooks.

Import as ``wuliang.hooks``.
"""

from wuliang.hooks.base import (
    HookSession,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from wuliang.hooks.checkpoint import Checkpoint
from wuliang.hooks.evict import Evict
from wuliang.hooks.export import IncrementalExport
from wuliang.hooks.periodic import PeriodicSyncHook
from wuliang.hooks.progressive import ProgressiveValidation
from wuliang.hooks.standard import (
    Eval,
    Logging,
    NanGuard,
    ProgressBar,
    SizeStats,
    StopAtStep,
    Summary,
    Timeline,
)

RunArgs = SessionRunArgs  # the short name

__all__ = [
    "Checkpoint",
    "Eval",
    "Evict",
    "HookSession",
    "IncrementalExport",
    "Logging",
    "NanGuard",
    "PeriodicSyncHook",
    "ProgressBar",
    "ProgressiveValidation",
    "RunArgs",
    "SessionRunArgs",
    "SessionRunContext",
    "SessionRunHook",
    "SessionRunValues",
    "SizeStats",
    "StopAtStep",
    "Summary",
    "Timeline",
]
