"""``wuliang serve`` in a process of its own, for tests: the installed
script, its start line parsed (``Server``), stopped with SIGTERM and
checked to exit 0 (``running``); a start that must fail (``serve_fails``,
``one_error_line``)."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCRIPT = Path(sys.executable).parent / "wuliang"
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package


def serve_fails(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), "serve", *args], capture_output=True, text=True, timeout=120, env=ENV
    )


def one_error_line(done: subprocess.CompletedProcess[str], status: int) -> str:
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("wuliang serve: error: "), done.stderr
    if status == 1:
        assert len(lines) == 1, done.stderr
    return lines[-1].removeprefix("wuliang serve: error: ")


class Server:
    """A running ``wuliang serve``: its start line, ports and log."""

    def __init__(self, process: subprocess.Popen[str], log: Path) -> None:
        self.process = process
        self.log = log
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 120)
        self.banner = process.stdout.readline().strip() if ready else ""
        assert self.banner, f"no start line: {log.read_text()[-3000:]}"
        match = re.search(r"grpc(?:\+tls)? [\d.]+:(\d+)", self.banner)
        assert match, self.banner
        self.grpc = int(match[1])
        match = re.search(r"https? [\d.]+:(\d+)", self.banner)
        self.http = int(match[1]) if match else 0

    def rest(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", self.http, timeout=30)
        try:
            connection.request(method, path, None if body is None else json.dumps(body))
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def running(tmp_path: Path, *args: str) -> Iterator[Server]:
    log = tmp_path / f"serve-{time.monotonic_ns()}.log"
    command = [str(SCRIPT), "serve", "--port", "0", "--http-port", "0", *args]
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=ENV
        )
    try:
        server = Server(process, log)
        yield server
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        assert process.stdout is not None
        process.stdout.close()
