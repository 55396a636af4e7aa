"""Sized tables: a key's vector grows with its base row's decayed score and
shrinks back (hysteresis) by evict; the session trains them as one table of
the widest dim; checkpoints resume exactly; serving answers the tower's
width."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from small_model import (
    Losses,
    batch_features,
    make_session,
    reader,
    trained_export,
    write_data,
)

import wuliang as wl
from wuliang.ps_server import SGD, Engine, Grow, PushPart, TableSpec, Zeros

SIZES = wl.Sizes((2, 8), promote=(3.0,))


def sized_engine(half_life: float = 0.0, click_weight: float = 0.0) -> Engine:
    engine = Engine(num_shards=2)
    engine.create_table(TableSpec("t", 2, optimizer=SGD(0.5), stats_half_life=half_life))
    grow = Grow("t", 4.0, 2.0, click_weight=click_weight)
    engine.create_table(TableSpec("t@6", 4, optimizer=SGD(0.5), initializer=Zeros(), grow=grow))
    return engine


def step(engine: Engine, keys: list[int], shows: list[float], at: int, clicks: Any = None) -> None:
    """A training step: pull both blocks, push ones with the shows given."""
    k = np.array(keys, np.uint64)
    engine.pull("t", k, train=True, step=at)
    engine.pull("t@6", k, train=True, step=at)
    engine.push_many(
        [
            PushPart(
                "t",
                k,
                np.ones((len(k), 2), np.float32),
                shows=np.array(shows, np.float32),
                clicks=None if clicks is None else np.array(clicks, np.float32),
            ),
            PushPart("t@6", k, np.ones((len(k), 4), np.float32)),
        ],
        step=at,
    )


def test_a_key_grows_once_its_base_row_scores_enough() -> None:
    engine = sized_engine()
    for at in (1, 2):
        step(engine, [1, 2], [1.0, 3.0], at)
    keys = np.array([1, 2, 3], np.uint64)
    # key 2 scored 3 after step 1 (below 4), 6 after step 2's base push: its
    # extension row was made by step 2's push, which applied its gradient
    ext = engine.lookup("t@6", keys)
    assert ext.found.tolist() == [False, True, False]
    np.testing.assert_allclose(ext.rows[1], -0.5)  # zeros, then one SGD step of 0.5
    assert (ext.rows[[0, 2]] == 0).all()  # below the threshold: zeros, pushes dropped
    base = engine.lookup("t", keys)
    np.testing.assert_allclose(base.rows[:2], -1.0 + base.rows[:2] + 1.0)
    stats = engine.stats("t@6")
    assert stats["grown"] == 1 and stats["rows"] == 1 and stats["dropped_pending"] == 3
    step(engine, [1], [2.0], 3)  # key 1 reaches 4: grows
    assert engine.lookup("t@6", keys).found.tolist() == [True, True, False]
    assert engine.stats("t@6")["grown"] == 2


def test_clicks_weigh_in_the_score() -> None:
    engine = sized_engine(click_weight=3.0)
    step(engine, [1, 2], [1.0, 1.0], 1, clicks=[1.0, 0.0])  # key 1: 1 + 3 * 1 = 4
    step(engine, [1, 2], [0.0, 0.0], 2)
    assert engine.contains("t@6", np.array([1, 2], np.uint64)).tolist() == [True, False]


def test_evict_shrinks_keys_below_demote_not_between_the_thresholds() -> None:
    engine = sized_engine(half_life=10.0)
    step(engine, [1, 2, 3], [5.0, 5.0, 5.0], 1)
    step(engine, [1, 2, 3], [0.0, 0.0, 0.0], 2)  # all three grew at score 5
    keys = np.array([1, 2, 3], np.uint64)
    assert engine.contains("t@6", keys).all()
    # at step 11 a score of 5 has decayed to 2.5: between demote (2) and promote (4)
    assert engine.evict("t@6", step=11)["shrunk"] == 0
    step(engine, [3], [4.0], 12)  # key 3 keeps up its evidence
    engine.erase("t", np.array([2], np.uint64))  # key 2's base row goes: its block too
    result = engine.evict("t@6", step=25)  # key 1: 5 * 0.5 ** 2.4 = 0.95 < 2
    assert result["shrunk"] == 2 and result["total"] == 2
    assert engine.contains("t@6", keys).tolist() == [False, False, True]
    assert sorted(engine.removed_keys("t@6").tolist()) == [1, 2]
    assert engine.stats("t@6")["shrunk"] == 2
    step(engine, [1], [1.0], 26)  # below promote again: stays small (hysteresis)
    assert not engine.contains("t@6", np.array([1], np.uint64))[0]


def test_bad_sizes_and_grow_rules_are_refused_by_name() -> None:
    engine = Engine(num_shards=1)
    with pytest.raises(ValueError, match=r"grow_base 'base'.*created first"):
        engine.create_table(TableSpec("x@4", 2, grow=Grow("base", 2.0, 1.0)))
    engine.create_table(TableSpec("base", 2))
    engine.create_table(TableSpec("x@4", 2, grow=Grow("base", 2.0, 1.0)))
    with pytest.raises(ValueError, match=r"cannot drop table 'base'.*'x@4' grows from it"):
        engine.drop_table("base")
    engine.drop_table("x@4")
    engine.drop_table("base")
    with pytest.raises(ValueError, match="demote must be <= promote"):
        Grow("base", 1.0, 2.0)
    with pytest.raises(ValueError, match="dims must increase"):
        wl.Sizes((8, 4), promote=(1.0,))
    with pytest.raises(ValueError, match="promote needs one threshold per size"):
        wl.Sizes((2, 4, 8), promote=(1.0,))
    with pytest.raises(ValueError, match=r"last of sizes .* must be the table's dim 16"):
        wl.EmbeddingTable("t", 16, sizes=SIZES)
    with pytest.raises(ValueError, match="'@' marks a sized table's blocks"):
        wl.EmbeddingTable("a@b", 8)
    table = wl.EmbeddingTable("t", 8, sizes=wl.Sizes((2, 4, 8), promote=(2.0, 6.0)))
    blocks = table.blocks()
    assert [(b.name, b.dim) for b in blocks] == [("t", 2), ("t@4", 2), ("t@8", 4)]
    assert blocks[2].grow == Grow("t", 6.0, 3.0)  # demote: half of promote by default
    assert table.block_columns == [("t", 0, 2), ("t@4", 2, 4), ("t@8", 4, 8)]
    spec = blocks[1].spec()
    assert TableSpec.from_dict(spec.to_dict()) == spec
    assert "grow" not in blocks[0].spec().to_dict()  # a plain table's dict is unchanged


def test_a_session_trains_a_sized_table_as_one_of_the_widest_dim(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    session = make_session(sizes=SIZES, evict_every_steps=10)
    try:
        session.train(reader(files, 0), steps=30)
        ps = session.context.ps
        assert sorted(ps.tables()) == ["items", "users", "users@8"]
        grown = ps.stats("users@8")
        assert 0 < grown["rows"] < ps.stats("users")["rows"]
        batch = next(iter(reader(files, 0)))
        pooled = np.asarray(session.run(batch, ["user"], train=False)["user"])
        assert pooled.shape == (batch.size, 8)
        users = batch.sparse["user"].values.astype(np.uint64)
        big = ps.contains("users@8", users)
        assert big.any() and not big.all()
        assert (pooled[~big, 2:] == 0).all()  # small keys: zeros past their size
        assert (pooled[big, 2:] != 0).any(axis=1).all()
        np.testing.assert_array_equal(pooled[:, :2], ps.lookup("users", users).rows)
        np.testing.assert_array_equal(pooled[big, 2:], ps.lookup("users@8", users[big]).rows)
        evicts = [h for h in session.hooks if isinstance(h, wl.hooks.Evict)]
        assert evicts and all("users@8" in r for _, r in evicts[0].results)
    finally:
        session.close()
        session.context.close()


def train(files: list[str], steps: int, hooks: list[Any]) -> list[float]:
    losses = Losses()
    session = make_session(sizes=SIZES, evict_every_steps=5)
    try:
        session.train(reader(files, 0), steps=steps, hooks=[*hooks, losses])
    finally:
        session.close()
        session.context.close()
    return losses.values


def test_resume_of_a_sized_table_equals_uninterrupted(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    model_dir = tmp_path / "model"
    whole = train(files, 22, [])
    first = train(files, 10, [wl.hooks.Checkpoint(model_dir, every_steps=1000)])
    second = train(files, 12, [wl.hooks.Checkpoint(model_dir, every_steps=1000)])
    assert first + second == whole  # bit for bit: both blocks restored


def test_serving_answers_a_sized_table_at_the_towers_width(tmp_path: Path) -> None:
    from wuliang.serving.client import Client
    from wuliang.serving.grpc.server import GrpcServer
    from wuliang.serving.service import Service
    from wuliang.serving.store import ModelStore

    trained = trained_export(tmp_path, sizes=wl.Sizes((2, 8), promote=(0.5,)))
    session, batch = trained["session"], trained["batch"]
    service = Service([ModelStore(trained["exports"], "m", poll_secs=0).start()])
    server = GrpcServer(service, port=0)
    try:
        with Client(f"127.0.0.1:{server.port}") as client:
            keys = np.array([*range(0, 300, 7), 10**12], np.uint64)
            rows, found, _ = client.lookup("users", keys)
            ps = session.context.ps
            want = np.concatenate(
                [ps.lookup("users", keys).rows, ps.lookup("users@8", keys).rows], axis=1
            )
            assert rows.shape == (len(keys), 8) and found[:-1].any() and not found[-1]
            np.testing.assert_array_equal(rows, want)
            assert (rows[:, 2:] != 0).any()  # some keys grew
            outputs, _ = client.predict(batch_features(batch), rows=batch.size)
            expected = session.run(batch, "predictions", train=False)
            np.testing.assert_allclose(outputs["predictions"], expected, rtol=1e-5, atol=1e-6)
    finally:
        server.stop()
        service.close()
        session.context.close()


def full_vectors(ps: Any, table: wl.EmbeddingTable, keys: np.ndarray) -> np.ndarray:
    """Each key's whole vector: its blocks' lookups side by side."""
    return np.concatenate([ps.lookup(b.name, keys).rows for b in table.blocks()], axis=1)


def test_a_checkpoint_restores_into_other_sizes_by_the_rule(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    model_dir = tmp_path / "model"
    session = make_session(sizes=SIZES, evict_every_steps=None)
    session.train(reader(files, 0), steps=12, hooks=[wl.hooks.Checkpoint(model_dir)])
    ps = session.context.ps
    keys = np.sort(np.concatenate([c.keys for c in ps.export("users")]))
    saved_table = session.context.sized["users"]
    before = full_vectors(ps, saved_table, keys)
    grown = ps.contains("users@8", keys)
    base = {int(k): (s, st) for c in ps.export("users")
            for k, s, st in zip(c.keys, c.shows, c.steps, strict=True)}  # fmt: skip
    session.close()
    session.context.close()

    # three sizes, promote 1.0 and 6.0: the rule on each key's decayed shows decides
    three = wl.Sizes((2, 4, 8), promote=(1.0, 6.0))
    again = make_session(sizes=three, evict_every_steps=None)
    try:
        assert again.restore_checkpoint(model_dir)
        ps = again.context.ps
        assert sorted(ps.tables()) == ["items", "users", "users@4", "users@8"]
        after = full_vectors(ps, again.context.sized["users"], keys)
        shows = np.array([base[int(k)][0] * 0.5 ** ((12 - base[int(k)][1]) / 20) for k in keys])
        old = np.where(grown, 8, 2)
        size = np.full(len(keys), 2)  # demote: half of promote (hysteresis)
        size[(shows >= 1.0) | ((old >= 4) & (shows >= 0.5))] = 4
        size[(shows >= 6.0) | ((old >= 8) & (shows >= 3.0))] = 8
        for k in range(len(keys)):
            want = before[k].copy()
            want[size[k] :] = 0
            np.testing.assert_array_equal(after[k], want)
        assert ps.contains("users@4", keys).tolist() == (size >= 4).tolist()
        assert (size == 4).any() and (size == 8).any() and (size == 2).any()
        again.train(reader(files, 0), steps=2)  # and trains on
    finally:
        again.close()
        again.context.close()

    fixed = make_session(evict_every_steps=None)  # the same table, now fixed at 8
    try:
        assert fixed.restore_checkpoint(model_dir)
        ps = fixed.context.ps
        assert sorted(ps.tables()) == ["items", "users"]
        np.testing.assert_array_equal(ps.lookup("users", keys).rows, before)
        state = np.concatenate([c.state for c in ps.export("users")])
        assert state.shape[1] == 8  # Adagrad: an accumulator per column
    finally:
        fixed.close()
        fixed.context.close()


def test_a_remote_pull_of_a_block_sends_the_grown_rows_only() -> None:
    """A block's rows of keys that have not grown are zeros: the servers send
    the others and a byte per key; the client puts the zeros back."""
    from wuliang.ps_server import PullPart
    from wuliang.ps_server.remote.client import RemoteServer
    from wuliang.ps_server.remote.server import PsServer

    servers = [PsServer(Engine(2), "127.0.0.1", 0, threads=4) for _ in range(2)]
    client = RemoteServer([f"127.0.0.1:{s.port}" for s in servers], timeout=30.0)
    try:
        client.create_table(TableSpec("t", 2, optimizer=SGD(0.5)))
        grow = Grow("t", 1.0, 0.5)
        client.create_table(
            TableSpec("t@34", 32, optimizer=SGD(0.5), initializer=Zeros(), grow=grow)
        )
        keys = np.arange(1000, dtype=np.uint64)
        hot = keys % 10 == 0
        client.push_many(
            [
                PushPart("t", keys, np.ones((1000, 2), np.float32), shows=hot.astype(np.float32)),
                PushPart("t@34", keys, np.ones((1000, 32), np.float32)),
            ],
            step=1,
        )
        before = client.data_bytes()["received"]
        out = np.full((1000, 32), np.nan, np.float32)
        client.pull_many([PullPart("t@34", keys, out)], train=False)
        received = client.data_bytes()["received"] - before
        want = np.zeros((1000, 32), np.float32)
        want[hot] = -0.5
        np.testing.assert_allclose(out, want)
        assert received < 1000 * 32 * 4 / 5  # 100 rows of 128 bytes and 1000 bytes, not 128,000
        dense = np.empty((1000, 2), np.float32)  # a table without zero rows: every row sent
        client.pull_many([PullPart("t", keys, dense)], train=False)
        np.testing.assert_array_equal(dense, client.lookup("t", keys).rows)
    finally:
        client.close()
        for server in servers:
            server.stop(grace=None)


def test_size_stats_report_keys_bytes_and_growth_per_step(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    report = wl.hooks.SizeStats(every_steps=5)
    session = make_session(sizes=SIZES, evict_every_steps=None, hooks=(report,))
    try:
        session.train(reader(files, 0), steps=10)
        stats = session.context.size_stats("users")
        ps = session.context.ps
        rows, grown = ps.stats("users")["rows"], ps.stats("users@8")["rows"]
        assert stats["sizes"][2]["keys"] == rows - grown and stats["sizes"][8]["keys"] == grown
        assert stats["sizes"][8]["bytes"] == ps.stats("users@8")["bytes"] > 0
        assert stats["grown"] == {8: grown} and stats["shrunk"] == {8: 0}
        assert [step for step, _ in report.results] == [5, 10]
        per_step = [r["users"]["grown_per_step"] for _, r in report.results]
        # read without syncing: the pushes still in flight are not counted yet
        assert per_step[0] > 0 and 0 < sum(per_step) * 5 <= grown
        with pytest.raises(KeyError, match="no sized table 'items'"):
            session.context.size_stats("items")
    finally:
        session.close()
        session.context.close()


def test_the_engine_pulls_and_pushes_columns_of_a_wider_array_in_place() -> None:
    from wuliang.ps_server import PullPart

    a, b = Engine(num_shards=2), Engine(num_shards=2)
    for engine in (a, b):
        engine.create_table(TableSpec("t", 3, optimizer=SGD(0.5)))
    keys = np.array([5, 1, 9, 1, 7], np.uint64)  # a repeat: summed gradients
    wide = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    a.push_many([PushPart("t", keys, wide[:, 2:5])], step=1)  # columns 2..4 of each row
    b.push_many([PushPart("t", keys, np.ascontiguousarray(wide[:, 2:5]))], step=1)
    into = np.zeros((5, 8), np.float32)
    a.pull_many([PullPart("t", keys, into[:, 4:7])], train=False)
    np.testing.assert_array_equal(into[:, 4:7], b.lookup("t", keys).rows)
    assert (into[:, :4] == 0).all() and (into[:, 7:] == 0).all()  # nothing else written
    updated = np.zeros((6, 8), np.float32)  # the next step's rows: keys 5, 1, 7 at 5, 0, 2
    rows = np.array([5, 0, -1, -1, 2], np.int32)
    a.push_many([PushPart("t", keys[[0, 1, 2, 4]], wide[[0, 1, 2, 4], 2:5],
                          updated=updated[:, 1:4], updated_rows=rows[[0, 1, 2, 4]])],
                unique=True, step=2)  # fmt: skip
    after = a.lookup("t", keys).rows
    np.testing.assert_array_equal(updated[[5, 0, 2], 1:4], after[[0, 1, 4]])  # keys 5, 1, 7
    with pytest.raises(ValueError, match=r"C-contiguous array \(or columns of one\)"):
        a.pull_many([PullPart("t", keys, np.zeros((3, 5), np.float32).T)], train=False)
    every_other = np.zeros((10, 3), np.float32)  # rows 0, 2, 4, ...: each row contiguous
    a.pull_many([PullPart("t", keys, every_other[::2])], train=False)
    np.testing.assert_array_equal(every_other[::2], a.lookup("t", keys).rows)
    assert (every_other[1::2] == 0).all()


def test_a_sized_table_trains_alike_on_remote_servers(tmp_path: Path) -> None:
    """Remote servers take whole rows: the session pulls a sized table's
    blocks into buffers and assembles them; the losses are the embedded
    engine's (which pulls them in place), bit for bit."""
    from wuliang.ps_server.remote.client import RemoteServer
    from wuliang.ps_server.remote.server import PsServer

    files = write_data(tmp_path)
    embedded = train(files, 12, [])
    servers = [PsServer(Engine(2), "127.0.0.1", 0, threads=4) for _ in range(2)]
    client = RemoteServer([f"127.0.0.1:{s.port}" for s in servers], timeout=30.0)
    try:
        losses = Losses()
        session = make_session(sizes=SIZES, evict_every_steps=5, ps=client)
        assert not client.takes_column_rows
        session.train(reader(files, 0), steps=12, hooks=[losses])
        session.close()
        assert losses.values == embedded
    finally:
        client.close()
        for server in servers:
            server.stop(grace=None)


