"""The ``wuliang`` command line.

Errors a user can cause never show a traceback. Usage errors exit with
status 2, as argparse's own do: bad option values are rejected by the
parser (``type=`` functions below), and options that do not go together by
each command's ``check`` (run before the command; its ``ValueError`` becomes
the parser's error). Runtime failures exit with status 1: the errors a
command expects (``ValueError``, ``OSError``, ``LookupError``: a missing
file, a corrupt checkpoint, a busy port, an unreachable Redis) are printed by
``main`` as one line ``wuliang <command>: error: <message>``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wuliang import __version__
from wuliang.serving.overload import DEFAULT_MAX_QUEUE, DEFAULT_MAX_QUEUE_MS
from wuliang.serving.predict import PREDICT_THREADS

# What ``main`` reports as ``wuliang <command>: error: ...`` instead of a
# traceback (``CorruptVersionError`` is a ValueError).
EXPECTED_ERRORS = (ValueError, OSError, LookupError)

DESCRIPTION = """Training and serving for large-scale recommendation models: \
the engine demo, synthetic data, data set converters, exports for serving and \
the online server."""

# -- option types: argparse reports their errors as usage errors -------------------


def bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (no upper bound if None)."""
    want = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid int value: {text!r} (must be {want})"
            ) from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    return parse


positive_int = bounded_int(1)
non_negative_int = bounded_int(0)


def float_above(low: float) -> Callable[[str], float]:
    """An argparse type: a finite number greater than low."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not math.isfinite(value) or value <= low:
            raise argparse.ArgumentTypeError(f"must be a finite number > {low:g}, got {text!r}")
        return value

    return parse


def delimiter(text: str) -> str:
    """An argparse type: one character; ``\\t`` or ``tab`` for a tab."""
    value = {"\\t": "\t", "tab": "\t"}.get(text, text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(
            f"must be one character ('\\t' or 'tab': a tab), got {text!r}"
        )
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show
    (flags, options without a default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_ = action.help or ""
        nothing = action.default is None or action.default is False
        if nothing or action.default is argparse.SUPPRESS or "%(default)" in help_:
            return help_
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, "*"):
            return help_  # a positional argument: no default
        shown = "%(default)r" if isinstance(action.default, str) else "%(default)s"
        return f"{help_} (default: {shown})".lstrip()


class _SchemaHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the description (the schema reference) as written."""


class _CsvParser(argparse.ArgumentParser):
    """``convert csv``: its description is the schema reference, read only
    when help is shown (it lives with the converter, which imports pyarrow)."""

    @property  # type: ignore[override]
    def description(self) -> str:
        from wuliang.reader.convert.csv import SCHEMA_HELP

        return "Converts delimited text to Parquet as a YAML schema describes.\n\n" + SCHEMA_HELP

    @description.setter
    def description(self, value: str | None) -> None:
        pass


# -- commands ------------------------------------------------------------------------


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
    if args.format == "criteo":
        files = convert.convert_criteo(
            args.input, args.out_dir, args.rows_per_file, args.bucketize, progress
        )
    elif args.format == "movielens":
        files = convert.convert_movielens(args.input, args.out_dir, progress)
    else:
        files = convert.convert_csv(
            args.input, args.out_dir, args.schema, args.rows_per_file, args.delimiter, progress
        )
        print(f"{files.summary()} to {args.out_dir}")  # rows dropped by the schema's policies
        return 0
    rows = sum(pq.read_metadata(f).num_rows for f in files)
    print(f"wrote {rows:,} rows in {len(files)} files to {args.out_dir}")
    return 0


