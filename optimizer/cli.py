"""``polyinfer optimize``: run the optimizer standalone on trace files.

The optimizer reads the traces a proxy wrote (``traces/traces-*.jsonl``), profiles
the traffic, lets its proposer agents search engine configs on a shared message board,
measures the candidates on a persistent engine that hot-reloads them, verifies the
best and, given ``--worker``, promotes the winner to that live engine worker.
``polyinfer serve --optimize`` runs the same in the background of a proxy.

Examples::

    # one campaign on recorded traffic, measured on an engine it starts itself;
    # searches and verifies, promotes nothing (no --worker)
    polyinfer optimize --traces traces/traces-*.jsonl --budget 8 --once
    # promote the winner to a running engine worker (polyinfer engine --port 8101)
    polyinfer optimize --traces traces.jsonl --worker http://127.0.0.1:8101 \\
        --board opt.sqlite --budget 16 --once

Without ``--measure-url`` it starts its own measurement engine on the
``--model``; without ``--worker`` it searches and verifies but promotes
nothing. The final snapshot (what /stats shows) is printed as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from optimizer.campaign import SearchConfig
from optimizer.errors import OptimizerError
from optimizer.join import join_campaign
from optimizer.measure import Tier
from optimizer.promote import PromotionConfig
from optimizer.sample import SampleConfig
from optimizer.service import AGENT_NAMES, OptimizerConfig, OptimizerService
from polyinfer.config import TINY_TARGET, CompiledConfig, ConfigError

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces", nargs="+", default=[], help="JSONL trace files (tailed)")
    p.add_argument("--join", action="store_true",
                   help="only run extra agents (bayes, evolution) in this process on the "
                        "board's open campaign, until it is done")
    p.add_argument("--worker", help="live engine worker URL to promote winners to")
    p.add_argument("--worker-backend", default="engine", choices=["engine", "vllm", "external"])
    p.add_argument("--config", help="base compiled config (YAML/JSON); default: built-in")
    p.add_argument("--model", default=str(TINY_TARGET), help="checkpoint dir (overrides config)")
    p.add_argument("--measure-url", help="persistent engine to measure on (default: start one)")
    p.add_argument("--board", default="optimizer-board.sqlite", help="message board file")
    p.add_argument("--agents", default="costmodel,bayes,evolution",
                   help=f"comma-separated, from {','.join(AGENT_NAMES)}")
    p.add_argument("--llm-url", help="OpenAI-compatible endpoint for the llm agent")
    p.add_argument("--llm-model", default="")
    p.add_argument("--budget", type=int, default=24, help="fast-tier experiments per campaign")
    p.add_argument("--finalists", type=int, default=2)
    p.add_argument("--fast-layers", type=int, default=2, help="layers loaded in the fast tier")
    p.add_argument("--fast-requests", type=int, default=12)
    p.add_argument("--slow-requests", type=int, default=24)
    p.add_argument("--slow-repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8,
                   help="replay concurrency cap (the traffic's own concurrency when lower)")
    p.add_argument("--objective", default="auto", choices=["auto", "request", "cpu", "wall"],
                   help="auto: per-request tok/s at low load, throughput when busy")
    p.add_argument("--throughput-objective", default="wall", choices=["wall", "cpu"],
                   help="auto's busy-traffic objective: wall tok/s (rewards idle cores) or "
                        "tok per engine CPU second (steadier on a shared box)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-output-tokens", type=int, default=48)
    p.add_argument("--memory-gb", type=float, default=1.0, help="memory budget for the KV cache")
    p.add_argument("--min-records", type=int, default=20)
    p.add_argument("--watch-s", type=float, default=10.0, help="live window before rollback")
    p.add_argument("--once", action="store_true", help="stop after one campaign")
    p.add_argument("--seed", type=int, default=0)


def build_config(args: argparse.Namespace) -> OptimizerConfig:
    base = CompiledConfig.load(args.config) if args.config else CompiledConfig()
    if args.model:
        import dataclasses

        base = dataclasses.replace(base, model=args.model)
    return OptimizerConfig(
        base=base, traces=tuple(args.traces), board_path=args.board, worker_url=args.worker,
        worker_backend=args.worker_backend, measure_url=args.measure_url,
        agents=tuple(a for a in args.agents.split(",") if a), llm_url=args.llm_url,
        llm_model=args.llm_model,
        fast=Tier("fast", args.fast_layers, args.fast_requests, concurrency=args.concurrency),
        slow=Tier("slow", None, args.slow_requests, repeats=args.slow_repeats,
                  concurrency=args.concurrency),
        sample=SampleConfig(args.max_prompt_tokens, args.max_output_tokens),
        search=SearchConfig(fast_budget=args.budget, finalists=args.finalists),
        promotion=PromotionConfig(watch_s=args.watch_s),
        memory_budget_bytes=int(args.memory_gb * (1 << 30)), min_records=args.min_records,
        objective=getattr(args, "objective", "auto"),
        throughput_objective=getattr(args, "throughput_objective", "wall"), once=args.once,
        seed=args.seed)


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except (ConfigError, OptimizerError) as e:
        logger.error("%s", e)
        return 2
    if args.join:
        cid = asyncio.run(join_campaign(config.board_path, config.base, config.knobs,
                                        seed=args.seed + 100,
                                        memory_budget_bytes=config.memory_budget_bytes))
        print(json.dumps({"joined": cid}))
        return 0 if cid else 1
    if not config.traces:
        logger.error("--traces: at least one trace file is needed (or --join)")
        return 2
    service = OptimizerService(config)
    try:
        asyncio.run(service.run())
    except KeyboardInterrupt:
        pass
    except OptimizerError as e:
        logger.error("%s", e)
        return 1
    finally:
        json.dump(service.snapshot(), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("optimize", help="re-tune engine configs from traces",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)
