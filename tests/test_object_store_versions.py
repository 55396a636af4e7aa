"""Checkpoints and exports in object storage: a moto server process is the
object store (``s3_server``), reached through pyarrow's S3 client at
``s3://`` URIs, and every result is compared with the same thing done in a
local folder.

What passing guarantees:

* A checkpoint saved to ``s3://`` and restored in a fresh session gives the
  same rows (with optimizer state and metadata) and the same tower as the
  session that saved it; its rows files are byte for byte those of a local
  checkpoint of the same session. Rotation removes old checkpoints
  (manifest first) and folders a crashed writer left without a manifest.
* A version folder without a manifest (a writer at work, or crashed) is no
  version: ``latest_checkpoint``, a session's restore, the export listing
  and ``ModelStore`` pass it by; a writer that fails leaves nothing.
* A full export and a delta written to ``s3://`` (by the session, and by
  ``wuliang export`` from an ``s3://`` checkpoint) are served by
  ``ModelStore`` (following the directory) and by ``wuliang serve``'s store
  exactly as the same exports from a local folder: lookups and predictions;
  compacting the ``s3://`` chain gives a full version of the same rows.
* Parameter servers (in this process, behind gRPC) write their own part
  files into an ``s3://`` checkpoint and load them back; the checkpoint
  restores into an embedded engine with their rows, and a server that
  comes back takes its own part of it (``wuliang ps --restore``).
* A damaged remote file is refused by name, and no message shows the URI's
  query (it may hold keys).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest
from s3_server import moto_s3
from small_model import make_session, reader, write_data

from wuliang.checkpoint import checkpoints, latest_checkpoint
from wuliang.cli import _serve_options, build_parser
from wuliang.cli import main as cli_main
from wuliang.export import compact
from wuliang.ps_server import Engine, server_of
from wuliang.ps_server.remote.recover import restore_own_part
from wuliang.ps_server.remote.server import PsServer
from wuliang.ps_server.storage import (
    CorruptVersionError,
    RemotePath,
    Version,
    VersionWriter,
    location,
    versions,
)
from wuliang.serving.run import make_store
from wuliang.serving.store import ModelStore

BUCKET = "wuliang-versions"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pafs.S3FileSystem]:
    with moto_s3(tmp_path_factory.mktemp("s3"), (BUCKET,)) as (_, fs):
        yield fs


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_data(tmp_path_factory.mktemp("data"))


def uri(relative: str) -> str:
    return f"s3://{BUCKET}/{relative}"


def objects(fs: pafs.S3FileSystem, relative: str) -> list[str]:
    """The objects under s3://BUCKET/relative, relative to it."""
    selector = pafs.FileSelector(f"{BUCKET}/{relative}", recursive=True, allow_not_found=True)
    root = f"{BUCKET}/{relative}/"
    return sorted(
        i.path[len(root) :] for i in fs.get_file_info(selector) if i.type == pafs.FileType.File
    )


def table_state(session: Any) -> dict[str, dict[int, tuple]]:
    """Every row of every table: vector, optimizer state, count, step, version."""
    state: dict[str, dict[int, tuple]] = {}
    for table in session.context.tables:
        rows = state.setdefault(table, {})
        for chunk in session.context.ps.export(table):
            for i, key in enumerate(chunk.keys.tolist()):
                rows[key] = (
                    chunk.weights[i].tobytes(),
                    chunk.state[i].tobytes(),
                    int(chunk.counts[i]),
                    int(chunk.steps[i]),
                    int(chunk.versions[i]),
                )
    return state


def close(session: Any) -> None:
    session.close()
    session.context.close()


# -- checkpoints ------------------------------------------------------------------------


