"""``pit-tvm`` entry point: dispatch to the subcommand modules.

Each module in ``SUBCOMMANDS`` exposes ``register(subparsers)``, which adds its parser and
sets ``func`` (called with the parsed args; its return value is the exit code).
"""
from __future__ import annotations

import argparse
import sys
from importlib import import_module

SUBCOMMANDS = ("demo", "analyze", "tune", "compile", "run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pit-tvm", description=__doc__.splitlines()[0])
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
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
