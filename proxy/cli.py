"""The `polyinfer` console script: one parser, one subcommand per part.

Each part owns its subcommand in a module exposing ``register(subparsers)``,
which adds a parser and sets ``func(args) -> int``. Modules are imported
lazily so that `polyinfer --help` stays fast and a part's heavy imports
(torch, vllm) load only when its subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# NOTE: order is the order shown in --help.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "proxy.serve_cli",
    "router.cli",
    "loadgen.cli",
    "engine.cli",
    "optimizer.cli",
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("polyinfer")
    except PackageNotFoundError:  # a checkout run without installing it
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyinfer",
        description="Adaptive OpenAI-compatible proxy for a fleet of LLM engine workers.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
