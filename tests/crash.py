"""Crashing a writer on purpose: run a Python child that writes versions in a
loop, wait for its first one, then SIGKILL it somewhere inside a later one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

# A child's first lines: a session with table "t" (dim 16, Adagrad) holding
# 400,000 rows (keys 1..400000), as `session`, `engine` and `keys`.
SESSION_WITH_ROWS = """
import sys, numpy as np, keras, wuliang as wl
keras.utils.set_random_seed(1)
table = wl.EmbeddingTable("t", 16, optimizer=wl.optimizers.Adagrad(0.1))
mlp = keras.Sequential([keras.layers.Dense(1)])
session = wl.Session(lambda e, d: mlp(e["f"]), [wl.SparseFeature("f", table)], wl.Context())
engine = session.context.engine
keys = np.arange(1, 400_001, dtype=np.uint64)
engine.load("t", keys, np.ones((len(keys), 16), np.float32))
"""


def kill_mid_write(code: str, arg: str, cwd: Path, log: Path, delay: float) -> str:
    """Runs ``python -c code arg``; after its first stdout line, waits delay
    seconds and kills it. Returns that first line (asserted non-empty)."""
    with (
        open(log, "w") as stderr,
        subprocess.Popen(
            [sys.executable, "-c", code, arg],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=cwd,  # not the source tree: the installed package
        ) as child,
    ):
        try:
            assert child.stdout is not None
            line = child.stdout.readline().strip()
            assert line, f"the child wrote nothing:\n{log.read_text()[-3000:]}"
            time.sleep(delay)
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
    return line
