"""The cluster a job runs on, as the orchestrator describes it: ``TF_CONFIG``.

Kubernetes (Kubeflow's TFJob), TensorFlow's own launchers and ``wuliang
launch`` give every process of a job the same ``cluster`` and its own
``task`` in the ``TF_CONFIG`` environment variable::

    {"cluster": {"chief": ["trainer-chief-0:2222"],
                 "worker": ["trainer-worker-0:2222", "trainer-worker-1:2222"],
                 "ps": ["trainer-ps-0:2222", "trainer-ps-1:2222"]},
     "task": {"type": "worker", "index": 1}}

wuliang reads its roles from it and keeps no cluster manager of its own:

* ``ps`` tasks are parameter servers: ``wuliang ps`` serves at its own
  address's port (on every interface: the address is the pod's name);
* ``chief`` and ``worker`` tasks train: ``Context()`` reaches the servers
  of ``cluster.ps`` (in that order: a key's server is ``server_of(key, N)``
  over that list); the chief alone restores, checkpoints, evicts and
  exports. They read disjoint shards of the data: the chief is trainer 0,
  worker i trainer i + 1 (``trainer_index`` of ``num_trainers``); a job
  without a chief makes worker 0 its chief, as TensorFlow does;
* other task types (``evaluator``) are neither; ``master`` (older
  TFJobs) is read as ``chief``.

A malformed ``TF_CONFIG`` is a ``ValueError`` naming what is wrong.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Cluster", "ClusterError"]

ROLES = ("chief", "worker", "ps", "evaluator")
_ALIASES = {"master": "chief"}  # older TFJobs name the chief "master"


class ClusterError(ValueError):
    """A ``TF_CONFIG`` that does not describe a job wuliang can run."""


@dataclass(frozen=True)
class Cluster:
    """One process's view of the job: every role's addresses and its own task."""

    chief: tuple[str, ...]
    worker: tuple[str, ...]
    ps: tuple[str, ...]
    task_type: str
    task_index: int
    evaluator: tuple[str, ...] = ()

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> Cluster | None:
        """The cluster of ``TF_CONFIG``; None when it is unset or empty."""
        text = (os.environ if environ is None else environ).get("TF_CONFIG", "").strip()
        return Cluster.from_json(text) if text else None

    @staticmethod
    def from_json(text: str) -> Cluster:
        try:
            config = json.loads(text)
        except json.JSONDecodeError as error:
            raise ClusterError(f"TF_CONFIG is not JSON: {error}") from None
        if not isinstance(config, dict):
            raise ClusterError("TF_CONFIG must be a JSON object with 'cluster' and 'task'")
        return Cluster.from_dict(config)

    @staticmethod
    def from_dict(config: Mapping[str, Any]) -> Cluster:
        cluster, task = config.get("cluster"), config.get("task")
        if not isinstance(cluster, dict) or not cluster:
            raise ClusterError("TF_CONFIG has no 'cluster' object of role -> addresses")
        if not isinstance(task, dict):
            raise ClusterError("TF_CONFIG has no 'task' object ({'type': ..., 'index': ...})")
        roles: dict[str, tuple[str, ...]] = {}
        cluster = {_ALIASES.get(role, role): addresses for role, addresses in cluster.items()}
        for role, addresses in cluster.items():
            if role not in ROLES:
                raise ClusterError(
                    f"TF_CONFIG cluster has role {role!r}; known roles: {', '.join(ROLES)}"
                )
            if not isinstance(addresses, list) or not all(
                isinstance(a, str) and _is_address(a) for a in addresses
            ):
                raise ClusterError(
                    f"TF_CONFIG cluster.{role} must be a list of 'host:port', got {addresses!r}"
                )
            roles[role] = tuple(addresses)
        if len(roles.get("chief", ())) > 1:
            raise ClusterError(f"TF_CONFIG has {len(roles['chief'])} chiefs; a job has one")
        kind, index = _ALIASES.get(task.get("type"), task.get("type")), task.get("index", 0)
        if kind not in roles:
            raise ClusterError(
                f"TF_CONFIG task.type {kind!r} is not a role of the cluster ({', '.join(roles)})"
            )
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not (0 <= index < len(roles[kind]))
        ):
            raise ClusterError(
                f"TF_CONFIG task.index {index!r} is not one of the {len(roles[kind])} {kind} tasks"
            )
        if not roles.get("chief") and not roles.get("worker"):
            raise ClusterError("TF_CONFIG cluster has neither a chief nor a worker: nobody trains")
        return Cluster(
            roles.get("chief", ()),
            roles.get("worker", ()),
            roles.get("ps", ()),
            kind,
            index,
            roles.get("evaluator", ()),
        )

    # -- this process ------------------------------------------------------------------

    @property
    def address(self) -> str:
        """This task's own address."""
        return getattr(self, self.task_type)[self.task_index]

    @property
    def is_trainer(self) -> bool:
        return self.task_type in ("chief", "worker")

    @property
    def is_chief(self) -> bool:
        """The trainer that restores, checkpoints, evicts and exports."""
        if self.chief:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def num_trainers(self) -> int:
        return len(self.chief) + len(self.worker)

    @property
    def trainer_index(self) -> int:
        """This trainer's data shard: the chief 0, worker i i + len(chief)."""
        if not self.is_trainer:
            raise ClusterError(f"a {self.task_type} task does not train")
        return self.task_index + (len(self.chief) if self.task_type == "worker" else 0)

    @property
    def port(self) -> int:
        """The port of this task's address."""
        return int(self.address.rsplit(":", 1)[1])


def _is_address(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(host) and bool(sep) and port.isdigit() and 1 <= int(port) <= 65535