def byte_size(text: str) -> int:
    """An argparse type: a number of bytes, ``>= 0``, with an optional unit
    ``K``, ``M``, ``G`` or ``T`` (powers of 1024; ``KiB``, ``GB``... read
    the same): ``500G``."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = value[-1:] if value[-1:] in units else ""
    try:
        number = float(value[: len(value) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid size: {text!r} (bytes, or a number with K, M, G or T: 500G)"
        ) from None
    if not math.isfinite(number) or number < 0:
        raise argparse.ArgumentTypeError(f"must be a size >= 0, got {text!r}")
    return int(number * units[unit])


def _export(args: argparse.Namespace) -> int:
    from wuliang.checkpoint import latest_checkpoint
    from wuliang.export import CheckpointSource, compact, export, prune
    from wuliang.ps_server.storage import location

    if args.compact:
        result = compact(args.export_dir)
    else:
        model_dir = location(args.model_dir)  # a folder, or a URI of an object store
        if not model_dir.is_dir():
            what = "is not a folder" if model_dir.exists() else "does not exist"
            raise FileNotFoundError(f"model directory {model_dir} {what}")
        path = latest_checkpoint(model_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint (ckpt-<step>) in {model_dir}")
        kind = "full" if args.full else "auto"
        result = export(CheckpointSource(path), args.export_dir, kind)
    print(result.status())
    if args.keep_versions is not None or args.keep_bytes is not None:
        pruned = prune(
            args.export_dir, keep_versions=args.keep_versions, keep_bytes=args.keep_bytes
        )
        print(pruned.status())
    return 0


def _check_export(args: argparse.Namespace) -> None:
    if args.model_dir is None and not args.compact:
        raise ValueError("the following arguments are required: --model-dir (or --compact)")


def _serve_options(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from wuliang.ps_server.storage import location
    from wuliang.serving.run import ServeOptions

    def path(value: str | None) -> Path | None:
        return None if value is None else Path(value)

    return ServeOptions(
        exports=None if args.exports is None else location(args.exports),  # or a URI
        model=args.model,
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        poll_secs=args.poll_secs,
        token_file=path(args.token_file),
        tls_cert=path(args.tls_cert),
        tls_key=path(args.tls_key),
        precision=args.precision,
        missing=args.missing,
        max_keys=args.max_keys,
        max_rows=args.max_rows,
        max_request_bytes=args.max_request_bytes,
        shards=args.shards,
        redis=args.redis,
        gpu_cache_rows=args.gpu_cache_rows,
        disk_dir=path(args.disk_dir),
        memory_gb=args.memory_gb,
        model_config=path(args.model_config),
        model_config_poll_secs=args.model_config_poll_secs,
        predict_threads=args.predict_threads,
        max_queue=args.max_queue,
        max_queue_ms=args.max_queue_ms,
    )


def _check_serve(args: argparse.Namespace) -> None:
    from wuliang.serving.run import check_options

    check_options(_serve_options(args))


def _serve(args: argparse.Namespace) -> int:
    from wuliang.serving.run import serve

    return serve(_serve_options(args))


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _publish(args: argparse.Namespace) -> int:
    from wuliang.serving.redis.publish import publish

    result = publish(
        args.export_dir,
        args.redis,
        args.model,
        args.version,
        retention=args.retention,
        shards=args.shards,
        full=args.full,
    )
    print(result.status())
    return 0


def _ps_options(args: argparse.Namespace) -> Any:
    from wuliang.ps_server.remote.run import PsOptions, listen_address
    from wuliang.ps_server.storage import location

    host, port = listen_address(args.port, args.host)
    return PsOptions(
        port,
        host=host,
        threads=args.threads,
        token_file=None if args.token_file is None else Path(args.token_file),
        tls_cert=None if args.tls_cert is None else Path(args.tls_cert),
        tls_key=None if args.tls_key is None else Path(args.tls_key),
        max_message_mb=args.max_message_mb,
        restore=None if args.restore is None else location(args.restore),
        server_index=args.server_index,
        num_servers=args.num_servers,
        parent_pid=args.parent_pid,
        disk_dir=None if args.disk_dir is None else Path(args.disk_dir),
        memory_gb=args.memory_gb,
    )


def _check_ps(args: argparse.Namespace) -> None:
    from wuliang.ps_server.remote.run import check_options

    check_options(_ps_options(args))


def _launch_options(args: argparse.Namespace) -> Any:
    from wuliang.launch import LaunchOptions

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return LaunchOptions(
        command,
        ps=args.ps,
        workers=args.workers,
        chief=not args.no_chief,
        ps_threads=args.ps_threads,
        max_restarts=args.max_restarts,
        restart_window=args.restart_window,
        max_backoff=args.max_backoff,
        recovery=args.recovery,
        model_dir=args.model_dir,
    )


def _check_launch(args: argparse.Namespace) -> None:
    _launch_options(args).check()


def _launch(args: argparse.Namespace) -> int:
    from wuliang.launch import launch

    return launch(_launch_options(args))


def _ps(args: argparse.Namespace) -> int:
    from wuliang.ps_server.remote.run import run

    return run(_ps_options(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wuliang", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"wuliang {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        parent: argparse._SubParsersAction,
        name: str,
        func: Callable[..., int],
        check: Callable[[argparse.Namespace], None] | None = None,
        **kw: str,
    ) -> argparse.ArgumentParser:
        kw.setdefault("description", kw.get("help", ""))
        p = parent.add_parser(name, formatter_class=HelpFormatter, **kw)
        p.set_defaults(func=func, prog=p.prog, parser=p, check=check)
        return p

    demo = command(sub, "demo", _demo, help="run the engine demo and print what it did")
    demo.add_argument("--steps", type=positive_int, default=40, help="training steps to simulate")
    demo.add_argument("--batch", type=positive_int, default=100_000, help="keys per step")
    demo.add_argument("--shards", type=bounded_int(1, 1024), default=2, help="engine shard threads")

    gen = command(sub, "datagen", _datagen, help="write synthetic Criteo-shaped Parquet data")
    gen.add_argument(
        "out_dir",
        help="written: part-00000.parquet ...; parts of an earlier run beyond the new ones "
        "are removed, other files are left alone",
    )
    gen.add_argument("--rows", type=positive_int, required=True, help="rows in all")
    gen.add_argument("--rows-per-file", type=positive_int, default=100_000, help="rows per file")
    gen.add_argument("--alpha", type=float_above(1), default=1.1, help="Zipf exponent of the ids")
    gen.add_argument(
        "--ids-per-field", type=positive_int, default=1_000_000_000, help="distinct ids per field"
    )
    gen.add_argument("--seed", type=non_negative_int, default=0, help="random seed")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")

    what = "convert a data set to Parquet for the reader"
    conv = sub.add_parser("convert", help=what, description=what, formatter_class=HelpFormatter)
    formats = conv.add_subparsers(dest="format", required=True, metavar="FORMAT")
    criteo = command(formats, "criteo", _convert, help="Criteo Display Advertising TSV")
    criteo.add_argument("input", help="the TSV file (.gz, .bz2, .zst: decompressed)")
    criteo.add_argument("out_dir", help="written: part-00000.parquet ...")
    criteo.add_argument(
        "--rows-per-file", type=positive_int, default=1_000_000, help="rows per file"
    )
    criteo.add_argument(
        "--bucketize", action="store_true", help="also I1_bucket ...: keys of log2 buckets"
    )
    movielens = command(formats, "movielens", _convert, help="MovieLens CSVs, one file per day")
    movielens.add_argument("input", help="directory with ratings.csv, movies.csv [, tags.csv]")
    movielens.add_argument("out_dir", help="written: YYYY-MM-DD.parquet, one per day")
    formats._parser_class = _CsvParser  # its --help shows the whole schema reference
    csv = command(formats, "csv", _convert, help="delimited text described by a YAML schema")
    formats._parser_class = argparse.ArgumentParser
    csv.formatter_class = _SchemaHelpFormatter
    csv.add_argument("input", help="the text file (.gz, .bz2, .zst: decompressed)")
    csv.add_argument("out_dir", help="written: part-00000.parquet ...")
    csv.add_argument("--schema", required=True, help="YAML schema of the columns")
    csv.add_argument("--rows-per-file", type=positive_int, default=1_000_000, help="rows per file")
    csv.add_argument(
        "--delimiter", type=delimiter, default=",", help="one character; '\\t' or 'tab' for tabs"
    )
    for p in (criteo, movielens, csv):
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    exp = command(
        sub,
        "export",
        _export,
        _check_export,
        help="export the newest checkpoint for serving (a delta of the last export)",
        description="Writes the next version of EXPORT_DIR from the newest checkpoint in "
        "MODEL_DIR: a delta of the last version (rows changed and keys removed since), or a "
        "full version when there is none; with --keep-versions or --keep-bytes, then "
        "removes the oldest versions that LATEST does not need. Idempotent and safe to rerun "
        "after a crash; prints a status line (and one of the pruning), exits 1 with a "
        "message on failure.",
    )
    exp.add_argument(
        "--model-dir", help="the trainer's checkpoints (ckpt-<step>/); a folder or a URI (s3://...)"
    )
    exp.add_argument(
        "--export-dir", required=True, help="versions 1/, 2/, ... and LATEST; a folder or a URI"
    )
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
    exp.add_argument(
        "--keep-versions",
        type=positive_int,
        metavar="N",
        help="then remove the oldest versions until N are left, never LATEST's chain "
        "(default: remove none)",
    )
    exp.add_argument(
        "--keep-bytes",
        type=byte_size,
        metavar="SIZE",
        help="then remove the oldest versions until they take at most SIZE (bytes, or "
        "with K, M, G, T: 500G), never LATEST's chain (default: remove none)",
    )
    srv = command(
        sub,
        "serve",
        _serve,
        _check_serve,
        help="serve an export directory online (gRPC and HTTP/JSON)",
        description="Loads the newest valid version of EXPORTS (a full export and its "
        "deltas), serves lookups and predictions over gRPC (wuliang's API and TensorFlow "
        "Serving's PredictionService, on one port) and an HTTP/JSON API shaped like "
        "TensorFlow Serving's, and applies each new version while serving (an empty EXPORTS, "
        "or a model not yet published to --redis, is served once its first version comes). "
        "Prints one line with the addresses once listening and logs each version applied or "
        "refused to stderr; runs until SIGINT or SIGTERM.",
    )
    srv.add_argument(
        "--exports",
        help="the trainer's export directory, a folder or a URI (s3://...) "
        "(with --redis: for the towers)",
    )
    srv.add_argument("--model", help="the model's name in requests (default: EXPORTS' name)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (both servers)")
    srv.add_argument(
        "--port", type=bounded_int(0, 65535), default=8500, help="gRPC port (0: any free one)"
    )
    srv.add_argument(
        "--http-port",
        type=bounded_int(-1, 65535),
        default=8501,
        help="HTTP port (0: any free one, -1: no HTTP server)",
    )
    srv.add_argument(
        "--poll-secs",
        type=non_negative_float,
        default=1.0,
        help="how often to look for new versions (0: only at start; default 1: a read of "
        "LATEST, so a trainer's delta serves within about a second)",
    )
    srv.add_argument("--token-file", help="requests must carry the token in this file")
    srv.add_argument("--tls-cert", help="PEM certificate: serve TLS (with --tls-key)")
    srv.add_argument("--tls-key", help="PEM private key of --tls-cert")
    srv.add_argument(
        "--precision",
        choices=["fp32", "fp16", "int8"],
        default="fp32",
        help="how served vectors are stored (int8: one scale per row)",
    )
    srv.add_argument(
        "--missing",
        choices=["zeros", "initial"],
        default="zeros",
        help="what keys never trained read as (found=false either way)",
    )
    srv.add_argument(
        "--max-keys", type=positive_int, default=100_000, help="keys one lookup may ask for"
    )
    srv.add_argument(
        "--max-rows", type=positive_int, default=10_000, help="rows one prediction may ask for"
    )
    srv.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=16 << 20,
        help="bytes of one request (HTTP body or gRPC message)",
    )
    srv.add_argument(
        "--predict-threads",
        type=bounded_int(1, 64),
        default=PREDICT_THREADS,
        metavar="N",
        help="threads answering predictions, per transport (default: %(default)s, from the "
        "cores: TensorFlow spreads one prediction over them)",
    )
    srv.add_argument(
        "--max-queue",
        type=bounded_int(0),
        default=DEFAULT_MAX_QUEUE,
        metavar="N",
        help="requests that may wait in a queue (each API's pool of each transport, and the "
        "HTTP loop): a closed loop of up to N callers is never refused; a request that finds N "
        "waiting is shed (RESOURCE_EXHAUSTED, HTTP 503 with Retry-After) and the queue is "
        "overloaded until its arrivals fall below what it answers (default: %(default)s; "
        "0: no bound, nothing shed)",
    )
    srv.add_argument(
        "--max-queue-ms",
        type=non_negative_float,
        default=DEFAULT_MAX_QUEUE_MS,
        metavar="MS",
        help="while a queue is overloaded, shed at once a lookup or prediction that would "
        "wait longer than MS (or one service time of its API, if longer) (default: "
        "%(default)s; 0: shed only beyond --max-queue)",
    )
    srv.add_argument("--shards", type=bounded_int(1, 1024), default=2, help="engine shard threads")
    srv.add_argument(
        "--gpu-cache-rows",
        type=bounded_int(0),
        default=0,
        metavar="N",
        help="keep the N hottest rows of each table (by the exported shows) on the GPU for "
        "predictions (lookups read the engine), or in host memory where there is none (0: "
        "off; not with --redis)",
    )
    srv.add_argument(
        "--disk-dir",
        metavar="DIR",
        help="a model larger than memory: rows beyond --memory-gb of RAM live in row files "
        "in DIR, a directory on a local disk, read there by lookups (docs/disk_tier.md; "
        "scratch: made afresh, deleted at exit; not with --redis)",
    )
    srv.add_argument(
        "--memory-gb",
        type=float,
        metavar="G",
        help="with --disk-dir: GiB of RAM for the rows of each served version (default 1)",
    )
    srv.add_argument(
        "--redis",
        metavar="URL",
        help="serve the version wuliang publish made current in this Redis (or Redis Cluster: "
        "redis+cluster://h1:p1,h2:p2), through a local hot cache, switching on each announcement",
    )
    srv.add_argument(
        "--model-config",
        metavar="FILE",
        help="serve the models of TensorFlow Serving's model config file (model_config_list: "
        "name, base_path, model_version_policy, version_labels), each from its own export "
        "directory; re-read on SIGHUP (instead of --exports, --model, --redis)",
    )
    srv.add_argument(
        "--model-config-poll-secs",
        type=non_negative_float,
        default=0.0,
        metavar="S",
        help="also re-read --model-config every S seconds (0: on SIGHUP only)",
    )

    ps = command(
        sub,
        "ps",
        _ps,
        _check_ps,
        help="run a parameter server (the engine behind gRPC) for remote training",
        description="Serves an engine of --threads shard threads over gRPC until SIGTERM or "
        "SIGINT (wuliang.ps_server.remote); a trainer reaches it with "
        "Context(ps=['host:port', ...]). Prints one line with its address once it listens.",
    )
    ps.add_argument(
        "--port",
        type=bounded_int(0, 65535),
        help="0: a free port (default: this task's port in TF_CONFIG, a ps task)",
    )
    ps.add_argument(
        "--host",
        help="the address to listen on (default 127.0.0.1; with TF_CONFIG's port 0.0.0.0)",
    )
    ps.add_argument(
        "--threads",
        type=bounded_int(1, 1024),
        default=2,
        help="engine shard threads (the same on every server of a job)",
    )
    ps.add_argument(
        "--token-file",
        default=os.environ.get("WULIANG_PS_TOKEN_FILE") or None,
        help="every call must carry the token in this file (default: $WULIANG_PS_TOKEN_FILE)",
    )
    ps.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key: TLS)")
    ps.add_argument("--tls-key", help="PEM private key of --tls-cert")
    ps.add_argument(
        "--max-message-mb",
        type=bounded_int(1, 2047),
        default=64,
        help="the largest message received or sent (clients split larger batches)",
    )
    ps.add_argument(
        "--restore",
        metavar="MODEL_DIR",
        help="first restore this server's part of the newest checkpoint in MODEL_DIR "
        "(a server that comes back after a failure; nothing when there is none)",
    )
    ps.add_argument(
        "--server-index",
        type=bounded_int(0),
        help="with --restore: which server this is (default: TF_CONFIG's ps task index)",
    )
    ps.add_argument(
        "--num-servers",
        type=bounded_int(1),
        help="with --restore: how many servers the job has (default: TF_CONFIG's ps tasks)",
    )
    ps.add_argument(
        "--disk-dir",
        metavar="DIR",
        help="the disk tier: rows beyond --memory-gb of RAM live in row files in DIR, a "
        "directory on a local disk (docs/disk_tier.md; scratch: made afresh, deleted at exit)",
    )
    ps.add_argument(
        "--memory-gb",
        type=float,
        metavar="G",
        help="with --disk-dir: GiB of RAM for the rows of all tables (default 1)",
    )
    ps.add_argument(
        "--parent-pid",
        type=bounded_int(1),
        metavar="PID",
        help="also stop (as on SIGTERM) once process PID is no longer this server's parent, "
        "i.e. it exited: for test harnesses and supervisors that must not leave servers behind",
    )

    launch = command(
        sub,
        "launch",
        _launch,
        _check_launch,
        help="run a job's roles (parameter servers, chief, workers) as local processes",
        description="Starts --ps parameter servers, a chief and --workers workers (the "
        "command after --) on this machine, each with its own TF_CONFIG, as an orchestrator "
        "would; prefixes every line with its role, restarts a process that fails, and stops "
        "everything when the chief ends or on Ctrl-C (wuliang.launch).",
    )
    launch.add_argument("--ps", type=bounded_int(0, 64), default=1, help="parameter servers")
    launch.add_argument("--workers", type=bounded_int(0, 64), default=0, help="workers")
    launch.add_argument(
        "--no-chief", action="store_true", help="workers only (worker 0 acts as the chief)"
    )
    launch.add_argument(
        "--ps-threads", type=bounded_int(1, 1024), default=2, help="each server's --threads"
    )
    launch.add_argument(
        "--model-dir",
        help="the job's model_dir: each server started (or restarted) takes its part of the "
        "newest checkpoint there (wuliang ps --restore)",
    )
    launch.add_argument(
        "--max-restarts",
        type=bounded_int(0),
        default=10,
        help="failures of one role within --restart-window that stop the job (a crash loop)",
    )
    launch.add_argument(
        "--recovery",
        choices=("partial", "full"),
        default="partial",
        help="partial: restart only the role that failed (a server restores its part of "
        "the newest checkpoint, the others keep theirs); full: any failure restarts every "
        "role from the newest checkpoint (exactly once; needs --model-dir)",
    )
    launch.add_argument(
        "--restart-window",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="the window --max-restarts counts failures in (default 600)",
    )
    launch.add_argument(
        "--max-backoff",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="the longest wait before a restart; it doubles from 1 s with each failure "
        "within the window after the first (default 30)",
    )
    launch.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- the trainer's command and its arguments"
    )

    pub = command(
        sub,
        "publish",
        _publish,
        help="publish an export version to Redis for a fleet of serving replicas",
        description="Writes a version of EXPORT_DIR to Redis or a Redis Cluster: a delta whose "
        "parent chain is in Redis writes only the rows it changed or removed, anything else "
        "every row of the version (its chain applied); then makes it current in one atomic "
        "step and announces it to the replicas (wuliang.serving.redis.publish); deletes the "
        "versions beyond --retention that no replica reads. Publishing the current version "
        "again writes nothing. Prints one status line, exits 1 with a message on failure.",
    )
    pub.add_argument("--export-dir", required=True, help="versions 1/, 2/, ... and LATEST")
    pub.add_argument(
        "--redis",
        required=True,
        metavar="URL",
        help="redis://[:password@]host:port/db, or a cluster: redis+cluster://h1:p1,h2:p2",
    )
    pub.add_argument(
        "--model", help="the model's name in Redis keys (default: the export directory's name)"
    )
    pub.add_argument(
        "--version", type=positive_int, help="the version to publish (default: LATEST)"
    )
    pub.add_argument(
        "--retention",
        type=positive_int,
        default=2,
        help="versions kept in Redis, the new one included (and those replicas read)",
    )
    pub.add_argument(
        "--full",
        action="store_true",
        help="write a full copy even if the version is a delta on top of what Redis holds",
    )
    pub.add_argument(
        "--shards",
        type=positive_int,
        help="hash-tagged shards of a full copy (default: 1 on one Redis, 8 per cluster master)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (argparse exits with 2
    on a usage error)."""
    args = build_parser().parse_args(argv)
    if args.check is not None:
        try:
            args.check(args)
        except ValueError as error:
            args.parser.error(str(error))  # exits 2
    try:
        return int(args.func(args))
    except EXPECTED_ERRORS as error:
        # a KeyError's str() is the repr of its argument
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"{args.prog}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
