"""What a table's storage costs against what it learns: sized tables
(``EmbeddingTable(sizes=Sizes(...))``) against fixed-size ones, and fp16
training tables against fp32 ones.

* **Sizes** (``--parts sizes``), per model:

  - ``movielens``: the repository's MovieLens example (``examples/movielens.py``:
    five tables, Adagrad(0.05), the ratings split by time, the later 20%
    held out);
  - ``criteo``: the Criteo-shaped synthetic model of ``train_bench.py`` (26
    single-valued Zipf(1.1) fields, 13 dense features, an MLP; datagen rows,
    the last file of the same stream held out, one epoch: every row seen once,
    as a stream).

  Each trains every table at the widest dim ``--dim`` (fixed) and sized
  ``(--small, --dim)`` (a key grows when its decayed shows reach
  ``--promote``, shrinks below half of it), alternated, ``--seeds`` seeds
  each: held-out AUC (``auc_minus_fixed``: the mean of sized − fixed),
  training samples/s after the first 20 steps (``samples_per_s_vs_fixed``:
  medians), keys per size,
  and ``bytes_per_key_vs_fixed``: the tables' bytes in RAM (rows with their
  optimizer state and metadata, and the index) per key, sized over fixed,
  each block's rows costed at what a row of its dim costs in a table of
  ``--rows`` rows (small tables round up to whole memory chunks).
* **fp16** (``--parts fp16``): the MovieLens model with every table fp32 and
  fp16 (Adagrad dim 16), alternated: ``auc_minus_fp32``; a table of
  ``--rows`` keys in each precision: ``fp16_storage_bytes_vs_fp32``.

``--quick``: one seed, fewer rows. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_data import movielens_example  # benchmarks/, the script's folder

DIM = 16


def train_once(ml: Any, split: tuple[Path, Path, int], precision: str, seed: int,
               epochs: int) -> dict[str, float]:  # fmt: skip
    """The example's model with every table in ``precision``: its held-out
    AUC and training samples/s."""
    import keras

    import wuliang as wl
    from wuliang.optimizers import Adagrad
    from wuliang.reader import ParquetReader

    train, test, rows = split
    keras.utils.set_random_seed(seed)
    options = {"dim": DIM, "seed": seed, "optimizer": Adagrad(0.05), "precision": precision}
    tables = {table: wl.EmbeddingTable(table, **options) for table, _ in ml.FEATURES.values()}
    features = [
        wl.SparseFeature(name, tables[table], combiner=combiner)
        for name, (table, combiner) in ml.FEATURES.items()
    ]
    estimator = wl.Estimator(ml.make_tower([64, 32]), features, label=ml.LABEL,
                             context=wl.Context(num_shards=2))  # fmt: skip
    columns = list(ml.FEATURES)
    reader = ParquetReader(train, 256, columns, label=ml.LABEL, shuffle_buffer=rows, seed=seed,
                           epochs=epochs)  # fmt: skip
    start = time.perf_counter()
    trained = estimator.train(reader)
    seconds = time.perf_counter() - start
    metrics = estimator.evaluate(ParquetReader(test, 4096, columns, label=ml.LABEL))
    estimator.context.close()
    return {"auc": metrics["auc"], "samples_per_s": trained["steps"] * 256 / seconds}


def bytes_per_key(precision: str, rows: int) -> tuple[float, float]:
    """(bytes per key in RAM with the index, bytes of weights and state a
    key) of a dim-16 Adagrad table of ``rows`` keys."""
    from wuliang.optimizers import Adagrad
    from wuliang.ps_server import Engine, TableSpec

    with Engine(2) as engine:
        engine.create_table(TableSpec("t", DIM, optimizer=Adagrad(0.05), precision=precision))
        keys = np.arange(rows, dtype=np.uint64)
        for lo in range(0, rows, 1 << 20):
            part = keys[lo : lo + (1 << 20)]
            engine.load("t", part, np.zeros((len(part), DIM), np.float32))
        stats = engine.stats("t")
        assert stats["rows"] == rows
    weight_bytes = {"fp32": 4, "fp16": 2}[precision] * DIM
    state_bytes = 4 * DIM  # Adagrad: an accumulator per weight, float32
    return (stats["row_bytes"] + stats["index_bytes"]) / rows, weight_bytes + state_bytes


# -- sized tables ---------------------------------------------------------------


def sized_options(args: argparse.Namespace, model: str, sized: bool) -> dict[str, Any]:
    """Each table's options: the widest dim, fixed or sized."""
    import wuliang as wl
    from wuliang.optimizers import Adagrad

    options: dict[str, Any] = {"dim": args.dim, "optimizer": Adagrad(0.05)}
    if sized:
        options["sizes"] = wl.Sizes((args.small, args.dim), promote=(args.promote[model],))
        options["stats_half_life"] = args.half_life[model]
    return options


def table_sizes(context: Any) -> dict[str, dict[int, int]]:
    """Per table the server holds: its rows by dim."""
    return {name: {spec.dim: context.ps.stats(name)["rows"]}
            for name, spec in ((n, context.ps.spec(n)) for n in context.ps.tables())}  # fmt: skip


def train_movielens(ml: Any, split: tuple[Path, Path, int], args: argparse.Namespace, seed: int,
                    sized: bool) -> dict[str, Any]:  # fmt: skip
    import keras

    import wuliang as wl
    from wuliang.reader import ParquetReader

    train, test, rows = split
    keras.utils.set_random_seed(seed)
    options = sized_options(args, "movielens", sized)
    tables = {table: wl.EmbeddingTable(table, seed=seed, **options)
              for table, _ in ml.FEATURES.values()}  # fmt: skip
    features = [wl.SparseFeature(name, tables[table], combiner=combiner)
                for name, (table, combiner) in ml.FEATURES.items()]  # fmt: skip
    estimator = wl.Estimator(ml.make_tower([64, 32]), features, label=ml.LABEL,
                             context=wl.Context(num_shards=2))  # fmt: skip
    columns = list(ml.FEATURES)
    reader = ParquetReader(train, 256, columns, label=ml.LABEL, shuffle_buffer=rows, seed=seed,
                           epochs=args.epochs)  # fmt: skip
    return finish(estimator, reader, ParquetReader(test, 4096, columns, label=ml.LABEL), 256)


