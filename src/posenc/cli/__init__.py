"""The ``posenc`` command: ``posenc plot | bench | compare | demo``.

``build_parser()`` builds the argument parser; ``main(argv=None) -> int`` runs a command and
returns its exit status, so every command is testable without ``sys.argv``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._version import __version__
from . import bench, compare, demo, plot


def build_parser() -> argparse.ArgumentParser:
    """The parser for every subcommand."""
    parser = argparse.ArgumentParser(
        prog="posenc",
        description=(
            "Positional encodings for self-attention: plot them, benchmark them, compare them."
        ),
    )
    parser.add_argument("--version", action="version", version=f"posenc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    plot.add_parser(commands)
    bench.add_parser(commands)
    compare.add_parser(commands)
    demo.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``posenc`` with ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (ValueError, TypeError, ImportError) as err:  # a bad value, found before any work
        print(f"posenc {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the system refused a read or write that the checks could not foresee
        print(f"posenc {args.command}: error: {err}", file=sys.stderr)
        return 1
