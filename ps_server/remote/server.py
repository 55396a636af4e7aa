"""The parameter-server process: the engine behind the gRPC service of ``ps.proto``.

``PsServer(engine, host, port)`` serves one ``Engine`` (``wuliang ps``
starts one, ``run.py``). Every call is checked before the engine sees it:
the token (``authorization: Bearer <token>`` when the server has one), the
request's bytes (a message that does not parse, an array of the wrong
length), the table and the arguments; a bad request is answered with a
status naming what is wrong (INVALID_ARGUMENT, NOT_FOUND for an unknown
table, ALREADY_EXISTS for a table created twice with different specs,
FAILED_PRECONDITION for a write during a version switch, UNAUTHENTICATED),
anything unexpected is logged and answered INTERNAL, and the server goes on.

Data calls (pulls and pushes) arrive on one bidirectional stream per client
and run in the order they arrive; an error answers that call only, and the
stream goes on. A push carries its client's id and a sequence number: the
server keeps each client's last push and its answer, so a push retried
after its answer was lost (the client reconnected) is answered again, not
applied twice. The last ``DEDUP_CLIENTS`` clients are remembered.

Threads: grpcio's pool runs the calls (a data stream holds one thread for
as long as its client is connected), the engine's shard workers do the work.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from wuliang.ps_server.engine import Engine
from wuliang.ps_server.interface import (
    ExchangePart,
    PullPart,
    PushPart,
    PushResult,
    TableUpdate,
    load_columns,
    scan_top_keys,
)
from wuliang.ps_server.remote import proto
from wuliang.ps_server.remote.wire import (
    FLOAT,
    I64,
    KEY,
    MASK,
    U32,
    Encoded,
    WireError,
    array,
    chunk_of,
    chunk_to_message,
    to_bytes,
)
from wuliang.ps_server.rpc.auth import metadata_token, token_matches
from wuliang.ps_server.rpc.net import grpc_address, listen_error
from wuliang.ps_server.rpc.tls import ServerTls
from wuliang.ps_server.spec import TableSpec
from wuliang.ps_server.storage.location import Location, RemotePath, is_uri, location
from wuliang.ps_server.storage.version import write_parts

log = logging.getLogger("wuliang.ps")
M = proto.M
DEDUP_CLIENTS = 10_000  # clients whose last push is remembered
MAX_DETAILS = 2000  # bytes of an error's message in a status
_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class RpcError(Exception):
    """A request answered with a status: ``code`` (a ``grpc.StatusCode``
    name) and a message naming what is wrong."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _status(error: BaseException) -> tuple[str, str]:
    """The status (code name, message) of an error raised by a call."""
    if isinstance(error, RpcError):
        return error.code, str(error)
    if isinstance(error, KeyError):  # UnknownTableError: its str is the message
        return "NOT_FOUND", error.args[0] if error.args else str(error)
    if isinstance(error, ValueError | TypeError | WireError):
        return "INVALID_ARGUMENT", str(error)
    if isinstance(error, RuntimeError):
        return "FAILED_PRECONDITION", str(error)
    if isinstance(error, OSError):
        return "FAILED_PRECONDITION", str(error)
    return "INTERNAL", f"{type(error).__name__} inside the server"


def _details(message: str) -> str:
    data = message.encode()
    return (
        message
        if len(data) <= MAX_DETAILS
        else data[: MAX_DETAILS - 3].decode(errors="ignore") + "..."
    )


def _parse(message: Any, data: bytes) -> Any:
    try:
        return message.FromString(data)
    except DecodeError as error:
        raise RpcError(
            "INVALID_ARGUMENT",
            f"the request is not a valid {message.DESCRIPTOR.name} ({len(data)} bytes): {error}",
        ) from None


def _step(has: bool, step: int) -> int | None:
    return step if has else None


