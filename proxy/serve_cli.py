"""`polyinfer serve`: the OpenAI-compatible proxy.

    polyinfer serve                                  # embedded default: 2 engine workers
    polyinfer serve --config polyinfer.yaml          # no `workers` in it: the same 2
    polyinfer serve --worker http://127.0.0.1:9001 --worker http://127.0.0.1:9002
    polyinfer serve --optimize                       # + the background optimizer
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from polyinfer.config import ConfigError
from proxy.config import (
    OptimizeConfig,
    ProxyConfig,
    RoutingConfig,
    ServerConfig,
    default_config,
    external_worker,
)
from proxy.routing import POLICIES
from proxy.server import run, serve_until_signal

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible routing proxy",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="polyinfer.yaml (workers, routing, traces, auth, limits)")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="an already running OpenAI-compatible worker (repeatable); "
                        "replaces the config's workers")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--policy", metavar="POLICY",
                   help=f"routing policy, overrides routing.policy: one of {', '.join(POLICIES)}"
                        f", or module:Class (default: {RoutingConfig().policy})")
    p.add_argument("--optimize", action="store_true",
                   help="run the background optimizer on an engine worker (see optimize.*)")
    p.add_argument("--optimize-worker", metavar="NAME",
                   help="the worker to optimize (default: every engine worker)")
    p.add_argument("--optimize-agents", metavar="NAMES",
                   help="comma-separated proposer agents: costmodel,bayes,evolution,llm")
    p.add_argument("--optimize-llm-url", metavar="URL",
                   help="OpenAI-compatible endpoint for the llm agent (implies it)")
    p.add_argument("--optimize-llm-model", metavar="NAME", default="",
                   help="model name the llm agent asks for")
    p.add_argument("--optimize-settings", metavar="FILE",
                   help="YAML/JSON of optimizer settings (budgets, canary, knobs: optimizer.settings)")
    p.set_defaults(func=main)


def build_config(args: argparse.Namespace) -> ProxyConfig:
    config = ProxyConfig.load(args.config) if args.config else default_config()
    if not config.workers and not args.worker:
        config = dataclasses.replace(config, workers=default_config().workers)
        logger.info("%s names no workers: starting the embedded default ones (%s)",
                    args.config, ", ".join(w.name for w in config.workers))
    if args.worker:
        workers = tuple(external_worker(url, i) for i, url in enumerate(args.worker))
        config = dataclasses.replace(config, workers=workers)
    if args.host or args.port is not None:
        config = dataclasses.replace(config, server=ServerConfig(
            host=args.host or config.server.host,
            port=config.server.port if args.port is None else args.port))
    if args.policy:
        config = dataclasses.replace(
            config, routing=dataclasses.replace(config.routing, policy=args.policy))
    optimize_worker = getattr(args, "optimize_worker", None)
    if getattr(args, "optimize", False) or optimize_worker:
        config = dataclasses.replace(config, optimize=_optimize_flags(config.optimize, args))
    if not config.workers:
        raise ConfigError("workers: expected at least one worker (config or --worker URL)")
    return config


def main(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except ConfigError as e:
        logger.error("%s", e)
        return 2
    try:
        run(lambda: serve_until_signal(config))
    except (OSError, RuntimeError) as e:  # port taken, a supervised worker failed to start...
        logger.error("polyinfer serve failed: %s", e)
        return 1
    return 0


def _optimize_flags(cfg: OptimizeConfig, args: argparse.Namespace) -> OptimizeConfig:
    """``optimize`` with the --optimize-* flags over it (the llm URL adds the llm agent)."""
    agents = cfg.agents
    if getattr(args, "optimize_agents", None):
        agents = tuple(a.strip() for a in args.optimize_agents.split(",") if a.strip())
    llm_url = getattr(args, "optimize_llm_url", None) or cfg.llm_url
    if llm_url and "llm" not in agents:
        agents = (*agents, "llm")
    return dataclasses.replace(cfg, enabled=True, agents=agents, llm_url=llm_url,
                               worker=getattr(args, "optimize_worker", None) or cfg.worker,
                               llm_model=getattr(args, "optimize_llm_model", "") or cfg.llm_model,
                               settings=getattr(args, "optimize_settings", None) or cfg.settings)
