"""A moto server process as a real S3-protocol object store on loopback, for
the tests of object storage (``test_reader_s3.py``,
``test_object_store_versions.py``): started on a free port with bounded
waits, reached through pyarrow's S3 client as a user's environment would
(``AWS_ENDPOINT_URL`` and keys in the environment, so ``s3://bucket/...``
URIs open it, in this process and in the processes it starts)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A moto server process on a free loopback port, answering (bounded waits)."""
    for _ in range(3):  # the port may be taken between choosing and binding it
        port = free_port()
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/data.json", timeout=1):
                    return proc, endpoint
            except OSError:
                time.sleep(0.05)
        proc.kill()
        proc.wait(5)
    raise RuntimeError(f"moto server did not start: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def moto_s3(root: Path, buckets: tuple[str, ...]) -> Iterator[tuple[str, pafs.S3FileSystem]]:
    """(endpoint, filesystem) of a moto server holding ``buckets``, with the
    environment pointing S3 clients at it; the server stops on exit."""
    proc, endpoint = start_moto(root / "moto.log")
    try:
        with pytest.MonkeyPatch.context() as env:  # as a user's environment would say
            for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
                env.delenv(name, raising=False)
            env.setenv("AWS_ENDPOINT_URL", endpoint)
            env.setenv("AWS_ACCESS_KEY_ID", "testing")
            env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            env.setenv("AWS_DEFAULT_REGION", "us-east-1")
            env.setenv("AWS_EC2_METADATA_DISABLED", "true")
            fs = pafs.S3FileSystem(
                endpoint_override=endpoint,
                scheme="http",
                access_key="testing",
                secret_key="testing",
                region="us-east-1",
                allow_bucket_creation=True,
            )
            for bucket in buckets:
                fs.create_dir(bucket)
            yield endpoint, fs
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
