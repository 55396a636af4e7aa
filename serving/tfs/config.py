"""TensorFlow Serving's model config file (``wuliang serve --model-config``):
the text format of its ``ModelServerConfig``, a ``model_config_list`` of
models, each::

    model_config_list {
      config {
        name: "ranker"
        base_path: "s3://models/ranker"       # an export directory: a folder or a URI
        model_platform: "tensorflow"          # optional; "tensorflow" or "wuliang"
        model_version_policy { latest { num_versions: 2 } }   # or specific, all
        version_labels { key: "stable" value: 41 }
        version_labels { key: "canary" value: 42 }
      }
    }

``read_model_config(path)`` parses it into ``ModelEntry`` s (protobuf's
text format parser over the messages of ``config.proto``) and checks each
one: a name and a base path, unique names, a known platform, a policy
whose versions and labels make sense. Every problem is a ``ValueError``
naming the file and, where protobuf says it, the line. Fields of
TensorFlow Serving's config that wuliang does not read (``logging_config``,
``custom_model_config`` …) are refused by name rather than ignored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from wuliang.serving.tfs import proto
from wuliang.serving.versioned import VersionPolicy

__all__ = ["PLATFORMS", "ModelEntry", "parse_model_config", "read_model_config"]

PLATFORMS = ("", "tensorflow", "wuliang")
_READ = "name, base_path, model_platform, model_version_policy and version_labels"


@dataclass(frozen=True)
class ModelEntry:
    """One model of the config."""

    name: str
    base_path: str
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    labels: dict[str, int] = field(default_factory=dict)


def read_model_config(path: str | os.PathLike[str]) -> list[ModelEntry]:
    """The models of a config file (see the module docstring)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"model config {path} cannot be read: {error}") from None
    return parse_model_config(text, str(path))


def parse_model_config(text: str, source: str = "the model config") -> list[ModelEntry]:
    """The models of a config's text."""
    message = proto.ModelServerConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as error:
        raise ValueError(
            f"model config {source}: {error} (wuliang reads model_config_list, each config "
            f"with {_READ})"
        ) from None
    if not message.HasField("model_config_list"):
        raise ValueError(f"model config {source}: no model_config_list")
    configs = message.model_config_list.config
    entries = [_entry(config, i, source) for i, config in enumerate(configs)]
    if not entries:
        raise ValueError(f"model config {source}: model_config_list names no model")
    names = [e.name for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"model config {source}: two models are named {twice[0]!r}")
    return entries


def _entry(config: Any, index: int, source: str) -> ModelEntry:
    where = f"model config {source}, config {index + 1}"
    if not config.name:
        raise ValueError(f"{where}: name is required")
    where += f" ({config.name!r})"
    if not config.base_path:
        raise ValueError(f"{where}: base_path is required (the model's export directory)")
    if config.model_platform not in PLATFORMS:
        raise ValueError(
            f"{where}: model_platform {config.model_platform!r} is not served here "
            '("tensorflow" or "wuliang": a wuliang export)'
        )
    policy = VersionPolicy()
    if config.HasField("model_version_policy"):
        choice = config.model_version_policy.WhichOneof("policy_choice")
        try:
            if choice == "latest":
                n = config.model_version_policy.latest.num_versions
                policy = VersionPolicy("latest", num_versions=n or 1)
            elif choice == "specific":
                versions = tuple(config.model_version_policy.specific.versions)
                policy = VersionPolicy("specific", versions=versions)
            elif choice == "all":
                policy = VersionPolicy("all")
        except ValueError as error:
            raise ValueError(f"{where}: model_version_policy: {error}") from None
    labels = dict(config.version_labels)
    for label, number in labels.items():
        if number < 1:
            raise ValueError(f"{where}: version label {label!r} names version {number} (< 1)")
        if policy.kind == "specific" and number not in policy.versions:
            raise ValueError(
                f"{where}: version label {label!r} names version {number}, which the policy "
                f"({policy}) never serves"
            )
    return ModelEntry(config.name, config.base_path, policy, labels)
