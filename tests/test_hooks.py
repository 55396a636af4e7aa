"""Hooks: call order, fetches, stopping, and the standard hooks."""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import wuliang as wl
from wuliang import hooks
from wuliang.ps_server import Normal
from wuliang.reader import Csr, CsrBatch

B = 8
STAGES = {"read", "prepare", "pull", "wait_update", "compute", "push"}  # staleness 0 (default)
OPTIONAL = {"push_linked"}  # pushes whose first half fed the next step's rows


def has_stages(stages: set[str]) -> bool:
    return STAGES <= stages <= STAGES | OPTIONAL


def make_batch(rng: np.random.Generator, size: int = B) -> CsrBatch:
    user = Csr(rng.integers(1, 30, size).astype(np.uint64), np.arange(size + 1, dtype=np.int64))
    x = rng.standard_normal((size, 1)).astype(np.float32)
    y = np.array([0, 1] * (size // 2), np.float32)  # both classes in every batch
    return CsrBatch({"user": user}, x, y, size, {"x": slice(0, 1)})


def batches(n: int, seed: int = 0) -> list[CsrBatch]:
    rng = np.random.default_rng(seed)
    return [make_batch(rng) for _ in range(n)]


class Tower:
    def __init__(self, nan: bool = False) -> None:
        self.layer = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))
        self.nan = nan

    def __call__(self, emb: dict[str, tf.Tensor], dense: dict[str, tf.Tensor]) -> Any:
        logits = self.layer(tf.concat([emb["user"], dense["x"]], axis=1))
        if self.nan:
            logits += tf.math.log(-1.0)
        return logits, {"user_vec": emb["user"] + 1.0}


def new_session(tower: Any = None, session_hooks: tuple[hooks.SessionRunHook, ...] = ()) -> Any:
    table = wl.EmbeddingTable("emb", 4, optimizer=wl.optimizers.SGD(0.1), initializer=Normal(0.3))
    return wl.Session(
        tower or Tower(),
        [wl.SparseFeature("user", table), wl.DenseFeature("x")],
        wl.Context(num_shards=2),
        hooks=session_hooks,
        optimizer=keras.optimizers.SGD(0.1),
    )


