"""``pit-tvm`` entry point: dispatch to the subcommand modules.

Each module in ``SUBCOMMANDS`` exposes ``register(subparsers)``, which adds its parser and
sets ``func`` (called with the parsed args; its return value is the exit code).

User errors (a bad argument, a file that is not what it should be, inputs that do not fit the
model) exit with code 2 and one line ``pit-tvm <command>: error: <problem>`` on stderr: the
subcommands raise :class:`~pit_tvm.errors.UserError`, which :func:`main` prints; argparse's own
errors are printed the same way. A traceback means a bug.
"""
from __future__ import annotations

import argparse
import sys
from importlib import import_module

from pit_tvm.errors import UserError

SUBCOMMANDS = ("demo", "analyze", "tune", "compile", "run")
USER_ERROR_EXIT = 2


def one_line(message) -> str:
    """``message`` on one line (a multi-line message from a library joined with ' | ')."""
    return " | ".join(line.strip() for line in str(message).splitlines() if line.strip())


def print_error(prog: str, message) -> int:
    """Print ``<prog>: error: <message>`` on one stderr line; return the user-error exit code."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return USER_ERROR_EXIT


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage error printed as one line (plus where to find the usage)."""

    def error(self, message):
        print_error(self.prog, f"{message} (see {self.prog} --help)")
        sys.exit(USER_ERROR_EXIT)


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts that must be >= 1 (``--repeat``, ``--trials``...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse ``type=`` for a fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="pit-tvm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = import_module(f"pit_tvm.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"pit_tvm.cli.{name}":
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def main(argv=None) -> int:
    """Run ``pit-tvm`` on ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:   # --help (0), or a usage error already printed (2)
        return int(done.code or 0)
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        return print_error(f"pit-tvm {args.command}", err)


if __name__ == "__main__":
    sys.exit(main())