def test_a_checkpoint_in_s3_restores_rows_and_tower(
    s3: pafs.S3FileSystem, files: list[str], tmp_path: Path
) -> None:
    model = uri("ckpt-model")
    batch = next(iter(reader(files, 0)))
    session = make_session()
    session.train(reader(files, 0), steps=4)
    first = session.save_checkpoint(model, keep=2)
    assert isinstance(first, RemotePath) and str(first) == f"{model}/ckpt-4"
    # what a crashed writer leaves: files, no manifest; not a checkpoint
    s3.copy_file(f"{BUCKET}/ckpt-model/ckpt-4/tables/users/part-00000.arrow",
                 f"{BUCKET}/ckpt-model/ckpt-5/tables/users/part-00000.arrow")  # fmt: skip
    assert [s for s, _ in checkpoints(model)] == [4]
    session.train(reader(files, 0), steps=2)
    session.save_checkpoint(model, keep=2)
    session.train(reader(files, 0), steps=2)
    path = session.save_checkpoint(model, keep=2)
    local = session.save_checkpoint(tmp_path / "model")  # the same rows, locally
    want = table_state(session)
    predictions = session.run(batch, "predictions", train=False)
    close(session)

    # rotation: ckpt-4 went (manifest first, then its files), and the crashed ckpt-5 with it
    assert [s for s, _ in checkpoints(model)] == [6, 8]
    assert objects(s3, "ckpt-model/ckpt-4") == objects(s3, "ckpt-model/ckpt-5") == []
    assert latest_checkpoint(model) == path
    remote, here = Version(path), Version(local)
    assert "manifest.json" in objects(s3, "ckpt-model/ckpt-8")
    assert set(objects(s3, "ckpt-model/ckpt-8")) == {*remote.manifest.files, "manifest.json"}
    rows_files = [f for f in remote.manifest.files if f.startswith("tables/")]
    assert rows_files and all(
        remote.manifest.files[f] == here.manifest.files[f] for f in rows_files
    )  # byte for byte: sizes and sha256
    assert remote.manifest.reader_position == here.manifest.reader_position

    again = make_session()
    assert again.restore_checkpoint(model)  # the newest in the folder
    assert again.global_step == 8 and str(again.restored) == str(path)
    assert table_state(again) == want
    np.testing.assert_array_equal(again.run(batch, "predictions", train=False), predictions)
    # saved again with no step since the restore: the restored tower is copied over
    copied = again.save_checkpoint(uri("ckpt-copy"))
    close(again)
    check = make_session()
    check.restore_checkpoint(copied)
    np.testing.assert_array_equal(check.run(batch, "predictions", train=False), predictions)
    close(check)


def test_a_version_without_its_manifest_is_no_version(
    s3: pafs.S3FileSystem, files: list[str]
) -> None:
    model = uri("partial/model")
    session = make_session()
    session.train(reader(files, 0), steps=3)
    session.save_checkpoint(model)
    spec = session.context.ps.spec("users")
    # a writer that fails leaves nothing behind
    with (
        pytest.raises(RuntimeError, match="stop"),
        VersionWriter(model, "ckpt-9", "checkpoint") as w,
    ):
        w.write_table(spec, session.context.ps.export("users"), state=True)
        assert objects(s3, "partial/model/ckpt-9")  # uploaded part by part
        raise RuntimeError("stop")
    assert objects(s3, "partial/model/ckpt-9") == []
    # one that crashed before its manifest: every file there, the manifest not
    for name in objects(s3, "partial/model/ckpt-3"):
        if name != "manifest.json":
            s3.copy_file(f"{BUCKET}/partial/model/ckpt-3/{name}",
                         f"{BUCKET}/partial/model/ckpt-9/{name}")  # fmt: skip
    assert latest_checkpoint(model) == location(f"{model}/ckpt-3")
    with pytest.raises(CorruptVersionError, match=r"ckpt-9/manifest\.json is missing"):
        Version(f"{model}/ckpt-9")
    again = make_session()
    again.restore_checkpoint(model)
    assert again.global_step == 3

    # exports: version 2 without a manifest is not served, and not listed
    exports = uri("partial/exports")
    session.export(exports)
    for name in objects(s3, "partial/exports/1"):
        if name != "manifest.json":
            s3.copy_file(f"{BUCKET}/partial/exports/1/{name}",
                         f"{BUCKET}/partial/exports/2/{name}")  # fmt: skip
    assert [n for n, _ in versions(exports)] == [1]
    with ModelStore(exports, "m", poll_secs=0, load_towers=False) as store:
        assert store.version == 1 and store.refresh() == []
        assert store.counters.refused == 0
    # the next export clears the leftover and writes version 2 whole
    session.train(reader(files, 0), steps=1)
    assert session.export(exports).version == 2
    assert set(objects(s3, "partial/exports/2")) == {*Version(f"{exports}/2").manifest.files,
                                                     "manifest.json"}  # fmt: skip
    close(session)
    close(again)


