"""The ``pagellm`` command line: one module per subcommand under ``commands/``.

Each command module exposes ``add_parser(subparsers)`` which registers its parser and sets
``func`` (called with the parsed namespace, returning an exit code). Command modules keep heavy
imports (torch, transformers) inside ``func`` so that ``pagellm kv-calc`` starts instantly.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown in --help.
COMMAND_MODULES = (
    "serve",
    "generate",
    "chat",
    "kv_calc",
    "demo",
    "bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagellm",
        description="pagellm: LLM inference and serving over a paged KV cache.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"pagellm.entrypoints.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"pagellm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
