"""Random and mutated requests on every RPC of the parameter server (``ps.proto``).

One ``PsServer(Engine(2), "127.0.0.1", 0)`` runs on threads of this process
and takes ``WULIANG_FUZZ_REQUESTS`` calls (default 10,000; fewer while
debugging), 8 at a time, every call with a deadline. What passing
guarantees:

* every call gets a gRPC status, and no call or data answer is INTERNAL
  (nor UNKNOWN, an exception the handlers did not catch): a bad request is
  the client's fault and is named as such (INVALID_ARGUMENT, NOT_FOUND,
  ALREADY_EXISTS, FAILED_PRECONDITION), and the server logs no error;
* no call hangs (a deadline, ``TIMEOUT``, is a failure) and the server does
  not die (UNAVAILABLE is a failure); a data stream answers each of its
  requests, in order, and ends OK;
* afterwards the server still answers correct pulls and pushes: fresh
  tables (dim 8 and dim 1) driven through a ``RemoteServer`` equal, bit for
  bit, an embedded ``Engine`` driven the same way;
* its memory does not grow without bound: the RSS of this process after
  the storm exceeds the RSS after a warm-up of a tenth of the requests by
  less than ``RSS_GROWTH_MB`` (the tables' rows are bounded: keys come from
  a small universe but for the random bytes).

The requests (seeded, so a failure reproduces): for each call a method of
``ps.proto`` is drawn, then a valid request of it from a pool built over the
server's tables (``t`` dim 4 Adagrad, ``u`` dim 1 SGD with admission, ``f``
dim 3 FTRL with a row cap, scratch tables): 30% are sent as they are, 35%
with a field mutated and 35% with their bytes mutated. Field mutations:
every field of the message (nested ones too) set to an edge value of its
type (empty, random or cut bytes, arrays of the wrong length, NaN and
infinite floats, 0 / 2**63 / 2**64 - 1 for integers, unknown and hostile
names, bad JSON) and the targeted cases: keys not a multiple of 8, gradients
not n*dim floats or of another table's dim, masks of the wrong length,
non-finite gradients, shard_offsets that do not fit (too few, falling,
past the keys, negative, huge), bad specs (JSON that does not parse, is not
an object, names unknown fields or kinds, has values of the wrong type or
out of range), versions out of range, folders that do not exist or are not
absolute or are files, file names escaping the folder (``../x``, an
absolute path, a symlink out) or not being part files. Byte mutations:
truncated, bit-flipped, inserted and deleted bytes, random bytes, another
method's message, a field claiming 4 GB. The client-streamed and
bidirectional calls (Data, Load, ApplyUpdate) send streams of 1 to 6 such
messages, and sometimes a stream of garbage.

Timing (2 cores shared with a CI run): about 13 s for the 10,000 calls, 16 s for
the file; RSS grew by about 10 MB (160 MB before, 170 MB after the warm-up,
170 MB after all).
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor

from wuliang.ps_server import (
    FTRL,
    SGD,
    Adagrad,
    Admission,
    Constant,
    Engine,
    Eviction,
    PullPart,
    PushPart,
    TableSpec,
    TruncatedNormal,
    Uniform,
    shard_of,
)
from wuliang.ps_server.remote import proto
from wuliang.ps_server.remote.client import RemoteServer
from wuliang.ps_server.remote.server import UNARY, PsServer

M = proto.M
SEED = 20240611
REQUESTS = int(os.environ.get("WULIANG_FUZZ_REQUESTS", 10_000))  # fewer while debugging
WARMUP = max(REQUESTS // 10, 1)
VALID_SHARE, FIELD_SHARE = 0.30, 0.35  # the rest: byte mutations
IN_FLIGHT = 8
TIMEOUT = 10.0  # every call's deadline
RSS_GROWTH_MB = 200
SHARDS = 2
GOOD = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION"})
STREAM_IN = {"Load": "LoadRequest", "ApplyUpdate": "UpdateRequest"}
METHODS = sorted([*UNARY, "Data", "Export", "ReadRows", *STREAM_IN])
UNIVERSE = 1000  # keys of the valid requests: 0..999 and a few extremes

TABLES = {
    "t": TableSpec("t", 4, optimizer=Adagrad(0.05), initializer=TruncatedNormal(0.1), seed=1),
    "u": TableSpec(
        "u", 1, optimizer=SGD(0.1), initializer=Constant(0.5), admission=Admission(min_count=2)
    ),
    "f": TableSpec(
        "f",
        3,
        optimizer=FTRL(0.05, l1=0.01),
        initializer=Uniform(-0.1, 0.1),
        eviction=Eviction(max_rows=300, ttl_steps=50),
    ),
}
SCRATCH = {
    "scratch": TableSpec("scratch", 2, optimizer=SGD(0.1)),
    "s2": TableSpec("s2", 5, optimizer=Adagrad(0.1), precision="fp16"),
}
NAMES = ["t", "u", "f", "scratch", "s2", "", "nope", "T", "t ", "é", "表", "a" * 300, "\x00",
         "../t", "t/u", ".t"]  # fmt: skip
BIG_U64 = [0, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]
BIG_U32 = [0, 1, 7, 2**16, 2**31, 2**32 - 1]
BAD_JSON = ["", "{", "[]", "null", "5", '"t"', "{}", '{"name": "t"}', '{"name": 5, "dim": 4}',
            '{"name": "t", "dim": 4, "nope": 1}', '{"name": "x", "dim": 1e999}',
            '{"name": "x", "dim": NaN}', "[" * 5000 + "]" * 5000,
            '{"name": "x", "dim": 4}' * 2]  # fmt: skip
# JSON values for a spec's fields: wrong types, out of range; never a valid
# large reserve or dim (a fuzzer must not make the test process allocate gigabytes)
JSON_VALUES: list[Any] = [None, True, -1, 0, 1.5, "1", [], {}, 2**32, 2**63, 2**64, 2**70,
                          float("nan"), float("inf"), "Adam", {"kind": "Nope"}]  # fmt: skip
SAFE_INTS = {"dim": [0, -1, 65537, 2**64, 1, 3, 7], "reserve_rows": [-1, 2**50, 2**63, 2**64, 10]}


# -- the server -----------------------------------------------------------------------


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The server, its tables filled a little, part files of ``t`` written
    into a version folder, and junk files beside them."""
    ps = PsServer(Engine(SHARDS), "127.0.0.1", 0)
    address = f"127.0.0.1:{ps.port}"
    client = RemoteServer([address], timeout=30.0, retry_seconds=5.0)
    try:
        rng = np.random.default_rng(SEED)
        for spec in (*TABLES.values(), *SCRATCH.values()):
            client.create_table(spec)
        for step in range(1, 4):
            for name, spec in TABLES.items():
                keys = rng.integers(0, UNIVERSE, 200).astype(np.uint64)
                client.pull(name, keys, step=step)
                grads = rng.normal(0, 1, (200, spec.dim)).astype(np.float32)
                client.push(name, keys, grads, step=step)
        folder = tmp_path / "version"
        folder.mkdir()
        files, _ = client.write_rows(folder, TABLES["t"], state=True)
        parts = [path for path, _ in files]
        (folder / "tables" / "t" / "junk.arrow").write_bytes(b"ARROW1" + bytes(100))
        (folder / "tables" / "t" / "empty.arrow").write_bytes(b"")
        valid = (folder / parts[0]).read_bytes()
        (folder / "tables" / "t" / "cut.arrow").write_bytes(valid[: len(valid) // 2])
        (folder / "tables" / "t" / "link.arrow").symlink_to("/etc/hostname")
        (folder / "tables" / "t" / "dir.arrow").mkdir()
        (tmp_path / "file.txt").write_text("not a folder")
        yield {"server": ps, "address": address, "client": client, "folder": folder,
               "parts": parts, "root": tmp_path}  # fmt: skip
    finally:
        client.close()
        ps.stop(grace=None)


# -- valid requests -------------------------------------------------------------------


class Pools:
    """Valid requests of every method, over the server's tables and files."""

    def __init__(self, rnd: random.Random, folder: Path, parts: list[str]) -> None:
        self.rnd = rnd
        self.folder = folder
        self.parts = parts

    def keys(self, n: int | None = None) -> np.ndarray:
        n = self.rnd.randint(0, 40) if n is None else n
        keys = np.array([self.rnd.randrange(UNIVERSE) for _ in range(n)], np.uint64)
        if n and self.rnd.random() < 0.1:
            keys[self.rnd.randrange(n)] = self.rnd.choice([2**64 - 1, 2**63, 0])
        return keys

    def table(self) -> str:
        return self.rnd.choice(list(TABLES) * 3 + list(SCRATCH))

    def dim(self, table: str) -> int:
        return {**TABLES, **SCRATCH}[table].dim

    def step(self) -> dict[str, Any]:
        has = self.rnd.random() < 0.7
        return {"has_step": has, "step": self.rnd.randint(1, 60) if has else 0}

    def offsets(self, keys: np.ndarray) -> tuple[np.ndarray, bytes]:
        """Keys grouped by shard, and their offsets."""
        shards = shard_of(keys, SHARDS)
        order = np.argsort(shards, kind="stable")
        bounds = np.searchsorted(shards[order], np.arange(SHARDS + 1)).astype("<i8")
        return keys[order], bounds.tobytes()

    def pull(self) -> Any:
        request = M["PullRequest"](train=self.rnd.random() < 0.7, **self.step())
        for _ in range(self.rnd.randint(1, 3)):
            table, keys = self.table(), self.keys()
            part = request.parts.add(table=table)
            if self.rnd.random() < 0.3:
                keys, part.shard_offsets = self.offsets(np.unique(keys))
            part.keys = keys.tobytes()
        return M["DataRequest"](pull=request)

    def push(self) -> Any:
        unique = self.rnd.random() < 0.5
        only = self.rnd.choice(["all", "updated", "rest", ""]) if unique else "all"
        request = M["PushRequest"](
            unique=unique, only=only, client=self.rnd.choice(["", "c1", "c2"]),
            seq=self.rnd.randint(0, 3), **self.step(),
        )  # fmt: skip
        for _ in range(self.rnd.randint(1, 3)):
            table = self.rnd.choice(list(TABLES))
            keys = self.keys()
            if unique:
                keys = np.unique(keys)
            grads = np.array(
                [[self.rnd.gauss(0, 1) for _ in range(self.dim(table))] for _ in keys], "<f4"
            ).reshape(len(keys), self.dim(table))
            part = request.parts.add(table=table, grads=grads.tobytes())
            if unique and self.rnd.random() < 0.3:
                keys, part.shard_offsets = self.offsets(keys)
                part.grads = grads.tobytes()
            part.keys = keys.tobytes()
            if self.rnd.random() < 0.4:
                part.updated_mask = bytes(self.rnd.randint(0, 1) for _ in keys)
        return M["DataRequest"](push=request)

    def data(self) -> Any:
        return self.pull() if self.rnd.random() < 0.5 else self.push()

    def rows(self, table: str) -> Any:
        """A ``Rows`` message of a table (of unique keys; some columns left
        empty at random, which loads and updates fill with defaults)."""
        spec = {**TABLES, **SCRATCH}[table]
        keys = np.unique(self.keys())
        rows = M["Rows"](keys=keys.tobytes(), dim=spec.dim)
        rows.weights = np.full((len(keys), spec.dim), 0.25, "<f4").tobytes()
        if self.rnd.random() < 0.5:
            rows.state_dim = spec.state_dim
            rows.state = np.full((len(keys), spec.state_dim), 0.5, "<f4").tobytes()
        for name, dtype in (("counts", "<u4"), ("steps", "<u8"), ("times", "<u4"),
                            ("versions", "<u8")):  # fmt: skip
            if self.rnd.random() < 0.5:
                setattr(rows, name, np.ones(len(keys), dtype).tobytes())
        return rows

    def spec_json(self) -> str:
        spec = self.rnd.choice([*TABLES.values()] * 3 + [*SCRATCH.values()])
        return json.dumps(spec.to_dict())

    def unary(self, method: str) -> Any:
        r, table = self.rnd, self.table()
        if method in ("Info", "Tables", "GetVersion", "AdvanceVersion", "GetClock"):
            return M["Empty"]()
        if method == "CreateTable":
            return M["Spec"](json=self.spec_json())
        if method == "DropTable":
            return M["TableRequest"](table=r.choice(["scratch", "s2"] * 4 + ["t", "u"]))
        if method in ("GetSpec", "Stats", "CountHistogram", "PendingCounts"):
            return M["TableRequest"](table=r.choice([table, table, ""]))
        if method == "Lookup":
            return M["LookupRequest"](table=table, keys=self.keys().tobytes(),
                                      missing=r.choice(["zeros", "initial", ""]))  # fmt: skip
        if method == "Prefetch":
            return self.pull().pull  # the pull's parts, as a prefetch sends them
        if method in ("Erase", "Contains", "ReadRows"):
            return M["KeysRequest"](table=table, keys=self.keys().tobytes())
        if method in ("Evict", "EvictByAge"):
            return M["EvictRequest"](table=r.choice([table, ""]), **self.step())
        if method == "StepsAtCount":
            return M["CountRequest"](table=table, count=r.randint(0, 5))
        if method == "EvictLeastFrequent":
            return M["LeastFrequentRequest"](
                table=table, threshold=r.randint(0, 3), cutoff=r.randint(0, 60),
                quota=r.randint(0, 20), **self.step(),
            )  # fmt: skip
        if method == "RemovedLog":
            return M["RemovedLogRequest"](table=table, since=r.randint(0, 5))
        if method == "LoadRemoved":
            keys = self.keys()
            versions = np.sort(np.array([r.randint(1, 5) for _ in keys], "<u8"))
            return M["LoadRemovedRequest"](
                table=table, keys=keys.tobytes(), versions=versions.tobytes(), floor=r.randint(0, 1)
            )
        if method == "TrimRemoved":
            return M["TrimRequest"](table=table, upto=r.randint(0, 5))
        if method == "LoadPending":
            keys = np.unique(self.keys())
            counts = np.array([r.randint(1, 3) for _ in keys], "<u4")
            return M["LoadPendingRequest"](table=table, keys=keys.tobytes(),
                                           counts=counts.tobytes())  # fmt: skip
        if method == "RestoreVersion":
            return M["VersionMessage"](version=r.randint(0, 10))
        if method == "SetClock":
            return M["ClockMessage"](seconds=r.choice([0, 0, 1_700_000_000, 2**32 - 1]))
        if method == "WriteRows":
            return M["WriteRowsRequest"](
                folder=str(self.folder), table=table, since=r.randint(0, 3),
                state=r.random() < 0.5, prefix=r.choice(["p-", "q-"]),
            )  # fmt: skip
        if method == "LoadRows":
            return M["LoadRowsRequest"](
                folder=str(self.folder), table="t", files=self.parts,
                server=0, servers=r.choice([1, 1, 2]), since=r.randint(0, 2), **self.step(),
            )  # fmt: skip
        if method == "TopKeys":
            return M["TopKeysRequest"](table=table, n=r.choice([0, 1, 5, 10**6]), **self.step())
        if method == "Job":
            return M["JobRequest"](
                add_steps=r.randint(0, 3), floor=r.randint(0, 50),
                put={r.choice(["ready", "position/0", "x"]): bytes(r.randint(0, 20))},
                get=["ready", "nothing"], has_prefix=r.random() < 0.5, prefix="position/",
            )  # fmt: skip
        if method == "Export":
            return M["ExportRequest"](table=table, since=r.randint(0, 3),
                                      chunk_rows=r.choice([0, 1000, 64]))  # fmt: skip
        raise AssertionError(method)

    def load(self) -> list[Any]:
        table = self.rnd.choice(list(TABLES))
        return [
            M["LoadRequest"](table=table, rows=self.rows(table), **self.step())
            for _ in range(self.rnd.randint(1, 3))
        ]

    def update(self) -> list[Any]:
        """Table headers, then each table's rows and removed keys."""
        label = self.rnd.randint(0, 9)
        names = self.rnd.sample(list(SCRATCH), self.rnd.randint(1, 2))
        messages, full = [], {}
        for name in names:
            spec = json.dumps(SCRATCH[name].to_dict())
            full[name] = self.rnd.random() < 0.5
            header = M["UpdateTable"](table=name, spec=M["Spec"](json=spec), full=full[name])
            messages.append(M["UpdateRequest"](table=header, label=label))
        for name in names:
            for _ in range(self.rnd.randint(0, 2)):
                message = M["UpdateRequest"](label=label)
                message.rows.table = name
                message.rows.rows.CopyFrom(self.rows(name))
                messages.append(message)
            if not full[name] and self.rnd.random() < 0.5:
                removed = M["KeysRequest"](table=name, keys=self.keys().tobytes())
                messages.append(M["UpdateRequest"](removed=removed, label=label))
        return messages


# -- mutations ------------------------------------------------------------------------


def hostile_string(rnd: random.Random, field: str, pools: Pools) -> str:
    if field == "json":
        if rnd.random() < 0.5:
            return rnd.choice(BAD_JSON)
        return mutate_json(json.loads(pools.spec_json()), rnd)
    if field == "folder":
        root = pools.folder
        return rnd.choice(
            [str(root / "missing"), "relative/dir", "", ".", str(root.parent / "file.txt"),
             "/nonexistent-wuliang-fuzz", str(root) + "/../" + root.name, str(root) + "\x00",
             str(root / "tables" / "t" / "link.arrow")]
        )  # fmt: skip
    if field in ("prefix", "files"):
        return rnd.choice(["../x", "/etc/passwd", "tables/t/../../../x", "", "\x00", ".hidden",
                           "tables/t/junk.arrow", "tables/t/empty.arrow", "tables/t/cut.arrow",
                           "tables/t/link.arrow", "tables/t/dir.arrow", "tables/t/none.arrow",
                           "tables", "p-", "a/b", "x" * 5000])  # fmt: skip
    if field in ("only", "missing"):
        return rnd.choice(["ALL", "none", "zeros ", "", "updated", "rest", "initial", "\x00"])
    return rnd.choice([*NAMES, "x" * 10_000])


def mutate_json(value: Any, rnd: random.Random) -> str:
    """A spec's JSON with one value (at any depth) replaced, or a key dropped or added."""
    node, key = value, None
    parents = []
    while isinstance(node, dict) and node:
        key = rnd.choice(list(node))
        parents.append((node, key))
        if not isinstance(node[key], dict) or rnd.random() < 0.4:
            break
        node = node[key]
    if not parents:
        return json.dumps(value)
    parent, key = parents[-1]
    what = rnd.random()
    if what < 0.15:
        del parent[key]
    elif what < 0.25:
        parent["unknown_field"] = 1
    elif key in SAFE_INTS:
        parent[key] = rnd.choice(SAFE_INTS[key])
    else:
        parent[key] = rnd.choice(JSON_VALUES)
    return json.dumps(value)  # NaN and Infinity as JSON's extensions


def hostile_bytes(rnd: random.Random, field: str, data: bytes) -> bytes:
    """An array field's bytes made wrong (or right, but hostile)."""
    kind = rnd.randrange(9)
    if kind == 0:
        return b""
    if kind == 1:
        return data[: -rnd.randint(1, 7)] if data else b"\x01\x02\x03"
    if kind == 2:
        return data + rnd.randbytes(rnd.choice([1, 3, 4, 8, 12]))
    if kind == 3:
        return rnd.randbytes(rnd.randint(1, 64))
    if kind == 4 and field in ("grads", "weights", "state"):
        values = np.frombuffer(data[: len(data) // 4 * 4], "<f4").copy()
        if len(values):
            values[rnd.randrange(len(values))] = rnd.choice([np.nan, np.inf, -np.inf, 3e38])
        return values.tobytes()
    if kind == 5 and field == "shard_offsets":
        return np.array(
            rnd.choice([[0], [0, 1], [0, 5, 2], [3, 2, 1], [-1, 0, 1], [0, 2**62, 2**63 - 1],
                        [0, 0, 10**9], [0, 1, 2, 3, 4], [-(2**63), 0, 0]]), "<i8"
        ).tobytes()  # fmt: skip
    if kind == 6:  # a large array (64 KiB of values)
        return np.arange(8192, dtype="<u8").tobytes()
    if kind == 7 and field in ("keys", "versions", "steps"):
        return np.array([2**64 - 1, 0, 2**63, 2**64 - 1], "<u8").tobytes()
    return data[: len(data) // 2]


def fields_of(message: Any) -> list[tuple[Any, Any]]:
    """(message, field descriptor) of every field, nested messages' too."""
    out = []
    for field in message.DESCRIPTOR.fields:
        out.append((message, field))
        if field.type != FieldDescriptor.TYPE_MESSAGE or field.message_type.GetOptions().map_entry:
            continue  # a map's entries: its keys and values are mutated as a whole
        if field.is_repeated:
            for item in getattr(message, field.name):
                out.extend(fields_of(item))
        elif message.HasField(field.name):
            out.extend(fields_of(getattr(message, field.name)))
    return out


def mutate_field(message: Any, rnd: random.Random, pools: Pools) -> str:
    """One field of ``message`` (at any depth) set to an edge value of its type."""
    candidates = fields_of(message)
    if not candidates:
        return "no_fields"
    owner, field = rnd.choice(candidates)
    name = field.name
    repeated = field.is_repeated
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if field.message_type.GetOptions().map_entry:  # a map: emptied, or a huge value
            entries = getattr(owner, name)
            if rnd.random() < 0.5:
                entries.clear()
            elif field.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_BYTES:
                entries["huge"] = bytes(2 << 20)
            return f"{name}: map"
        if repeated:
            items = getattr(owner, name)
            if len(items) and rnd.random() < 0.5:
                items.append(copy.deepcopy(items[0]))  # a part twice
            else:
                del items[:]
        else:
            owner.ClearField(name)  # a oneof left empty, a missing spec or rows
        return f"{name}_message"
    if repeated:  # repeated strings (files) or bytes
        values = getattr(owner, name)
        if field.type == FieldDescriptor.TYPE_STRING:
            values.append(hostile_string(rnd, name, pools))
        else:
            values.append(rnd.randbytes(rnd.randint(0, 16)))
        return f"{name}_repeated"
    if field.type == FieldDescriptor.TYPE_BYTES:
        setattr(owner, name, hostile_bytes(rnd, name, getattr(owner, name)))
    elif field.type == FieldDescriptor.TYPE_STRING:
        setattr(owner, name, hostile_string(rnd, name, pools))
    elif field.type == FieldDescriptor.TYPE_BOOL:
        setattr(owner, name, not getattr(owner, name))
    elif field.type == FieldDescriptor.TYPE_UINT32:
        setattr(owner, name, rnd.choice(BIG_U32))
    else:
        setattr(owner, name, rnd.choice(BIG_U64))
    return name


def mutate_targeted(message: Any, rnd: random.Random) -> str | None:
    """The cases named in the module docstring that a field mutation rarely
    builds: another table's dim, unknown tables, shard_offsets that do not fit."""
    if message.DESCRIPTOR.name != "DataRequest":
        return None
    kind = message.WhichOneof("call")
    if kind is None:
        return None
    parts = getattr(message, kind).parts
    if not len(parts):
        return None
    part = parts[rnd.randrange(len(parts))]
    choice = rnd.randrange(4)
    if choice == 0:
        part.table = rnd.choice(["nope", "", "T"])
        return "unknown_table"
    n = len(part.keys) // 8
    if choice == 1 and kind == "push":  # grads of another table's dim
        part.grads = np.zeros((n, rnd.choice([1, 2, 3, 5, 8])), "<f4").tobytes()
        return "grads_dim"
    if choice == 2:
        offsets = np.array(sorted(rnd.randint(0, n + 3) for _ in range(SHARDS + 1)), "<i8")
        part.shard_offsets = offsets.tobytes()
        return "offsets_unfit"
    if kind == "push":
        part.updated_mask = bytes(n + rnd.choice([-1, 1, 7]) if n else 3)
        return "mask_length"
    return None


def edit_bytes(data: bytes, rnd: random.Random, others: list[bytes]) -> tuple[str, bytes]:
    """A byte-level mutation of a serialized message."""
    kind = rnd.choice(["truncate", "flip", "insert", "delete", "random", "other", "length"])
    if kind == "truncate":
        return kind, data[: rnd.randint(0, max(len(data) - 1, 0))]
    if kind == "flip":
        out = bytearray(data or b"\x00")
        for _ in range(rnd.randint(1, 4)):
            out[rnd.randrange(len(out))] ^= 1 << rnd.randrange(8)
        return kind, bytes(out)
    if kind == "insert":
        at = rnd.randint(0, len(data))
        return kind, data[:at] + rnd.randbytes(rnd.randint(1, 16)) + data[at:]
    if kind == "delete":
        at = rnd.randint(0, len(data))
        return kind, data[:at] + data[at + rnd.randint(1, 16) :]
    if kind == "random":
        return kind, rnd.randbytes(rnd.randint(0, 300))
    if kind == "other":
        return kind, rnd.choice(others)
    return kind, data + b"\x12\xff\xff\xff\xff\x0f" + rnd.randbytes(8)  # field 2 claims 4 GB


def mutated(
    message: Any, rnd: random.Random, pools: Pools, others: list[bytes], valid: bool = True
) -> tuple[str, bytes]:
    """(what was done, the bytes to send) for one message: sent as it is
    (``VALID_SHARE``, when ``valid``), with a field mutated or its bytes."""
    draw = rnd.random() if valid else VALID_SHARE + rnd.random() * (1 - VALID_SHARE)
    if draw < VALID_SHARE:
        return "valid", message.SerializeToString()
    if draw < VALID_SHARE + FIELD_SHARE:
        copy_ = type(message)()
        copy_.CopyFrom(message)
        name = (mutate_targeted(copy_, rnd) if rnd.random() < 0.3 else None) or mutate_field(
            copy_, rnd, pools
        )
        return f"field_{name}", copy_.SerializeToString()
    name, data = edit_bytes(message.SerializeToString(), rnd, others)
    return f"bytes_{name}", data


Case = tuple[str, str, Any]  # method, what was done, bytes (a list of them for streams)


def cases(rnd: random.Random, pools: Pools, count: int) -> Iterator[Case]:
    others = [pools.unary(m).SerializeToString() for m in ("Lookup", "LoadRows", "CreateTable")]
    others += [pools.data().SerializeToString(), pools.load()[0].SerializeToString()]
    for _ in range(count):
        method = rnd.choice(METHODS)
        if method in ("Data", "Load", "ApplyUpdate"):
            if rnd.random() < 0.05:
                garbage = [rnd.randbytes(rnd.randint(0, 200)) for _ in range(rnd.randint(1, 6))]
                yield method, "garbage_stream", garbage
                continue
            if method == "Data":
                messages = [pools.data() for _ in range(rnd.randint(1, 6))]
            elif method == "Load":
                messages = pools.load()
            else:
                messages = pools.update()
                if rnd.random() < 0.2:
                    rnd.shuffle(messages)  # rows before their header, headers late
            sent = [("valid", m.SerializeToString()) for m in messages]
            if rnd.random() >= VALID_SHARE:  # some messages mutated, the others valid
                for i in rnd.sample(range(len(sent)), rnd.randint(1, len(sent))):
                    sent[i] = mutated(messages[i], rnd, pools, others, valid=False)
            what = ",".join(sorted({w for w, _ in sent}))
            yield method, what, [data for _, data in sent]
        else:
            what, data = mutated(pools.unary(method), rnd, pools, others)
            yield method, what, data


# -- calling ------------------------------------------------------------------------


def call(channel: grpc.Channel, case: Case) -> list[str]:
    """The statuses of one call: its own, and for Data each answer's."""
    method, _, payload = case
    path = proto.method_path(method)
    try:
        if method == "Data":
            answers = list(channel.stream_stream(path)(iter(payload), timeout=TIMEOUT))
            codes = [M["DataResponse"].FromString(a).error_code or "OK" for a in answers]
            if len(answers) != len(payload):
                codes.append(f"ANSWERS_{len(answers)}_OF_{len(payload)}")
            return ["OK", *codes]
        if method in ("Export", "ReadRows"):
            for _ in channel.unary_stream(path)(payload, timeout=TIMEOUT):
                pass
        elif method in STREAM_IN:
            channel.stream_unary(path)(iter(payload), timeout=TIMEOUT)
        else:
            channel.unary_unary(path)(payload, timeout=TIMEOUT)
        return ["OK"]
    except grpc.RpcError as error:
        return [error.code().name]


def storm(
    address: str, stream: Iterator[Case], counts: collections.Counter, failures: list[str]
) -> None:
    """Sends every case, ``IN_FLIGHT`` at a time; counts the statuses and
    records the cases answered with a status a bad request must not get."""
    lock = threading.Lock()
    options = [("grpc.max_receive_message_length", 256 << 20)]
    with grpc.insecure_channel(address, options=options) as channel:

        def worker() -> None:
            while True:
                with lock:
                    case = next(stream, None)
                if case is None:
                    return
                codes = call(channel, case)
                with lock:
                    for code in codes:
                        counts[f"{case[0]} {code}"] += 1
                    bad = [c for c in codes if c not in GOOD]
                    if bad:
                        payload = case[2] if isinstance(case[2], bytes) else case[2][:3]
                        failures.append(f"{case[0]} {case[1]} -> {bad}: {payload!r:.400}")

        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            for future in [pool.submit(worker) for _ in range(IN_FLIGHT)]:
                future.result()


# -- the test ---------------------------------------------------------------------------


def same_as_engine(client: RemoteServer) -> None:
    """Fresh tables on the server and on an embedded engine, driven the same
    way, give the same rows bit for bit."""
    engine = Engine(SHARDS)
    rng = np.random.default_rng(SEED + 1)
    specs = [
        TableSpec("check8", 8, optimizer=Adagrad(0.05), initializer=TruncatedNormal(0.1), seed=5),
        TableSpec("check1", 1, optimizer=FTRL(0.05), initializer=Uniform(-0.1, 0.1)),
    ]
    try:
        for spec in specs:
            client.create_table(spec)
            engine.create_table(spec)
        for step in range(1, 5):
            keys = [rng.integers(0, 300, 128).astype(np.uint64) for _ in specs]
            grads = [rng.normal(0, 1, (128, s.dim)).astype(np.float32) for s in specs]
            rows, results = [], []
            for ps in (client, engine):
                outs = [np.empty((128, s.dim), np.float32) for s in specs]
                pulls = [PullPart(s.name, k, o) for s, k, o in zip(specs, keys, outs, strict=True)]
                ps.pull_many(pulls, step=step)
                rows.append(outs)
                pushes = [
                    PushPart(s.name, k, g) for s, k, g in zip(specs, keys, grads, strict=True)
                ]
                results.append(ps.push_many(pushes, step=step))
            for a, b in zip(*rows, strict=True):
                np.testing.assert_array_equal(a, b, strict=True)
            assert results[0] == results[1]
        everything = np.arange(300, dtype=np.uint64)
        for spec in specs:
            np.testing.assert_array_equal(
                client.pull(spec.name, everything, train=False),
                engine.pull(spec.name, everything, train=False),
                strict=True,
            )
    finally:
        engine.close()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_random_and_mutated_requests(
    server: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """``REQUESTS`` random and mutated calls over every RPC: each gets a
    status other than INTERNAL/UNKNOWN, none hangs, the server still pulls
    and pushes correctly afterwards and its memory stays bounded."""
    caplog.set_level(logging.ERROR, logger="wuliang.ps")
    pools = Pools(random.Random(SEED), server["folder"], server["parts"])
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []
    rss_start = rss_mb()
    start = time.perf_counter()
    storm(server["address"], cases(random.Random(SEED + 1), pools, WARMUP), counts, failures)
    rss_warm, warm_seconds = rss_mb(), time.perf_counter() - start
    rest = REQUESTS - WARMUP
    storm(server["address"], cases(random.Random(SEED + 2), pools, rest), counts, failures)
    rss_end, seconds = rss_mb(), time.perf_counter() - start
    summary = (
        f"{REQUESTS} calls in {seconds:.1f} s (warm-up {warm_seconds:.1f} s); RSS "
        f"{rss_start:.0f} MB before, {rss_warm:.0f} MB after the warm-up, {rss_end:.0f} MB "
        f"after all; statuses: {dict(sorted(counts.items()))}"
    )
    print(summary)
    examples = "\n".join(failure[:700] for failure in failures[:20])
    assert not failures, f"{len(failures)} calls answered badly, e.g.:\n{examples}"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[:5]
    for method in METHODS:  # every RPC was called, some calls of each passed, some failed
        codes = {k.split()[1] for k in counts if k.split()[0] == method}
        assert "OK" in codes and len(codes) > 1, (method, codes)
    assert counts.total() >= REQUESTS

    # the server is alive and still right
    with grpc.insecure_channel(server["address"]) as channel:
        info = channel.unary_unary(proto.method_path("Info"))(b"", timeout=TIMEOUT)
        assert M["InfoResponse"].FromString(info).shards == SHARDS
    same_as_engine(server["client"])
    assert rss_end - rss_warm < RSS_GROWTH_MB, summary


def test_the_checks_can_fail(server: dict[str, Any]) -> None:
    """The storm's judge reports what it must: a call answered with a status
    a bad request must not get (here UNIMPLEMENTED, a method the server does
    not have) is a failure."""
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []
    storm(server["address"], iter([("Nope", "unknown_method", b"")]), counts, failures)
    assert counts == {"Nope UNIMPLEMENTED": 1}
    assert len(failures) == 1 and "UNIMPLEMENTED" in failures[0], failures


def test_named_hostile_requests(server: dict[str, Any]) -> None:
    """Requests the storm draws at random, each answered as it must be: the
    data calls' array checks, non-finite gradients dropped and counted,
    paths outside the version folder refused, JSON nested too deeply
    INVALID_ARGUMENT (it was FAILED_PRECONDITION), an export asking for
    chunks of 2**32 - 1 rows served in chunks that fit a message (it was
    INTERNAL: the engine allocated a buffer of that many rows), and a table
    of dim 1 pulled and pushed (its rows were sent 1-D and refused)."""
    folder = server["folder"]
    with grpc.insecure_channel(server["address"]) as channel:

        def unary(method: str, message: Any) -> str:
            try:
                channel.unary_unary(proto.method_path(method))(
                    message.SerializeToString(), timeout=TIMEOUT
                )
                return "OK"
            except grpc.RpcError as error:
                return error.code().name

        def data(*requests: Any) -> list[Any]:
            stream = channel.stream_stream(proto.method_path("Data"))
            raw = [r.SerializeToString() for r in requests]
            answers = [M["DataResponse"].FromString(a) for a in stream(iter(raw), timeout=TIMEOUT)]
            assert len(answers) == len(requests)
            return answers

        keys = np.arange(10, dtype="<u8")

        def push(table: str, grads: bytes, **part: Any) -> Any:
            message = M["PushPart"](table=table, keys=keys.tobytes(), grads=grads, **part)
            return M["DataRequest"](push=M["PushRequest"](parts=[message], only="all"))

        def pull(table: str, keys_bytes: bytes, **part: Any) -> Any:
            message = M["PullPart"](table=table, keys=keys_bytes, **part)
            return M["DataRequest"](pull=M["PullRequest"](parts=[message], train=True))

        nan = np.ones((10, 4), "<f4")
        nan[3, 1] = np.nan
        nan[7, 0] = np.inf
        answers = data(
            pull("t", keys.tobytes()[:-1]),  # keys not a multiple of 8 bytes
            push("t", np.ones((10, 3), "<f4").tobytes()),  # another dim's gradients
            push("t", np.ones(41, "<f4").tobytes()),  # not n * dim floats
            push("t", np.ones((10, 4), "<f4").tobytes(), updated_mask=bytes(9)),
            pull("t", keys.tobytes(), shard_offsets=np.array([0, 4, 11], "<i8").tobytes()),
            pull("t", keys.tobytes(), shard_offsets=np.array([0, 10], "<i8").tobytes()),
            pull("nope", keys.tobytes()),
            push("t", nan.tobytes()),  # non-finite rows are dropped and counted
            push("u", np.full((10, 1), 0.5, "<f4").tobytes()),  # a table of dim 1
            pull("u", keys.tobytes()),
        )
        codes = [a.error_code or "OK" for a in answers]
        assert codes == ["INVALID_ARGUMENT"] * 6 + ["NOT_FOUND", "OK", "OK", "OK"], [
            (a.error_code, a.error_message) for a in answers
        ]
        assert "keys" in answers[0].error_message and "grads" in answers[1].error_message
        assert answers[7].push.dropped_nan == 2 and answers[7].push.applied == 8
        assert len(answers[9].pull.rows[0]) == 10 * 4  # ten rows of one float

        deep = M["Spec"](json="[" * 5000 + "]" * 5000)
        assert unary("CreateTable", deep) == "INVALID_ARGUMENT"
        for files in (["../x"], ["/etc/hostname"], ["tables/t/link.arrow"]):
            request = M["LoadRowsRequest"](folder=str(folder), table="t", files=files, servers=1)
            assert unary("LoadRows", request) == "INVALID_ARGUMENT", files
        for where in ("relative", str(folder / "missing"), str(server["root"] / "file.txt")):
            request = M["LoadRowsRequest"](folder=where, table="t", files=server["parts"])
            assert unary("LoadRows", request) == "FAILED_PRECONDITION", where
            request = M["WriteRowsRequest"](folder=where, table="t", prefix="p-")
            assert unary("WriteRows", request) == "FAILED_PRECONDITION", where
        for table, prefix in (("t", "../"), ("../t", "p-"), ("t", ".hidden"), ("t", "a/b")):
            request = M["WriteRowsRequest"](folder=str(folder), table=table, prefix=prefix)
            assert unary("WriteRows", request) == "INVALID_ARGUMENT", (table, prefix)

        export = channel.unary_stream(proto.method_path("Export"))
        request = M["ExportRequest"](table="t", chunk_rows=2**32 - 1).SerializeToString()
        rows = sum(len(M["Rows"].FromString(m).keys) // 8 for m in export(request, timeout=TIMEOUT))
        stats = channel.unary_unary(proto.method_path("Stats"))
        answer = stats(M["TableRequest"](table="t").SerializeToString(), timeout=TIMEOUT)
        assert rows == json.loads(M["Json"].FromString(answer).json)["rows"] > 0


def test_the_version_does_not_wrap(server: dict[str, Any]) -> None:
    """RestoreVersion above 2**63 - 1 is refused (advancing from 2**64 - 1
    would wrap to 0, and rows changed afterwards would fall out of deltas);
    from 2**63 - 1 the version advances to 2**63."""
    with grpc.insecure_channel(server["address"]) as channel:
        restore = channel.unary_unary(proto.method_path("RestoreVersion"))
        with pytest.raises(grpc.RpcError) as refused:
            restore(M["VersionMessage"](version=2**64 - 1).SerializeToString(), timeout=TIMEOUT)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2**63 - 1" in refused.value.details()
        restore(M["VersionMessage"](version=2**63 - 1).SerializeToString(), timeout=TIMEOUT)
        advance = channel.unary_unary(proto.method_path("AdvanceVersion"))
        answer = advance(M["Empty"]().SerializeToString(), timeout=TIMEOUT)
        assert M["VersionMessage"].FromString(answer).version == 2**63
