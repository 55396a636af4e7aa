"""Test-only crash points: the tests SIGKILL writers at named points of a
write, to check that a crash anywhere leaves every committed version intact.

``WULIANG_TEST_CRASH_AT=<point>[:<n>]``, read once at import, makes the
process print ``WULIANG_TEST_CRASH_AT reached <point>:<n>`` on stdout the
n-th time (default 1) a writer reaches that point, and block there (the test
kills it; it exits by itself after ``BLOCK_S``); a value naming no point is
a ValueError at import. Unset, ``crash_point`` returns at once. The points,
in the order a write reaches them:

* ``writer-open``: the ``.tmp-`` directory exists, nothing is in it;
* ``rows-file``: a rows part file is written and recorded (n: the n-th);
* ``before-manifest``: every file is written, the manifest is not;
* ``before-rename``: the manifest is written and synced, the directory is
  still ``.tmp-`` (not in an object store: its manifest commits the version);
* ``after-rename``: the version is in place; the caller's follow-up (a
  checkpoint's rotation, an export's ``LATEST``) has not run;
* ``checkpoint-rotate`` (``wuliang.checkpoint``): an old checkpoint is
  renamed out of sight (in an object store: its manifest is deleted), not
  yet removed;
* ``latest-temp`` (``wuliang.export``): the new ``LATEST`` is written to its
  temporary file, not yet renamed over ``LATEST`` (not in an object store,
  where ``LATEST`` is uploaded whole);
* ``export-prune`` (``wuliang.export.prune``): an old export version is
  renamed out of sight (in an object store: its manifest is deleted), not
  yet removed.

The engine's disk tier (C++, docs/disk_tier.md) has points of its own, read
from the same variable by each engine with a disk tier when it starts:

* ``tier-demote``: a demoted row's record is appended, its locator not set;
* ``tier-promote``: a call's cold records are read, not installed in RAM;
* ``tier-compact``: a file's live records are appended again, the file not
  dropped;
* ``tier-demote-idle``: a shard's worker is about to demote rows between
  calls (the call that left it over its budget has returned).
"""

from __future__ import annotations

import os
import sys
import time

CRASH_ENV = "WULIANG_TEST_CRASH_AT"
CRASH_POINTS = (
    "writer-open",
    "rows-file",
    "before-manifest",
    "before-rename",
    "after-rename",
    "checkpoint-rotate",
    "latest-temp",
    "export-prune",
)
# the engine's (C++)
TIER_POINTS = ("tier-demote", "tier-promote", "tier-compact", "tier-demote-idle")
BLOCK_S = 600.0  # a crashed-on-purpose process nobody kills exits after this


def _crash_at(value: str | None) -> tuple[str, int] | None:
    """``<point>[:<n>]`` of the environment variable, or None when unset."""
    if not value:
        return None
    point, _, n = value.partition(":")
    if point not in CRASH_POINTS + TIER_POINTS or (n and (not n.isdigit() or int(n) < 1)):
        raise ValueError(
            f"{CRASH_ENV}={value!r}: expected <point>[:<n>], n >= 1, "
            f"point one of {', '.join(CRASH_POINTS + TIER_POINTS)}"
        )
    return point, int(n or 1)


_CRASH_AT = _crash_at(os.environ.get(CRASH_ENV))
_hits = 0


def crash_point(name: str) -> None:
    """Announces and blocks at the point ``WULIANG_TEST_CRASH_AT`` names,
    its n-th time; returns at once when the variable is unset."""
    global _hits
    if _CRASH_AT is None or name != _CRASH_AT[0]:
        return
    _hits += 1
    if _hits != _CRASH_AT[1]:
        return
    print(f"{CRASH_ENV} reached {name}:{_hits}", flush=True)
    sys.stderr.flush()
    time.sleep(BLOCK_S)  # the test SIGKILLs us here
    os._exit(70)  # never go on writing after a crash point