def test_a_redis_fleet_serves_a_sized_table_at_the_towers_width(
    tmp_path: Path, redis_url: str
) -> None:
    """Published to Redis, a sized table's blocks are tables of the fleet; a
    replica's lookups answer the widest size, as the trainer's rows, and its
    predictions are the trainer's."""
    from wuliang.serving.client import Client
    from wuliang.serving.grpc.server import GrpcServer
    from wuliang.serving.redis.model import RedisModelStore
    from wuliang.serving.redis.publish import publish
    from wuliang.serving.service import Service

    trained = trained_export(tmp_path, sizes=wl.Sizes((2, 8), promote=(0.5,)))
    session, batch = trained["session"], trained["batch"]
    try:
        result = publish(trained["exports"], redis_url)
        assert set(result.rows) == {"users", "users@8", "items"}
        keys = np.array([*range(0, 300, 7), 10**12], np.uint64)
        ps = session.context.ps
        want = np.concatenate([ps.lookup("users", keys).rows, ps.lookup("users@8", keys).rows], 1)
        store = RedisModelStore(redis_url, result.model, trained["exports"], poll_secs=0)
        service = Service([store.start()])
        server = GrpcServer(service, port=0)
        try:
            with Client(f"127.0.0.1:{server.port}") as client:
                rows, found, _ = client.lookup("users", keys, model=result.model)
                assert rows.shape == (len(keys), 8) and not found[-1]
                np.testing.assert_array_equal(rows, want)
                assert (rows[:, 2:] != 0).any()
                outputs, _ = client.predict(batch_features(batch), rows=batch.size,
                                            model=result.model)  # fmt: skip
                expected = session.run(batch, "predictions", train=False)
                np.testing.assert_allclose(outputs["predictions"], expected, rtol=1e-5, atol=1e-6)
        finally:
            server.stop()
            service.close()
    finally:
        session.context.close()


def test_a_sized_table_trains_alike_behind_the_hot_cache(tmp_path: Path) -> None:
    """The hot cache (numpy here, the GPU's code path) passes a sized table's
    blocks and base through uncached and caches the others: the losses are
    the embedded engine's, bit for bit."""
    from wuliang.ps_server import parameter_server

    files = write_data(tmp_path)
    embedded = train(files, 12, [])
    ps = parameter_server("embedded?gpu_cache_rows=64&xp=numpy", num_shards=2)
    try:
        losses = Losses()
        session = make_session(sizes=SIZES, evict_every_steps=5, ps=ps)
        session.train(reader(files, 0), steps=12, hooks=[losses])
        session.close()
        assert losses.values == embedded
        assert ps.stats("users@8")["rows"] > 0
    finally:
        ps.close()
