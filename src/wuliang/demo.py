"""``wuliang demo``: the parameter-server engine alone, without TensorFlow.

One table (dim 16, Adagrad, a key admitted at its second sighting, TTL and
row-cap eviction) is trained on a stream of Zipf-distributed ids, which is
what recommendation features look like: each step pulls the step's unique
ids and pushes a gradient for each, as a trainer would. It prints the pull
and push rates, the rows, memory per row and admission counts, what an
eviction removed, and the size of a delta export of the last 5 steps (rows
changed and keys removed, read from the engine, nothing written), then one
JSON summary line. (``make demo`` runs ``examples/movielens.py`` instead:
training, export and serving end to end.)
"""

from __future__ import annotations

import json
import time

import numpy as np

from wuliang.ps_server import Adagrad, Admission, Engine, Eviction, TableSpec


def zipf_ids(rng: np.random.Generator, n: int, alpha: float = 1.1) -> np.ndarray:
    """n ids from an unbounded Zipf(alpha) space, scrambled to look like hashes."""
    ranks = rng.zipf(alpha, size=n).astype(np.uint64)
    return ranks * np.uint64(0x9E3779B97F4A7C15)


def run_engine_demo(steps: int = 40, batch: int = 100_000, num_shards: int = 2) -> dict:
    """Runs the demo; returns the summary it prints last (a JSON line).

    Args:
        steps: training steps to simulate (>= 1).
        batch: ids drawn per step (>= 1).
        num_shards: the engine's shard threads.

    Raises:
        ValueError: steps or batch below 1, or a bad num_shards (the engine's check).
    """
    for name, value in (("steps", steps), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    rng = np.random.default_rng(0)
    engine = Engine(num_shards=num_shards)
    spec = TableSpec(
        "item",
        dim=16,
        optimizer=Adagrad(learning_rate=0.05),
        admission=Admission(min_count=2),
        eviction=Eviction(ttl_steps=steps // 2, max_rows=200_000),
    )
    engine.create_table(spec)
    print(
        f"engine: {num_shards} shard threads; table 'item' dim 16, Adagrad, admit at 2nd sighting"
    )

    pull_s = push_s = 0.0
    keys_seen = 0
    delta_since = 0
    for step in range(steps):
        if step == steps - 5:
            delta_since = engine.advance_version() - 1
        keys = np.unique(zipf_ids(rng, batch))
        keys_seen += len(keys)
        t0 = time.perf_counter()
        rows = engine.pull("item", keys, step=step)
        t1 = time.perf_counter()
        grads = (0.01 * rows + rng.standard_normal(rows.shape, dtype=np.float32) * 0.001).astype(
            np.float32
        )
        engine.push("item", keys, grads, unique=True, step=step)
        t2 = time.perf_counter()
        pull_s += t1 - t0
        push_s += t2 - t1
    stats = engine.stats("item")
    print(
        f"trained {steps} steps of {batch:,} ids: pull {keys_seen / pull_s / 1e6:.1f}M keys/s, "
        f"push {keys_seen / push_s / 1e6:.1f}M keys/s (unique keys per step)"
    )
    print(
        f"rows {stats['rows']:,} ({stats['bytes'] / max(stats['rows'], 1):.0f} B/row), "
        f"admitted {stats['admitted']:,}, pending {stats['pending_keys']:,}, "
        f"updates dropped while pending {stats['dropped_pending']:,}"
    )

    before = stats["bytes"]
    evicted = engine.evict("item", step=steps)
    after = engine.stats("item")
    print(
        f"evict: {evicted['ttl']:,} by TTL ({steps // 2} steps), {evicted['lfu']:,} by max_rows; "
        f"rows {after['rows']:,}, memory {before / 2**20:.1f} -> {after['bytes'] / 2**20:.1f} MiB"
    )

    delta_rows = sum(len(chunk) for chunk in engine.export("item", since=delta_since))
    removed = len(engine.removed_keys("item", since=delta_since))
    print(
        f"delta export of the last 5 steps: {delta_rows:,} rows changed, {removed:,} keys removed"
    )
    summary = {
        "steps": steps,
        "batch": batch,
        "pull_keys_per_s": round(keys_seen / pull_s),
        "push_keys_per_s": round(keys_seen / push_s),
        "rows": after["rows"],
        "evicted": evicted["total"],
        "delta_rows": delta_rows,
    }
    print(json.dumps(summary))
    engine.close()
    return summary
