"""The job board and a trainer's part in a job, without TensorFlow: the step
counted by every trainer and raised to the highest seen, values put and
taken, the chief's ready mark waited for (and the wait bounded, naming the
chief), finished trainers, a restored server's board, the tower's optimizer
mapped onto the engine's, and periodic hooks that fire when a cluster's
steps jump past their multiple."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from wuliang.job import Job, JobError
from wuliang.ps_server import Engine
from wuliang.ps_server.cluster import Cluster
from wuliang.ps_server.job import POSITION, READY, JobBoard, checkpoint_values
from wuliang.ps_server.remote.client import RemoteServer
from wuliang.ps_server.remote.server import PsServer


@pytest.fixture
def remote() -> Iterator[RemoteServer]:
    servers = [PsServer(Engine(1), "127.0.0.1", 0, threads=4) for _ in range(2)]
    client = RemoteServer([f"127.0.0.1:{s.port}" for s in servers])
    yield client
    client.close()
    for server in servers:
        server.stop(grace=None)


def cluster(task: str, index: int, workers: int = 2) -> Cluster:
    return Cluster.from_dict(
        {
            "cluster": {
                "chief": ["c:1"],
                "worker": [f"w{i}:1" for i in range(workers)],
                "ps": ["p:1"],
            },
            "task": {"type": task, "index": index},
        }
    )


def test_the_board_counts_raises_and_keeps_values() -> None:
    board = JobBoard()
    assert board.apply(add_steps=3).step == 3
    assert board.apply(floor=10, add_steps=2).step == 12  # raised first, then counted
    assert board.apply(floor=5).step == 12  # a floor below changes nothing
    state = board.apply(put={"a": b"1", "position/0": b"{}", "position/1": b"[]"}, get=["a", "x"])
    assert state.values == {"a": b"1"}
    assert board.apply(prefix="position/").values == {"position/0": b"{}", "position/1": b"[]"}
    assert board.apply(put={"a": b""}, get=["a"]).values == {}  # an empty value removes
    with pytest.raises(ValueError, match="add_steps"):
        board.apply(add_steps=-1)
    with pytest.raises(ValueError, match="non-empty name"):
        board.apply(put={"": b"x"})
    with pytest.raises(ValueError, match="more than"):
        board.apply(put={"big": b"x" * (2 << 20)})


@pytest.mark.parametrize("kind", ["embedded", "remote"])
def test_the_board_of_a_parameter_server(kind: str, remote: RemoteServer) -> None:
    ps = Engine(1) if kind == "embedded" else remote
    assert ps.job(add_steps=4).step == 4
    state = ps.job(add_steps=1, floor=100, put={"k": b"v"}, get=["k"], prefix="none/")
    assert (state.step, state.values) == (101, {"k": b"v"})
    assert ps.job(prefix="").values == {"k": b"v"}
    if kind == "remote":  # kept on the first server only
        assert remote._servers[0].address != remote._servers[1].address


def test_a_restored_server_puts_the_checkpoint_on_its_board() -> None:
    values = checkpoint_values(40, {"0": {"a": 1}, "2": {"b": 2}})
    engine = Engine(1)
    state = engine.job(floor=40, put=values, get=[READY], prefix=POSITION)
    assert state.step == 40
    assert json.loads(state.values[READY]) == {"restored_step": 40}
    assert json.loads(state.values["position/2"]) == {"b": 2}


class Position:
    def __init__(self, n: int) -> None:
        self.n = n

    def to_dict(self) -> dict[str, int]:
        return {"n": self.n}


def test_trainers_count_steps_and_share_positions(remote: RemoteServer) -> None:
    chief, worker = Job(remote, cluster("chief", 0)), Job(remote, cluster("worker", 1))
    assert (chief.is_chief, chief.trainer, worker.trainer, worker.trainers) == (True, 0, 2, 3)
    for n in range(50):
        chief.note_step(Position(n))
        worker.note_step(Position(100 + n))
    chief.sync()
    worker.sync()
    assert chief.sync() == worker.sync() == 100  # every step counted once
    assert worker.position() == {"n": 149}
    assert chief.positions() == {"0": {"n": 49}, "2": {"n": 149}}
    worker.put_positions({"1": {"n": 7}})
    assert Job(remote, cluster("worker", 0)).position() == {"n": 7}
    chief.close()
    worker.close()


def test_the_chief_holds_every_trainer_for_a_checkpoints_cut(remote: RemoteServer) -> None:
    chief = Job(remote, cluster("chief", 0))
    busy, idle = Job(remote, cluster("worker", 0)), Job(remote, cluster("worker", 1))
    chief.mark_ready(restored=None)
    busy.wait_ready()
    idle.wait_ready()  # answers holds from now on, without a step
    busy.note_step(Position(1))  # its push begun, not applied
    holds: list[bytes | None] = []
    holder = threading.Thread(target=lambda: holds.append(chief.hold_trainers()))
    holder.start()
    holder.join(timeout=1.0)
    assert holder.is_alive(), "the cut did not wait for the begun push"
    busy.push_done()
    holder.join(timeout=10)
    assert not holder.is_alive() and holds[0] is not None
    assert chief.positions()["1"] == {"n": 1}  # sent with its answer
    stepped = threading.Event()

    def step() -> None:
        busy.note_step(Position(2))
        stepped.set()

    stepper = threading.Thread(target=step)
    stepper.start()
    assert not stepped.wait(0.5), "a push began during the hold"
    chief.release(holds[0])
    assert stepped.wait(10)
    stepper.join()
    busy.push_done()
    assert busy.sync() == chief.sync() == 2
    for job in (chief, busy, idle):
        job.close()


def test_a_held_trainer_flushes_its_changes_before_it_answers(remote: RemoteServer) -> None:
    """A trainer whose changes wait locally (a shared cache) sends them
    (``Job.flush``) after its begun pushes and before its answer, so the
    cut has them; and before it finishes."""
    chief = Job(remote, cluster("chief", 0, workers=1))
    worker = Job(remote, cluster("worker", 0, workers=1))
    order: list[str] = []
    worker.flush = lambda: order.append("flush")
    chief.mark_ready(restored=None)
    worker.wait_ready()
    worker.note_step(Position(1))
    holds: list[bytes | None] = []
    holder = threading.Thread(target=lambda: holds.append(chief.hold_trainers()))
    holder.start()
    holder.join(timeout=0.5)
    assert holder.is_alive() and order == []  # its push is not applied yet
    order.append("pushed")
    worker.push_done()
    holder.join(timeout=10)
    assert not holder.is_alive() and holds[0] is not None
    assert order == ["pushed", "flush"]
    chief.release(holds[0])
    worker.finish()
    assert order == ["pushed", "flush", "flush"]
    for job in (chief, worker):
        job.close()


def test_a_trainer_that_does_not_stop_is_named_and_the_cut_goes_on(
    remote: RemoteServer, caplog: pytest.LogCaptureFixture
) -> None:
    chief = Job(remote, cluster("chief", 0, workers=1))
    Job(remote, cluster("worker", 0, workers=1))  # never joins: no thread answers
    chief.cut_seconds = 0.3
    start = time.monotonic()
    hold = chief.hold_trainers()
    assert time.monotonic() - start < 5
    assert "trainer(s) 1 did not stop for the checkpoint" in caplog.text
    chief.release(hold)
    assert chief.call(get=["hold"]).values == {}
    Job(remote, cluster("worker", 0, workers=1)).finish()  # a finished trainer counts as held
    caplog.clear()
    chief.release(chief.hold_trainers())
    assert "did not stop" not in caplog.text


def test_workers_wait_for_the_chief_and_the_wait_is_bounded(remote: RemoteServer) -> None:
    worker = Job(remote, cluster("worker", 0), wait_seconds=0.3)
    with pytest.raises(JobError, match=r"the chief \(c:1\) has not made the job ready"):
        worker.wait_ready()
    worker.wait_seconds = 30
    chief = Job(remote, cluster("chief", 0))
    timer = threading.Timer(0.3, lambda: chief.mark_ready(restored=None))
    timer.start()
    start = time.monotonic()
    assert worker.wait_ready() == {"restored": None}
    assert time.monotonic() - start < 10
    timer.join()
    worker.close()  # its thread (answering holds) ends
    assert not [t for t in threading.enumerate() if t.name == "wuliang-job"]


def test_the_chief_waits_for_every_trainer_to_finish(remote: RemoteServer) -> None:
    jobs = [Job(remote, cluster("chief", 0))] + [
        Job(remote, cluster("worker", i)) for i in range(2)
    ]
    jobs[0].finish()
    jobs[2].finish()
    with pytest.raises(JobError, match=r"trainer\(s\) 1 did not finish"):
        jobs[0].wait_finished(timeout=0.2)
    jobs[1].finish()
    jobs[0].wait_finished(timeout=5)


def test_the_towers_optimizer_maps_onto_the_engines() -> None:
    keras = pytest.importorskip("keras")
    from wuliang.dense import engine_optimizer
    from wuliang.ps_server.spec import FTRL, SGD, Adagrad, Adam

    assert engine_optimizer(keras.optimizers.SGD(0.1)) == SGD(0.1)
    assert engine_optimizer(keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.2)) == (
        Adagrad(0.05, initial_accumulator=0.2, epsilon=1e-7)
    )
    adam = engine_optimizer(keras.optimizers.Adam(0.002, beta_1=0.8, beta_2=0.99, epsilon=1e-6))
    assert adam == Adam(0.002, beta1=0.8, beta2=0.99, epsilon=1e-6)
    ftrl = engine_optimizer(keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01,
                                                  l2_regularization_strength=0.5))  # fmt: skip
    assert (ftrl.l1, ftrl.l2) == (0.01, 1.0) and isinstance(ftrl, FTRL)
    refused = [
        (keras.optimizers.SGD(0.1, momentum=0.9), "momentum"),
        (keras.optimizers.Adam(0.1, clipnorm=1.0), "clipnorm"),
        (keras.optimizers.AdamW(0.1), "weight_decay"),
        (keras.optimizers.RMSprop(0.1), "RMSprop cannot be applied"),
        (keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)),
         "learning-rate schedule"),
    ]  # fmt: skip
    for optimizer, message in refused:
        with pytest.raises(ValueError, match=message):
            engine_optimizer(optimizer)


def test_a_shared_tower_applies_the_optimizer_as_keras_does() -> None:
    """One Adam step of a tower's variables on the parameter server equals
    Keras's Adam on the same gradients; pulled values land in the variables."""
    keras = pytest.importorskip("keras")
    tf = pytest.importorskip("tensorflow")
    from wuliang.dense import BLOCK, SharedTower, tower_specs

    rng = np.random.default_rng(0)
    shapes = [(300, 7), (7,), (1,)]  # 2,108 floats: 9 blocks, the last one padded
    local = [tf.Variable(rng.normal(size=s).astype(np.float32)) for s in shapes]
    shared = [tf.Variable(v.numpy()) for v in local]
    optimizer = keras.optimizers.Adam(0.01)
    engine = Engine(2)
    for spec in tower_specs(optimizer).values():
        engine.create_table(spec)
    tower = SharedTower(engine, shared, [], is_chief=True)
    assert tower.start() == "filled" and tower.trainable.rows == -(-2108 // BLOCK)
    for _ in range(3):
        grads = [rng.normal(size=s).astype(np.float32) for s in shapes]
        optimizer.apply_gradients(zip([tf.constant(g) for g in grads], local, strict=True))
        tower.push(grads, step=1)
        tower.pull()
        for a, b in zip(local, shared, strict=True):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
    again = SharedTower(engine, [tf.Variable(np.zeros(s, np.float32)) for s in shapes], [], True)
    assert again.start() == "pulled"  # a chief that comes back takes the servers' values
    np.testing.assert_array_equal(again.trainable.variables[0].numpy(), shared[0].numpy())


def test_periodic_hooks_fire_when_a_clusters_steps_jump() -> None:
    from wuliang.hooks.periodic import PeriodicSyncHook

    hook = PeriodicSyncHook(every_steps=10, every_secs=None)
    asked = [0, 3, 8, 13, 14, 29, 30, 31, 40]  # steps jump: other trainers trained between
    due = [s for s in asked if hook.sync_after(s)]
    assert due == [13, 29, 40]  # the first at or past each multiple (steps + 1: 10, 20+30, 40)
    sequential = PeriodicSyncHook(every_steps=10, every_secs=None)
    assert [s for s in range(35) if sequential.sync_after(s)] == [9, 19, 29]


def test_every_k_steps_the_trainers_changes_are_added() -> None:
    """GEO mode: each trainer's change since its last sync is added to the
    servers' values, and each then takes the sum of everyone's."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from wuliang.dense import SharedTower, tower_specs

    engine = Engine(1)
    for spec in tower_specs(keras.optimizers.RMSprop(0.1), sync_steps=3).values():
        engine.create_table(spec)  # any optimizer: the trainers apply it
    start = np.arange(6, dtype=np.float32)
    a = [tf.Variable(start.copy())]
    b = [tf.Variable(np.zeros(6, np.float32))]
    chief = SharedTower(engine, a, [], True, sync_steps=3)
    worker = SharedTower(engine, b, [], False, sync_steps=3)
    assert chief.start() == "filled"
    worker.pull()
    np.testing.assert_array_equal(b[0].numpy(), start)
    for _ in range(2):  # no sync before the third step
        a[0].assign_add(np.ones(6, np.float32))
        b[0].assign_add(np.full(6, 10, np.float32))
        chief.after_step(None, 1)
        worker.after_step(None, 1)
    np.testing.assert_array_equal(engine.lookup("__tower__", np.array([1], np.uint64)).rows[0, :6],
                                  start)  # fmt: skip
    a[0].assign_add(np.ones(6, np.float32))
    chief.after_step(None, 3)  # +3 added
    b[0].assign_add(np.full(6, 10, np.float32))
    worker.after_step(None, 3)  # +30 added, and it takes +33
    np.testing.assert_allclose(b[0].numpy(), start + 33)
    chief.pull()  # a sync with nothing changed: takes everyone's
    np.testing.assert_allclose(a[0].numpy(), start + 33)


def test_non_trainable_variables_follow_the_chiefs() -> None:
    """Batch-norm statistics: the chief writes its values with each push,
    the other trainers take them with each pull (theirs are overwritten)."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from wuliang.dense import SharedTower, tower_specs

    engine = Engine(1)
    for spec in tower_specs(keras.optimizers.SGD(0.1)).values():
        engine.create_table(spec)
    weights = [tf.Variable(np.ones(3, np.float32)) for _ in range(2)]
    moving = [tf.Variable(np.full(300, 5.0, np.float32)), tf.Variable(np.zeros(300, np.float32))]
    chief = SharedTower(engine, [weights[0]], [moving[0]], is_chief=True)
    worker = SharedTower(engine, [weights[1]], [moving[1]], is_chief=False)
    chief.start()
    worker.pull()
    np.testing.assert_array_equal(moving[1].numpy(), 5.0)
    moving[0].assign(np.full(300, 7.0, np.float32))
    moving[1].assign(np.full(300, -1.0, np.float32))  # a worker's own statistics do not count
    worker.push([np.ones(3, np.float32)], step=1)
    chief.push([np.ones(3, np.float32)], step=2)
    worker.pull()
    np.testing.assert_array_equal(moving[1].numpy(), 7.0)
    np.testing.assert_allclose(weights[1].numpy(), 1 - 2 * 0.1)  # both pushes applied


def test_trainers_without_servers_share_nothing_and_are_told(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import wuliang as wl

    config = {
        "cluster": {"chief": ["c:1"], "worker": ["w:1"]},
        "task": {"type": "worker", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with wl.Context() as context:  # no ps tasks: an embedded engine, no job to wait for
        assert context.job is None and context.is_chief and not context.shares_tower
    assert "each trains a model of its own" in caplog.text


def test_a_trainer_of_a_job_with_servers_has_a_job(
    monkeypatch: pytest.MonkeyPatch, remote: RemoteServer
) -> None:
    import wuliang as wl

    config = {
        "cluster": {"chief": ["c:1"], "worker": ["w:1"], "ps": remote.addresses},
        "task": {"type": "worker", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with wl.Context() as context:
        assert context.job is not None and not context.is_chief and context.shares_tower
        assert context.ps.num_servers == 2


def test_each_trainer_of_several_gets_a_cache_of_shared_rows(
    monkeypatch: pytest.MonkeyPatch, remote: RemoteServer
) -> None:
    """Several trainers: each trainer's cache merges its changes (Geo-SGD)
    every ``cache_sync_steps``, and a cut of the job waits for them (the
    job's ``flush``); one trainer writes its rows back whole. A given
    cache that writes rows back whole is refused for several trainers."""
    import wuliang as wl
    from wuliang.ps_server.cache import CachedServer

    config = {
        "cluster": {"chief": ["c:1"], "worker": ["w:1"], "ps": remote.addresses},
        "task": {"type": "chief", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with wl.Context(gpu_cache_rows=64, cache_sync_steps=3) as context:
        assert context.ps.sync_steps == 3
        assert context.job is not None and context.job.flush == context.ps.flush
    whole = CachedServer(RemoteServer(remote.addresses), rows=64, xp="numpy")
    try:
        with pytest.raises(ValueError, match="writes its rows back whole"):
            wl.Context(whole)
    finally:
        whole.close()
    with pytest.raises(ValueError, match="cache_sync_steps must be an int >= 1"):
        wl.Context(gpu_cache_rows=64, cache_sync_steps=0)
    config["cluster"] = {"chief": ["c:1"], "ps": remote.addresses}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with wl.Context(gpu_cache_rows=64) as context:  # one trainer: its cache is the only one
        assert context.job is not None and context.ps.cache_stats() == {}
        assert context.ps.sync_steps is None and context.job.flush is None
