"""``wuliang serve`` as a new user meets it, in processes of its own: a busy
port or a bad certificate is one error line naming it (exit 1), options that
do not go together are usage errors (exit 2); a server with nothing to serve
yet (an empty export directory, a model not yet published to Redis) says
so, answers UNAVAILABLE and NOT_SERVING, and serves the first version when
it comes; each version applied and each refusal is logged; the start line
says ``grpc+tls`` and ``https`` under TLS; a lookups-only replica answers
predictions FAILED_PRECONDITION (HTTP 400)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from row_chunks import version_rows
from serve_cli import one_error_line, running, serve_fails
from small_model import trained_export

from wuliang.ps_server import SGD, TableSpec
from wuliang.ps_server.storage import ModelDescription, SparseInput, VersionWriter
from wuliang.serving.client import Client, ServingClientError
from wuliang.serving.redis.publish import publish


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A session trained 5 steps and exported (version 1), its files, a batch."""
    trained = trained_export(tmp_path_factory.mktemp("serving-cli"))
    yield trained
    trained["session"].context.close()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for 127.0.0.1."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    root = tmp_path_factory.mktemp("tls")
    key, cert = root / "key.pem", root / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def wait_for(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- starting ---------------------------------------------------------------------------


def test_a_busy_port_is_one_line_naming_it(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        message = one_error_line(
            serve_fails("--exports", str(tmp_path), "--port", str(port), "--http-port", "-1"), 1
        )
        assert message == (
            f"gRPC cannot listen on 127.0.0.1:{port}: the port is in use (another server "
            f"listens there) (--port {port})"
        )
        message = one_error_line(
            serve_fails("--exports", str(tmp_path), "--port", "0", "--http-port", str(port)), 1
        )
        assert message == (
            f"HTTP cannot listen on 127.0.0.1:{port}: the port is in use (another server "
            f"listens there) (--http-port {port})"
        )


def test_bad_tls_files_are_named(tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    other_key = tmp_path / "other.pem"
    subprocess.run(
        ["openssl", "genrsa", "-out", str(other_key), "2048"], check=True, capture_output=True
    )
    cases = {
        (junk, key): f"TLS certificate {junk} holds no PEM certificate",
        (cert, junk): f"TLS key {junk} holds no PEM private key",
        (cert, other_key): f"TLS key {other_key} does not belong to the certificate {cert}",
        (tmp_path / "none.pem", key): f"TLS certificate {tmp_path / 'none.pem'} cannot be read",
        (key, cert): f"TLS certificate {key} holds no PEM certificate",
    }
    for (c, k), want in cases.items():
        done = serve_fails("--exports", str(tmp_path), "--tls-cert", str(c), "--tls-key", str(k))
        message = one_error_line(done, 1)
        assert message.startswith(want), message
        assert "listen" not in message


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--exports", ".", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        ([], "--exports is required (or --redis, or --model-config)"),
        (["--redis", "redis://127.0.0.1:1/0", "--model", "m", "--precision", "fp16"],
         "with --redis"),
        (["--redis", "redis://127.0.0.1:1/0"], "--redis needs --model"),
        (["--exports", ".", "--port", "70000"], "--port"),
        (["--exports", ".", "--max-request-bytes", "0"], "--max-request-bytes"),
        (["--exports", ".", "--max-queue", "-1"], "--max-queue"),
        (["--exports", ".", "--max-queue-ms", "nan"], "--max-queue-ms"),
    ],
)  # fmt: skip
def test_options_that_do_not_go_together_are_usage_errors(args: list[str], named: str) -> None:
    assert named in one_error_line(serve_fails(*args), 2)


# -- serving ----------------------------------------------------------------------------


def test_an_empty_export_directory_waits_then_serves_and_logs(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    exports = tmp_path / "exports"
    exports.mkdir()
    with running(tmp_path, "--exports", str(exports), "--model", "m", "--poll-secs", "0.2") as s:
        assert s.banner == (
            f"serving model 'm' (waiting for its first version) from {exports}: "
            f"grpc 127.0.0.1:{s.grpc}, http 127.0.0.1:{s.http}"
        )
        assert s.rest("GET", "/v1/models/m")[1]["model_version_status"][0]["state"] == "LOADING"
        assert s.rest("GET", "/healthz")[0] == 503
        with Client(f"127.0.0.1:{s.grpc}") as client:
            assert not client.healthy()
            with pytest.raises(ServingClientError) as error:
                client.lookup("users", [1])
            assert error.value.code == "UNAVAILABLE"
            shutil.copytree(trained["exports"] / "1", exports / "1")
            wait_for(client.healthy)
            assert client.lookup("users", [1, 2]).version == 1
            # A version without its SavedModel is refused, and logged.
            staged = tmp_path / "2"  # version 1 renamed 2, its SavedModel gone
            shutil.copytree(trained["exports"] / "1", staged)
            manifest = json.loads((staged / "manifest.json").read_text())
            (staged / "manifest.json").write_text(
                json.dumps({**manifest, "name": "2", "version": 2})
            )
            shutil.rmtree(staged / "serving")
            staged.rename(exports / "2")
            wait_for(lambda: "version 2 refused" in s.log_text())
            assert client.status()[0]["version"] == 1
        log = s.log_text()
    assert re.search(r"INFO wuliang.serving: model m: version 1 \(full\) applied in [\d.]+ s", log)
    assert re.search(r"ERROR wuliang.serving: model m: version 2 refused: .*serving", log), log


def test_tls_is_named_in_the_start_line(
    trained: dict[str, Any], tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    args = ["--exports", str(trained["exports"]), "--model", "m"]
    with running(tmp_path, *args, "--tls-cert", str(cert), "--tls-key", str(key)) as s:
        assert s.banner == (
            f"serving model 'm' version 1 from {trained['exports']}: "
            f"grpc+tls 127.0.0.1:{s.grpc}, https 127.0.0.1:{s.http}"
        )
        with Client(f"127.0.0.1:{s.grpc}", tls_root=cert) as client:
            assert client.lookup("users", [1]).version == 1


def write_plain_version(root: Path, number: int) -> None:
    """An export version of one table and no SavedModel (lookups only)."""
    keys = np.arange(1, 11, dtype=np.uint64)
    with VersionWriter(root, str(number), "full") as writer:
        writer.write_table(
            TableSpec("t", 2, optimizer=SGD()),
            [version_rows(keys, np.full((10, 2), number, np.float32), number)],
            state=False,
        )
        writer.commit(
            number=number,
            engine_version=number,
            step=number,
            model=ModelDescription(sparse=(SparseInput("k", "t"),)),
        )
    (root / "LATEST").write_text(f"{number}\n")


def test_a_replica_started_before_the_first_publish_waits(tmp_path: Path, redis_url: str) -> None:
    import redis

    with redis.Redis.from_url(redis_url) as r:
        r.flushall()
    exports = tmp_path / "m"
    args = ["--redis", redis_url, "--model", "m", "--poll-secs", "0.2"]
    with running(tmp_path, *args) as s:
        assert "(waiting for its first version)" in s.banner and "version 0" not in s.banner
        assert s.rest("GET", "/v1/models/m")[1]["model_version_status"][0]["state"] == "LOADING"
        assert s.rest("GET", "/healthz")[0] == 503
        with Client(f"127.0.0.1:{s.grpc}") as client:
            assert not client.healthy()
            with pytest.raises(ServingClientError) as error:
                client.lookup("t", [1])
            assert error.value.code == "UNAVAILABLE"
            write_plain_version(exports, 1)
            publish(exports, redis_url, "m")
            wait_for(client.healthy)
            got = client.lookup("t", [1, 99])
            assert got.version == 1 and got.found.tolist() == [True, False]
            # No export directory: lookups only, and predictions say why.
            with pytest.raises(ServingClientError) as error:
                client.predict({"k": [1]})
            assert error.value.code == "FAILED_PRECONDITION"
            assert "serves lookups only" in error.value.message
            assert "no export directory" in error.value.message
        status, answer = s.rest("POST", "/v1/models/m:predict", {"instances": [{"k": 1}]})
        assert status == 400 and "serves lookups only" in answer["error"]
    assert re.search(r"model m: version 1 \(full\) applied from Redis in [\d.]+ s", s.log_text())