class _Pushes:
    """Each client's last push: (sequence number, its answer), and a lock
    per client, so a retried push is answered from here."""

    def __init__(self, capacity: int = DEDUP_CLIENTS) -> None:
        self.capacity = capacity
        self.last: collections.OrderedDict[str, tuple[int, bytes]] = collections.OrderedDict()
        self.locks: dict[str, threading.Lock] = {}
        self.lock = threading.Lock()

    def lock_of(self, client: str) -> threading.Lock:
        with self.lock:
            lock = self.locks.get(client)
            if lock is None:
                lock = self.locks[client] = threading.Lock()
            return lock

    def answered(self, client: str, seq: int) -> bytes | None:
        """The stored answer of a push already applied; RpcError for an older one."""
        with self.lock:
            last = self.last.get(client)
        if last is None or seq > last[0]:
            return None
        if seq == last[0]:
            return last[1]
        raise RpcError(
            "FAILED_PRECONDITION",
            f"push {seq} of client {client!r} is older than its last push {last[0]}",
        )

    def remember(self, client: str, seq: int, answer: bytes) -> None:
        with self.lock:
            self.last[client] = (seq, answer)
            self.last.move_to_end(client)
            while len(self.last) > self.capacity:
                gone, _ = self.last.popitem(last=False)
                self.locks.pop(gone, None)


