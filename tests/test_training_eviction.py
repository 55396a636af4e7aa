"""Eviction while training: the tables' policies applied on schedule by the
session (``hooks.Evict``), at synced steps, so runs stay exact and resume
exactly from checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from small_model import Losses, make_session, reader, write_data

import wuliang as wl

TTL = wl.eviction.TTL(steps=3)


def evict_hook(session: wl.Session) -> wl.hooks.Evict:
    (hook,) = [h for h in session.hooks if isinstance(h, wl.hooks.Evict)]
    return hook


def users(session: wl.Session) -> dict[int, bytes]:
    out = {}
    for chunk in session.context.engine.export("users"):
        out.update({int(k): w.tobytes() for k, w in zip(chunk.keys, chunk.weights, strict=True)})
    return out


def test_the_session_evicts_on_schedule_in_train_and_run(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    piped = make_session(eviction=TTL, evict_every_steps=4)
    hook = evict_hook(piped)
    assert piped.hooks[0] is hook and hook.tables == ["users"]  # first: before checkpoints
    losses = Losses()
    piped.train(reader(files, 0), steps=10, hooks=[losses])
    assert [step for step, _ in hook.results] == [4, 8]
    evicted = sum(r["users"]["ttl"] for _, r in hook.results)
    assert evicted > 20
    stepwise = make_session(eviction=TTL, evict_every_steps=4)
    batches = [b for b, _ in zip(reader(files, 0), range(10), strict=False)]
    assert [float(stepwise.run(b, "loss")) for b in batches] == losses.values
    assert [s for s, _ in evict_hook(stepwise).results] == [4, 8]
    assert users(stepwise) == users(piped)  # the same rows left, bit for bit
    for s in (piped, stepwise):
        s.close()
        s.context.close()


def test_resume_with_eviction_equals_uninterrupted(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    model_dir = tmp_path / "model"

    def train(steps: int, hooks: list[Any]) -> list[float]:
        losses = Losses()
        session = make_session(eviction=TTL, evict_every_steps=4)
        try:
            session.train(reader(files, 0), steps=steps, hooks=[*hooks, losses])
            assert evict_hook(session).results  # it evicted
        finally:
            session.close()
            session.context.close()
        return losses.values

    whole = train(20, [])
    # The checkpoint of step 8 is taken after that step's eviction.
    first = train(8, [wl.hooks.Checkpoint(model_dir, every_steps=4)])
    second = train(12, [wl.hooks.Checkpoint(model_dir, every_steps=1000)])
    assert first + second == whole


def test_no_eviction_without_a_policy_or_a_schedule(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    plain = make_session()
    unscheduled = make_session(eviction=TTL, evict_every_steps=None)
    assert not any(isinstance(h, wl.hooks.Evict) for h in plain.hooks + unscheduled.hooks)
    unscheduled.train(reader(files, 0), steps=6)
    assert unscheduled.context.engine.stats("users")["evicted_ttl"] == 0
    own = wl.hooks.Evict(every_steps=2)
    given = make_session(eviction=TTL, hooks=(own,))
    assert [h for h in given.hooks if isinstance(h, wl.hooks.Evict)] == [own]
    given.train(reader(files, 0), steps=6)
    assert [step for step, _ in own.results] == [2, 4, 6]
    for s in (plain, unscheduled, given):
        s.context.close()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    with pytest.raises(ValueError, match="evict_every_steps"):
        wl.Context(evict_every_steps=0)
    with pytest.raises(ValueError, match="every_steps"):
        wl.hooks.Evict(every_steps=0)
    session = make_session()
    with pytest.raises(ValueError, match="no table 'nope'"):
        session.train(reader(files, 0), steps=1, hooks=[wl.hooks.Evict(tables=["nope"])])
    session.context.close()


def test_evict_logs_what_it_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = write_data(tmp_path)
    session = make_session(eviction=TTL, evict_every_steps=5)
    with caplog.at_level("INFO", logger="wuliang.evict"):
        session.train(reader(files, 0), steps=5)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "wuliang.evict"]
    assert line.startswith("step 5: evicted ") and "users" in line
    assert np.sum([r["users"]["total"] for _, r in evict_hook(session).results]) > 0
    session.context.close()


def test_an_evict_hook_given_to_train_replaces_the_sessions(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    session = make_session(eviction=TTL, evict_every_steps=3)
    own = wl.hooks.Evict(every_steps=5)
    session.train(reader(files, 0), steps=6, hooks=[own])
    assert [step for step, _ in own.results] == [5]
    assert evict_hook(session).results == []  # the session's own sat this train() out
    session.train(reader(files, 0), steps=3)
    assert [step for step, _ in evict_hook(session).results] == [9]
    session.context.close()
