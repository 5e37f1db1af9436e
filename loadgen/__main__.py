"""``python -m loadgen ...`` is ``polyinfer loadgen ...`` (without the other subcommands)."""

from __future__ import annotations

import argparse
import logging
import sys

from loadgen.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["loadgen", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