# -- exports --------------------------------------------------------------------------


def lookups(store: Any, keys: dict[str, np.ndarray]) -> dict[str, tuple]:
    out = {}
    for table, k in keys.items():
        found = store.lookup(table, k)
        out[table] = (found.rows.tobytes(), found.found.tobytes(), found.version)
    return out


def served(store: Any, keys: dict[str, np.ndarray]) -> tuple[Any, np.ndarray]:
    """Lookups of keys, and the tower's predictions for some pooled inputs."""
    version = store.served()
    inputs = {f.name: np.full((4, 8 if f.name == "user" else 4), 0.25, np.float32)
              for f in version.model.sparse}  # fmt: skip
    inputs.update({d.name: np.ones((4, d.dim), np.float32) for d in version.model.dense})
    return lookups(store, keys), next(iter(version.tower(inputs).values()))


def test_exports_in_s3_serve_as_local_ones(
    s3: pafs.S3FileSystem, files: list[str], tmp_path: Path
) -> None:
    session = make_session()
    session.train(reader(files, 0), steps=4)
    local, remote = tmp_path / "exports", uri("exports/m")
    assert session.export(local).kind == session.export(remote).kind == "full"
    keys = {t: np.array(sorted(rows), np.uint64) for t, rows in table_state(session).items()}
    follower = ModelStore(remote, poll_secs=0).start()  # follows the remote directory
    assert follower.name == "m" and follower.version == 1
    session.train(reader(files, 0), steps=3)
    session.save_checkpoint(uri("exports/model"))
    for root in (local, remote):
        result = session.export(root)
        assert (result.version, result.kind, result.parent) == (2, "delta", 1)
    assert (local / "LATEST").read_text() == location(f"{remote}/LATEST").read_text() == "2\n"
    keys = {t: np.union1d(k, list(table_state(session)[t])).astype(np.uint64)
            for t, k in keys.items()}  # fmt: skip
    close(session)

    with ModelStore(local, poll_secs=0) as store:
        want, predictions = served(store, keys)
    assert follower.refresh() == [2]  # the delta applied live
    got = [served(follower, keys)]
    follower.close()
    args = build_parser().parse_args(["serve", "--exports", remote, "--poll-secs", "0"])
    with make_store(_serve_options(args)) as store:  # as `wuliang serve` opens it
        assert store.version == 2
        got.append(served(store, keys))
    for lookup, predicted in got:
        assert lookup == want
        np.testing.assert_array_equal(predicted, predictions)

    # `wuliang export` from the s3:// checkpoint into an s3:// export directory
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["export", "--model-dir", uri("exports/model"),
                         "--export-dir", uri("exports/job")]) == 0  # fmt: skip
    assert f"-> {uri('exports/job')}/1" in out.getvalue()
    with ModelStore(uri("exports/job"), poll_secs=0, load_towers=False) as store:
        assert lookups(store, keys) == {t: (*v[:2], 1) for t, v in want.items()}
    # compaction of the s3:// chain: one full version with the same rows
    result = compact(remote)
    assert (result.version, result.kind) == (3, "full")
    with ModelStore(remote, poll_secs=0, load_towers=False) as store:
        assert lookups(store, keys) == {t: (*v[:2], 3) for t, v in want.items()}


# -- parameter servers --------------------------------------------------------------------


