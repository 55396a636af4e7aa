"""A trainer feeds every row's show and click statistics: after one pass
over the data, each user's shows are its occurrences and its clicks the
labels of those examples (no decay), the items table (no ``stats_label``)
has shows only, and ``top_keys`` names the most shown users."""

from __future__ import annotations

from pathlib import Path

import keras
import pyarrow.parquet as pq
from small_model import write_data

import wuliang as wl
from wuliang.reader import ParquetReader


def test_training_feeds_shows_and_clicks(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    keras.utils.set_random_seed(5)
    users = wl.EmbeddingTable("users", 8, stats_label="label")
    items = wl.EmbeddingTable("items", 4)
    features = [wl.SparseFeature("user", users), wl.SparseFeature("items", items, combiner="mean")]
    mlp = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])

    def tower(embeddings: dict, dense: dict) -> object:
        return mlp(wl.embedding.concat([embeddings["user"], embeddings["items"]]))

    context = wl.Context(num_shards=2)
    session = wl.Session(tower, features, context)
    session.train(ParquetReader(files, 64, ["user", "items"], label="label"))

    data = pq.read_table(files).to_pydict()
    want_shows: dict[int, float] = {}
    want_clicks: dict[int, float] = {}
    item_shows: dict[int, float] = {}
    for user, its, label in zip(data["user"], data["items"], data["label"], strict=True):
        want_shows[user] = want_shows.get(user, 0) + 1
        want_clicks[user] = want_clicks.get(user, 0) + label
        for item in its:
            item_shows[item] = item_shows.get(item, 0) + 1

    def stats(table: str) -> dict[int, tuple[float, float]]:
        return {
            int(k): (float(s), float(c))
            for chunk in context.ps.export(table)
            for k, s, c in zip(chunk.keys, chunk.shows, chunk.clicks, strict=True)
        }

    # keys are the reader's hashes of the ids: compare the multisets of values
    got = stats("users")
    assert sorted(s for s, _ in got.values()) == sorted(want_shows.values())
    assert sorted(got.values()) == sorted((want_shows[u], want_clicks[u]) for u in want_shows)
    got_items = stats("items")
    assert sorted(s for s, _ in got_items.values()) == sorted(item_shows.values())
    assert all(c == 0 for _, c in got_items.values())  # no stats_label: shows only
    keys, shows = context.ps.top_keys("users", 3)
    assert list(shows) == sorted(want_shows.values(), reverse=True)[:3]
    assert [got[int(k)][0] for k in keys] == list(shows)
    context.close()