class PsService:
    """The handlers of ``ps.proto`` over one engine (see the module docstring).

    Args:
        engine: the engine served.
        token: when set, every call must carry it.
        max_message_bytes: the largest message sent (an export's chunks fit it).
    """

    def __init__(
        self, engine: Engine, token: str | None = None, max_message_bytes: int = 64 << 20
    ) -> None:
        self.engine = engine
        self.token = token
        self.max_message_bytes = max_message_bytes
        self.instance = uuid.uuid4().hex
        self.pushes = _Pushes()
        # restored from a checkpoint (--restore): behind the job's version until raised
        self.behind = False
        self.restored_step: int | None = None  # that checkpoint's step
        self._behind_lock = threading.Lock()
        self.stopping = False  # set by PsServer.stop: calls are refused UNAVAILABLE
        self._busy = 0  # calls and data requests being answered
        self._idle = threading.Condition()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Counts a call (or a data request) being answered; UNAVAILABLE
        once the server is stopping (a client retries elsewhere or later)."""
        with self._idle:
            if self.stopping:
                raise RpcError("UNAVAILABLE", "the parameter server is stopping")
            self._busy += 1
        try:
            yield
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def stop_taking_calls(self, timeout: float | None) -> bool:
        """Refuses new calls and waits until those being answered are done
        (at most ``timeout`` s); True when none is left."""
        with self._idle:
            self.stopping = True
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    # -- data ----------------------------------------------------------------

    def data(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """A client's pulls and pushes, one at a time, answered in order;
        ends when the client ends the stream or goes away, and with
        UNAVAILABLE when the server stops (the client sends the requests
        left unanswered again, once a server is back)."""
        try:
            yield from self._data(requests)
        except grpc.RpcError:  # the client went away, or the server stops: nothing to answer
            return

    def _data(self, requests: Iterator[bytes]) -> Iterator[bytes]:
        for raw in requests:
            with self.working():  # outside the try: a stopping server ends the stream
                yield self._answer(raw)

    def _answer(self, raw: bytes) -> bytes:
        """One data request's answer; a bad request's names what is wrong."""
        try:
            request = _parse(M["DataRequest"], raw)
            kind = request.WhichOneof("call")
            if kind == "pull":
                return self.pull(request.pull)
            if kind == "push":
                return self.push(request.push)
            if kind == "exchange":
                return self.exchange(request.exchange)
            raise RpcError("INVALID_ARGUMENT", "a data request needs a pull, a push or an exchange")
        except Exception as error:  # the call fails, the stream goes on
            code, message = _status(error)
            if code == "INTERNAL":
                log.exception("data call failed")
            answer = M["DataResponse"](error_code=code, error_message=_details(message))
            return answer.SerializeToString()

    def pull(self, request: Any) -> bytes:
        """A pull's answer (serialized ``DataResponse``)."""
        parts, outs = [], []
        for part in request.parts:
            spec = self.engine.spec(part.table)
            keys = array(part.keys, KEY, f"pull of table {part.table!r}: keys")
            out = np.empty((len(keys), spec.dim), np.float32)
            offsets = (
                array(part.shard_offsets, I64, "shard_offsets") if part.shard_offsets else None
            )
            parts.append(PullPart(part.table, keys, out, offsets))
            outs.append(out)
        self.engine.pull_many(
            parts, train=request.train, step=_step(request.has_step, request.step)
        )
        rows = Encoded(M["PullResponse"])
        for out in outs:
            present = out.any(axis=1) if request.sparse_rows and len(out) else None
            if present is not None and present.sum() <= 0.75 * len(out):  # zeros not sent
                rows.add_array("rows", out[present])
                rows.add_array("present", present.view(np.uint8))
            else:
                rows.add_array("rows", out)
                if request.sparse_rows:
                    rows.add_array("present", np.zeros(0, np.uint8))
        return Encoded(M["DataResponse"]).add_message("pull", rows).join()

    def exchange(self, request: Any) -> bytes:
        """A cache's exchange (``ParameterServer.exchange_many``): its answer
        (serialized ``DataResponse``), the misses' rows and the incoming
        keys' whole rows per part. A retried exchange is run again: the rows
        given back are the cache's values (a load writes them again) and the
        misses' sightings count again, as a retried training pull's do;
        changes given back to merge (``merge``) are added again."""
        parts, outs = [], []
        for part in request.parts:
            spec = self.engine.spec(part.table)
            what = f"exchange with table {part.table!r}"
            keys = array(part.keys, KEY, f"{what}: keys")
            out = np.empty((len(keys), spec.dim), np.float32)
            offsets = (
                array(part.shard_offsets, I64, "shard_offsets") if part.shard_offsets else None
            )
            back = None
            if part.back.keys:
                back = chunk_of(part.back, f"{what}: rows given back", spec.dim)
                empty = {  # left empty: the defaults, as a load's
                    name: None
                    for name in ("state", "counts", "steps", "times", "versions")
                    if len(getattr(back, name)) != len(back.keys)
                }
                back = dataclasses.replace(back, **empty)
            incoming = array(part.incoming, KEY, f"{what}: incoming keys")
            parts.append(ExchangePart(part.table, keys, out, incoming, back, offsets, part.merge))
            outs.append(out)
        answers = self.engine.exchange_many(parts, step=_step(request.has_step, request.step))
        response = M["ExchangeResponse"]()
        for out, (rows, found, created) in zip(outs, answers, strict=True):
            response.rows.append(out.tobytes())
            read = response.incoming.add(found=np.asarray(found, np.uint8).tobytes())
            chunk_to_message(rows, read.rows)
            response.created.append(np.asarray(created, np.uint8).tobytes())
        return M["DataResponse"](exchange=response).SerializeToString()

    def push(self, request: Any) -> bytes:
        """A push's answer (serialized ``DataResponse``), applied once per
        (client, sequence number)."""
        client, seq = request.client, request.seq
        if not client or seq < 1:
            return self._push(request)
        with self.pushes.lock_of(client):
            answer = self.pushes.answered(client, seq)
            if answer is None:
                answer = self._push(request)
                self.pushes.remember(client, seq, answer)
            return answer

    def _push(self, request: Any) -> bytes:
        parts, updated = [], []
        for part in request.parts:
            spec = self.engine.spec(part.table)
            what = f"push to table {part.table!r}"
            keys = array(part.keys, KEY, f"{what}: keys")
            grads = array(part.grads, FLOAT, f"{what}: grads", len(keys), spec.dim)
            offsets = (
                array(part.shard_offsets, I64, "shard_offsets") if part.shard_offsets else None
            )
            rows = out = None
            if part.updated_mask:
                mask = array(part.updated_mask, MASK, f"{what}: updated_mask", len(keys)) != 0
                rows = np.where(mask, np.cumsum(mask, dtype=np.int32) - 1, -1).astype(np.int32)
                out = np.empty((int(mask.sum()), spec.dim), np.float32)
            shows, clicks = (
                array(data, FLOAT, f"{what}: {name}", len(keys)) if data else None
                for name, data in (("shows", part.shows), ("clicks", part.clicks))
            )
            parts.append(PushPart(part.table, keys, grads, offsets, out, rows, shows, clicks))
            updated.append(out)
        result: PushResult = self.engine.push_many(
            parts,
            unique=request.unique,
            only=request.only or "all",
            step=_step(request.has_step, request.step),
        )
        send = request.only != "rest"
        response = Encoded(
            M["PushResponse"],
            applied=result.applied,
            dropped_nan=result.dropped_nan,
            dropped_pending=result.dropped_pending,
            duplicates=result.duplicates,
        )
        for out in updated:
            response.add_array("updated", out if out is not None and send else b"")
        return Encoded(M["DataResponse"]).add_message("push", response).join()

    def lookup(self, request: Any) -> Any:
        keys = array(request.keys, KEY, "keys")
        result = self.engine.lookup(request.table, keys, missing=request.missing or "zeros")
        return M["LookupResponse"](
            rows=result.rows.tobytes(),
            found=result.found.astype(np.uint8).tobytes(),
            version=result.version,
        )

    # -- tables --------------------------------------------------------------

    def info(self, request: Any) -> Any:
        return M["InfoResponse"](
            shards=self.engine.num_shards,
            instance=self.instance,
            wuliang_version=_version(),
            version=self.engine.version,
            restored=self.restored_step is not None,
            restored_step=self.restored_step or 0,
            prefetches=self.engine.prefetches,
        )

    def create_table(self, request: Any) -> Any:
        spec = _spec_of(request.json)
        try:
            self.engine.create_table(spec)
        except ValueError:
            if spec.name not in self.engine.tables():
                raise
            held = self.engine.spec(spec.name)
            if held != spec:
                raise RpcError(
                    "ALREADY_EXISTS",
                    f"table {spec.name!r} exists with another spec: {held!r}, asked {spec!r}",
                ) from None
        return M["Empty"]()

    def drop_table(self, request: Any) -> Any:
        self.engine.drop_table(request.table)
        return M["Empty"]()

    def tables(self, request: Any) -> Any:
        return M["TablesResponse"](names=self.engine.tables())

    def get_spec(self, request: Any) -> Any:
        return M["Spec"](json=json.dumps(self.engine.spec(request.table).to_dict()))

    def stats(self, request: Any) -> Any:
        return M["Json"](json=json.dumps(self.engine.stats(request.table or None)))

    # -- rows ----------------------------------------------------------------

    def export(self, request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The rows as ``Rows`` messages of at most ``chunk_rows`` rows, and
        fewer where that many would not fit in a message (the engine holds a
        buffer of a chunk's size: the client's number is no allocation)."""
        spec = self.engine.spec(request.table)
        row_bytes = 32 + 4 * (spec.dim + spec.state_dim)  # key, columns, weights, state
        fit = max(1, (self.max_message_bytes - (1 << 16)) // row_bytes)
        chunk_rows = min(request.chunk_rows or 65536, fit)
        chunks = self.engine.export(request.table, request.since, chunk_rows)
        for chunk in chunks:
            yield chunk_to_message(chunk, M["Rows"]()).SerializeToString()

    def load(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        for raw in requests:
            request = _parse(M["LoadRequest"], raw)
            self._load(request)
        return M["Empty"]().SerializeToString()

    def _load(self, request: Any) -> None:
        spec = self.engine.spec(request.table)
        chunk = chunk_of(request.rows, f"load into table {request.table!r}", spec.dim)
        args = load_columns(chunk)  # state None where the message has none
        for name in ("counts", "steps", "times", "versions", "shows", "clicks"):
            if len(args[name]) != len(chunk.keys):  # left empty: the defaults
                args[name] = None
        self.engine.load(request.table, **args, step=_step(request.has_step, request.step))

    def erase(self, request: Any) -> Any:
        count = self.engine.erase(request.table, array(request.keys, KEY, "keys"))
        return M["Count"](count=count)

    def prefetch(self, request: Any) -> Any:
        parts = []
        for part in request.parts:
            keys = array(part.keys, KEY, f"prefetch of table {part.table!r}: keys")
            offsets = (
                array(part.shard_offsets, I64, "shard_offsets") if part.shard_offsets else None
            )
            parts.append(PullPart(part.table, keys, None, offsets))
        return M["Count"](count=self.engine.prefetch_many(parts))

    def contains(self, request: Any) -> Any:
        found = self.engine.contains(request.table, array(request.keys, KEY, "keys"))
        return M["Mask"](mask=np.asarray(found, np.uint8).tobytes())

    def evict(self, request: Any) -> Any:
        counts = self.engine.evict(
            request.table or None, step=_step(request.has_step, request.step)
        )
        return M["Json"](json=json.dumps(counts))

    def evict_by_age(self, request: Any) -> Any:
        step = _step(request.has_step, request.step)
        return M["Json"](json=json.dumps(self.engine.evict_by_age(request.table, step=step)))

    def count_histogram(self, request: Any) -> Any:
        hist = self.engine.count_histogram(request.table)
        buckets = np.flatnonzero(hist).astype(np.uint64)
        return M["Records"](keys=to_bytes(buckets, KEY), values=to_bytes(hist[buckets], KEY))

    def steps_at_count(self, request: Any) -> Any:
        steps = self.engine.steps_at_count(request.table, request.count)
        return M["Records"](values=to_bytes(steps, KEY))

    def evict_least_frequent(self, request: Any) -> Any:
        counts = self.engine.evict_least_frequent(
            request.table,
            request.threshold,
            request.cutoff,
            request.quota,
            step=_step(request.has_step, request.step),
        )
        return M["Json"](json=json.dumps(counts))

    def removed_log(self, request: Any) -> Any:
        keys, versions = self.engine.removed_log(request.table, request.since)
        return M["Records"](keys=to_bytes(keys, KEY), values=to_bytes(versions, KEY))

    def load_removed(self, request: Any) -> Any:
        keys = array(request.keys, KEY, "keys")
        versions = array(request.versions, KEY, "versions", len(keys))
        self.engine.load_removed(request.table, keys, versions, request.floor)
        return M["Empty"]()

    def trim_removed(self, request: Any) -> Any:
        self.engine.trim_removed(request.table, request.upto)
        return M["Empty"]()

    def pending_counts(self, request: Any) -> Any:
        keys, counts = self.engine.pending_counts(request.table)
        return M["Records"](keys=to_bytes(keys, KEY), values=to_bytes(counts, U32))

    def top_keys(self, request: Any) -> Any:
        step = _step(request.has_step, request.step)
        keys, shows, at = scan_top_keys(self.engine, request.table, request.n, step)
        return M["TopKeysResponse"](keys=to_bytes(keys, KEY), shows=to_bytes(shows, FLOAT), step=at)

    def read_rows(self, request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
        """``ReadRowsResponse`` messages for consecutive runs of the keys,
        each run as many keys as one message holds (their rows at most)."""
        spec = self.engine.spec(request.table)  # an unknown table: NOT_FOUND
        keys = array(request.keys, KEY, "keys")
        row_bytes = 33 + 4 * (spec.dim + spec.state_dim)  # mask, key, columns, weights, state
        fit = max(1, (self.max_message_bytes - (1 << 16)) // row_bytes)
        for start in range(0, len(keys), fit):
            rows, found = self.engine.read_rows(request.table, keys[start : start + fit])
            answer = M["ReadRowsResponse"](found=np.asarray(found, np.uint8).tobytes())
            chunk_to_message(rows, answer.rows)
            yield answer.SerializeToString()

    def load_pending(self, request: Any) -> Any:
        keys = array(request.keys, KEY, "keys")
        counts = array(request.counts, U32, "counts", len(keys))
        self.engine.load_pending(request.table, keys, counts)
        return M["Empty"]()

    def apply_update(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """Table headers first, then each table's rows and removed keys, in
        header order (streamed into the engine's staging as they come)."""
        stream = _Peekable(_parse(M["UpdateRequest"], raw) for raw in requests)
        updates: dict[str, TableUpdate] = {}
        label = 0
        while stream.peek() is not None and stream.peek().WhichOneof("part") == "table":
            message = stream.next()
            label = message.label
            header = message.table
            spec = _spec_of(header.spec.json)
            update = TableUpdate(spec, full=header.full, rows=[])
            update.rows = _rows_of(stream, header.table, update, spec.dim)
            updates[header.table] = update
        self.engine.apply_update(updates, label=label)
        if stream.peek() is not None:
            raise RpcError("INVALID_ARGUMENT", "apply_update: messages after the last table")
        return M["Empty"]().SerializeToString()

    # -- versions ------------------------------------------------------------

    def get_version(self, request: Any) -> Any:
        return M["VersionMessage"](version=self.engine.version)

    def advance_version(self, request: Any) -> Any:
        return M["VersionMessage"](version=self.engine.advance_version())

    def restore_version(self, request: Any) -> Any:
        with self._behind_lock:
            if self.behind and request.version > self.engine.version:
                # Restored from a checkpoint, now raised to the job's version: the
                # removal records of the versions in between are lost, so the next
                # delta export (whose removal log must reach back) becomes a full one.
                for table in self.engine.tables():
                    self.engine.trim_removed(table, request.version)
                self.behind = False
            self.engine.restore_version(request.version)
        return M["Empty"]()

    # -- the clock -------------------------------------------------------------

    def get_clock(self, request: Any) -> Any:
        return M["ClockMessage"](seconds=self.engine.clock() or 0)

    def set_clock(self, request: Any) -> Any:
        self.engine.set_clock(request.seconds or None)  # a restart is back on the wall clock
        return M["Empty"]()

    # -- the job board ---------------------------------------------------------

    def job(self, request: Any) -> Any:
        state = self.engine.job(
            add_steps=request.add_steps,
            floor=request.floor,
            put=dict(request.put),
            get=list(request.get),
            prefix=request.prefix if request.has_prefix else None,
        )
        return M["JobResponse"](step=state.step, values=state.values)

    # -- part files ----------------------------------------------------------

    def write_rows(self, request: Any) -> Any:
        folder = _folder(request.folder)
        _check_name(request.table, "table")
        _check_name(request.prefix, "prefix")
        spec = self.engine.spec(request.table)
        files, rows = write_parts(
            folder, spec, self.engine.export(spec.name, since=request.since),
            state=request.state, prefix=request.prefix,
        )  # fmt: skip
        return M["WriteRowsResponse"](
            files=[
                M["WrittenFile"](path=path, sha256=entry.sha256, bytes=entry.bytes, rows=entry.rows)
                for path, entry in files
            ],
            rows=rows,
        )

    def load_rows(self, request: Any) -> Any:
        folder = _folder(request.folder)
        if not 0 <= request.server < max(request.servers, 1):
            raise RpcError(
                "INVALID_ARGUMENT", f"server {request.server} of {request.servers} servers"
            )
        self.engine.spec(request.table)
        files = [_inside(folder, relative) for relative in request.files]
        loaded = self.engine.load_rows(
            folder.resolve(),
            request.table,
            files,
            step=_step(request.has_step, request.step),
            since=request.since,
            owned=(request.server, max(request.servers, 1)),
        )
        return M["Count"](count=loaded)


def _rows_of(stream: _Peekable, table: str, update: TableUpdate, dim: int) -> Iterator[Any]:
    """A table's rows from the update stream; its removed keys go into
    ``update.removed`` (the engine reads them after the rows)."""
    while True:
        message = stream.peek()
        if message is None:
            return
        kind = message.WhichOneof("part")
        if kind == "rows" and message.rows.table == table:
            stream.next()
            chunk = chunk_of(message.rows.rows, f"rows of table {table!r}", dim)
            empty = {  # columns left empty take their defaults, as in a load
                name: None
                for name in ("counts", "steps", "times", "versions", "shows", "clicks")
                if len(getattr(chunk, name)) != len(chunk.keys)
            }
            yield dataclasses.replace(chunk, **empty) if empty else chunk
        elif kind == "removed" and message.removed.table == table:
            stream.next()
            update.removed = array(message.removed.keys, KEY, f"removed keys of {table!r}")
            return
        else:
            return


class _Peekable:
    def __init__(self, items: Iterator[Any]) -> None:
        self.items = items
        self.head: list[Any] = []

    def peek(self) -> Any:
        if not self.head:
            self.head.append(next(self.items, None))
        return self.head[0]

    def next(self) -> Any:
        item = self.peek()
        self.head.clear()
        return item


def _version() -> str:
    """The installed wuliang's version (the façade's ``__version__``, read
    from the package metadata: this floor does not import the façade)."""
    try:
        return importlib.metadata.version("wuliang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _spec_of(text: str) -> TableSpec:
    """The spec in a request's JSON; INVALID_ARGUMENT for JSON that does not
    parse (nested too deeply included) or is no spec."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise RpcError("INVALID_ARGUMENT", "the spec's JSON is nested too deeply") from None
    return TableSpec.from_dict(data)


def _check_name(name: str, what: str) -> None:
    if not name or not set(name) <= _NAME_OK or name.startswith("."):
        raise RpcError("INVALID_ARGUMENT", f"{what} {name!r} is not a file name")


def _folder(folder: str) -> Location:
    """A version's folder: an absolute path this server sees, or a URI of an
    object store (errors name it without its query)."""
    if is_uri(folder):
        return location(folder)  # ValueError: INVALID_ARGUMENT; OSError: FAILED_PRECONDITION
    path = Path(folder)
    if not path.is_absolute() or not path.is_dir():
        raise RpcError(
            "FAILED_PRECONDITION",
            f"folder {folder!r} is not a directory this server sees (servers and the client "
            "must share the model and export directories)",
        )
    return path


def _inside(folder: Location, relative: str) -> str:
    """A file's path relative to the version folder, refused when it leads out."""
    if isinstance(folder, RemotePath):
        parts = relative.split("/")
        if not relative or any(p in ("", ".", "..") for p in parts):
            raise RpcError("INVALID_ARGUMENT", f"file {relative!r} is outside the version folder")
        return relative
    path = (folder / relative).resolve()
    if folder.resolve() not in path.parents:
        raise RpcError("INVALID_ARGUMENT", f"file {relative!r} is outside the version folder")
    return str(path.relative_to(folder.resolve()))


# -- the gRPC server ------------------------------------------------------------------

UNARY = {
    "Info": ("Empty", "info"),
    "Lookup": ("LookupRequest", "lookup"),
    "Prefetch": ("PullRequest", "prefetch"),
    "CreateTable": ("Spec", "create_table"),
    "DropTable": ("TableRequest", "drop_table"),
    "Tables": ("Empty", "tables"),
    "GetSpec": ("TableRequest", "get_spec"),
    "Stats": ("TableRequest", "stats"),
    "Erase": ("KeysRequest", "erase"),
    "Contains": ("KeysRequest", "contains"),
    "Evict": ("EvictRequest", "evict"),
    "EvictByAge": ("EvictRequest", "evict_by_age"),
    "CountHistogram": ("TableRequest", "count_histogram"),
    "StepsAtCount": ("CountRequest", "steps_at_count"),
    "EvictLeastFrequent": ("LeastFrequentRequest", "evict_least_frequent"),
    "RemovedLog": ("RemovedLogRequest", "removed_log"),
    "LoadRemoved": ("LoadRemovedRequest", "load_removed"),
    "TrimRemoved": ("TrimRequest", "trim_removed"),
    "PendingCounts": ("TableRequest", "pending_counts"),
    "LoadPending": ("LoadPendingRequest", "load_pending"),
    "TopKeys": ("TopKeysRequest", "top_keys"),
    "GetVersion": ("Empty", "get_version"),
    "AdvanceVersion": ("Empty", "advance_version"),
    "RestoreVersion": ("VersionMessage", "restore_version"),
    "GetClock": ("Empty", "get_clock"),
    "SetClock": ("ClockMessage", "set_clock"),
    "WriteRows": ("WriteRowsRequest", "write_rows"),
    "LoadRows": ("LoadRowsRequest", "load_rows"),
    "Job": ("JobRequest", "job"),
}


def _guard(service: PsService, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    """A handler that checks the token and answers errors with statuses."""

    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            if service.token is not None and not token_matches(
                metadata_token(context.invocation_metadata()), service.token
            ):
                raise RpcError("UNAUTHENTICATED", "a valid token is required")
            with service.working():
                return call(request, context)
        except Exception as error:
            code, message = _status(error)
            if code == "INTERNAL":
                log.exception("%s failed", name)
            context.abort(getattr(grpc.StatusCode, code), _details(message))

    return handle


def ps_handler(service: PsService) -> grpc.GenericRpcHandler:
    """The ``wuliang.ps.ParameterServer`` methods over ``service``."""
    handlers: dict[str, Any] = {}
    for method, (message, attr) in UNARY.items():

        def unary(raw: bytes, context: Any, message: str = message, attr: str = attr) -> bytes:
            return getattr(service, attr)(_parse(M[message], raw)).SerializeToString()

        handlers[method] = grpc.unary_unary_rpc_method_handler(_guard(service, method, unary))

    def export(raw: bytes, context: Any) -> Iterator[bytes]:
        yield from service.export(_parse(M["ExportRequest"], raw), context)

    handlers["Export"] = grpc.unary_stream_rpc_method_handler(
        _stream_guard(service, "Export", export)
    )

    def read_rows(raw: bytes, context: Any) -> Iterator[bytes]:
        yield from service.read_rows(_parse(M["KeysRequest"], raw), context)

    handlers["ReadRows"] = grpc.unary_stream_rpc_method_handler(
        _stream_guard(service, "ReadRows", read_rows)
    )
    handlers["Load"] = grpc.stream_unary_rpc_method_handler(_guard(service, "Load", service.load))
    handlers["ApplyUpdate"] = grpc.stream_unary_rpc_method_handler(
        _guard(service, "ApplyUpdate", service.apply_update)
    )
    handlers["Data"] = grpc.stream_stream_rpc_method_handler(
        _stream_guard(service, "Data", service.data, whole=False)  # counted per request
    )
    return grpc.method_handlers_generic_handler(proto.SERVICE, handlers)


def _stream_guard(
    service: PsService, name: str, call: Callable[..., Any], whole: bool = True
) -> Callable[..., Any]:
    """``_guard`` for handlers that answer with a stream (``whole``: the
    call counts as working until its stream ends)."""

    def handle(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
        if service.token is not None and not token_matches(
            metadata_token(context.invocation_metadata()), service.token
        ):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid token is required")
        try:
            with service.working() if whole else contextlib.nullcontext():
                yield from call(request, context)
        except Exception as error:
            code, message = _status(error)
            if code == "INTERNAL":
                log.exception("%s failed", name)
            context.abort(getattr(grpc.StatusCode, code), _details(message))

    return handle


class PsServer:
    """A started parameter server (``port``: the bound port); ``stop()`` ends it.

    Args:
        engine: the engine to serve (the server closes it on ``stop``).
        host, port: where to listen (port 0: a free one).
        token: when set, every call must carry it.
        tls: serve TLS with this certificate and key.
        max_message_mb: the largest message received or sent; clients
            split larger batches.
        threads: grpcio's pool (each connected client's data stream holds one).
    """

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        tls: ServerTls | None = None,
        max_message_mb: int = 64,
        threads: int = 16,
    ) -> None:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        if not isinstance(max_message_mb, int) or not 1 <= max_message_mb <= 2047:
            raise ValueError(f"max_message_mb must be an int in [1, 2047], got {max_message_mb!r}")
        limit = max_message_mb << 20
        self.engine = engine
        self.service = PsService(engine, token, limit)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="wuliang-ps")
        self.server = grpc.server(
            self.pool,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ],
        )
        self.server.add_generic_rpc_handlers((ps_handler(self.service),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = grpc_address(host, port)
        try:
            if tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, tls.grpc_credentials())
        except RuntimeError as error:
            self.pool.shutdown(wait=False)
            raise listen_error(host, port, "the parameter server", error) from None
        if self.port == 0:
            self.pool.shutdown(wait=False)
            raise listen_error(host, port, "the parameter server")
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(proto.SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.server.start()

    def stop(self, grace: float | None = 1.0) -> None:
        """Refuses new calls (UNAVAILABLE), lets those being answered finish
        (at most ``grace`` s; None: none), then ends every call and stream
        (a connected client's idle data stream does not hold it up) and
        closes the engine."""
        from grpc_health.v1 import health_pb2

        for service in ("", proto.SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if not self.service.stop_taking_calls(grace or 0.0):
            log.warning("stopping with calls still being answered after %s s", grace)
        self.server.stop(None).wait()
        self.pool.shutdown(wait=True)
        self.engine.close()
