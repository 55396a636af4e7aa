"""MovieLens end to end: convert, split by time, train a DNN with wuliang, evaluate.

What this example shows:

1. ``wuliang.reader.convert.convert_movielens`` turns the MovieLens CSVs into
   one Parquet file per UTC day, in time order (skipped when the work
   directory already holds a conversion of the same input).
2. A time split: the first 80% of the *ratings* (not of the day files) train,
   the last 20% test. The boundary usually falls inside a day: with ``T`` the
   timestamp of rating number ``round(0.8 * N)`` (0-based, in time order),
   train is every rating with ``timestamp < T`` and test every rating with
   ``timestamp >= T`` (ratings of the same second stay together, on the test
   side). Only the boundary day is split by rows (a day file is sorted by
   timestamp); the day files are streamed into ``WORK/split/train.parquet``
   and ``WORK/split/test.parquet``, one file per side: MovieLens-small has
   ~4,100 day files of ~25 ratings, and one file per side reads several
   times faster than thousands of tiny ones.
3. Five sparse features in five embedding tables of the parameter server
   (``user_id``, ``movie_id``, ``year``; ``genres`` and ``tags`` lists pooled
   with ``combiner="mean"``), a Keras MLP tower over their concatenation, the
   ``label`` column (rating >= 4) as the target, trained with ``Estimator.train``
   on shuffled batches and evaluated with ``Estimator.evaluate`` (exact AUC).
   Every table uses the library's defaults (``EmbeddingTable(name, dim)``:
   lazy Adam 1e-3, small truncated-normal initial vectors), the tower Keras
   Adam 1e-3: nothing is tuned.
4. With ``--baseline``: the same tower (same class, sizes, seed and epochs) in
   plain Keras at Keras's defaults, with ``keras.layers.Hashing`` +
   ``keras.layers.Embedding`` per feature (its default uniform initializer;
   list features padded to a fixed length, masked mean), trained with
   ``model.fit`` and Adam 1e-3 on the same train split and scored with the
   same exact AUC function (``wuliang.metrics.auc``) on the same test split.

5. Export and serve, as the hourly job and the online server would (skip
   with ``--no-export``): a checkpoint of the trained model and ``wuliang
   export`` (a full version, there being none yet); ``wuliang serve`` on free
   loopback ports, asked over its REST API for a lookup (the ``movie`` rows of
   two movies rated the next day) and a prediction (two of that day's
   ratings), both responses printed; one more day of training (the first
   day of the test split), another checkpoint and ``wuliang export
   --incremental`` (a delta: the rows that day changed), which the server
   picks up while running; the same two requests again, now answered from
   the delta's version with the day's changes; then the server is stopped
   (SIGTERM) and must exit cleanly (its log: ``WORK/serve.log``). Both
   manifests' row counts are printed.
   ``WORK/model`` and ``WORK/exports`` are rewritten on each run.

The last line printed is one JSON object: auc, logloss, samples_per_s,
train_examples, test_examples, export_rows (rows per export version),
served_versions (of the answers before and after the delta),
served_rows_changed (and
baseline_auc, baseline_logloss, baseline_samples_per_s with ``--baseline``)::

    .venv/bin/python examples/movielens.py --baseline
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "datasets" / "movielens-small"  # ml-latest-small, shipped compressed
DEFAULT_WORK_DIR = REPO / "runs" / "movielens"

# feature (Parquet column) -> (table, combiner); lists are pooled with a mean.
FEATURES: dict[str, tuple[str, str]] = {
    "user_id": ("user", "sum"),
    "movie_id": ("movie", "sum"),
    "genres": ("genre", "mean"),
    "tags": ("tag", "mean"),
    "year": ("year", "sum"),
}
LIST_FEATURES = ("genres", "tags")
LABEL = "label"
TRAIN_FRACTION = 0.8
ROW_GROUP_ROWS = 1 << 16


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data",
        type=Path,
        default=Path(os.environ.get("WULIANG_MOVIELENS", DEFAULT_DATA)),
        help="MovieLens directory with ratings.csv, movies.csv (and tags.csv), each may be "
        ".csv.gz (default: $WULIANG_MOVIELENS or the repository's datasets/movielens-small)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help="converted day files and the split go here (default: runs/movielens)",
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dim", type=int, default=16, help="embedding dimension of every table")
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 32], help="MLP layer sizes")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--baseline", action="store_true", help="also train the same tower in plain Keras"
    )
    p.add_argument("--no-export", action="store_true", help="skip the checkpoint and export steps")
    p.add_argument(
        "--ps",
        help="parameter servers: embedded, or host:port,host:port of running `wuliang ps` "
        "processes (checkpoints and exports then need --work-dir on a file system the "
        "servers see at the same path); default: the ps tasks of TF_CONFIG, else embedded",
    )
    p.add_argument(
        "--max-ratings",
        type=int,
        default=None,
        help="use only the first N ratings in time order (for quick tests)",
    )
    return p.parse_args(argv)


# -- data ----------------------------------------------------------------------


def convert(data: Path, work_dir: Path) -> list[Path]:
    """The day files of data in work_dir/days, converting unless already done."""
    from wuliang.reader.convert.movielens import convert_movielens, find_csv

    days = work_dir / "days"
    marker = work_dir / "converted.json"
    inputs = {name: find_csv(data, name) for name in ("ratings", "movies", "tags")}
    if inputs["ratings"] is None:
        raise SystemExit(f"{data} has no ratings.csv (pass --data or set WULIANG_MOVIELENS)")
    source = {
        "data": str(data.resolve()),
        **{
            path.name: [s.st_size, s.st_mtime_ns]
            for path in inputs.values()
            if path is not None
            for s in [path.stat()]
        },
    }
    if marker.is_file() and json.loads(marker.read_text()) == source:
        files = sorted(days.glob("*.parquet"))
        if files:
            print(f"converted data: {days} ({len(files)} day files, already converted)")
            return files
    start = time.perf_counter()
    files = convert_movielens(data, days, progress=False)
    marker.write_text(json.dumps(source))
    took = time.perf_counter() - start
    print(f"converted {data} -> {days}: {len(files)} day files in {took:.1f} s")
    return files


def split_by_time(
    files: Sequence[Path], out: Path, fraction: float, max_ratings: int | None = None
) -> tuple[Path, Path, int, int]:
    """Writes out/train.parquet and out/test.parquet: the ratings before / from the
    timestamp of rating round(fraction * N), both in time order.

    Only the day holding the boundary is split by rows (each day file is sorted
    by timestamp); with max_ratings, only the first max_ratings ratings are used.
    Returns (train file, test file, train rows, test rows).
    """
    counts = np.array([pq.read_metadata(f).num_rows for f in files], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    total = int(starts[-1]) if max_ratings is None else min(int(starts[-1]), max_ratings)
    k = round(fraction * total)
    if not 0 < k < total:
        raise SystemExit(f"{total} ratings: too few to split {fraction:.0%} / {1 - fraction:.0%}")
    # The day holding rating k, and the first rating of that day at its timestamp.
    day = int(np.searchsorted(starts, k, side="right")) - 1
    ts = pq.read_table(files[day], columns=["timestamp"]).column("timestamp").to_numpy()
    boundary = int(starts[day]) + int(np.searchsorted(ts, ts[k - starts[day]], side="left"))

    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.parquet", "test": out / "test.parquet"}
    ranges = {"train": (0, boundary), "test": (boundary, total)}
    schema = pq.read_schema(files[0])
    for name, (first, stop) in ranges.items():
        tmp = paths[name].with_suffix(".tmp")
        with pq.ParquetWriter(tmp, schema) as writer:
            pending: list[pa.Table] = []
            rows = 0
            for i in range(int(np.searchsorted(starts, first, side="right")) - 1, len(files)):
                lo, hi = max(first, int(starts[i])), min(stop, int(starts[i + 1]))
                if lo >= hi:
                    break
                table = pq.read_table(files[i])
                pending.append(table.slice(lo - int(starts[i]), hi - lo))
                rows += hi - lo
                if rows >= ROW_GROUP_ROWS:  # large row groups: fewer, cheaper reads
                    writer.write_table(pa.concat_tables(pending))
                    pending, rows = [], 0
            if pending:
                writer.write_table(pa.concat_tables(pending))
        tmp.replace(paths[name])
    return paths["train"], paths["test"], boundary, total - boundary


# -- the model -----------------------------------------------------------------


def make_tower(hidden: Sequence[int]) -> Any:
    """The tower: concat of the features' embeddings -> ReLU MLP -> one logit.

    Called as ``tower(embeddings, dense)`` with ``embeddings[name]`` ``[B, dim]``
    (how wuliang calls towers), and so by the Keras baseline too.
    """
    import keras

    class Tower(keras.Model):
        def __init__(self) -> None:
            super().__init__(name="tower")
            self.mlp = [keras.layers.Dense(h, activation="relu") for h in hidden]
            self.logit = keras.layers.Dense(1)

        def call(self, embeddings: dict[str, Any], dense: dict[str, Any] | None = None) -> Any:
            x = keras.ops.concatenate([embeddings[name] for name in FEATURES], axis=-1)
            for layer in self.mlp:
                x = layer(x)
            return self.logit(x)

    return Tower()


def train_wuliang(
    args: argparse.Namespace, train: Path, test: Path, train_rows: int
) -> tuple[dict[str, float], Any]:
    """Trains and evaluates; returns the metrics and the (open) estimator."""
    import keras

    import wuliang as wl
    from wuliang.reader import ParquetReader

    keras.utils.set_random_seed(args.seed)
    tables = {
        table: wl.EmbeddingTable(table, dim=args.dim, seed=args.seed)  # library defaults
        for table, _ in FEATURES.values()
    }
    features = [
        wl.SparseFeature(name, tables[table], combiner=combiner)
        for name, (table, combiner) in FEATURES.items()
    ]
    estimator = wl.Estimator(
        make_tower(args.hidden), features, label=LABEL, context=wl.Context(ps=args.ps)
    )
    columns = list(FEATURES)
    train_reader = ParquetReader(
        train,
        args.batch_size,
        columns,
        label=LABEL,
        shuffle_buffer=train_rows,  # as large as the train split: a near-uniform shuffle
        seed=args.seed,
        epochs=args.epochs,
    )
    steps_per_epoch = -(-train_rows // args.batch_size)
    hooks = [wl.hooks.Logging(every_steps=max(1, steps_per_epoch))]
    start = time.perf_counter()
    trained = estimator.train(train_reader, hooks=hooks)
    train_s = time.perf_counter() - start
    metrics = estimator.evaluate(ParquetReader(test, 4096, columns, label=LABEL))
    return {**metrics, **trained, "train_s": train_s}, estimator


# -- export ----------------------------------------------------------------------


def first_day(split: Path, out: Path) -> Path:
    """The ratings of the first 24 hours of a split (in time order)."""
    table = pq.read_table(split)
    start = table.column("timestamp")[0].as_py()
    day = table.filter(pc.less(table.column("timestamp"), start + 86_400))
    pq.write_table(day, out)
    return out


def wuliang_cli(*args: str, cwd: Path) -> str:
    """Runs a ``wuliang`` command (the export job, as cron would); returns its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "wuliang", *args], capture_output=True, text=True, cwd=cwd
    )
    if proc.returncode != 0:
        raise SystemExit(f"wuliang {args[0]} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip()


class Server:
    """``wuliang serve`` in a subprocess on free loopback ports, asked over REST."""

    def __init__(self, export_dir: Path, model: str, cwd: Path) -> None:
        self.model = model
        self.command = [
            "wuliang", "serve", "--exports", str(export_dir), "--model", model,
            "--port", "0", "--http-port", "0", "--poll-secs", "0.5",
        ]  # fmt: skip
        self.log = cwd / "serve.log"  # its logging; a pipe nobody read could fill
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *self.command],
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        assert self.proc.stdout is not None
        self.banner = self.proc.stdout.readline().strip()  # once serving
        match = re.search(r"http ([\d.]+):(\d+)", self.banner)
        if match is None:
            self.proc.kill()
            raise SystemExit(f"wuliang serve did not start:\n{self.log_tail()}")
        self.url = f"http://{match[1]}:{match[2]}/v1/models/{model}"

    def request(self, path: str, body: Any = None) -> Any:
        """The JSON answer of GET (no body) or POST ``url + path``."""
        data = None if body is None else json.dumps(body).encode()
        with urllib.request.urlopen(self.url + path, data, timeout=30) as answer:
            return json.loads(answer.read())

    def version(self) -> int:
        return int(self.request("")["model_version_status"][0]["version"])

    def wait_for(self, version: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.version() < version:
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not apply version {version} in {timeout} s")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM; the server must exit cleanly (status 0) within 30 s."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise SystemExit("wuliang serve did not stop within 30 s of SIGTERM") from None
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        if code != 0:
            raise SystemExit(f"wuliang serve exited with {code}:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def short(answer: dict[str, Any]) -> str:
    """A response as JSON, each vector cut to its first 4 values."""
    shown = dict(answer)
    if "vectors" in shown:
        shown["vectors"] = [[round(x, 5) for x in v[:4]] + ["..."] for v in shown["vectors"]]
    return json.dumps(shown)


def ask(server: Server, day: pa.Table) -> tuple[int, list[list[float]]]:
    """Asks the server for a lookup and a prediction, prints both; returns the
    version they were served from and the looked-up vectors."""
    movies = [int(m) for m in day.column("movie_id")[:2].to_pylist()]
    rows = day.slice(0, 2).select(list(FEATURES)).to_pylist()
    lookup = server.request("/tables/movie:lookup", {"keys": movies})
    print(
        f"POST {server.url}/tables/movie:lookup {json.dumps({'keys': movies})}\n-> {short(lookup)}"
    )
    predict = server.request(":predict", {"instances": rows})
    print(f"POST {server.url}:predict {json.dumps({'instances': rows})}\n-> {json.dumps(predict)}")
    if lookup["model_version"] != predict["model_version"]:
        print("(a version landed between the two requests)")
    return int(lookup["model_version"]), lookup["vectors"]


def export_and_serve(args: argparse.Namespace, estimator: Any, test: Path) -> dict[str, Any]:
    """Full export, served; one more day of training and a delta export, which
    the running server applies; returns row counts and served versions."""
    from wuliang.export import versions
    from wuliang.ps_server.storage import Version
    from wuliang.reader import ParquetReader

    work: Path = args.work_dir
    model_dir, export_dir = work / "model", work / "exports"
    for folder in (model_dir, export_dir):  # the demo's own scratch: start clean
        shutil.rmtree(folder, ignore_errors=True)
    job = ("--model-dir", str(model_dir), "--export-dir", str(export_dir))
    session = estimator.session
    session.save_checkpoint(model_dir)
    print(f"$ wuliang export {' '.join(job)}\n{wuliang_cli('export', *job, cwd=work)}")
    day_path = first_day(test, work / "split" / "next_day.parquet")
    day = pq.read_table(day_path)
    server = Server(export_dir, "movielens", cwd=work)
    try:
        print(f"$ {' '.join(server.command)}\n{server.banner}")
        before = ask(server, day)
        estimator.train(ParquetReader(day_path, args.batch_size, list(FEATURES), label=LABEL))
        print(f"trained on the next day: {day.num_rows} ratings, to step {session.global_step}")
        session.save_checkpoint(model_dir)
        print(
            f"$ wuliang export --incremental {' '.join(job)}\n"
            f"{wuliang_cli('export', '--incremental', *job, cwd=work)}"
        )
        server.wait_for(before[0] + 1)
        print("the server applied the delta while serving; the same requests again:")
        after = ask(server, day)
    finally:
        server.stop()
    print("wuliang serve stopped cleanly (SIGTERM, exit status 0)")
    totals = {}
    for number, path in versions(export_dir):
        version = Version(path)
        tables = version.tables
        counts = ", ".join(f"{t} {v.rows:,}" for t, v in tables.items())
        removed = sum(v.removed or 0 for v in tables.values())
        what = "full" if version.kind == "full" else f"delta of {version.parent}"
        print(
            f"export {number} ({what}, step {version.step}): rows {counts}"
            + (f"; {removed} removed" if version.kind == "delta" else "")
        )
        totals[str(number)] = sum(v.rows for v in tables.values())
    return {
        "export_rows": totals,
        "served_versions": [before[0], after[0]],
        "served_rows_changed": before[1] != after[1],  # the day's movies were trained
    }


def load_split(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A split as numpy for Keras: ids as int64 [N, 1], lists padded with 0 to [N, L]."""
    table = pq.read_table(path, columns=[*FEATURES, LABEL])
    x: dict[str, np.ndarray] = {}
    for name in FEATURES:
        column = table.column(name).combine_chunks()
        if name in LIST_FEATURES:
            lengths = pc.list_value_length(column).fill_null(0).to_numpy()
            values = pc.list_flatten(column).to_numpy().view(np.int64)  # uint64 hash -> int64
            padded = np.zeros((len(lengths), max(1, int(lengths.max(initial=0)))), np.int64)
            padded[np.arange(padded.shape[1]) < lengths[:, None]] = values
            x[name] = padded
        else:  # a missing year becomes -1, one more value to hash
            x[name] = column.fill_null(-1).to_numpy().astype(np.int64)[:, None]
    return x, table.column(LABEL).to_numpy().astype(np.float32)


def pad_to(x: dict[str, np.ndarray], widths: dict[str, int]) -> dict[str, np.ndarray]:
    out = dict(x)
    for name, width in widths.items():
        out[name] = np.pad(x[name], ((0, 0), (0, width - x[name].shape[1])))
    return out


def train_baseline(args: argparse.Namespace, train: Path, test: Path) -> dict[str, float]:
    """The same tower in plain Keras: Hashing + Embedding per feature, model.fit."""
    import keras

    from wuliang.metrics import auc, logloss

    x_train, y_train = load_split(train)
    x_test, y_test = load_split(test)
    widths = {n: max(x_train[n].shape[1], x_test[n].shape[1]) for n in LIST_FEATURES}
    x_train, x_test = pad_to(x_train, widths), pad_to(x_test, widths)

    keras.utils.set_random_seed(args.seed)
    inputs = {
        name: keras.Input(shape=(x_train[name].shape[1],), dtype="int64", name=name)
        for name in FEATURES
    }
    pooled = {}
    for name in FEATURES:
        if name in LIST_FEATURES:  # 0 pads: bin 0, masked out of the mean
            ids = keras.layers.Hashing(args.num_bins, mask_value=0, name=f"{name}_hash")(
                inputs[name]
            )
            vectors = keras.layers.Embedding(args.num_bins, args.dim, name=f"{name}_emb")(ids)
            mask = keras.ops.expand_dims(keras.ops.cast(ids > 0, "float32"), -1)
            total = keras.ops.sum(vectors * mask, axis=1)
            count = keras.ops.maximum(keras.ops.sum(mask, axis=1), 1.0)
            pooled[name] = total / count
        else:
            ids = keras.layers.Hashing(args.num_bins, name=f"{name}_hash")(inputs[name])
            vectors = keras.layers.Embedding(args.num_bins, args.dim, name=f"{name}_emb")(ids)
            pooled[name] = keras.ops.squeeze(vectors, axis=1)
    logits = make_tower(args.hidden)(pooled, {})
    model = keras.Model(inputs, logits)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    start = time.perf_counter()
    model.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, shuffle=True, verbose=0
    )
    train_s = time.perf_counter() - start
    scores = keras.ops.convert_to_numpy(
        keras.ops.sigmoid(model.predict(x_test, batch_size=4096, verbose=0))
    ).ravel()
    return {
        "auc": auc(y_test, scores),
        "logloss": logloss(y_test, scores),
        "samples_per_s": len(y_train) * args.epochs / train_s,
        "train_s": train_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.num_bins = 1 << 16
    started = time.perf_counter()
    work_dir: Path = args.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    files = convert(args.data, work_dir)
    train, test, train_rows, test_rows = split_by_time(
        files, work_dir / "split", TRAIN_FRACTION, args.max_ratings
    )
    print(
        f"split by time: {train_rows:,} train ratings -> {train}, "
        f"{test_rows:,} test ratings -> {test}"
    )
    settings = (
        f"dim {args.dim}, MLP {args.hidden}, batch {args.batch_size}, "
        f"{args.epochs} epochs, seed {args.seed}"
    )
    print(f"wuliang: 5 tables (library defaults), {settings}")
    result, estimator = train_wuliang(args, train, test, train_rows)
    print(
        f"wuliang: AUC {result['auc']:.4f}, logloss {result['logloss']:.4f}, "
        f"{result['samples_per_s']:,.0f} samples/s ({result['train_s']:.1f} s training)"
    )
    summary = {
        "auc": result["auc"],
        "logloss": result["logloss"],
        "samples_per_s": result["samples_per_s"],
        "train_examples": train_rows,
        "test_examples": test_rows,
    }
    if not args.no_export:
        summary.update(export_and_serve(args, estimator, test))
    estimator.context.close()
    if args.baseline:
        print(f"Keras baseline: Hashing({args.num_bins}) + Embedding, Adam 1e-3, {settings}")
        base = train_baseline(args, train, test)
        print(
            f"Keras baseline: AUC {base['auc']:.4f}, logloss {base['logloss']:.4f}, "
            f"{base['samples_per_s']:,.0f} samples/s ({base['train_s']:.1f} s training)"
        )
        print()
        print(f"{'':<16}{'AUC':>8}{'logloss':>10}{'samples/s':>12}")
        for name, r in (("wuliang", result), ("Keras baseline", base)):
            print(f"{name:<16}{r['auc']:>8.4f}{r['logloss']:>10.4f}{r['samples_per_s']:>12,.0f}")
        print(f"difference      {result['auc'] - base['auc']:>+8.4f}")
        summary.update(
            baseline_auc=base["auc"],
            baseline_logloss=base["logloss"],
            baseline_samples_per_s=base["samples_per_s"],
        )
    print(f"total time {time.perf_counter() - started:.1f} s")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
