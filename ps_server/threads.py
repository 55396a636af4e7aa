"""Scheduling of the background threads that feed TensorFlow.

A training step keeps every core busy with TensorFlow's intra-op threads,
which split each matmul into one chunk per thread. A background thread that
wakes up meanwhile (an engine shard creating rows, the pusher summing
gradients, a reader thread decoding the next file) preempts one of them, and
the other cores then wait for the delayed chunk, so on a small machine each
millisecond of background work costs more than a millisecond of step time.

``Context(background="idle")`` (opt-in) runs those threads under Linux's
``SCHED_IDLE`` policy: they never preempt a thread of normal priority and run
on cores that would otherwise idle, which TensorFlow leaves often enough
(between ops, while the step's Python runs, whenever the step waits for the
pipeline). It pays off on a trainer that has the machine to itself (measured
figures in ``docs/performance.md``). It is not the default because on a
machine shared with other busy processes those threads get almost no CPU
(``SCHED_IDLE`` weighs 3 against 1024), so training stalls, and because an
unprivileged process cannot undo it (leaving ``SCHED_IDLE`` needs
``CAP_SYS_NICE``). It is set only on threads started for the purpose and on
the workers of an engine the context owns; threads a library starts lazily
from one of them inherit it (the worker of Arrow's I/O pool that Parquet
reading starts on first use is such a thread). ``"normal"`` (the default)
leaves every thread as the OS schedules it.
"""

from __future__ import annotations

import os

BACKGROUND = ("idle", "normal")


def check_background(value: object, who: str = "background") -> str:
    """Returns ``value`` if it is a known policy; else ValueError naming it."""
    if value not in BACKGROUND:
        raise ValueError(f"{who} must be 'idle' or 'normal', got {value!r}")
    return str(value)


def set_background(background: str, thread_id: int = 0) -> bool:
    """Applies the policy to a thread of this process (0: the calling one).

    Returns whether the thread now runs under it: ``"normal"`` leaves the
    thread as it is, and where ``SCHED_IDLE`` is not available or not
    permitted (another OS, a seccomp profile) it stays as it is too.
    """
    if background == "normal":
        return True
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # not permitted, or the thread has ended
        return False
    return True
