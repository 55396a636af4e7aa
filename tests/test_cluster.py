"""Roles from ``TF_CONFIG``: parsing and its errors, ``wuliang ps`` serving at
its own address, ``Context()`` finding the servers, and the shipped TFJob
manifest giving every pod the role and addresses the code expects (its
``TF_CONFIG`` generated as Kubeflow's training operator generates it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_data import REPO

import wuliang as wl
from wuliang.ps_server import Engine
from wuliang.ps_server.cluster import Cluster, ClusterError
from wuliang.ps_server.remote.run import listen_address
from wuliang.ps_server.remote.server import PsServer

JOB = {
    "cluster": {
        "chief": ["job-chief-0:2222"],
        "worker": ["job-worker-0:2222", "job-worker-1:2222"],
        "ps": ["job-ps-0:2222", "job-ps-1:2223"],
    },
    "environment": "cloud",
}


def config(kind: str, index: int, job: dict = JOB) -> str:
    return json.dumps({**job, "task": {"type": kind, "index": index}})


def test_roles_shards_and_the_chief() -> None:
    chief = Cluster.from_json(config("chief", 0))
    assert (chief.is_chief, chief.is_trainer, chief.trainer_index) == (True, True, 0)
    assert chief.num_trainers == 3 and chief.ps == ("job-ps-0:2222", "job-ps-1:2223")
    worker = Cluster.from_json(config("worker", 1))
    assert (worker.is_chief, worker.trainer_index, worker.address) == (
        False,
        2,
        "job-worker-1:2222",
    )
    server = Cluster.from_json(config("ps", 1))
    assert (server.is_trainer, server.port, server.address) == (False, 2223, "job-ps-1:2223")
    with pytest.raises(ClusterError, match="a ps task does not train"):
        _ = server.trainer_index
    no_chief = {"cluster": {"worker": ["w0:1", "w1:1"], "ps": ["p:1"]}}
    assert Cluster.from_json(config("worker", 0, no_chief)).is_chief  # as TensorFlow does
    assert not Cluster.from_json(config("worker", 1, no_chief)).is_chief
    master = {"cluster": {"master": ["m:1"], "worker": ["w:1"]}}
    old = Cluster.from_json(config("master", 0, master))
    assert (old.task_type, old.chief, old.is_chief) == ("chief", ("m:1",), True)
    assert Cluster.from_env({}) is None and Cluster.from_env({"TF_CONFIG": " "}) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "TF_CONFIG is not JSON"),
        ("[]", "must be a JSON object"),
        ('{"task": {"type": "worker", "index": 0}}', "no 'cluster' object"),
        ('{"cluster": {"worker": ["w:1"]}}', "no 'task' object"),
        (config("worker", 0, {"cluster": {"gpu": ["g:1"]}}), "role 'gpu'; known roles"),
        (config("worker", 0, {"cluster": {"worker": ["w"]}}), r"cluster.worker must be a list"),
        (config("worker", 0, {"cluster": {"worker": "w:1"}}), r"cluster.worker must be a list"),
        (config("worker", 0, {"cluster": {"worker": ["w:99999"]}}), "list of 'host:port'"),
        (config("chief", 0, {"cluster": {"chief": ["a:1", "b:1"]}}), "2 chiefs"),
        (config("ps", 0, {"cluster": {"worker": ["w:1"]}}), "task.type 'ps' is not a role"),
        (config("worker", 2), r"task.index 2 is not one of the 2 worker tasks"),
        (config("worker", -1), "task.index -1"),
        (config("ps", 0, {"cluster": {"ps": ["p:1"]}}), "neither a chief nor a worker"),
    ],
)
def test_a_bad_tf_config_names_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        Cluster.from_json(text)


def test_wuliang_ps_listens_at_its_tf_config_address() -> None:
    env = {"TF_CONFIG": config("ps", 1)}
    assert listen_address(None, None, env) == ("0.0.0.0", 2223)  # reached from other pods
    assert listen_address(None, "10.0.0.5", env) == ("10.0.0.5", 2223)
    assert listen_address(7001, None, env) == ("127.0.0.1", 7001)  # --port wins
    with pytest.raises(ValueError, match="names this process worker 0, not a parameter server"):
        listen_address(None, None, {"TF_CONFIG": config("worker", 0)})
    with pytest.raises(ValueError, match="--port is required"):
        listen_address(None, None, {})


def test_wuliang_ps_refuses_a_tf_config_of_another_role_as_a_usage_error() -> None:
    env = {**os.environ, "TF_CONFIG": config("worker", 0)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-m", "wuliang", "ps"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 2
    assert "names this process worker 0, not a parameter server" in done.stderr


def test_a_context_in_a_trainer_reaches_the_servers_of_tf_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    servers = [PsServer(Engine(2), "127.0.0.1", 0, token="t0k", threads=4) for _ in range(2)]
    try:
        addresses = [f"127.0.0.1:{s.port}" for s in servers]
        job = {"cluster": {"chief": ["127.0.0.1:1"], "ps": addresses}}
        monkeypatch.setenv("TF_CONFIG", config("chief", 0, job))
        (tmp_path / "token").write_text("t0k\n")
        monkeypatch.setenv("WULIANG_PS_TOKEN_FILE", str(tmp_path / "token"))
        context = wl.Context()
        assert context.cluster is not None and context.cluster.is_chief
        assert context.ps.num_servers == 2 and context.ps.addresses == addresses
        context.create_table(wl.EmbeddingTable("t", dim=4))
        assert all(s.engine.tables() == ["t"] for s in servers)
        context.close()
        embedded = wl.Context(ps="embedded")  # an explicit address wins
        assert embedded.ps.num_servers == 1 and embedded.cluster is not None
        embedded.close()
    finally:
        for server in servers:
            server.stop(grace=None)
    monkeypatch.setenv("TF_CONFIG", config("chief", 0, {"cluster": {"chief": ["c:1"]}}))
    alone = wl.Context()  # a cluster without servers trains on the embedded engine
    assert alone.ps.num_servers == 1
    alone.close()


# -- the shipped manifest ----------------------------------------------------------------------


def operator_tf_configs(tfjob: dict[str, Any], namespace: str = "default") -> dict[str, str]:
    """Each pod's TF_CONFIG, as Kubeflow's training operator writes it: role
    names lower-cased, every replica's address the DNS name of its headless
    service (``<job>-<role>-<index>.<namespace>.svc``) and the port of the
    ``tfjob-port`` port of the ``tensorflow`` container (2222 by default)."""
    name = tfjob["metadata"]["name"]
    cluster: dict[str, list[str]] = {}
    for role, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        (container,) = [c for c in spec["template"]["spec"]["containers"]
                        if c["name"] == "tensorflow"]  # fmt: skip
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        port = ports.get("tfjob-port", 2222)
        cluster[role.lower()] = [
            f"{name}-{role.lower()}-{i}.{namespace}.svc:{port}" for i in range(spec["replicas"])
        ]
    return {
        f"{role}-{i}": json.dumps(
            {"cluster": cluster, "task": {"type": role, "index": i}, "environment": "cloud"}
        )
        for role, addresses in cluster.items()
        for i in range(len(addresses))
    }


def test_the_tfjob_manifest_gives_every_pod_its_role() -> None:
    tfjob = yaml.safe_load((REPO / "deploy" / "k8s" / "tfjob.yaml").read_text())
    assert (tfjob["apiVersion"], tfjob["kind"]) == ("kubeflow.org/v1", "TFJob")
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert {role: s["replicas"] for role, s in specs.items()} == {"PS": 2, "Chief": 1, "Worker": 2}
    pods = {pod: Cluster.from_json(text) for pod, text in operator_tf_configs(tfjob).items()}
    assert sorted(pods) == ["chief-0", "ps-0", "ps-1", "worker-0", "worker-1"]
    servers = ("wuliang-ctr-ps-0.default.svc:2222", "wuliang-ctr-ps-1.default.svc:2222")
    for pod, cluster in pods.items():
        assert cluster.ps == servers, pod  # every trainer routes keys over the same list
        assert cluster.num_trainers == 3
    assert [p for p, c in pods.items() if c.is_chief] == ["chief-0"]
    assert sorted(c.trainer_index for c in pods.values() if c.is_trainer) == [0, 1, 2]
    for pod in ("ps-0", "ps-1"):  # a server listens on every interface at its own port
        env = {"TF_CONFIG": operator_tf_configs(tfjob)[pod]}
        assert listen_address(None, None, env) == ("0.0.0.0", 2222)
    for role, spec in specs.items():
        (container,) = spec["template"]["spec"]["containers"]
        command = container["command"]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert env.get("WULIANG_PS_TOKEN_FILE", "").startswith("/secrets/"), role
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert any(env["WULIANG_PS_TOKEN_FILE"].startswith(m) for m in mounts), role
        if role == "PS":
            assert command[:2] == ["wuliang", "ps"] and "--port" not in command
            restore = command[command.index("--restore") + 1]  # a server that comes back
            assert any(restore.startswith(m + "/") for m in mounts), restore
            assert container["readinessProbe"]["grpc"]["port"] == 2222
            assert spec["restartPolicy"] == "OnFailure"
        else:
            assert command[0] == "python" and (REPO / command[1]).is_file(), command
            assert "--ps" not in command  # the servers come from TF_CONFIG
            model_dir = command[command.index("--model-dir") + 1]
            assert model_dir == restore, (model_dir, restore)  # the servers restore from it


def test_the_dockerfile_installs_with_the_readme_command() -> None:
    text = (REPO / "Dockerfile").read_text()
    install = re.search(r"pip install[^\n]*wuliang-\*\.whl\)\[([a-z,]+)\]", text)
    assert install is not None, "the image installs wuliang's wheel with its extras"
    assert {"tf", "serving"} <= set(install[1].split(","))
    assert "WULIANG_NATIVE=OFF" in text  # a portable build: pods' CPUs differ
    assert "EXPOSE 2222" in text


def test_the_start_line_of_a_tf_config_server() -> None:
    """A real ``wuliang ps`` process started with a ps task's TF_CONFIG (a
    free loopback port in its address) serves there."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = {"cluster": {"chief": ["127.0.0.1:1"], "ps": [f"127.0.0.1:{port}"]}}
    env = {**os.environ, "TF_CONFIG": config("ps", 0, job)}
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "wuliang", "ps", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        line = ""
        while not line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert line == f"parameter server listening on grpc 127.0.0.1:{port} (2 shard threads)\n"
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()


def test_wuliang_ps_restore_needs_to_know_which_server_it_is(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CONFIG")}
    for args, message in (
        (["--restore", str(tmp_path)], "--restore needs to know which server this is"),
        (["--restore", str(tmp_path), "--server-index", "0"], "go together"),
        (["--restore", str(tmp_path), "--server-index", "2", "--num-servers", "2"],
         "--server-index 2 is not one of --num-servers 2"),
    ):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "wuliang", "ps", "--port", "0", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr
