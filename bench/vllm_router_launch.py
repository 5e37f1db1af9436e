#!/usr/bin/env python3
"""Start vllm-router's Rust router with the arguments its ``vllm-router`` command takes.

Its own launcher (``vllm_router.launch_router``) also imports the Python mini load
balancer, which needs fastapi and uvicorn; the Rust router needs neither. This lets the
wheel alone (``pip install --no-deps vllm-router``) run on a machine without them, e.g.

    bench/proxy_overhead.py --vllm-router bench/vllm_router_launch.py
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> None:
    from vllm_router.router import Router
    from vllm_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(description=__doc__)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    args._validate_router_args()
    Router.from_args(args).start()


if __name__ == "__main__":
    main(sys.argv[1:])
