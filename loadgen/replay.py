"""One replay, end to end: read -> schedule -> prepare -> send -> summarize -> write.

This is also loadgen's Python API (re-exported from ``loadgen``): the routing
and optimizer benchmarks call :func:`replay` (async) or :func:`run_replay`
in-process and read the returned summary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.arrivals import arrivals
from loadgen.client import StreamingClient, make_session
from loadgen.config import ReplayConfig
from loadgen.errors import TargetError, TraceError
from loadgen.lengths import describe
from loadgen.metrics import summarize
from loadgen.prepare import PrepareStats, RequestBuilder
from loadgen.readers import BadLines, detect_format, read_trace
from loadgen.request import PreparedRequest, RequestResult, TraceRequest
from loadgen.runner import Runner
from loadgen.synth import PromptSynthesizer, SynthStats
from loadgen.tokenizer import load_token_counter

logger = logging.getLogger(__name__)


@dataclass
class ReplayResult:
    summary: dict[str, Any]  # what summary.json holds
    results: list[RequestResult]  # one per sent request


@dataclass
class Prepared:
    requests: list[PreparedRequest]
    stats: PrepareStats
    bad: BadLines
    trace_format: str
    tokenizer: str
    synth: SynthStats | None


async def discover_models(session: aiohttp.ClientSession) -> list[tuple[str, str | None]]:
    """(id, root) of every model the target lists at ``GET /v1/models``."""
    try:
        async with session.get("/v1/models") as resp:
            body = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        raise TargetError(f"GET /v1/models failed ({e}); pass --model") from e
    models = body.get("data") if isinstance(body, dict) else None
    listed = [(str(m["id"]), m.get("root") if isinstance(m.get("root"), str) else None)
              for m in models or () if isinstance(m, dict) and "id" in m]
    if not listed:
        raise TargetError(f"GET /v1/models listed no model ({str(body)[:200]}); pass --model")
    return listed


async def resolve_target(session: aiohttp.ClientSession, cfg: ReplayConfig
                         ) -> tuple[str, str | None]:
    """The model name to send, and the tokenizer to count with.

    Without ``--tokenizer``, a checkpoint directory that the server reports as
    the model's ``root`` (the engine and vLLM do) is used when it exists on
    this machine; otherwise lengths are estimated.
    """
    if cfg.client.model and cfg.tokenizer:
        return cfg.client.model, cfg.tokenizer
    try:
        listed = await discover_models(session)
    except TargetError:
        if cfg.client.model:
            return cfg.client.model, cfg.tokenizer
        raise
    name = cfg.client.model or listed[0][0]
    root = next((r for n, r in listed if n == name), None)
    if cfg.tokenizer is None and root and (Path(root) / "tokenizer.json").is_file():
        logger.info("counting tokens with the target's own tokenizer at %s", root)
        return name, root
    return name, cfg.tokenizer


def prepare(cfg: ReplayConfig, model: str, tokenizer: str | None,
            records: Sequence[TraceRequest] | None) -> Prepared:
    """Read, schedule and build every request (blocking: run it in a thread)."""
    bad = BadLines(cfg.trace.bad_lines)
    fmt = "records"
    source = "records"
    if records is None:
        source = cfg.trace.path
        fmt = detect_format(cfg.trace.path) if cfg.trace.format == "auto" else cfg.trace.format
        records = list(read_trace(cfg.trace.path, fmt, bad))
    schedule = _schedule(source, list(records), bad, cfg)
    counter = load_token_counter(tokenizer)
    needs_synth = any(r.prompt is None and r.messages is None for _, r in schedule)
    synth = (PromptSynthesizer(counter, cfg.lengths.scaled_block_tokens, cfg.arrivals.seed)
             if needs_synth else None)
    builder = RequestBuilder(cfg.client, model, cfg.lengths, counter, synth)
    requests = [builder.build(i, offset, rec) for i, (offset, rec) in enumerate(schedule)]
    if synth is not None and synth.stats.num_inexact:
        logger.warning("%d of %d synthesized prompts are not of the exact length",
                       synth.stats.num_inexact, synth.stats.num_prompts)
    return Prepared(requests, builder.stats, bad, fmt, counter.name,
                    synth.stats if synth is not None else None)


def _schedule(source: str, records: list[TraceRequest], bad: BadLines, cfg: ReplayConfig
              ) -> list[tuple[float, TraceRequest]]:
    """The arrivals of ``records``; nothing to send is an error that says why."""
    try:
        schedule = arrivals(records, cfg.arrivals)
    except TraceError as e:
        raise TraceError(f"{source}: {e}") from e
    if not schedule:
        why = f"{len(records)} records read, {bad.num_bad} bad lines skipped"
        a = cfg.arrivals
        if records and a.mode == "trace":
            end = "" if a.window_end_s is None else f"{a.window_end_s:g}"
            why += f", none inside --window {a.window_start_s:g}:{end}"
        raise TraceError(f"{source}: nothing to replay ({why})")
    return schedule


def describe_run(cfg: ReplayConfig, prep: Prepared, model: str) -> dict[str, Any]:
    """The settings part of the summary: what was replayed, how, against what."""
    a = cfg.arrivals
    return {
        "label": cfg.output.label,
        "target": cfg.client.target,
        "model": model,
        "endpoint": cfg.client.endpoint,
        "stream": cfg.client.stream,
        "trace": {"path": cfg.trace.path, "format": prep.trace_format,
                  "num_bad_lines": prep.bad.num_bad, "bad_lines": prep.bad.first},
        "arrival": {"mode": a.mode, "rate": a.rate, "burstiness": a.burstiness,
                    "concurrency": a.concurrency, "time_scale": a.time_scale,
                    "window_s": [a.window_start_s, a.window_end_s],
                    "max_requests": a.max_requests, "duration_s": a.duration_s,
                    "max_concurrency": cfg.client.max_concurrency, "seed": a.seed},
        "lengths": {"policy": dataclasses.asdict(cfg.lengths),
                    "description": describe(cfg.lengths, prep.stats.lengths),
                    **prep.stats.lengths.to_json()},
        "prompts": {"tokenizer": prep.tokenizer, "exact": prep.stats.tokens_exact,
                    "num_synthesized": prep.stats.num_synthesized,
                    "num_from_trace": prep.stats.num_text,
                    "num_truncated_text": prep.stats.num_truncated_text,
                    "num_recounted": prep.synth.num_verified if prep.synth else 0,
                    "num_inexact": prep.synth.num_inexact if prep.synth else 0},
    }


async def replay(cfg: ReplayConfig, records: Sequence[TraceRequest] | None = None
                 ) -> ReplayResult:
    """Run one replay; ``records`` replaces reading ``cfg.trace.path`` when given."""
    if cfg.output.directory:
        from loadgen.report import prepare_output_dir

        prepare_output_dir(Path(cfg.output.directory))
    async with make_session(cfg.client) as session:
        model, tokenizer = await resolve_target(session, cfg)
        prep = await asyncio.to_thread(prepare, cfg, model, tokenizer, records)
        cap = cfg.arrivals.concurrency if cfg.arrivals.mode == "concurrency" \
            else cfg.client.max_concurrency
        runner = Runner(StreamingClient(cfg.client, session), cap, cfg.arrivals.duration_s,
                        cfg.output.quiet)
        run = await runner.run(prep.requests)
    summary = describe_run(cfg, prep, model)
    summary["started_unix_s"] = run.started_unix_s
    summary["num_not_sent"] = run.num_not_sent
    summary["loadgen_cpu_s_per_request"] = run.cpu_s / max(len(run.results), 1)
    summary.update(summarize(run.results, run.duration_s, cfg.slo))
    result = ReplayResult(summary, run.results)
    if cfg.output.directory:
        from loadgen.report import write_outputs

        await asyncio.to_thread(write_outputs, Path(cfg.output.directory), result,
                                cfg.output.plots)
    return result


async def sweep(cfg: ReplayConfig) -> list[ReplayResult]:
    """One replay per rate in ``cfg.sweep_rates`` (each in its own output subfolder)."""
    out = []
    for rate in cfg.sweep_rates:
        directory = cfg.output.directory and str(Path(cfg.output.directory) / f"rate-{rate:g}")
        one = dataclasses.replace(
            cfg, sweep_rates=(),
            arrivals=dataclasses.replace(cfg.arrivals, rate=rate),
            output=dataclasses.replace(cfg.output, directory=directory,
                                       label=f"{cfg.output.label or 'rate'} {rate:g} req/s"))
        out.append(await replay(one))
    if cfg.output.directory:
        from loadgen.compare import compare_table

        table = compare_table([r.summary for r in out], [f"{r:g} req/s" for r in cfg.sweep_rates])
        path = Path(cfg.output.directory) / "sweep.md"
        title = f"# rate sweep{': ' + cfg.output.label if cfg.output.label else ''}"
        await asyncio.to_thread(path.write_text, f"{title}\n\n{table}\n")
    return out


def run_replay(cfg: ReplayConfig, records: Sequence[TraceRequest] | None = None
               ) -> dict[str, Any]:
    """Synchronous :func:`replay` on a fresh event loop (uvloop when installed): the summary."""
    return _run(replay(cfg, records)).summary


def run_sweep(cfg: ReplayConfig) -> list[dict[str, Any]]:
    return [r.summary for r in _run(sweep(cfg))]


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
