"""``polyinfer engine`` / ``python -m engine``: serve one model with the built-in engine.

One engine worker on its own: an OpenAI-compatible server (``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, vLLM's ``/metrics`` names, ``POST /admin/reload``)
for a Llama-family checkpoint, run by the compiled config's ``engine`` section
(continuous batching, paged KV cache, speculative decoding). ``polyinfer serve``
starts workers like this one itself; run one alone to test a config or to attach it
to a proxy by URL.

Examples::

    polyinfer engine --model models/tiny-target --port 8100
    polyinfer engine --model models/tiny-target --config compiled.yaml   # e.g.
    #   backend: engine
    #   engine: {max_num_seqs: 8, spec_method: ngram, spec_max_depth: 4}
    curl -s localhost:8100/v1/completions -H 'content-type: application/json' \\
      -d '{"model": "tiny-target", "prompt": "def fib(n):", "max_tokens": 16}'
    polyinfer serve --worker http://127.0.0.1:8100                     # a proxy in front
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from pathlib import Path

from engine.errors import EngineError
from polyinfer.config import CompiledConfig, ConfigError

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint directory (overrides the config's model)")
    parser.add_argument("--config", help="compiled config, YAML or JSON")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8100)
    parser.add_argument("--served-model-name", default="", help="name clients use")


def _port(text: str) -> int:
    """A TCP port, 1..65535 (argparse names the flag when this raises)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {port}")
    return port


def build_config(args: argparse.Namespace) -> CompiledConfig:
    config = CompiledConfig.load(args.config) if args.config else CompiledConfig()
    if args.model:
        config = dataclasses.replace(config, model=str(Path(args.model)))
    if args.served_model_name:
        config = dataclasses.replace(config, served_model_name=args.served_model_name)
    if config.backend != "engine":
        raise ConfigError(f"backend: expected 'engine' for `polyinfer engine`, got "
                          f"{config.backend!r}")
    return config


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except ConfigError as e:
        logger.error("%s", e)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_serve(config, args.host, args.port))
    except KeyboardInterrupt:
        pass
    except EngineError as e:  # the model or a config value cannot be served; names which
        logger.error("cannot start the engine: %s", e)
        return 2
    except OSError as e:  # e.g. --host/--port cannot be bound
        logger.error("cannot serve on %s:%d: %s", args.host, args.port, e)
        return 1
    return 0


async def _serve(config: CompiledConfig, host: str, port: int) -> None:
    from engine.server import serve

    await serve(config, host, port)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("engine", help="serve a model with the built-in engine",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)
