"""Scheduling of the background threads that feed TensorFlow.

A training step keeps every core busy with TensorFlow's intra-op threads,
which split each matmul into one chunk per thread. A background thread that
wakes up meanwhile (an engine shard creating rows, the pusher summing
gradients, a reader thread decoding the next file) preempts one of them, and
the other core then waits for the delayed chunk: on the 2-core benchmark
machine each millisecond of background work cost about 0.7 ms of step time
on top of itself.

``background="idle"`` (a ``Context`` setting, the default) runs those
threads under Linux's ``SCHED_IDLE`` policy: they never preempt a thread of
normal priority and run on cores that would otherwise idle, which TensorFlow
leaves often enough (between ops, while the step's Python runs, and whenever
the step waits for the pipeline). Measured in blocks of steps alternated in
one run (``benchmarks/train_bench.py``'s model): steps 11.5% shorter than
with normal priority; nice 19 gave 7.5%. The cost: on a machine shared with
other busy processes of normal priority, these threads get very little CPU
(``SCHED_IDLE`` is a weight of 3 against 1024), so training slows down more
than it would; use ``background="normal"`` there. The policy is one-way for
an unprivileged process (leaving ``SCHED_IDLE`` needs ``CAP_SYS_NICE``), so
it is set only on threads started for the purpose and on the workers of an
engine the context owns. Threads that a library starts lazily from one of
them inherit it: the worker of Arrow's I/O pool that Parquet reading starts
on first use is such a thread (it does the reader's background work).
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
