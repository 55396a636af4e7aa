"""The ``wuliang`` command line."""

from __future__ import annotations

import argparse
import sys

from wuliang import __version__


def _demo(args: argparse.Namespace) -> int:
    from wuliang.demo import run_engine_demo

    run_engine_demo(steps=args.steps, batch=args.batch, num_shards=args.shards)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
