"""``wuliang launch``: a job's roles as local processes, as an orchestrator runs them.

``wuliang launch --ps 2 --workers 2 -- python train.py ...`` starts, on this
machine, what a TFJob starts on a cluster: N parameter servers (``wuliang
ps``), a chief and M workers (the command after ``--``), each with its own
``TF_CONFIG`` (free loopback ports; ``wuliang.ps_server.cluster`` reads it).
The servers start first; the trainers once every server has printed its
start line. Every line a process prints goes to this terminal prefixed
with its role (``[ps-1]``, ``[chief-0]``, ``[worker-0]``). With
``--model-dir`` each server, at every start, takes its part of the newest
checkpoint there (``wuliang ps --restore``): a server that died comes back
with the rows of that checkpoint, the others keep theirs.

Like ``restartPolicy: OnFailure``, a process that fails (a non-zero exit, a
signal) is started again with the same ``TF_CONFIG``. Restarts are budgeted
over a window, as systemd's ``StartLimitBurst`` within
``StartLimitIntervalSec``: a role that fails more than ``max_restarts``
times within ``restart_window`` seconds is in a crash loop and the job stops,
naming it; preemptions spread over a job's months never stop it. A role's
first failure within the window restarts at once, each further one after a
delay doubling from 1 s up to ``max_backoff`` (Kubernetes' CrashLoopBackOff),
so a crash loop does not spin. A trainer that exits 0 is done.

Recovery (``recovery``): ``"partial"`` (the default) restarts only the
role that failed: a server restores its part of the newest checkpoint and
the others keep their rows (updates since that checkpoint to the restarted
server's rows are lost, as Meta's CPR weighs it), a trainer resumes its
reader from the job board. ``"full"`` makes a job exact: any failure kills
every role and restarts them all from the newest checkpoint (servers, then
trainers, the chief restoring the checkpoint's reader positions), so no row
is trained twice or lost; the job retrains what came after that
checkpoint. The job
ends when the chief ends (or, without a chief, when every worker has): the
others get SIGTERM, then SIGKILL after ``grace`` seconds, and the launcher
exits with the chief's status. Ctrl-C or SIGTERM stops everything the same way (exit 130).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import IO

__all__ = ["LaunchOptions", "launch"]

RECOVERY = ("partial", "full")


@dataclass
class LaunchOptions:
    """What ``wuliang launch`` starts (``wuliang launch --help`` explains each)."""

    command: list[str]
    _: KW_ONLY
    ps: int = 1
    workers: int = 0
    chief: bool = True
    ps_threads: int = 2
    max_restarts: int = 10  # failures of one role within restart_window
    restart_window: float = 600.0  # seconds
    max_backoff: float = 30.0  # seconds
    recovery: str = "partial"  # or "full": any failure restarts every role from the checkpoint
    start_timeout: float = 60.0
    grace: float = 10.0
    model_dir: str | None = None  # servers restore their part of its newest checkpoint

    def check(self) -> None:
        if not self.command:
            raise ValueError("give the trainer's command after --, e.g. -- python train.py")
        if self.ps < 0 or self.workers < 0:
            raise ValueError("--ps and --workers must be >= 0")
        if not self.chief and self.workers == 0:
            raise ValueError("nobody trains: --no-chief needs --workers >= 1")
        if self.restart_window <= 0:
            raise ValueError(f"--restart-window must be > 0 seconds, got {self.restart_window:g}")
        if self.recovery not in RECOVERY:
            raise ValueError(
                f"--recovery must be one of {', '.join(RECOVERY)}, got {self.recovery!r}"
            )
        if self.recovery == "full" and self.model_dir is None:
            raise ValueError("--recovery full restores the newest checkpoint: give --model-dir")
        if self.max_backoff < 0:
            raise ValueError(f"--max-backoff must be >= 0 seconds, got {self.max_backoff:g}")


@dataclass
class _Role:
    kind: str  # "ps", "chief" or "worker"
    index: int
    command: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0  # over the job's life
    failures: list[float] = field(default_factory=list)  # monotonic times, within the window
    restart_at: float | None = None  # a restart waiting for its backoff
    done: bool = False  # a trainer that exited 0
    started: threading.Event = field(default_factory=threading.Event)  # a server's start line

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def cluster_of(options: LaunchOptions) -> dict[str, list[str]]:
    """The job's ``TF_CONFIG`` cluster on free loopback ports."""
    counts = {"chief": int(options.chief), "worker": options.workers, "ps": options.ps}
    ports = iter(_free_ports(sum(counts.values())))
    return {kind: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for kind, n in counts.items() if n}


