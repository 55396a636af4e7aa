"""Crashing a writer on purpose, at a named point of its write.

``wuliang.ps_server.storage.crash`` reads ``WULIANG_TEST_CRASH_AT=<point>[:<n>]`` at import
(test-only): the n-th time a writer reaches that point, the process prints
``WULIANG_TEST_CRASH_AT reached <point>:<n>`` and blocks. ``crash_at`` runs a
Python child with the variable set, waits for that line and SIGKILLs the
child there, so every crash lands exactly where the test asks, or the test
fails saying the child never got there.

``two_table_session`` and ``set_rows`` build the same model and rows in the
test and in its children, so that a checkpoint written by either one can be
checked against ``expected_rows``.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

TESTS = Path(__file__).resolve().parent
CRASH_ENV = "WULIANG_TEST_CRASH_AT"  # as wuliang.ps_server.storage.crash.CRASH_ENV
KEYS = np.arange(1, 2001, dtype=np.uint64)
DIMS = {"a": 4, "b": 3}  # "a": Adagrad (with optimizer state), "b": SGD (none)

# A child's first lines: the tests folder importable (for this module), the
# installed wuliang used (the child runs outside the source tree).
CHILD_PRELUDE = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
"""


def crash_at(
    code: str, args: list[str], point: str, cwd: Path, log: Path, timeout: float = 120
) -> list[str]:
    """Runs ``python -c code *args`` with ``WULIANG_TEST_CRASH_AT=point``;
    SIGKILLs it once it reports the point. Returns the lines it printed
    before. Fails if it exits or takes over ``timeout`` s without reaching
    the point."""
    marker = f"{CRASH_ENV} reached {point if ':' in point else point + ':1'}"
    env = {**os.environ, CRASH_ENV: point}
    lines: queue.Queue[str | None] = queue.Queue()
    with (
        open(log, "w") as stderr,
        subprocess.Popen(
            [sys.executable, "-c", CHILD_PRELUDE + code, *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=cwd,  # not the source tree: the installed package
            env=env,
        ) as child,
    ):

        def pump() -> None:
            assert child.stdout is not None
            for line in child.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)  # end of output: the child exited

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(
                        f"the child did not reach {point} in {timeout} s; printed {seen}"
                        f"\n{log.read_text()[-3000:]}"
                    ) from None
                if line is None:
                    child.wait(timeout=30)
                    raise AssertionError(
                        f"the child exited ({child.returncode}) without reaching {point}; "
                        f"printed {seen}\n{log.read_text()[-3000:]}"
                    )
                if line == marker:
                    break
                seen.append(line)
            child.send_signal(signal.SIGKILL)  # blocked at the point: killed there
            child.wait(timeout=30)
            assert child.returncode == -signal.SIGKILL, child.returncode
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
            reader.join(timeout=30)
    return seen


def two_table_session(ps: Any = None) -> Any:
    """A session with tables "a" (dim 4, Adagrad) and "b" (dim 3, SGD) and
    a one-layer tower; the same variables in every process. ``ps``: its
    parameter server (default: an embedded engine)."""
    import keras

    import wuliang as wl

    keras.utils.set_random_seed(1)
    a = wl.EmbeddingTable("a", DIMS["a"], optimizer=wl.optimizers.Adagrad(0.1))
    b = wl.EmbeddingTable("b", DIMS["b"], optimizer=wl.optimizers.SGD(0.1))
    dense = keras.layers.Dense(1)
    features = [wl.SparseFeature("a", a), wl.SparseFeature("b", b)]
    return wl.Session(
        lambda e, d: dense(wl.embedding.concat([e["a"], e["b"]])), features, wl.Context(ps)
    )


def weights_at(step: int, table: str, keys: np.ndarray) -> np.ndarray:
    """The vectors ``set_rows(step)`` gives keys (exact in float32)."""
    columns = np.arange(DIMS[table], dtype=np.float32) / 4
    return (keys.astype(np.float32)[:, None] / 1024 + step + columns).astype(np.float32)


def set_rows(session: Any, step: int) -> None:
    """Sets the session to step ``step`` with the rows of that step: every
    key in ``KEYS`` but ``step`` (erased: the removal log is not empty),
    vectors ``weights_at(step)``."""
    engine = session.context.engine
    for table in DIMS:
        engine.load(table, KEYS, weights_at(step, table, KEYS))
        engine.erase(table, np.array([step], np.uint64))
    session.context.global_step = step


def sorted_rows(chunks: Iterable[Any]) -> dict[str, np.ndarray]:
    """The columns of ``RowChunk`` s (at least one), concatenated and sorted by key."""
    chunks = list(chunks)
    names = ("keys", "weights", "state", "counts", "steps", "versions")
    columns = {n: np.concatenate([getattr(c, n) for c in chunks]) for n in names}
    order = np.argsort(columns["keys"], kind="stable")
    return {n: v[order] for n, v in columns.items()}


def expected_rows(step: int, table: str) -> tuple[np.ndarray, np.ndarray]:
    """(keys, vectors) of a table after ``set_rows(step)``, by key."""
    keys = np.setdiff1d(KEYS, np.array([step], np.uint64))
    return keys, weights_at(step, table, keys)
