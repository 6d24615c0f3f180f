"""The ``stragglerwatch`` command. Each subcommand only parses arguments and calls the library."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence

from . import __version__
from .eventlog import RunDirError, load_run
from .report import rank_summary, render_summary


def _show_warning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
    print(f"stragglerwatch: warning: {message}", file=sys.stderr)


def cmd_summary(args: argparse.Namespace) -> int:
    frame = load_run(args.run_dir)
    summary = rank_summary(frame)
    world = int(frame["world_size"].iloc[0]) if len(frame) else 0
    if args.format == "json":
        out = {
            "world_size": world,
            "steps": int(frame["step"].nunique()),
            "ranks": [{"rank": int(rank), **row} for rank, row in summary.to_dict("index").items()],
        }
        print(json.dumps(out, indent=2))
    else:
        print(render_summary(summary, world))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stragglerwatch",
        description="Find the slow and the stuck ranks of PyTorch DDP training jobs.",
        epilog="Record a run with stragglerwatch.attach(model) in the training script; "
        "then inspect its run dir with the commands above.",
    )
    parser.add_argument("--version", action="version", version=f"stragglerwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "summary",
        help="per-rank table of a run: median step, busy and phase times, busy time vs peers",
        description="Print one row per rank of a run dir: median step time, busy time "
        "(step minus exposed all-reduce wait: the straggler signal) and phase times in ms, "
        "and the rank's busy time relative to the median of its peers.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run dir written by stragglerwatch.attach()")
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    p.set_defaults(func=cmd_summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    warnings.showwarning = _show_warning
    try:
        return args.func(args)
    except RunDirError as exc:
        print(f"stragglerwatch: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
