"""``wuliang launch``: the roles of a job as local processes. Every trainer
gets its own TF_CONFIG and reaches the servers through ``Context()``; lines
carry their role; a server killed with SIGKILL is started again and the
chief's next call reaches it; the job ends with the chief; Ctrl-C stops
every process. All waits are bounded."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TRAINER = """
import sys, time
from pathlib import Path
import numpy as np
import wuliang as wl

ctx = wl.Context()
c = ctx.cluster
print(f"role {c.task_type} {c.task_index} trainer {c.trainer_index} of {c.num_trainers} "
      f"servers {ctx.ps.num_servers} chief {c.is_chief}", flush=True)
table = wl.EmbeddingTable("t", dim=4)
ctx.create_table(table)  # every trainer creates it: the same spec is a no-op
keys = np.arange(10, dtype=np.uint64) + 100 * c.trainer_index
ctx.ps.pull("t", keys)
if c.is_chief:
    go, deadline = Path(sys.argv[1]), time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    ctx.ps.create_table(table.spec())  # a restarted server starts empty
    ctx.ps.pull("t", keys)  # retried while a server restarts
    print("chief done, rows", ctx.ps.stats("t")["rows"], flush=True)
ctx.close()
"""


class Launch:
    """A running ``wuliang launch``: its lines, read on a thread."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CONFIG")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wuliang", "launch", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.fresh: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.fresh.put(line.rstrip("\n"))
        self.proc.stdout.close()

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """The first line (seen so far or next) matching ``pattern``."""
        for line in list(self.lines):
            if found := re.search(pattern, line):
                return found
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.fresh.get(timeout=0.2)
            except queue.Empty:
                continue
            if found := re.search(pattern, line):
                return found
        raise AssertionError(f"no line matches {pattern!r}:\n" + "\n".join(self.lines[-40:]))

    def wait_for(self, pattern: str, count: int, timeout: float = 60.0) -> None:
        """Until ``count`` lines match ``pattern``."""
        deadline = time.monotonic() + timeout
        while sum(bool(re.search(pattern, line)) for line in list(self.lines)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {count} lines match {pattern!r}")
            time.sleep(0.05)

    def pids(self) -> list[int]:
        return [int(m) for line in self.lines for m in re.findall(r"\(pid (\d+)\)", line)]


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    started: list[Launch] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
        run.proc.wait(timeout=30)
        run.reader.join(timeout=30)
        for pid in run.pids():  # nothing is left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_job_runs_restarts_a_killed_server_and_ends_with_its_chief(
    tmp_path: Path, launches: list[Launch]
) -> None:
    script, go = tmp_path / "train.py", tmp_path / "go"
    script.write_text(TRAINER)
    run = Launch("--ps", "2", "--workers", "1", "--", sys.executable, str(script), str(go))
    launches.append(run)
    run.expect(r"^\[chief-0\] role chief 0 trainer 0 of 2 servers 2 chief True$")
    run.expect(r"^\[worker-0\] role worker 0 trainer 1 of 2 servers 2 chief False$")
    run.expect(r"^\[launch\] worker-0 finished$")
    for i in (0, 1):
        run.expect(rf"^\[ps-{i}\] parameter server listening on grpc 127\.0\.0\.1:\d+ ")
    old = int(run.expect(r"^\[launch\] started ps-0 \(pid (\d+)\)$")[1])
    os.kill(old, signal.SIGKILL)
    run.expect(
        r"^\[launch\] ps-0 exited \(signal 9\); restarting \(1 of 10 within 600 s, 1 in all\)$"
    )
    run.wait_for(r"^\[ps-0\] parameter server listening", count=2)  # the new ps-0 serves
    go.touch()
    run.expect(r"^\[chief-0\] chief done, rows \d+$", timeout=120)
    assert run.proc.wait(timeout=60) == 0, "\n".join(run.lines[-30:])
    assert len(run.pids()) == 5  # ps-0 twice, ps-1, chief, worker
    assert not [p for p in run.pids() if alive(p)], "processes left running"


def test_ctrl_c_stops_every_process(tmp_path: Path, launches: list[Launch]) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    run = Launch("--ps", "1", "--", sys.executable, str(script), str(tmp_path / "never"))
    launches.append(run)
    run.expect(r"^\[chief-0\] role chief 0 trainer 0 of 1 servers 1 chief True$")
    run.proc.send_signal(signal.SIGINT)
    assert run.proc.wait(timeout=60) == 130
    run.expect(r"^\[launch\] SIGINT: stopping every process$")
    assert not [p for p in run.pids() if alive(p)], "processes left running"


def test_a_trainer_that_keeps_failing_stops_the_job(tmp_path: Path, launches: list[Launch]) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys; print('failing', flush=True); sys.exit(3)\n")
    run = Launch("--ps", "0", "--max-restarts", "2", "--", sys.executable, str(script))
    launches.append(run)
    assert run.proc.wait(timeout=60) == 1
    run.expect(
        r"^\[launch\] chief-0 exited \(status 3\); restarting \(1 of 2 within 600 s, 1 in all\)$"
    )
    run.expect(
        r"^\[launch\] chief-0 exited \(status 3\); restarting in 1 s "
        r"\(2 of 2 within 600 s, 2 in all\)$"
    )
    run.expect(
        r"^\[launch\] error: chief-0 failed \(status 3\) 3 times within 600 s; stopping the job$"
    )
    assert sum(line == "[chief-0] failing" for line in run.lines) == 3


def test_failures_spread_wider_than_the_window_never_stop_the_job(
    tmp_path: Path, launches: list[Launch]
) -> None:
    """Preemptions over a long job: one failure per window, many in all."""
    script, count = tmp_path / "flaky.py", tmp_path / "count"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        f"p = Path({str(count)!r})\n"
        "n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1))\n"
        "print('run', n, flush=True)\n"
        "time.sleep(1.2)\n"
        "sys.exit(0 if n == 4 else 9)\n"
    )
    run = Launch(
        "--ps", "0", "--max-restarts", "1", "--restart-window", "1", "--",
        sys.executable, str(script),
    )  # fmt: skip
    launches.append(run)
    assert run.proc.wait(timeout=60) == 0, "\n".join(run.lines[-20:])
    run.expect(
        r"^\[launch\] chief-0 exited \(status 9\); restarting \(1 of 1 within 1 s, 4 in all\)$"
    )
    run.expect(r"^\[launch\] chief-0 finished$")


def test_usage_errors() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for args, message in (
        (["--ps", "1"], "give the trainer's command after --"),
        (["--no-chief", "--", "python", "x.py"], "nobody trains"),
        (["--recovery", "full", "--", "python", "x.py"], "give --model-dir"),
        (["--restart-window", "0", "--", "python", "x.py"], "--restart-window must be > 0"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "wuliang", "launch", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr
