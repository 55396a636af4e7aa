"""The ``wuliang`` command line."""

from __future__ import annotations

import argparse
import sys

from wuliang import __version__


def _demo(args: argparse.Namespace) -> int:
    from wuliang.demo import run_engine_demo

    run_engine_demo(steps=args.steps, batch=args.batch, num_shards=args.shards)
    return 0


def _datagen(args: argparse.Namespace) -> int:
    from wuliang.reader.datagen import DatagenConfig, generate

    cfg = DatagenConfig(
        rows=args.rows,
        rows_per_file=args.rows_per_file,
        alpha=args.alpha,
        ids_per_field=args.ids_per_field,
        seed=args.seed,
    )
    files = generate(args.out_dir, cfg, progress=not args.quiet)
    print(f"wrote {cfg.rows:,} rows in {len(files)} files to {args.out_dir}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    import pyarrow.parquet as pq

    from wuliang.reader import convert

    progress = not args.quiet
    try:
        if args.format == "criteo":
            files = convert.convert_criteo(
                args.input, args.out_dir, args.rows_per_file, args.bucketize, progress
            )
        elif args.format == "movielens":
            files = convert.convert_movielens(args.input, args.out_dir, progress)
        else:
            delimiter = {"\\t": "\t", "tab": "\t"}.get(args.delimiter, args.delimiter)
            files = convert.convert_csv(
                args.input, args.out_dir, args.schema, args.rows_per_file, delimiter, progress
            )
    except (ValueError, OSError) as error:
        print(f"wuliang convert {args.format}: error: {error}", file=sys.stderr)
        return 1
    rows = sum(pq.read_metadata(f).num_rows for f in files)
    print(f"wrote {rows:,} rows in {len(files)} files to {args.out_dir}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from wuliang.checkpoint import latest_checkpoint
    from wuliang.export import CheckpointSource, compact, export
    from wuliang.storage import CorruptVersionError

    try:
        if args.compact:
            result = compact(args.export_dir)
        else:
            if args.model_dir is None:
                raise ValueError("--model-dir is required (or --compact)")
            path = latest_checkpoint(args.model_dir)
            if path is None:
                raise FileNotFoundError(f"no checkpoint (ckpt-<step>) in {args.model_dir}")
            kind = "full" if args.full else "auto"
            result = export(CheckpointSource(path), args.export_dir, kind)
    except (CorruptVersionError, ValueError, OSError, KeyError) as error:
        print(f"wuliang export: error: {error}", file=sys.stderr)
        return 1
    print(result.status())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wuliang", description=__doc__)
    parser.add_argument("--version", action="version", version=f"wuliang {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the engine demo and print what it did")
    demo.add_argument("--steps", type=int, default=40, help="training steps to simulate")
    demo.add_argument("--batch", type=int, default=100_000, help="keys per step")
    demo.add_argument("--shards", type=int, default=2, help="engine shard threads")
    demo.set_defaults(func=_demo)

    gen = sub.add_parser("datagen", help="write synthetic Criteo-shaped Parquet data")
    gen.add_argument("out_dir")
    gen.add_argument("--rows", type=int, required=True)
    gen.add_argument("--rows-per-file", type=int, default=100_000)
    gen.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent of the ids")
    gen.add_argument("--ids-per-field", type=int, default=1_000_000_000)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(func=_datagen)

    conv = sub.add_parser("convert", help="convert a data set to Parquet for the reader")
    formats = conv.add_subparsers(dest="format", required=True, metavar="FORMAT")
    criteo = formats.add_parser("criteo", help="Criteo Display Advertising TSV")
    criteo.add_argument("input", help="the TSV file (.gz, .bz2, .zst: decompressed)")
    criteo.add_argument("out_dir", help="written: part-00000.parquet ...")
    criteo.add_argument("--rows-per-file", type=int, default=1_000_000)
    criteo.add_argument(
        "--bucketize", action="store_true", help="also I1_bucket ...: keys of log2 buckets"
    )
    movielens = formats.add_parser("movielens", help="MovieLens CSVs, one file per day")
    movielens.add_argument("input", help="directory with ratings.csv, movies.csv [, tags.csv]")
    movielens.add_argument("out_dir", help="written: YYYY-MM-DD.parquet, one per day")
    csv = formats.add_parser("csv", help="delimited text described by a YAML schema")
    csv.add_argument("input", help="the text file (.gz, .bz2, .zst: decompressed)")
    csv.add_argument("out_dir", help="written: part-00000.parquet ...")
    csv.add_argument("--schema", required=True, help="YAML schema of the columns")
    csv.add_argument("--rows-per-file", type=int, default=1_000_000)
    csv.add_argument("--delimiter", default=",", help="one character; '\\t' or 'tab' for tabs")
    for p in (criteo, movielens, csv):
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(func=_convert)

    exp = sub.add_parser(
        "export",
        help="export the newest checkpoint for serving (a delta of the last export)",
        description="Writes the next version of EXPORT_DIR from the newest checkpoint in "
        "MODEL_DIR: a delta of the last version (rows changed and keys removed since), or a "
        "full version when there is none. Idempotent and safe to rerun after a crash; "
        "prints one status line, exits 1 with a message on failure.",
    )
    exp.add_argument("--model-dir", help="the trainer's checkpoints (ckpt-<step>/)")
    exp.add_argument("--export-dir", required=True, help="versions 1/, 2/, ... and LATEST")
    mode = exp.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="write a full version")
    mode.add_argument(
        "--incremental",
        action="store_true",
        help="a delta of the last version (the default; full when there is none)",
    )
    mode.add_argument(
        "--compact", action="store_true", help="merge LATEST and its base into a full version"
    )
    exp.set_defaults(func=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