def test_parameter_servers_write_their_parts_into_s3(
    s3: pafs.S3FileSystem, files: list[str]
) -> None:
    running = [PsServer(Engine(2), "127.0.0.1", 0, threads=8) for _ in range(2)]
    try:
        session = make_session(ps=[f"127.0.0.1:{s.port}" for s in running])
        session.train(reader(files, 0), steps=4)
        path = session.save_checkpoint(uri("servers/model"))
        want = table_state(session)
        parts = [f for f in Version(path).manifest.files if "/part-s" in f]
        assert {p.split("/part-")[1][:2] for p in parts} == {"s0", "s1"}  # each server's
        assert set(parts) <= set(objects(s3, "servers/model/ckpt-4"))
        # back onto the servers (each loads what it owns), and into an embedded engine
        session.restore_checkpoint(path)
        assert table_state(session) == want
        embedded = make_session()
        embedded.restore_checkpoint(path)
        assert table_state(embedded) == want
        close(embedded)
        close(session)
        # a server that comes back takes its part (wuliang ps --restore s3://...)
        engine = Engine(2)
        part = restore_own_part(engine, uri("servers/model"), 1, 2)
        assert part is not None and part.step == 4
        for table, rows in want.items():
            mine = {k for k in rows if server_of([k], 2)[0] == 1}
            assert {int(k) for c in engine.export(table) for k in c.keys} == mine
        engine.close()
    finally:
        for server in running:
            server.stop(grace=None)


# -- damage and secrets -------------------------------------------------------------------


def test_a_damaged_file_is_named_and_queries_are_never_shown(
    s3: pafs.S3FileSystem, files: list[str]
) -> None:
    session = make_session()
    session.train(reader(files, 0), steps=2)
    path = session.save_checkpoint(uri("damaged/model"))
    part = "tables/items/part-00000.arrow"
    data = bytearray(location(f"{path}/{part}").read_bytes())
    data[-100] ^= 0xFF
    location(f"{path}/{part}").write_bytes(bytes(data))
    with pytest.raises(CorruptVersionError, match=f"{path}/{part} does not match its sha256"):
        session.restore_checkpoint(path)

    secret = "NOT-A-REAL-KEY-7"
    with_query = f"{uri('nothing/here')}?access_key=testing&secret_key={secret}"
    for call in (
        lambda: session.restore_checkpoint(with_query),
        lambda: Version(with_query),
        lambda: ModelStore(f"{uri('nothing')}?bogus={secret}"),
    ):
        with pytest.raises((OSError, ValueError)) as raised:
            call()
        assert secret not in str(raised.value)
        assert f"s3://{BUCKET}/nothing" in str(raised.value)
    close(session)


def test_a_model_config_serves_an_export_directory_in_s3(
    s3: pafs.S3FileSystem, files: list[str], tmp_path: Path
) -> None:
    """``wuliang serve --model-config``: a model whose base_path is an
    ``s3://`` URI serves as a local one, its versions kept by the policy."""
    from wuliang.serving.run import ServeOptions, start

    session = make_session()
    session.train(reader(files, 0), steps=2)
    remote = uri("config/ranker")
    session.export(remote)
    session.train(reader(files, 0), steps=1)
    session.export(remote)
    keys = {t: np.array(sorted(rows), np.uint64) for t, rows in table_state(session).items()}
    config = tmp_path / "models.config"
    policy = "model_version_policy { latest { num_versions: 2 } }"
    labels = "version_labels { key: 'stable' value: 1 }"
    entry = f"name: 'ranker' base_path: '{remote}' {policy} {labels}"
    config.write_text(f"model_config_list {{ config {{ {entry} }} }}")
    options = ServeOptions(None, model_config=config, port=0, http_port=-1, poll_secs=0)
    running = start(options)
    try:
        model = running.service.store("ranker")
        assert model.served_versions() == [1, 2]  # type: ignore[attr-defined]
        for table, table_keys in keys.items():
            got = running.service.lookup("ranker", table, table_keys)
            want = session.context.ps.lookup(table, table_keys)
            np.testing.assert_array_equal(got.rows, want.rows)
            assert got.version == 2
            assert running.service.lookup("ranker", table, table_keys, label="stable").version == 1
    finally:
        running.stop()
        close(session)
