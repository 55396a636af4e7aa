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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
