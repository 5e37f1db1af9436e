"""``python -m engine --model DIR --port N [--config compiled.yaml]``."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.cli import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    add_arguments(parser)
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