class _Job:
    def __init__(self, options: LaunchOptions, out: IO[str]) -> None:
        self.options = options
        self.out = out
        self.out_lock = threading.Lock()
        self.cluster = cluster_of(options)
        server = [sys.executable, "-m", "wuliang", "ps", "--threads", str(options.ps_threads)]
        server += ["--host", "127.0.0.1"]
        if options.model_dir is not None:
            server += ["--restore", options.model_dir]
        self.roles = [
            _Role(kind, i, server if kind == "ps" else list(options.command), self._env(kind, i))
            for kind in ("ps", "chief", "worker")
            for i in range(len(self.cluster.get(kind, ())))
        ]
        self.stopping = threading.Event()

    def _env(self, kind: str, index: int) -> dict[str, str]:
        config = {"cluster": self.cluster, "task": {"type": kind, "index": index}}
        return {**os.environ, "TF_CONFIG": json.dumps(config), "PYTHONUNBUFFERED": "1"}

    def say(self, text: str) -> None:
        with self.out_lock:
            self.out.write(text if text.endswith("\n") else text + "\n")
            self.out.flush()

    def start(self, role: _Role) -> None:
        role.started.clear()
        role.proc = subprocess.Popen(
            role.command,
            env=role.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops them in order
        )
        self.say(f"[launch] started {role.name} (pid {role.proc.pid})")
        threading.Thread(target=self._relay, args=(role, role.proc), daemon=True).start()

    def _relay(self, role: _Role, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if role.kind == "ps" and "listening on" in line:
                role.started.set()
            self.say(f"[{role.name}] {line}")
        proc.stdout.close()

    def run(self) -> int:
        servers = [r for r in self.roles if r.kind == "ps"]
        trainers = [r for r in self.roles if r.kind != "ps"]
        self.say(f"[launch] TF_CONFIG cluster: {json.dumps(self.cluster)}")
        try:
            for role in servers:
                self.start(role)
            for role in servers:
                if not self._wait_started(role):
                    return 130  # stopped while the servers started
            for role in trainers:
                self.start(role)
            return self._watch(trainers)
        finally:
            self.stop_all()

    def _wait_started(self, role: _Role) -> bool:
        """Until a server prints its start line; False when the job is stopped."""
        deadline = time.monotonic() + self.options.start_timeout
        while not role.started.wait(0.1):
            if self.stopping.is_set():
                return False
            if role.proc is not None and role.proc.poll() is not None:
                raise RuntimeError(f"{role.name} exited with status {role.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{role.name} did not start in {self.options.start_timeout:g} s")
        return True

    def _watch(self, trainers: list[_Role]) -> int:
        chief = next((r for r in trainers if r.kind == "chief"), None)
        while not self.stopping.wait(0.2):
            for role in self.roles:
                if role.restart_at is not None:
                    if time.monotonic() >= role.restart_at:
                        role.restart_at = None
                        self.start(role)
                    continue
                code = role.proc.poll() if role.proc is not None else None
                if code is None or role.done:
                    continue
                if code == 0 and role.kind != "ps":
                    role.done = True
                    self.say(f"[launch] {role.name} finished")
                    continue
                self._restart(role, code)
                if self.options.recovery == "full":
                    if not self._roll_back(role):
                        return 130
                    break
            if chief is not None and chief.done:
                return 0
            if chief is None and all(r.done for r in trainers):
                return 0
        return 130

    def _restart(self, role: _Role, code: int) -> None:
        """Starts a failed role again, after its backoff; raises when it
        failed more than max_restarts times within the window."""
        how = f"signal {-code}" if code < 0 else f"status {code}"
        options = self.options
        now = time.monotonic()
        role.failures = [t for t in role.failures if now - t < options.restart_window]
        role.failures.append(now)
        recent = len(role.failures)
        window = f"{options.restart_window:g} s"
        if recent > options.max_restarts:
            raise RuntimeError(
                f"{role.name} failed ({how}) {recent} times within {window}; stopping the job"
            )
        role.restarts += 1
        delay = 0.0 if recent == 1 else min(2.0 ** (recent - 2), options.max_backoff)
        after = f" in {delay:g} s" if delay else ""
        self.say(
            f"[launch] {role.name} exited ({how}); restarting{after} "
            f"({recent} of {options.max_restarts} within {window}, {role.restarts} in all)"
        )
        role.proc = None
        role.restart_at = now + delay

    def _roll_back(self, failed: _Role) -> bool:
        """Full recovery: every other role is killed (SIGKILL: a trainer must
        not checkpoint what a lost server left), then, after the failed role's
        backoff, the servers start again (each restores its part of the
        newest checkpoint), then every trainer (the chief restores the
        checkpoint, reader positions included). False when the job is
        stopped meanwhile."""
        self.say(f"[launch] {failed.name} failed: every role restarts from the newest checkpoint")
        running = [r for r in self.roles if r.proc is not None and r.proc.poll() is None]
        for role in running:
            assert role.proc is not None
            role.proc.kill()
        for role in running:
            assert role.proc is not None
            role.proc.wait(timeout=30)
        wait = max(0.0, (failed.restart_at or 0.0) - time.monotonic())
        if self.stopping.wait(wait):
            return False
        for role in self.roles:
            role.done, role.restart_at, role.proc = False, None, None
        servers = [r for r in self.roles if r.kind == "ps"]
        for role in servers:
            self.start(role)
        for role in servers:
            if not self._wait_started(role):
                return False
        for role in self.roles:
            if role.kind != "ps":
                self.start(role)
        return True

    def stop_all(self) -> None:
        running = [r.proc for r in self.roles if r.proc is not None and r.proc.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + self.options.grace
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def launch(options: LaunchOptions, out: IO[str] | None = None) -> int:
    """Runs the job (see the module docstring); returns the exit status."""
    options.check()
    job = _Job(options, out or sys.stdout)
    previous: dict[int, object] = {}

    def stop(signum: int, frame: object) -> None:
        job.say(f"[launch] {signal.Signals(signum).name}: stopping every process")
        job.stopping.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, stop)
    try:
        code = job.run()
    except RuntimeError as error:
        job.say(f"[launch] error: {error}")
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    chief = next((r for r in job.roles if r.kind == "chief"), None)
    if code == 0 and chief is not None and chief.proc is not None:
        code = chief.proc.returncode
    return code
