"""Several models from TensorFlow Serving's model config file, followed while
the server runs (``wuliang serve --model-config FILE``).

``ModelConfigWatcher(path, make_model)`` reads the file
(``wuliang.serving.tfs.config``) and makes a ``VersionedModel`` per entry
(``make_model``: its export directory, policy and labels, with the
server's store options). Once the ``Service`` serves them (``attach``), it
re-reads the file on SIGHUP (``hangup``, the signal handler: it only
records the signal) and every ``poll_secs`` (0: on SIGHUP only), on a
thread of its own, and applies the differences without dropping a request:

* a model added, or whose ``base_path`` changed: a new ``VersionedModel``,
  loaded before it is served (requests for it are NOT_FOUND until then,
  and the old one of that name keeps serving meanwhile);
* a model removed: no longer served from the next request on, and closed
  ``RETIRE_SECONDS`` later (``Service.update_models``), so requests that
  took it finish first;
* a policy or labels changed: ``VersionedModel.reconfigure``, which loads
  and unloads versions as the new policy says.

A file that does not parse or check, a model that fails to start, and a
config that would leave no model are logged (ERROR) and change nothing:
the server keeps serving what it served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from wuliang.serving.service import Service
from wuliang.serving.tfs.config import ModelEntry, read_model_config
from wuliang.serving.versioned import VersionedModel

__all__ = ["ModelConfigWatcher"]

log = logging.getLogger("wuliang.serving")
TICK_SECONDS = 0.2  # how often the thread looks for a SIGHUP


class ModelConfigWatcher:
    """The models of a config file, kept as the file says (see the module
    docstring).

    Args:
        path: the model config file.
        make_model: a (not started) model for an entry.
        poll_secs: how often to re-read the file (0: on SIGHUP only).
    """

    def __init__(
        self,
        path: str | Path,
        make_model: Callable[[ModelEntry], VersionedModel],
        poll_secs: float = 0.0,
    ) -> None:
        if poll_secs < 0:
            raise ValueError(f"poll_secs must be >= 0, got {poll_secs!r}")
        self.path = Path(path)
        self.make_model = make_model
        self.poll_secs = poll_secs
        self.entries: dict[str, ModelEntry] = {}
        self.service: Service | None = None
        self.reloads = 0  # files applied after the first
        self._hangups: list[int] = []  # appended by the signal handler: atomic, no lock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def models(self) -> list[VersionedModel]:
        """The file's models, made but not started (ValueError: a bad file)."""
        entries = read_model_config(self.path)
        self.entries = {e.name: e for e in entries}
        return [self.make_model(e) for e in entries]

    def attach(self, service: Service) -> ModelConfigWatcher:
        """Starts following the file for ``service``, which serves ``models()``."""
        self.service = service
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._follow, name="wuliang-model-config", daemon=True
            )
            self._thread.start()
        return self

    def hangup(self, signum: int = 0, frame: FrameType | None = None) -> None:
        """A SIGHUP handler: the file is re-read on the watcher's thread."""
        self._hangups.append(signum)

    def _follow(self) -> None:
        due = time.monotonic() + self.poll_secs
        seen = 0
        while not self._stop.wait(TICK_SECONDS):
            now = time.monotonic()
            hangups = len(self._hangups)
            if hangups > seen or (self.poll_secs > 0 and now >= due):
                seen = hangups
                due = now + self.poll_secs
                try:
                    self.reload()
                except Exception:  # never let the watcher die
                    log.exception("model config %s: reloading failed", self.path)

    def reload(self) -> bool:
        """Re-reads the file and applies it; False when it changed nothing
        because of an error (logged)."""
        assert self.service is not None, "attach() first"
        with self._lock:
            try:
                entries = {e.name: e for e in read_model_config(self.path)}
            except ValueError as error:
                log.error("%s; keeping the models served", error)
                return False
            service = self.service
            added, changed, failed = [], [], False
            for name, entry in entries.items():
                old = self.entries.get(name)
                if old is not None and old == entry:
                    continue
                if old is None or old.base_path != entry.base_path:
                    try:
                        added.append(self.make_model(entry).start())
                    except (OSError, ValueError) as error:
                        log.error("model config %s: model %r not served: %s",
                                  self.path, name, error)  # fmt: skip
                        failed = True
                        continue
                else:
                    store = service.stores.get(name)
                    try:
                        if isinstance(store, VersionedModel):
                            store.reconfigure(entry.policy, entry.labels)
                    except ValueError as error:
                        log.error("model config %s: model %r unchanged: %s",
                                  self.path, name, error)  # fmt: skip
                        failed = True
                        continue
                    changed.append(name)
                self.entries[name] = entry
            removed = [name for name in self.entries if name not in entries]
            if added or removed:
                try:
                    service.update_models(added, removed)
                except ValueError as error:
                    log.error("model config %s: %s; keeping the models served", self.path, error)
                    for model in added:
                        model.close()
                    return False
                for name in removed:
                    del self.entries[name]
            self.reloads += 1
            log.info(
                "model config %s: %d models (added or replaced: %s; removed: %s; changed: %s)",
                self.path, len(service.stores), ", ".join(m.name for m in added) or "none",
                ", ".join(removed) or "none", ", ".join(changed) or "none",
            )  # fmt: skip
            return not failed

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