@pytest.fixture
def make_session() -> Iterator[Callable[..., Any]]:
    """Builds sessions for one test (``new_session``'s arguments) and closes
    them, and their engines, after it. A fresh session traces its step again
    (~0.2 s), which buys every test its own state."""
    made: list[Any] = []

    def make(*args: Any, **kwargs: Any) -> Any:
        made.append(new_session(*args, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()
        s.context.close()


@pytest.fixture
def session(make_session: Callable[..., Any]) -> Any:
    """A fresh session, for the tests that only add hooks to train()."""
    return make_session()


def due_steps(start: int, steps: int, every: int) -> list[int]:
    """The 1-based global steps an every-N hook acts on in a train() from start."""
    return [n + 1 for n in range(start, start + steps) if (n + 1) % every == 0]


def wuliang_threads() -> list[str]:
    """wuliang's threads, but a parameter server's call threads (its
    ``*_async`` calls), which live until the server is closed."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith("wuliang") and not t.name.startswith("wuliang-ps-call")
    )


class Recorder(hooks.SessionRunHook):
    """Logs every call as (name, method, detail) into a shared list."""

    def __init__(self, name: str, log: list[tuple[str, str, Any]], fetches: tuple = ()) -> None:
        self.name, self.log, self.fetches = name, log, fetches
        self.results: list[dict[str, Any]] = []
        self.contexts: list[hooks.SessionRunContext] = []
        self.timings: list[dict[str, float]] = []

    def begin(self) -> None:
        self.log.append((self.name, "begin", None))

    def after_create_session(self, session: Any) -> None:
        self.log.append((self.name, "after_create_session", session))

    def before_run(self, run_context: hooks.SessionRunContext) -> hooks.SessionRunArgs:
        self.log.append((self.name, "before_run", run_context.step))
        self.contexts.append(run_context)
        return hooks.SessionRunArgs(list(self.fetches))

    def after_run(
        self, run_context: hooks.SessionRunContext, run_values: hooks.SessionRunValues
    ) -> None:
        self.log.append((self.name, "after_run", run_context.step))
        self.results.append(run_values.results)
        self.timings.append(run_values.timings)

    def end(self, session: Any) -> None:
        self.log.append((self.name, "end", session))


# --- the protocol -------------------------------------------------------------------


def test_two_hooks_are_called_in_order(session: Any) -> None:
    log: list[tuple[str, str, Any]] = []
    first, second = Recorder("a", log), Recorder("b", log)
    start = session.global_step
    data = batches(3)
    result = session.train(data, hooks=[first, second])
    assert result["steps"] == 3
    calls = [(name, method) for name, method, _ in log]
    per_step = [("a", "before_run"), ("b", "before_run"), ("a", "after_run"), ("b", "after_run")]
    assert calls == [
        ("a", "begin"),
        ("b", "begin"),
        ("a", "after_create_session"),
        ("b", "after_create_session"),
        *per_step * 3,
        ("a", "end"),
        ("b", "end"),
    ]
    steps = [detail for _, method, detail in log if method in ("before_run", "after_run")]
    assert steps == [s for s in range(start, start + 3) for _ in range(4)]
    assert all(detail is session for _, m, detail in log if m in ("after_create_session", "end"))
    assert [c.batch for c in first.contexts] == data
    assert all(c.train for c in first.contexts)
    assert wuliang_threads() == []


def test_session_hooks_see_run_and_train_and_end_at_close(make_session: Callable[..., Any]) -> None:
    log: list[tuple[str, str, Any]] = []
    hook = Recorder("s", log)
    s = make_session(session_hooks=(hook,))
    data = batches(3)
    s.run(data[0], "loss")
    s.run(data[1], "loss", train=False)
    s.train(data[2:])
    assert [m for _, m, _ in log] == [
        "begin",
        "after_create_session",
        *["before_run", "after_run"] * 3,
    ]
    assert [c.train for c in hook.contexts] == [True, False, True]
    assert [c.step for c in hook.contexts] == [0, 1, 1]  # an eval run does not count
    s.close()
    assert [m for _, m, _ in log][-1] == "end"


def test_before_run_fetches_arrive_in_after_run(session: Any) -> None:
    log: list[tuple[str, str, Any]] = []
    asking = Recorder("ask", log, fetches=("predictions", "user", "user_vec", "loss"))
    quiet = Recorder("quiet", log)
    session.train(batches(2, seed=1), hooks=[asking, quiet])
    for results in asking.results:
        assert set(results) == {"predictions", "user", "user_vec", "loss"}
        assert results["predictions"].shape == (B,)
        assert results["user"].shape == (B, 4)
        np.testing.assert_allclose(results["user_vec"], results["user"] + 1.0, rtol=1e-6)
        assert np.ndim(results["loss"]) == 0
    assert quiet.results == [{}, {}]  # each hook gets what it asked for
    for timings in asking.timings:
        assert {"read", "prepare", "pull", "compute"} <= set(timings)
        assert all(v >= 0 for v in timings.values())

    bad = Recorder("bad", log, fetches=("no_such_output",))
    step = session.global_step
    with pytest.raises(KeyError, match="hook Recorder: cannot fetch 'no_such_output'"):
        session.train(batches(1), hooks=[bad])
    assert session.global_step == step  # checked before the step trains
    assert wuliang_threads() == []


def test_a_bad_fetch_fails_before_anything_trains(make_session: Callable[..., Any]) -> None:
    """Logging asks its fetches at the first step too (not only when due), and a
    hook's names are checked before the step: the typo fails with no step taken
    (the pipeline's early pulls may have created rows; none was pushed);
    tower outputs are known before the first step."""
    s = make_session()
    with pytest.raises(KeyError, match=r"hook Logging: cannot fetch 'los'.*valid names"):
        s.train(batches(3), hooks=[hooks.Logging(every_steps=100, fetches=["los"])])
    assert s.global_step == 0
    log: list[tuple[str, str, Any]] = []
    outputs = Recorder("outputs", log, fetches=("user_vec",))
    assert s.train(batches(1), hooks=[outputs])["steps"] == 1  # a tower output, first step
    assert outputs.results[0]["user_vec"].shape == (B, 4)


def test_session_hooks_in_an_unlabeled_evaluation_run(
    tmp_path: Path, make_session: Callable[..., Any]
) -> None:
    """The standard hooks that fetch the loss skip runs without labels (and
    the training-only ones skip evaluation runs); a hook of the user's that
    asks for the loss of such a batch is named in the error."""
    logged = hooks.Logging(every_steps=1)
    s = make_session(
        session_hooks=(hooks.NanGuard(), hooks.ProgressBar(), hooks.Summary(tmp_path), logged)
    )
    s.run(batches(1)[0], "loss")
    unlabeled = batches(1, seed=3)[0]
    unlabeled.labels = None
    predictions = s.run(unlabeled, "predictions", train=False)
    assert predictions.shape == (B,) and s.global_step == 1
    asking = Recorder("user", [], fetches=("loss",))
    t = make_session(session_hooks=(asking,))
    with pytest.raises(KeyError, match=r"hook Recorder asked to fetch 'loss'.*no labels"):
        t.run(unlabeled, "predictions", train=False)
    s.close()


class StopAfter(hooks.SessionRunHook):
    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.seen = 0

    def after_run(
        self, run_context: hooks.SessionRunContext, run_values: hooks.SessionRunValues
    ) -> None:
        self.seen += 1
        if self.seen == self.steps:
            run_context.request_stop()


def test_request_stop_ends_training_after_that_step(session: Any) -> None:
    start = session.global_step
    result = session.train(batches(6), hooks=[StopAfter(2)])
    assert result["steps"] == 2 and result["samples"] == 2 * B
    assert session.global_step == start + 2
    assert wuliang_threads() == []


def test_hooks_see_the_restored_step(tmp_path: Path, make_session: Callable[..., Any]) -> None:
    """A checkpoint is restored before any hook's after_create_session, so
    StopAtStep(num_steps) listed before Checkpoint counts from the restored step."""
    first = make_session()
    first.train(batches(3), hooks=[hooks.Checkpoint(tmp_path)])
    resumed = make_session()
    result = resumed.train(
        batches(10), hooks=[hooks.StopAtStep(num_steps=2), hooks.Checkpoint(tmp_path)]
    )
    assert result["steps"] == 2 and resumed.global_step == 5


def test_negative_steps_are_refused(session: Any) -> None:
    for bad in (-3, 1.5):
        with pytest.raises(ValueError, match="steps must be an int >= 0"):
            session.train(batches(2), steps=bad)
        with pytest.raises(ValueError, match="steps must be an int >= 0"):
            session.evaluate(batches(2), steps=bad)
    assert session.train(batches(2), steps=0)["steps"] == 0


def test_stop_at_step(session: Any) -> None:
    start = session.global_step
    assert session.train(batches(10), hooks=[hooks.StopAtStep(num_steps=3)])["steps"] == 3
    assert session.global_step == start + 3
    last = session.global_step + 2
    assert session.train(batches(10), hooks=[hooks.StopAtStep(last_step=last)])["steps"] == 2
    assert session.global_step == last
    with pytest.raises(ValueError):
        hooks.StopAtStep()
    with pytest.raises(ValueError):
        hooks.StopAtStep(last_step=3, num_steps=3)


# --- the standard hooks ---------------------------------------------------------------


def test_nan_guard(make_session: Callable[..., Any]) -> None:
    s = make_session(Tower(nan=True))
    with pytest.raises(FloatingPointError, match="nan"):
        s.train(batches(4), hooks=[hooks.NanGuard()])
    assert s.global_step == 0  # the failing step was not applied
    assert wuliang_threads() == []
    result = s.train(batches(4), hooks=[hooks.NanGuard(fail=False)])
    assert result["steps"] == 1 and s.global_step == 0


def test_logging_logs_the_loss(session: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wuliang")
    start = session.global_step
    session.train(batches(4), hooks=[hooks.Logging(every_steps=2)])
    messages = [r.getMessage() for r in caplog.records if r.name == "wuliang"]
    assert len(messages) == 2, messages
    for message, step in zip(messages, due_steps(start, 4, 2), strict=True):
        assert f"step {step}:" in message
        assert "loss = " in message and "samples/s" in message
        value = float(message.split("loss = ")[1].split()[0].rstrip(","))
        assert np.isfinite(value)
    with pytest.raises(ValueError):
        hooks.Logging(every_steps=0)


def stages_by_step(path: Path) -> dict[int, set[str]]:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    stages: dict[int, set[str]] = defaultdict(set)
    for event in events:
        if event["ph"] != "X":
            continue
        assert event["ts"] >= 0 and event["dur"] >= 0
        assert {"name", "pid", "tid", "args"} <= set(event)
        stages[event["args"]["step"]].add(event["name"])
    return stages


def test_timeline_writes_a_chrome_trace(tmp_path: Path, make_session: Callable[..., Any]) -> None:
    s = make_session()
    path = tmp_path / "trace" / "timeline.json"
    s.train(batches(5), hooks=[hooks.Timeline(path, first_step=1, num_steps=3)])
    stages = stages_by_step(path)
    assert sorted(stages) == [1, 2, 3]
    for step in (1, 2, 3):
        assert has_stages(stages[step]), (step, stages[step])
    lanes = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "M"]
    assert any(e["args"]["name"] == "wuliang-pull" for e in lanes)
    assert not s.trace.enabled  # disabled again at end


def test_timeline_of_a_later_train_call(tmp_path: Path, session: Any) -> None:
    """Timeline's steps are global steps (as run_context.step): a second train()
    call must record every stage of its steps too."""
    session.train(batches(2))
    first = session.global_step
    path = tmp_path / "later.json"
    session.train(batches(3), hooks=[hooks.Timeline(path, first_step=first, num_steps=2)])
    stages = stages_by_step(path)
    # Every stage of a step carries the global step, in every train() call.
    assert sorted(stages) == [first, first + 1]
    assert all(has_stages(stages[s]) for s in stages), stages


def test_summary_writes_event_files(tmp_path: Path, session: Any) -> None:
    logdir = tmp_path / "tb"
    start = session.global_step
    # Summary writes TensorBoard scalars (tensorboard comes with wuliang[tf]).
    session.train(batches(4), hooks=[hooks.Summary(logdir, every_steps=2)])
    files = list(logdir.glob("events.out.tfevents.*"))
    assert files
    found: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for event in tf.compat.v1.train.summary_iterator(str(files[0])):
        for value in event.summary.value:
            found[value.tag].append((event.step, float(tf.make_ndarray(value.tensor))))
    assert {"loss", "samples_per_s", "auc", "rows/emb"} <= set(found)
    assert [step for step, _ in found["loss"]] == due_steps(start, 4, 2)
    assert all(np.isfinite(v) and v > 0 for _, v in found["loss"])
    assert all(0.0 <= v <= 1.0 for _, v in found["auc"])


def test_eval_runs_every_n_steps_and_at_the_end(session: Any) -> None:
    evaluation = batches(3, seed=9)
    hook = hooks.Eval(lambda: list(evaluation), every_steps=2)
    start = session.global_step
    session.train(batches(5, seed=2), hooks=[hook])
    due = due_steps(start, 5, 2)
    ends = [] if due[-1] == start + 5 else [start + 5]
    assert [step for step, _ in hook.history] == due + ends
    for _, metrics in hook.history:
        assert 0.0 <= metrics["auc"] <= 1.0
        assert metrics["examples"] == 3 * B
        assert np.isfinite(metrics["loss"])
    assert wuliang_threads() == []


def test_eval_sees_the_engine_in_sync(make_session: Callable[..., Any]) -> None:
    """Pipelined training with Eval gives the metrics of evaluating after
    the same steps taken one at a time (every push applied)."""
    evaluation = batches(3, seed=9)
    hook = hooks.Eval(lambda: list(evaluation), every_steps=2)
    make_session().train(batches(5, seed=2), hooks=[hook])
    one_by_one = make_session()
    expected = []
    for n, batch in enumerate(batches(5, seed=2), 1):
        one_by_one.run(batch, "loss")
        if n % 2 == 0 or n == 5:
            expected.append((n, one_by_one.evaluate(list(evaluation))))
    assert hook.history == expected
    with pytest.raises(ValueError, match="steps"):
        hooks.Eval(evaluation, steps=0)


def test_progress_bar(session: Any, capsys: pytest.CaptureFixture[str]) -> None:
    session.train(batches(3), hooks=[hooks.ProgressBar(total=3)])
    err = capsys.readouterr().err
    assert "3/3" in err and "loss=" in err


def test_no_end_after_a_failed_step(tmp_path: Path, make_session: Callable[..., Any]) -> None:
    """As TF's MonitoredSession: after a step raised, no hook's end() runs, so
    a Checkpoint hook does not save what the failure left (a NaN tower)."""
    extra = hooks.Checkpoint(tmp_path / "extra", every_steps=1000)
    s = make_session(Tower(nan=True))
    with pytest.raises(FloatingPointError, match="nan"):
        s.train(batches(4), hooks=[hooks.NanGuard(), extra])
    own = hooks.Checkpoint(tmp_path / "own", every_steps=1000)
    t = make_session(Tower(nan=True), session_hooks=(own, hooks.NanGuard()))
    with pytest.raises(FloatingPointError, match="nan"):
        t.run(batches(1)[0], "loss")
    t.close()
    assert extra.saved == own.saved == []
    assert not (tmp_path / "extra").exists() and not (tmp_path / "own").exists()