def criteo_data(folder: Path, rows: int) -> tuple[list[Path], list[Path]]:
    """Datagen rows in files of rows / 6: the first five train, the last is held out."""
    from wuliang.reader.datagen import DatagenConfig, generate

    config = DatagenConfig(rows=rows, rows_per_file=rows // 6)
    files = sorted(Path(f) for f in generate(folder, config))
    return files[:-1], files[-1:]


def train_criteo(data: tuple[list[Path], list[Path]], args: argparse.Namespace, seed: int,
                 sized: bool) -> dict[str, Any]:  # fmt: skip
    import keras

    import wuliang as wl
    from wuliang.reader import ParquetReader
    from wuliang.reader.datagen import DENSE, LABEL, SINGLE

    keras.utils.set_random_seed(seed)
    options = sized_options(args, "criteo", sized)
    features: list[Any] = [wl.SparseFeature(c, wl.EmbeddingTable(c, seed=seed, **options))
                           for c in SINGLE]  # fmt: skip
    features += [wl.DenseFeature(d) for d in DENSE]
    mlp = keras.Sequential([keras.Input((len(SINGLE) * args.dim + len(DENSE),)),
                            keras.layers.Dense(256, activation="relu"),
                            keras.layers.Dense(128, activation="relu"),
                            keras.layers.Dense(1)])  # fmt: skip

    def tower(embeddings: dict, dense: dict) -> Any:
        return mlp(wl.embedding.concat([*(embeddings[c] for c in SINGLE),
                                        *(dense[d] for d in DENSE)]))  # fmt: skip

    estimator = wl.Estimator(tower, features, label=LABEL, context=wl.Context(num_shards=2))
    columns = [*SINGLE, *DENSE]
    train, test = data
    batch = 2048
    reader = ParquetReader([str(f) for f in train], batch, columns, label=LABEL)
    return finish(estimator, reader, ParquetReader([str(f) for f in test], 8192, columns,
                                                   label=LABEL), batch)  # fmt: skip


WARMUP_STEPS = 20  # not timed: tracing, first allocations


def finish(estimator: Any, reader: Any, test: Any, batch: int) -> dict[str, Any]:
    """Trains (the steps after the first ``WARMUP_STEPS`` timed), evaluates,
    and counts each table's rows by dim."""
    import wuliang as wl

    class Clock(wl.hooks.SessionRunHook):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def after_run(self, run_context: Any, run_values: Any) -> None:
            self.ends.append(time.perf_counter())

    clock = Clock()
    estimator.train(reader, hooks=[clock])
    timed = clock.ends[WARMUP_STEPS:]
    metrics = estimator.evaluate(test)
    sizes = table_sizes(estimator.context)
    grown = {n: estimator.context.ps.stats(n)["grown"] for n in estimator.context.ps.tables()}
    estimator.context.close()
    rate = (len(timed) - 1) * batch / (timed[-1] - timed[0])
    return {"auc": metrics["auc"], "samples_per_s": rate, "rows": sizes,
            "grown": sum(grown.values())}  # fmt: skip


_ROW_COST: dict[int, float] = {}


def row_cost(dim: int, rows: int) -> float:
    """Bytes in RAM a row of an Adagrad table of this dim costs (row, state,
    metadata and index) in a table of ``rows`` rows."""
    if dim not in _ROW_COST:
        from wuliang.optimizers import Adagrad
        from wuliang.ps_server import Engine, TableSpec

        with Engine(2) as engine:
            engine.create_table(TableSpec("t", dim, optimizer=Adagrad(0.05)))
            keys = np.arange(rows, dtype=np.uint64)
            for lo in range(0, rows, 1 << 20):
                part = keys[lo : lo + (1 << 20)]
                engine.load("t", part, np.zeros((len(part), dim), np.float32))
            stats = engine.stats("t")
        _ROW_COST[dim] = (stats["row_bytes"] + stats["index_bytes"]) / rows
    return _ROW_COST[dim]


def table_bytes(rows: dict[str, dict[int, int]], cost_rows: int) -> tuple[float, int]:
    """(bytes of every table's rows, keys: rows of the tables that are not
    extension blocks)."""
    total = sum(n * row_cost(dim, cost_rows) for by_dim in rows.values()
                for dim, n in by_dim.items())  # fmt: skip
    keys = sum(n for name, by_dim in rows.items() if "@" not in name for n in by_dim.values())
    return total, keys


def bench_sizes(runs: dict[bool, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """One model's figures from its fixed (False) and sized (True) runs."""
    auc = {k: [round(r["auc"], 4) for r in v] for k, v in runs.items()}
    mean = {k: sum(v) / len(v) for k, v in auc.items()}
    rate = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in runs.items()}
    fixed_bytes, fixed_keys = table_bytes(runs[False][-1]["rows"], args.rows)
    sized_bytes, sized_keys = table_bytes(runs[True][-1]["rows"], args.rows)
    big = sum(n for name, by_dim in runs[True][-1]["rows"].items() if "@" in name
              for n in by_dim.values())  # fmt: skip
    return {
        "auc_fixed": auc[False],
        "auc_sized": auc[True],
        "auc_minus_fixed": round(mean[True] - mean[False], 4),
        "bytes_per_key_fixed": round(fixed_bytes / fixed_keys, 1),
        "bytes_per_key_sized": round(sized_bytes / sized_keys, 1),
        "bytes_per_key_vs_fixed": round((sized_bytes / sized_keys) / (fixed_bytes / fixed_keys), 3),
        "keys": sized_keys,
        "keys_at_widest": big,
        "grown": runs[True][-1]["grown"],
        "samples_per_s_fixed": round(rate[False]),
        "samples_per_s_sized": round(rate[True]),
        "samples_per_s_vs_fixed": round(rate[True] / rate[False], 3),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, fewer rows")
    p.add_argument("--parts", nargs="+", choices=["sizes", "fp16"], default=["sizes", "fp16"])
    p.add_argument("--models", nargs="+", choices=["movielens", "criteo"],
                   default=["movielens", "criteo"])  # fmt: skip
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2, help="MovieLens epochs")
    p.add_argument("--criteo-rows", type=int, default=1_200_000)
    p.add_argument("--dim", type=int, default=32, help="the widest dim (and the fixed tables')")
    p.add_argument("--small", type=int, default=4, help="a sized table's first size")
    p.add_argument("--promote", type=float, nargs=2, default=[50.0, 4.0],
                   help="decayed shows that grow a key: MovieLens, Criteo")  # fmt: skip
    p.add_argument("--half-life", type=float, nargs=2, default=[300.0, 100.0],
                   help="the stats' half-life in steps: MovieLens, Criteo")  # fmt: skip
    p.add_argument("--rows", type=int, default=4_000_000, help="keys of the bytes tables")
    args = p.parse_args(argv)
    args.promote = dict(zip(("movielens", "criteo"), args.promote, strict=True))
    args.half_life = dict(zip(("movielens", "criteo"), args.half_life, strict=True))
    if args.quick:
        args.seeds, args.rows, args.criteo_rows = 1, 1_000_000, 600_000
    result: dict[str, Any] = {"seeds": args.seeds}
    ml = movielens_example()
    with tempfile.TemporaryDirectory() as tmp:
        files = ml.convert(ml.DEFAULT_DATA, Path(tmp))
        split = ml.split_by_time(files, Path(tmp, "split"), ml.TRAIN_FRACTION)[:3]
        if "sizes" in args.parts:
            data = None
            if "criteo" in args.models:
                data = criteo_data(Path(tmp, "criteo"), args.criteo_rows)
            for model in args.models:
                runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
                for seed in range(42, 42 + args.seeds):
                    for sized in (False, True):  # alternated: the machine's drift hits both
                        if model == "movielens":
                            r = train_movielens(ml, split, args, seed, sized)
                        else:
                            r = train_criteo(data, args, seed, sized)  # type: ignore[arg-type]
                        runs[sized].append(r)
                        print(f"{model} seed {seed} {'sized' if sized else 'fixed'}: "
                              f"AUC {r['auc']:.4f}, {r['samples_per_s']:,.0f} samples/s, "
                              f"rows {r['rows']}", flush=True)  # fmt: skip
                result[model] = bench_sizes(runs, args)
                print(model, json.dumps(result[model]), flush=True)
        if "fp16" in args.parts:
            result.update(bench_fp16(ml, split, args))
    print(json.dumps(result))


def bench_fp16(ml: Any, split: tuple[Path, Path, int], args: argparse.Namespace) -> dict[str, Any]:
    auc: dict[str, list[float]] = {"fp32": [], "fp16": []}
    rate: dict[str, list[float]] = {"fp32": [], "fp16": []}
    for seed in range(42, 42 + args.seeds):
        for precision in ("fp32", "fp16"):  # alternated: the machine's drift hits both
            r = train_once(ml, split, precision, seed, args.epochs)
            print(f"seed {seed} {precision}: AUC {r['auc']:.4f}, "
                  f"{r['samples_per_s']:,.0f} samples/s", flush=True)  # fmt: skip
            auc[precision].append(round(r["auc"], 4))
            rate[precision].append(r["samples_per_s"])
    ram = {p: bytes_per_key(p, args.rows) for p in ("fp32", "fp16")}
    for precision, (per_key, own) in ram.items():
        print(
            f"{precision}: {per_key:.1f} bytes a key in RAM, {own} of weights and state", flush=True
        )
    mean = {k: sum(v) / len(v) for k, v in auc.items()}
    return {
        "auc_fp32": auc["fp32"],
        "auc_fp16": auc["fp16"],
        "auc_minus_fp32": round(mean["fp16"] - mean["fp32"], 4),
        "bytes_per_key_fp32": round(ram["fp32"][0], 1),
        "bytes_per_key_fp16": round(ram["fp16"][0], 1),
        "fp16_storage_bytes_vs_fp32": round(ram["fp16"][0] / ram["fp32"][0], 3),
        "fp16_weights_and_state_vs_fp32": round(ram["fp16"][1] / ram["fp32"][1], 3),
        "fp16_samples_per_s_vs_fp32": round(
            statistics.median(rate["fp16"]) / statistics.median(rate["fp32"]), 3
        ),
    }


if __name__ == "__main__":
    main()
