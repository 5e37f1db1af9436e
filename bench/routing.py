# ruff: noqa: E402
"""Routing policies side by side on heterogeneous engine workers and mixed real traffic.

Fleet (one per policy, identical; ``--fleet``): three built-in engine workers on
the bundled tiny model whose compiled configs differ in what a CPU rewards per
request shape (``--fit-only`` measures it, unloaded and loaded). ``equal`` (the
default): every worker one core, so the configs differ and the resources do not
-- the only thing a router can learn is which config fits which shape (``fast-long``
gives ``long`` two cores; under load it was the best place for every shape, and
least-outstanding, which sends more to a faster worker, already got the gain):

- ``spec``: n-gram speculation (max depth 8, default 4 for the baselines),
  4 sequences, 256-token prefill chunks, one core; declared for the
  repetitive domains (translation, code, extraction: n-gram 1.7-3.2x at low
  batch), prompts < 600 tokens;
- ``batch``: 32 sequences (16 in ``fast-long``), 256-token chunks, no
  speculation, one core; declared for the conversational domains (chat, math, qa);
- ``long``: 16 sequences, 2,048-token chunks (a whole long prompt in one step),
  no speculation, one core (``fast-long``: ``--long-cores`` engine-core
  processes, default 2); declared for the long-prompt domains (summarization, rag).

``gpu`` (with ``--device cuda``, the GPU fleet): ``spec`` as above, ``draft`` (draft-model
speculation with the bundled draft, 8 sequences, max depth 4, default 1; declared for the
conversational domains) and ``batch`` (32 sequences, 2,048-token chunks, no speculation;
declared for the long-prompt domains), all on the one device.

Every worker keeps the engine's default KV cache (32,768 tokens) with automatic
prefix caching on (the engine's default): a worker feature, so every policy gets it.

Workload (``--workload``): ``specbench``: real prompts (Spec-Bench
questions, all 13 categories, and GSM8K problems) as chat requests, with arrival
times and output lengths taken from the Azure LLM 2023 conversation trace
(time-scaled to the rate; outputs scaled by ``--output-scale`` and clipped),
replayed with loadgen's Python API, greedy (temperature 0, as Spec-Bench and
bench/spec_depth.py measure). ``prefix-mix`` (the default): ``--prefix-share`` of the
requests (and of the rate) are Mooncake requests with shared prefixes (lengths and
``hash_ids`` as recorded; prompts scaled by 1/16, so 512-token blocks become 32-token
blocks, and cut to their leading blocks to fit the context; outputs as recorded,
clipped to ``--max-output``), from ``--trace-start`` (default 3000: the trace's reuse
grows along it, and from there a request finds ~26% of its blocks in the 100 before;
``--trace-windows``: every rate replays the same windows, or the trace is walked forward,
see :class:`Schedules`); the rest is the
``specbench`` workload at the remaining rate. Mooncake requests are scored as their
own class, ``prefix``, and carry its SLO in their bodies. ``trace`` (``--trace PATH``): any
trace loadgen's readers read (``--trace-format``), e.g. the Azure code and conversation
traces: each round a window of consecutive requests picked by the round's seed, arrival gaps
scaled to the rate, prompts of the recorded lengths x ``--trace-prompt-scale`` in
``--trace-domain``'s text (``code``: Python source; else loadgen's English corpus), outputs as
recorded; scored as their own class, ``trace``, its SLO in their bodies.

SLOs: per class, set by a rule (``SLO_RULE`` x the class's unloaded latency over its own
prompts: per probe prompt, a sample spread over the class's own prompt lengths, its
latency on the slowest worker; then the 90th percentile over the prompts,
``SLO_QUANTILE``), from this run's own probe, the same for every policy: at light load
every placement meets 90% of them. NOTE: the rule, not seconds, is what
stays fixed: one lent machine measured 2-2.5x slower per core than another, and SLOs
fixed in seconds from a fast machine's calibration put every rate past every policy's
knee. ``--slo-seconds`` gives seconds instead (e.g. a previous call's, to split one sweep
over several calls). Every proxy is
configured with them (routing.slo_ttft_s / slo_tpot_s); only the adaptive
policy uses them. Every policy is scored by the trace's domain label. The
``prefix`` and ``trace`` classes' SLOs are set the same way (cold-cache probes spread
over the window's, or the trace's, replayed prompt lengths); ``--prefix-slo`` overrides
the prefix class's.

Policies (``--policies``, each on its own fleet; default round_robin, least_outstanding,
adaptive): the product's policies (round_robin, least_outstanding, declared_fit, adaptive),
and ``least_outstanding-twin`` (least-outstanding again: an A/A, how far two identical
fleets of one run differ, the noise every comparison sits in). The A/Bs of the proxy's
options that are off by default (``routing.forward_slos``, per-worker ``max_outstanding``
caps) were answered (bench/RESULTS.md, Routing: settings) and their arms removed.

Rates: ``--rates`` in req/s, or ``--rate-multiples``: each m x this machine's speed index
(the median ratio of the reference probe's latencies, ``REF_PROBE``, on the machine it was
measured on, to this run's probe), so that the same plan brackets the same knees on a faster or
slower lent machine.

Order of a run: start a fleet per policy -> probe (unloaded, then ``--fit-concurrency``
requests of a class at a time) -> for each rate: an unscored warm-up replay
(same schedule for every policy, all at once; with ``--trace-windows forward``
only before the first rate), then ``--rounds`` measured rounds, each a fresh
schedule (seed + round) replayed by every policy at the same time. Printed: goodput
per round, adaptive's ratio to each baseline (median, min-max), TTFT/TPOT percentiles, the fleet's prefix-cache hit rate (prompt tokens
found cached / looked up, from the workers' vllm:prefix_cache_* counters), each policy's peak
goodput over the rates and, over a sweep, the highest rate at which it still holds 90% and 80%
of its requests to their SLOs (interpolated between the swept rates: goodput as a capacity at a
stated attainment) with the ratios of those rates, where
requests went per (worker, class) with how many met the SLO, and the adaptive
policy's depths and decision reasons per rate.

    python bench/routing.py --rates 4 6 8 --duration 20 --rounds 3 --warmup 20 --seed 100
    python bench/routing.py --rate-multiples 5 8 12 17 --duration 15 --rounds 4 --warmup 10 --fit-concurrency 1 --probe-passes 2 --seed 100 --policies round_robin least_outstanding adaptive least_outstanding-twin
    python bench/routing.py --workload specbench --rates 7 9 --duration 15 --rounds 3 --warmup 20 --seed 100

Needs ~13 free cores (four fleets of three one-core workers, plus this process; three
policies: ~10; ``fast-long``: one more core per fleet): the device runs used the lent H200
machine's 16 CPU cores (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import orjson
import yaml
from aiohttp import web

from loadgen.client import StreamingClient, make_session
from loadgen.config import (
    ArrivalConfig,
    ClientConfig,
    LengthConfig,
    OutputConfig,
    ReplayConfig,
    SloConfig,
    TraceConfig,
)
from loadgen.metrics import meets_slo
from loadgen.readers import read_trace
from loadgen.replay import prepare, resolve_target
from loadgen.request import RequestResult, TraceRequest
from loadgen.runner import Runner
from loadgen.synth import PromptSynthesizer, load_corpus_words
from loadgen.tokenizer import load_token_counter
from polyinfer.config import TINY_DRAFT, TINY_TARGET, CompiledConfig, DeclaredFit, EngineConfig
from proxy.app import create_app, default_estimator
from proxy.config import (
    HealthConfig,
    LimitsConfig,
    ProxyConfig,
    RoutingConfig,
    SpeculationConfig,
    WorkerSpec,
)
from proxy.config import TraceConfig as ProxyTraceConfig
from proxy.routing import build_policy
from proxy.supervisor import free_port
from router.adaptive import AdaptivePolicy
from router.corpus import SPEC_BENCH_MAP

ROOT = Path(__file__).resolve().parents[1]
# Domain classes: what this hardware rewards per shape (bench/RESULTS.md, specdec runs:
# n-gram gives 1.7-3.2x at low batch on translation/code/extraction, 1.2-1.5x on chat/qa).
CLASSES: dict[str, tuple[str, ...]] = {
    "repetitive": ("translation", "code", "extraction"),
    "conversational": ("chat", "math", "qa"),
    "long": ("summarization", "rag"),
}
CLASS_OF = {d: c for c, ds in CLASSES.items() for d in ds}
# name -> the proxy's speculation mode: the product's policies (proxy.routing) and the
# least-outstanding A/A that sizes the noise
POLICIES: dict[str, Literal["policy", "adaptive"]] = {
    "round_robin": "policy", "least_outstanding": "policy", "declared_fit": "policy",
    "adaptive": "adaptive", "least_outstanding-twin": "policy"}
LO_TWIN = "least_outstanding-twin"  # LO again, on its own fleet: the A/A that sizes the noise
BASELINE_OF = {LO_TWIN: "least_outstanding"}  # a bench name -> the product policy it runs
# NOTE: the others run when asked for (--policies): a fleet per policy costs three cores
DEFAULT_POLICIES = ["round_robin", "least_outstanding", "adaptive"]
# (policy, baseline) pairs whose goodput ratios the reports print, where both ran
COMPARISONS = (("adaptive", "round_robin"), ("adaptive", "least_outstanding"),
               ("declared_fit", "round_robin"), ("adaptive", "declared_fit"),
               (LO_TWIN, "least_outstanding"))
MAX_MODEL_LEN = 2048
CHAT_TEMPLATE_TOKENS = 8  # what the chat template adds around one user message
# NOTE: greedy decoding, as Spec-Bench and bench/spec_depth.py measure: the traces carry no
# sampling parameters, and the engine's default (temperature 1, as OpenAI's) makes the
# tiny model's n-gram acceptance near zero (adaptive depth 0 for 83-97% of requests).
TEMPERATURE = 0.0
PROBE_MAX_CHARS = 5000  # ~1,300 tokens: a probe prompt + its output fits MAX_MODEL_LEN
SLO_RULE = {"repetitive": (10.0, 2.5), "conversational": (10.0, 2.5), "long": (5.0, 5.0),
            "prefix": (5.0, 5.0), "trace": (5.0, 2.5)}
# NOTE: the rule's base (slos_from): per class, the latency its own probe prompts (a sample of
# its own prompt lengths, not one median prompt) get unloaded on the slowest worker, at the
# 90th percentile over those prompts -- what a request of the class gets alone wherever a
# baseline sends it, so that at light load every placement meets 90% of them. Chosen before
# the held-out measurements (the median probe prompt on the best worker set TPOT SLOs the
# held-out Mooncake trace's long prompts missed even alone).
SLO_QUANTILE = 0.9
# The shared-prefix workload (``--workload prefix-mix``): Mooncake requests, scored as their
# own class. Its SLO has no fixed default: it is SLO_RULE["prefix"] x the best unloaded
# (cold-cache, one request at a time) latency of a median-length prompt of the window on any
# worker, from this run's probe (the rule is fixed, the probe sets the value, the same for
# every policy); --prefix-slo overrides it.
PREFIX = "prefix"
# NOTE: --rate-multiples: rates set from the run's own probe, so a sweep brackets the knees
# on whatever machine is lent. The reference is an unloaded one-request probe (the lent
# machine's 16 cores, 2026-11-30 06:16 UTC): worker ->
# class -> (TTFT s, TPOT s). A multiple m is m req/s on that machine, times this machine's
# speed relative to it (speed_index).
REF_PROBE: dict[str, dict[str, tuple[float, float]]] = {
    "spec": {"repetitive": (0.02282, 0.001003), "conversational": (0.01643, 0.001643),
             "long": (0.1729, 0.002698), "prefix": (0.1939, 0.002881)},
    "batch": {"repetitive": (0.02687, 0.003289), "conversational": (0.02111, 0.003274),
              "long": (0.2268, 0.003904), "prefix": (0.2450, 0.003431)},
    "long": {"repetitive": (0.01967, 0.002333), "conversational": (0.01671, 0.002357),
             "long": (0.1956, 0.002842), "prefix": (0.2220, 0.002838)},
}
MOONCAKE = "traces/mooncake_synthetic.jsonl"
# NOTE: 512-token blocks -> 32-token blocks: the median prompt from request 2000 on becomes
# ~810 tokens; prompts past the context are cut to their leading blocks (loadgen clips the
# length, the synthesizer keeps the leading blocks), not dropped.
MOONCAKE_PROMPT_SCALE = 1 / 16
PROBE_BLOCK_ID = 10**7  # probe prompts use block ids the trace never does: a cold cache
WORKLOADS = ("prefix-mix", "specbench", "trace")
# ``--workload trace`` (``--trace PATH``): any trace the loadgen readers read, its requests
# scored as their own class, ``trace``, with its SLO in their bodies (as ``prefix``)
TRACE = "trace"
TRACE_LINE = 2 * 10**6  # trace requests' line numbers in a schedule start here


FLEETS = ("equal", "fast-long", "gpu")


def ngram_worker(device: str) -> CompiledConfig:
    """Every fleet's ``spec`` worker: n-gram speculation at a small batch, for repetitive
    domains' short prompts."""
    return CompiledConfig(model=str(TINY_TARGET), engine=EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=256, spec_method="ngram", spec_max_depth=8,
        spec_default_depth=4, max_model_len=MAX_MODEL_LEN, num_threads=1, device=device),
        fit=DeclaredFit(domains=CLASSES["repetitive"], prompt_tokens=(0, 600)))


def gpu_fleet(device: str) -> dict[str, CompiledConfig]:
    """``--fleet gpu`` (with ``--device cuda``): configs that differ as a GPU fleet's do --
    n-gram speculation at small batch, draft-model speculation, a large batch without it.
    NOTE: on the GPU the bundled pair is launch-bound, so what differs between workers is
    tokens per launch (speculation) and slots, not compute; the draft worker's default depth
    is an operator's cautious 1 (the depth policy finds what pays, for the adaptive arm)."""
    model = str(TINY_TARGET)
    spec = ngram_worker(device)
    draft = CompiledConfig(model=model, engine=EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=512, spec_method="draft",
        draft_model=str(TINY_DRAFT), spec_max_depth=4, spec_default_depth=1,
        max_model_len=MAX_MODEL_LEN, num_threads=1, device=device),
        fit=DeclaredFit(domains=CLASSES["conversational"], prompt_tokens=(0, 600)))
    batch = CompiledConfig(model=model, engine=EngineConfig(
        max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN,
        num_threads=1, device=device), fit=DeclaredFit(domains=CLASSES["long"]))
    return {"spec": spec, "draft": draft, "batch": batch}


def fleet_configs(fleet: str, long_cores: int, device: str) -> dict[str, CompiledConfig]:
    """The compiled configs (see the module docstring); ``--fit-only`` measures their fit.
    ``equal``: one core each, so the only thing a router can learn is which config fits
    which shape; ``fast-long``: ``long`` on ``long_cores`` cores; ``gpu``: :func:`gpu_fleet`."""
    if fleet == "gpu":
        return gpu_fleet(device)
    model = str(TINY_TARGET)
    spec = ngram_worker(device)
    batch = CompiledConfig(model=model, engine=EngineConfig(
        max_num_seqs=32 if fleet == "equal" else 16, max_num_batched_tokens=256,
        max_model_len=MAX_MODEL_LEN,
        num_threads=1, device=device),
        fit=DeclaredFit(domains=CLASSES["conversational"], prompt_tokens=(0, 600)))
    # NOTE: engine-core processes, one thread each: a long prompt's prefill is one
    # sequence, which lanes cannot split, so more cores for prefill means more cores.
    if fleet == "equal":
        long = CompiledConfig(model=model, engine=EngineConfig(
            max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN,
            num_threads=1, device=device), fit=DeclaredFit(domains=CLASSES["long"]))
        return {"spec": spec, "batch": batch, "long": long}
    long = CompiledConfig(model=model, engine=EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN,
        data_parallel_size=long_cores, device=device), fit=DeclaredFit(domains=CLASSES["long"]))
    return {"spec": spec, "batch": batch, "long": long}


def make_policy(name: str, seed: int) -> Any:
    """The policy behind a ``--policies`` name (:data:`POLICIES`)."""
    if name == "adaptive":
        return AdaptivePolicy(seed=seed)
    return build_policy(BASELINE_OF.get(name, name), seed=seed)


def domain_class(domain: str | None) -> str:
    return CLASS_OF.get(domain or "", "conversational")


def record_class(record: TraceRequest) -> str:
    """The class a request is scored in: Mooncake requests (prefix blocks) are their own, and
    so are a ``--trace`` workload's."""
    if record.hash_ids:
        return PREFIX
    return TRACE if record.line >= TRACE_LINE else domain_class(record.domain)


@dataclass(frozen=True)
class Slos:
    """Per class (the domain classes, and ``prefix`` with the shared-prefix workload): TTFT
    and TPOT limits, seconds."""

    ttft_s: dict[str, float]
    tpot_s: dict[str, float]

    def for_class(self, cls: str) -> SloConfig:
        return SloConfig(ttft_s=self.ttft_s[cls], tpot_s=self.tpot_s[cls])

    def body_fields(self, cls: str) -> dict[str, float]:
        """A request's own SLO fields (the proxy's per-domain tables cover only domains)."""
        return {"slo_ttft_s": self.ttft_s[cls], "slo_tpot_s": self.tpot_s[cls]}

    def routing(self, policy: str) -> RoutingConfig:
        """Per-domain SLO tables for the proxy ('*' = conversational)."""
        def table(limits: dict[str, float]) -> dict[str, float]:
            return {"*": limits["conversational"], **{d: limits[c] for d, c in CLASS_OF.items()}}
        return RoutingConfig(policy=policy, slo_ttft_s=table(self.ttft_s),
                             slo_tpot_s=table(self.tpot_s))

    def describe(self) -> str:
        return "; ".join(f"{c}: TTFT <= {self.ttft_s[c]:.3f} s, TPOT <= {self.tpot_s[c] * 1e3:.1f} ms"
                         for c in self.ttft_s)


# --- fleets ------------------------------------------------------------------------------------

def start_workers(configs: dict[str, CompiledConfig], log_dir: Path, tag: str
                  ) -> tuple[dict[str, str], list[subprocess.Popen[bytes]]]:
    urls, procs = {}, []
    # NOTE: OMP_NUM_THREADS=1 keeps torch's import-time pools small; the engine then sets
    # each worker's own num_threads (the fleets share the machine: no oversubscription).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, cfg in configs.items():
        path = log_dir / f"{tag}-{name}.yaml"
        path.write_text(yaml.safe_dump(cfg.to_dict()))
        port = free_port()
        log = (log_dir / f"{tag}-{name}.log").open("wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "--log-level", "WARNING", "engine",
             "--config", str(path), "--port", str(port)], stdout=log, stderr=log, env=env))
        urls[name] = f"http://127.0.0.1:{port}"
    return urls, procs


async def wait_healthy(urls: dict[str, str], procs: list[subprocess.Popen[bytes]],
                       timeout_s: float = 600.0) -> None:
    """Until every worker answers /health; a worker process that exits first fails at once
    (its log is in --log-dir)."""
    # NOTE: 600 s: nine workers importing torch at once on a shared two-core box took
    # longer than 180 s
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        for url, proc in zip(urls.values(), procs, strict=True):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {url} exited ({proc.returncode}) before healthy")
                try:
                    async with s.get(f"{url}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {url} not healthy after {timeout_s} s")
                await asyncio.sleep(0.5)


# --- workload ----------------------------------------------------------------------------------

def load_prompts(data: Path) -> list[tuple[str, str]]:
    prompts = []
    for line in (data / "prompts/spec_bench_questions.jsonl").read_text().splitlines():
        row = json.loads(line)
        prompts.append((row["turns"][0], SPEC_BENCH_MAP[row["category"]]))
    with (data / "prompts/gsm8k_train.jsonl").open() as f:
        prompts += [(json.loads(next(f))["question"], "math") for _ in range(80)]
    return prompts


def build_workload(data: Path, num: int, rate: float, seed: int) -> list[TraceRequest]:
    """Real prompts (shuffled by ``seed``) x a window of Azure conversation arrivals and
    output lengths (the window's start also picked by ``seed``)."""
    rng = random.Random(seed)
    prompts = load_prompts(data)
    rng.shuffle(prompts)
    with (data / "traces/azure_llm_2023_conv.csv").open() as f:
        rows = list(csv.DictReader(f))
    start = rng.randrange(max(len(rows) - num, 1))
    rows = rows[start:start + num]
    ts = [datetime.datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in rows]
    span = (ts[-1] - ts[0]) or 1.0
    scale = (len(rows) / rate) / span  # trace gaps stretched/shrunk to the target mean rate
    return [TraceRequest(line=i + 1, timestamp_s=(ts[i] - ts[0]) * scale,
                         messages=({"role": "user", "content": prompts[i % len(prompts)][0]},),
                         output_tokens=int(row["GeneratedTokens"]),
                         domain=prompts[i % len(prompts)][1])
            for i, row in enumerate(rows)]


PREFIX_LINE = 10**6  # Mooncake requests' line numbers in a mixed schedule start here


def load_mooncake(data: Path) -> list[TraceRequest]:
    return list(read_trace(data / MOONCAKE, "mooncake"))


def build_prefix_workload(data: Path, mooncake: list[TraceRequest], num: int, rate: float,
                          seed: int, start: int, share: float, output_scale: float,
                          block_offset: int = 0) -> list[TraceRequest]:
    """``num`` requests at ``rate`` req/s, merged by arrival time: a ``share`` of them are
    Mooncake requests ``start``, ``start + 1``, ... (arrival gaps scaled to their share of
    the rate; lengths and prefix blocks as recorded, block ids + ``block_offset``, prompts
    scaled at replay), the rest the Spec-Bench workload (:func:`build_workload` with
    ``seed``) at the remaining rate, its outputs scaled by ``output_scale`` here (the replay
    then scales no output: Mooncake's are as recorded, clipped to --max-output)."""
    num_prefix = round(num * share)
    rows = mooncake[start:start + num_prefix]
    if num_prefix < 2:
        raise ValueError(f"a round of {num} requests holds {num_prefix} Mooncake requests; "
                         "the replay needs at least 2: raise --duration or the rate")
    if len(rows) < num_prefix:
        raise ValueError(f"the Mooncake trace has no {num_prefix} requests from {start}")
    t0, t1 = rows[0].timestamp_s or 0.0, rows[-1].timestamp_s or 0.0
    scale = (len(rows) / (rate * share)) / ((t1 - t0) or 1.0)
    prefix = [dataclasses.replace(r, line=PREFIX_LINE + i,
                                  timestamp_s=((r.timestamp_s or 0.0) - t0) * scale,
                                  hash_ids=tuple(h + block_offset for h in r.hash_ids))
              for i, r in enumerate(rows)]
    spec = build_workload(data, num - num_prefix, rate * (1 - share), seed) \
        if num > num_prefix else []
    spec = [dataclasses.replace(r, output_tokens=round((r.output_tokens or 0) * output_scale))
            for r in spec]
    return sorted(prefix + spec, key=lambda r: r.timestamp_s or 0.0)


def prefix_probe_texts(mooncake: list[TraceRequest], start: int, num: int, max_output: int,
                       seed: int, skip: int = 0) -> list[str]:
    """``num`` prompts spread over the scaled lengths of the 200 Mooncake requests from
    ``start`` (:func:`spread_lengths`), each of its own block ids (which the trace never
    uses): cold-cache probes. ``skip``: the first prompt is number ``skip`` of that
    sequence."""
    limit = MAX_MODEL_LEN - max_output - CHAT_TEMPLATE_TOKENS
    lengths = spread_lengths([min(round((r.prompt_tokens or 0) * MOONCAKE_PROMPT_SCALE), limit)
                              for r in mooncake[start:start + 200]], num)
    block = max(round(512 * MOONCAKE_PROMPT_SCALE), 1)
    synth = PromptSynthesizer(load_token_counter(TINY_TARGET), block, seed)
    return [synth.prompt(n, PROBE_BLOCK_ID + i,
                         tuple(PROBE_BLOCK_ID + 1000 * i + j for j in range(n // block)))
            for i, n in zip(range(skip, skip + num), lengths, strict=True)]


def spread_lengths(lengths: list[int], num: int) -> list[int]:
    """``num`` lengths at the quantiles (i + 0.5) / num of ``lengths``: a sample that spans
    the distribution (its 90th percentile among them from 5 on), not its median alone."""
    ordered = sorted(lengths)
    return [max(ordered[min(int((i + 0.5) / num * len(ordered)), len(ordered) - 1)], 1)
            for i in range(num)]


# --- a trace workload (--trace): any trace the loadgen readers read ----------------------------

# NOTE: code prompts for a code trace: real Python source (the standard library's, so the
# prompts are the same for every checkout of this repository on one Python version), cut
# to the recorded lengths; other domains get loadgen's English corpus.
CODE_CORPUS_MODULES = ("argparse", "textwrap", "json.decoder", "csv", "dataclasses")


def code_words() -> list[str]:
    import importlib
    import inspect
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in CODE_CORPUS_MODULES)
    return load_corpus_words(text)


def trace_synthesizer(domain: str, seed: int) -> PromptSynthesizer:
    words = code_words() if domain == "code" else None
    return PromptSynthesizer(load_token_counter(TINY_TARGET), 512, seed, words=words)


def trace_lengths(records: list[TraceRequest], scale: float, max_output: int) -> list[int]:
    """Prompt lengths as replayed: scaled, clipped to leave room for the output."""
    limit = MAX_MODEL_LEN - max_output - CHAT_TEMPLATE_TOKENS
    return [min(max(round((r.prompt_tokens or 0) * scale), 1), limit) for r in records]


def build_trace_workload(records: list[TraceRequest], synth: PromptSynthesizer, domain: str,
                         scale: float, max_output: int, num: int, rate: float, seed: int,
                         key_offset: int = 0) -> list[TraceRequest]:
    """``num`` consecutive requests of the trace from a start picked by ``seed``, arrival
    gaps scaled to ``rate`` req/s, prompts of their recorded lengths x ``scale`` in
    ``domain``'s text (:func:`trace_synthesizer`), outputs as recorded (clipped at replay).
    A prompt's text is keyed by its line plus ``key_offset``: the same line gives the same
    text under one offset, another under another."""
    rng = random.Random(seed)
    start = rng.randrange(max(len(records) - num, 1))
    rows = records[start:start + num]
    if len(rows) < 2:
        raise ValueError(f"a round of {num} requests: the replay needs at least 2")
    t0, t1 = rows[0].timestamp_s or 0.0, rows[-1].timestamp_s or 0.0
    gap = (len(rows) / rate) / ((t1 - t0) or 1.0)
    lengths = trace_lengths(rows, scale, max_output)
    return [TraceRequest(line=TRACE_LINE + start + i,
                         timestamp_s=((r.timestamp_s or 0.0) - t0) * gap,
                         messages=({"role": "user",
                                    "content": synth.prompt(n, TRACE_LINE + start + i
                                                            + key_offset)},),
                         output_tokens=r.output_tokens, domain=domain)
            for i, (r, n) in enumerate(zip(rows, lengths, strict=True))]


def trace_probe_texts(records: list[TraceRequest], synth: PromptSynthesizer, scale: float,
                      max_output: int, num: int, skip: int = 0) -> list[str]:
    """``num`` prompts spread over the whole trace's replayed lengths (:func:`spread_lengths`),
    texts the workload never sends (keys past every line)."""
    lengths = spread_lengths(trace_lengths(records, scale, max_output), num)
    return [synth.prompt(n, 2 * TRACE_LINE + i)
            for i, n in zip(range(skip, skip + num), lengths, strict=True)]


TRACE_WINDOWS = ("per-rate", "forward")
# NOTE: per-rate namespaces: block ids of rate i's pass are shifted by (i + 1) x this, past
# the trace's ids (< 50,000) and the probes' (PROBE_BLOCK_ID + ...), so no cache holds a
# pass's prefixes from an earlier one.
NAMESPACE = 10**8
REUSE_LOOKBACK = 100  # requests before a window that its prefix reuse is measured against


def prefix_reuse(mooncake: list[TraceRequest], start: int, stop: int,
                 lookback: int = REUSE_LOOKBACK) -> float:
    """The trace's shared-prefix character over requests [start, stop): the share of their
    prefix blocks that lead the prompt and were seen in the ``lookback`` requests before
    each (the reuse a fleet's caches, ~100 scaled prompts, can find)."""
    num_blocks = num_seen = 0
    for i in range(start, min(stop, len(mooncake))):
        seen = {h for r in mooncake[max(i - lookback, 0):i] for h in r.hash_ids}
        lead = 0
        for h in mooncake[i].hash_ids:
            if h not in seen:
                break
            lead += 1
        num_blocks += len(mooncake[i].hash_ids)
        num_seen += lead
    return num_seen / num_blocks if num_blocks else 0.0


class Schedules:
    """The run's schedules (``--workload``): ``specbench`` (Azure arrivals); ``prefix-mix``
    replays Mooncake windows from ``--trace-start`` (``--trace-windows``):

    - ``per-rate`` (the default): every rate replays the same windows --
      its warm-up the requests just before ``--trace-start``, round r the r-th window after
      it -- with the block ids moved to a namespace of the rate's own, so no worker's cache
      holds them from an earlier rate. Rates then differ in nothing but the rate: the
      Mooncake trace's reuse grows along it (requests 2500-2999 find 17% of their blocks in
      the 100 before, 3000-3499 26%, 3750-3992 70%: :func:`prefix_reuse`), so walking it
      forward gave the later (higher) rates more reuse. Needs ``rounds`` x the largest
      rate's window after ``--trace-start``.
    - ``forward``: the warm-up takes the requests just before, each measured
      round the next unused ones, and the caches carry over from rate to rate. Needs
      ``rounds`` x the sum of every rate's window.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.prefix_mix = args.workload == "prefix-mix"
        self.per_rate = getattr(args, "trace_windows", "forward") == "per-rate"
        self.mooncake = load_mooncake(args.data) if self.prefix_mix else []
        self.trace = args.workload == TRACE
        self.records = list(read_trace(args.trace, args.trace_format)) if self.trace else []
        self.synth = trace_synthesizer(args.trace_domain, args.seed) if self.trace else None
        self.cursor = args.trace_start
        self.offset = 0  # block-id namespace of the current pass
        self.passes = 0  # trace schedules built so far: each its own prompt-key namespace
        self.window = (0, 0)  # the last round's Mooncake requests, trace indices [from, to)
        if self.prefix_mix and self.mooncake_needed() > len(self.mooncake):
            # NOTE: checked before any fleet starts: a trace that runs out mid-sweep used to
            # cost the run its last rounds (the device's subset of the trace ends at 3993)
            raise ValueError(
                f"the plan needs Mooncake requests {args.trace_start}.."
                f"{self.mooncake_needed() - 1}; {args.data / MOONCAKE} has {len(self.mooncake)}"
                " (fewer --rounds, a shorter --duration or an earlier --trace-start)")

    def mooncake_needed(self) -> int:
        """One past the last Mooncake request the measured rounds will take."""
        a = self.args
        per_round = [round(int(rate * a.duration) * a.prefix_share) for rate in a.rates]
        return a.trace_start + a.rounds * (max(per_round) if self.per_rate else sum(per_round))

    def _build(self, rate: float, num: int, seed: int, start: int) -> list[TraceRequest]:
        a = self.args
        if self.synth is not None:
            # NOTE: a round's window is picked by its seed alone, so every rate replays the
            # same lines, and two rounds' windows can overlap; every schedule built takes
            # its own key namespace, or a later round re-sent an earlier one's prompts and
            # found them in the workers' prefix caches (the code-trace calls in
            # bench/RESULTS.md, Routing, before this)
            self.passes += 1
            return build_trace_workload(self.records, self.synth, a.trace_domain,
                                        a.trace_prompt_scale, a.max_output, num, rate, seed,
                                        self.passes * NAMESPACE)
        if not self.prefix_mix:
            return build_workload(a.data, num, rate, seed)
        return build_prefix_workload(a.data, self.mooncake, num, rate, seed, start,
                                     a.prefix_share, a.output_scale, self.offset)

    def begin_rate(self, index: int) -> None:
        """Called before rate number ``index`` of the sweep: ``per-rate`` starts its pass."""
        if self.per_rate:
            self.cursor, self.offset = self.args.trace_start, (index + 1) * NAMESPACE

    def warmup(self, rate: float, num: int, seed: int) -> list[TraceRequest]:
        start = max(self.args.trace_start - round(num * self.args.prefix_share), 0)
        return self._build(rate, num, seed, start)

    def round(self, rate: float, num: int, seed: int) -> list[TraceRequest]:
        records = self._build(rate, num, seed, self.cursor)
        start, self.cursor = self.cursor, self.cursor + sum(1 for r in records if r.hash_ids)
        self.window = (start, self.cursor)
        return records

    def probe_prompts(self, num: int, skip: int = 0) -> dict[str, list[str]]:
        if self.synth is not None:
            return {TRACE: trace_probe_texts(self.records, self.synth,
                                             self.args.trace_prompt_scale, self.args.max_output,
                                             num, skip)}
        if not self.prefix_mix:
            return {}
        return {PREFIX: prefix_probe_texts(self.mooncake, self.args.trace_start, num,
                                           self.args.max_output, self.args.seed, skip)}

    def describe(self, records: list[TraceRequest]) -> str:
        num_prefix = sum(1 for r in records if r.hash_ids)
        if self.trace:
            return (f"{len(records)} requests of {self.args.trace.name} (lines "
                    f"{records[0].line - TRACE_LINE}-{records[-1].line - TRACE_LINE})")
        if not num_prefix:
            return f"{len(records)} Spec-Bench requests"
        return (f"{len(records) - num_prefix} Spec-Bench + {num_prefix} Mooncake requests "
                f"(trace requests {self.window[0]}-{self.window[1] - 1}, reuse "
                f"{prefix_reuse(self.mooncake, *self.window):.0%}, block ids +{self.offset})")


# --- probe: unloaded latency per (worker, domain class) ----------------------------------------

async def probe_one(s: aiohttp.ClientSession, url: str, text: str, max_tokens: int
                    ) -> tuple[float, float]:
    """(TTFT, TPOT) of one streamed request, seconds, at the worker's default depth. TPOT as
    loadgen defines it: (e2e - TTFT) / (completion_tokens - 1), tokens from the usage (a
    speculating worker sends several tokens in one chunk)."""
    body = {"model": TINY_TARGET.name, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": TEMPERATURE, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, num = 0.0, max_tokens
    async with s.post(f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                first = first or time.perf_counter()
            num = (event.get("usage") or {}).get("completion_tokens", num)
    end = time.perf_counter()
    return first - t0, (end - first) / max(num - 1, 1)


def class_prompts(data: Path, num: int, skip: int = 0) -> dict[str, list[str]]:
    """``num`` prompts per class from the ``skip``-th, domains mixed (fixed shuffle, not the
    workload's)."""
    prompts = load_prompts(data)
    random.Random(7).shuffle(prompts)
    # NOTE: the probe sends prompts whole; loadgen truncates the workload's to fit instead
    fits = [(t, d) for t, d in prompts if len(t) <= PROBE_MAX_CHARS]
    return {c: [t for t, d in fits if domain_class(d) == c][skip:skip + num] for c in CLASSES}


Samples = dict[str, dict[str, list[tuple[float, float]]]]  # worker -> class -> per prompt


async def probe_worker(s: aiohttp.ClientSession, url: str, picks: dict[str, list[str]],
                       concurrency: int, max_tokens: int) -> dict[str, list[tuple[float, float]]]:
    """(TTFT, TPOT) per class and prompt, ``concurrency`` requests of the class at a time."""
    await probe_one(s, url, "warm up", 8)
    out = {}
    for c, texts in picks.items():
        res: list[tuple[float, float]] = []
        for i in range(0, len(texts) - concurrency + 1, concurrency):
            res += await asyncio.gather(*(probe_one(s, url, t, max_tokens)
                                          for t in texts[i:i + concurrency]))
        out[c] = res
    return out


async def probe_samples(urls: dict[str, str], data: Path, num: int, max_tokens: int,
                        concurrency: int, extra: dict[str, list[str]] | None = None,
                        skip: int = 0) -> Samples:
    """(TTFT, TPOT) per worker, class and prompt at the worker's default depth: ``num``
    rounds of ``concurrency`` requests of one class (1 = unloaded), the same prompts in the
    same order on every worker. The workers are probed at the same time (each has its own
    cores). ``extra``: more classes' prompts; ``skip``: the class prompts from the
    ``skip``-th (:func:`class_prompts`)."""
    picks = {**class_prompts(data, num * concurrency, skip), **(extra or {})}
    async with aiohttp.ClientSession() as s:
        res = await asyncio.gather(*(probe_worker(s, url, picks, concurrency, max_tokens)
                                     for url in urls.values()))
    return dict(zip(urls, res, strict=True))


def median_fit(samples: Samples) -> dict[str, dict[str, tuple[float, float]]]:
    """Median (TTFT, TPOT) per worker and class."""
    return {w: {c: (statistics.median(r[0] for r in res), statistics.median(r[1] for r in res))
                for c, res in by.items()} for w, by in samples.items()}


async def probe(urls: dict[str, str], data: Path, num: int, max_tokens: int, concurrency: int,
                extra: dict[str, list[str]] | None = None, skip: int = 0
                ) -> dict[str, dict[str, tuple[float, float]]]:
    """Median (TTFT, TPOT) per worker and class (:func:`probe_samples`)."""
    return median_fit(await probe_samples(urls, data, num, max_tokens, concurrency, extra, skip))


def print_fit(label: str, ref: dict[str, dict[str, tuple[float, float]]]) -> None:
    classes = list(next(iter(ref.values())))
    print(f"fit ({label}): worker | " + " | ".join(f"{c} TTFT s / TPOT ms" for c in classes))
    for w, by in ref.items():
        print(f"  {w:<6} | " + " | ".join(f"{by[c][0]:.3f} / {by[c][1] * 1e3:.1f}"
                                         for c in classes), flush=True)
    best = {c: min(ref, key=lambda w: ref[w][c][0] + 48 * ref[w][c][1]) for c in classes}
    print(f"  best per class (TTFT + 48 x TPOT): {best}", flush=True)


def unloaded_base(samples: Samples, cls: str) -> tuple[float, float]:
    """The rule's base for ``cls`` (see SLO_QUANTILE): per probe prompt, its unloaded
    (TTFT, TPOT) on the slowest worker; then the SLO_QUANTILE quantile over the prompts."""
    per_prompt = list(zip(*(by[cls] for by in samples.values()), strict=True))
    worst = [(max(r[0] for r in rs), max(r[1] for r in rs)) for rs in per_prompt]
    return tuple(quantile([w[i] for w in worst], SLO_QUANTILE) for i in (0, 1))  # type: ignore[return-value]


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's default)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def slos_from(args: argparse.Namespace, samples: Samples) -> Slos:
    """--slo-seconds, else SLO_RULE on the unloaded probe's samples (:func:`unloaded_base`)."""
    ttft, tpot = {}, {}
    for i, c in enumerate(CLASSES):
        if args.slo_seconds:
            ttft[c], tpot[c] = args.slo_seconds[2 * i], args.slo_seconds[2 * i + 1]
        else:
            (k_ttft, k_tpot), (b_ttft, b_tpot) = SLO_RULE[c], unloaded_base(samples, c)
            ttft[c], tpot[c] = k_ttft * b_ttft, k_tpot * b_tpot
    own = [c for c in (PREFIX, TRACE) if c in next(iter(samples.values()))]
    for c in own:
        if c == PREFIX and args.prefix_slo:
            ttft[c], tpot[c] = args.prefix_slo
        else:  # the rule on this run's probe of the class's own prompt lengths
            (k_ttft, k_tpot), (b_ttft, b_tpot) = SLO_RULE[c], unloaded_base(samples, c)
            ttft[c], tpot[c] = k_ttft * b_ttft, k_tpot * b_tpot
    return Slos(ttft, tpot)


def speed_index(ref: dict[str, dict[str, tuple[float, float]]],
                probe: dict[str, dict[str, tuple[float, float]]]) -> float:
    """This machine's speed relative to the reference's: the median, over every (worker,
    class) cell both probes have and over TTFT and TPOT, of reference latency / this one."""
    ratios = [r / t for w, by in probe.items() for c, lat in by.items()
              if c in ref.get(w, {}) for r, t in zip(ref[w][c], lat, strict=True) if t > 0]
    if not ratios:
        raise ValueError("the probe shares no (worker, class) cell with the reference")
    return statistics.median(ratios)


def rates_from_probe(multiples: list[float], speed: float) -> list[float]:
    """--rate-multiples: m req/s on the reference machine -> m x speed, to 0.1 req/s."""
    return [max(round(m * speed, 1), 0.1) for m in multiples]


# --- one replay --------------------------------------------------------------------------------

def proxy_config(name: str, urls: dict[str, str], configs: dict[str, CompiledConfig],
                 slos: Slos) -> ProxyConfig:
    """The proxy in front of policy ``name``'s fleet."""
    return ProxyConfig(
        workers=tuple(WorkerSpec(n, url=urls[n], config=configs[n]) for n in configs),
        # NOTE: every proxy is told the SLOs the run is judged by, as an operator would
        # configure them; only the adaptive policy uses them. The policy object itself is
        # handed to the app (make_policy): the config only names its kind.
        routing=slos.routing(BASELINE_OF.get(name, name)),
        speculation=SpeculationConfig(mode=POLICIES[name]),
        traces=ProxyTraceConfig(enabled=False),
        health=HealthConfig(interval_s=1.0, metrics_interval_s=0.25),
        # NOTE: every policy's proxy runs in this process, on the event loop that also
        # drives every load generator: its loop lag is the bench's, not the proxy's. With the
        # lag rule on, a stall of that loop as a round began (324-366 ms late at 2-4% busy:
        # the loop's thread off the CPU) shed the round's first 2-3 requests with 429 in
        # every proxy alike, in several device runs. Nothing here runs past a proxy's
        # capacity.
        limits=LimitsConfig(max_loop_lag_s=0))


async def run_policy(name: str, policy: Any, urls: dict[str, str],
                     configs: dict[str, CompiledConfig], records: list[TraceRequest],
                     slos: Slos, args: argparse.Namespace) -> dict[str, Any]:
    config = proxy_config(name, urls, configs, slos)
    app = create_app(config, estimator=default_estimator(config), policy=policy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    prefix_mix = args.workload == "prefix-mix"
    # NOTE: the shared-prefix and trace classes have no domain of their own: their requests
    # carry their SLO in the body (an operator's per-request SLO); the other classes' come
    # from the proxy's tables.
    extra = {r.line: slos.body_fields(record_class(r)) for r in records
             if record_class(r) in (PREFIX, TRACE)}
    try:
        await asyncio.sleep(1.5)  # first health probe + metrics scrape
        cfg = ReplayConfig(
            trace=TraceConfig(path="<records>"),
            client=ClientConfig(target=f"http://127.0.0.1:{port}", model=TINY_TARGET.name,
                                stream=True, ignore_eos=True, timeout_s=300.0),
            arrivals=ArrivalConfig(mode="trace", seed=args.seed),
            lengths=LengthConfig(
                prompt_scale=MOONCAKE_PROMPT_SCALE if prefix_mix else 1.0,
                output_scale=1.0 if prefix_mix or args.workload == TRACE else args.output_scale,
                max_output_tokens=args.max_output, min_output_tokens=8,
                max_model_len=MAX_MODEL_LEN),
            slo=SloConfig(ttft_s=None, tpot_s=None),  # scored per class below
            output=OutputConfig(quiet=True, label=name), tokenizer=str(TINY_TARGET))
        before = await fleet_counters(urls)
        result = await replay_greedy(cfg, records, extra)
        after = await fleet_counters(urls)
    finally:
        await runner.cleanup()
    out = score(name, result, records, slos)
    out["cache_queries"], out["cache_hits"], out["preemptions"] = (
        a - b for a, b in zip(after, before, strict=True))
    return out


# counters: prefix-cache queries and hits (tokens), sequences preempted. NOTE: a preempted
# sequence re-prefills its prompt and finds its own blocks cached, so hits without shared
# prefixes can be preemptions (read the two together).
FLEET_METRICS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")


async def fleet_counters(urls: dict[str, str]) -> tuple[float, float, float]:
    """:data:`FLEET_METRICS` summed over the fleet's workers' /metrics."""
    texts = []
    async with aiohttp.ClientSession() as s:
        for url in urls.values():
            async with s.get(f"{url}/metrics") as r:
                texts.append(await r.text())
    return counter_totals(texts)


def counter_totals(texts: list[str]) -> tuple[float, float, float]:
    """:data:`FLEET_METRICS` summed over Prometheus texts (any labels, ``_total`` or not)."""
    totals = [0.0, 0.0, 0.0]
    for text in texts:
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            base = name.split("{", 1)[0].removesuffix("_total")
            if base in FLEET_METRICS:
                totals[FLEET_METRICS.index(base)] += float(value.split()[0])
    return totals[0], totals[1], totals[2]


async def replay_greedy(cfg: ReplayConfig, records: list[TraceRequest],
                        extra: dict[int, dict[str, float]]) -> list[RequestResult]:
    """loadgen's replay (loadgen.replay.replay) with ``temperature`` set in every body, and
    ``extra`` fields in the bodies of the requests from those trace lines."""
    async with make_session(cfg.client) as session:
        model, tokenizer = await resolve_target(session, cfg)
        prep = await asyncio.to_thread(prepare, cfg, model, tokenizer, records)
        reqs = [dataclasses.replace(r, body=orjson.dumps(
            {**orjson.loads(r.body), "temperature": TEMPERATURE, **extra.get(r.line, {})}))
            for r in prep.requests]
        runner = Runner(StreamingClient(cfg.client, session), cfg.client.max_concurrency,
                        cfg.arrivals.duration_s, cfg.output.quiet)
        return (await runner.run(reqs)).results


def score(name: str, results: list[RequestResult], records: list[TraceRequest], slos: Slos
          ) -> dict[str, Any]:
    """Goodput over the schedule's span, by the trace's class (its domain label, or
    ``prefix`` for Mooncake requests), plus per-request rows."""
    span_s = max((r.timestamp_s or 0.0) for r in records) or 1.0
    by_line = {r.line: r for r in records}
    rows: list[dict[str, Any]] = []
    for r in results:
        rec = by_line[r.line]
        cls = record_class(rec)
        rows.append({"ok": r.ok, "good": meets_slo(r, slos.for_class(cls)),
                     "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "tokens": r.completion_tokens,
                     "prompt_tokens": r.prompt_tokens, "worker": r.worker, "domain": rec.domain, "class": cls,
                     "routed_domain": r.domain, "spec_depth": r.spec_depth, "error": r.error})
    num_good = sum(1 for row in rows if row["good"])
    return {"policy": name, "num_requests": len(rows), "num_ok": sum(1 for r in results if r.ok),
            "num_good": num_good, "span_s": span_s, "goodput": num_good / span_s,
            "requests": rows}


# --- reports -----------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def fmt_row(s: dict[str, Any]) -> str:
    ok = [r for r in s["requests"] if r["ok"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    return (f"{s['policy']:<18} goodput {s['goodput']:5.2f} req/s ({s['num_good']:>3}/"
            f"{s['num_requests']} ok={s['num_ok']})  TTFT p50 {pct(ttft, .5):6.3f} p99 "
            f"{pct(ttft, .99):6.3f}  TPOT p50 {pct(tpot, .5) * 1e3:6.1f} ms p99 "
            f"{pct(tpot, .99) * 1e3:6.1f} ms  prefix-cache hits {hit_rate([s]):5.1%}  "
            f"[{placement(s)}]")


def hit_rate(runs: list[dict[str, Any]]) -> float:
    """Prompt tokens the workers found in their prefix caches / prompt tokens they looked up."""
    queries = sum(r.get("cache_queries", 0.0) for r in runs)
    return sum(r.get("cache_hits", 0.0) for r in runs) / queries if queries else float("nan")


def placement(s: dict[str, Any]) -> str:
    """Where requests went: worker -> interactive-class / bulk-class counts (good in brackets)."""
    cells: dict[tuple[str, str], list[int]] = {}
    for r in s["requests"]:
        key = (r["worker"] or "none", r["class"])
        cell = cells.setdefault(key, [0, 0])
        cell[0] += 1
        cell[1] += r["good"]
    return ", ".join(f"{w}/{c[:4]} {n}({g})" for (w, c), (n, g) in sorted(cells.items()))


def ratio_line(rate: float, rounds: dict[str, list[dict[str, Any]]]) -> str:
    good = {n: [r["goodput"] for r in runs] for n, runs in rounds.items()}
    parts = [f"{rate:6g} | " + " / ".join(f"{n} {statistics.median(g):.3f}"
                                           for n, g in good.items())]
    for top, base in COMPARISONS:
        if base not in good or top not in good:
            continue
        ratios = [a / b if b else float("inf") for a, b in zip(good[top], good[base],
                                                               strict=True)]
        parts.append(f"{top}/{base} {statistics.median(ratios):.2f}x "
                     f"({min(ratios):.2f}-{max(ratios):.2f})")
    return " | ".join(parts)


# --- the run -----------------------------------------------------------------------------------

async def replay_all(policies: dict[str, Any], fleets: dict[str, dict[str, str]],  # name -> urls
                     configs: dict[str, CompiledConfig], records: list[TraceRequest], slos: Slos,
                     args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    # NOTE: every policy replays the same schedule at the same time on their own fleets, so
    # the machine's background load hits them alike.
    runs = await asyncio.gather(*(
        run_policy(name, policies[name], fleets[name], configs, records, slos, args)
        for name in args.policies))
    return dict(zip(args.policies, runs, strict=True))


def rate_summary(rate: float, rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Where requests went over all rounds of a rate: policy -> worker/class -> [sent, good]."""
    out: dict[str, Any] = {}
    for name, runs in rounds.items():
        cells: dict[str, list[int]] = {}
        for run in runs:
            for r in run["requests"]:
                cell = cells.setdefault(f"{r['worker'] or 'none'}/{r['class']}", [0, 0])
                cell[0] += 1
                cell[1] += r["good"]
        out[name] = dict(sorted(cells.items()))
        print(f"placement {rate:g} {name:<18} " + ", ".join(
            f"{k} {n}({g})" for k, (n, g) in sorted(cells.items())), flush=True)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    # NOTE: one policy object per name for the whole run: the adaptive policy keeps what
    # it learned (warm-up included), as a long-running proxy would.
    policies = {name: make_policy(name, args.seed) for name in args.policies}
    configs = fleet_configs(args.fleet, args.long_cores, args.device)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    fleets = {name: start_workers(configs, args.log_dir, name) for name in args.policies}
    out: dict[str, Any] = {"rates": {}, "placement": {}, "depths": {}}
    try:
        for fleet_urls, fleet_procs in fleets.values():
            await wait_healthy(fleet_urls, fleet_procs)
        urls = {n: f[0] for n, f in fleets.items()}
        first = urls[args.policies[0]]
        schedules = Schedules(args)
        num = args.probe_requests
        for i in reversed(range(args.probe_passes)):
            # NOTE: only the last pass (i = 0) counts, on the prompts a one-pass probe sends;
            # the ones before warm every worker up on other prompts of every class (the same
            # ones would be prefix-cache hits in the last pass). One machine probed 1.5x
            # slower at its start.
            samples = await probe_samples(first, args.data, num, args.max_output, 1,
                                          schedules.probe_prompts(num, skip=i * num),
                                          skip=i * num)
            ref = median_fit(samples)
            if i > 0:
                print_fit(f"unloaded, warm-up pass (prompts from the {i * num}-th; not used)",
                          ref)
        print_fit("unloaded, 1 request at a time", ref)
        out["probe"] = ref
        out["probe_samples"] = samples
        if args.fit_concurrency > 1:
            loaded = await probe(first, args.data, args.probe_requests, args.max_output,
                                 args.fit_concurrency, schedules.probe_prompts(
                                     args.probe_requests * args.fit_concurrency))
            print_fit(f"loaded, {args.fit_concurrency} requests of a class at a time", loaded)
            out["probe_loaded"] = loaded
        if args.rate_multiples:
            speed = speed_index(REF_PROBE, ref)
            args.rates = rates_from_probe(args.rate_multiples, speed)
            out["rate_rule"] = {"multiples": args.rate_multiples, "speed_index": speed,
                                "rates": args.rates}
            print(f"speed index {speed:.3f} of the reference probe: rates {args.rates} req/s "
                  f"(multiples {args.rate_multiples})", flush=True)
            schedules = Schedules(args)  # the trace must cover the rates now set
        slos = slos_from(args, samples)
        out["slos"] = {"ttft_s": slos.ttft_s, "tpot_s": slos.tpot_s}
        rule = "given" if args.slo_seconds else "rule"
        print(f"SLOs ({rule}): {slos.describe()}",
              flush=True)
        if args.fit_only:
            return out
        for i, rate in enumerate(args.rates):
            schedules.begin_rate(i)
            if args.warmup > 0 and (i == 0 or schedules.per_rate):
                await warm_up(args.warmup_rate or rate, policies, urls, configs, slos,
                              schedules, args)
            await run_rate(rate, policies, urls, configs, slos, schedules, args, out)
    finally:
        procs = [p for _, ps in fleets.values() for p in ps]
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    adaptive: Any = policies.get("adaptive")
    out["adaptive_stats"] = adaptive.stats() if adaptive is not None else {}
    # what each adaptive fleet's depth policy learned (acceptance, step model, calibration)
    out["depth_policies"] = {n: p.depth_policy.snapshot() for n, p in policies.items()
                             if isinstance(p, AdaptivePolicy)}
    return out


async def warm_up(rate: float, policies: dict[str, Any], urls: dict[str, dict[str, str]],
                  configs: dict[str, CompiledConfig], slos: Slos, schedules: Schedules,
                  args: argparse.Namespace) -> None:
    """One unscored replay of ``--warmup`` seconds at ``rate``, all policies at once."""
    # NOTE: at least 4 requests, so a tiny rate still has 2 Mooncake ones to scale arrivals by
    records = schedules.warmup(rate, max(int(rate * args.warmup), 4), args.seed + 1000)
    warm = await replay_all(policies, urls, configs, records, slos, args)
    for s in warm.values():
        print(f"warm-up {rate:g} " + fmt_row(s), flush=True)


async def run_rate(rate: float, policies: dict[str, Any], urls: dict[str, dict[str, str]],
                   configs: dict[str, CompiledConfig], slos: Slos, schedules: Schedules,
                   args: argparse.Namespace, out: dict[str, Any]) -> None:
    """``--rounds`` fresh schedules at ``rate``, all policies at once; results into ``out``."""
    adaptive: Any = policies.get("adaptive")
    depths_before = dict(adaptive.depths) if adaptive is not None else {}
    reasons_before = dict(adaptive.reasons) if adaptive is not None else {}
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in args.policies}
    for r in range(args.rounds):
        records = schedules.round(rate, int(rate * args.duration), args.seed + r)
        print(f"rate {rate:g} round {r + 1}: {schedules.describe(records)}", flush=True)
        for name, s in (await replay_all(policies, urls, configs, records, slos, args)).items():
            rounds[name].append(s)
            print(f"rate {rate:g} round {r + 1} " + fmt_row(s), flush=True)
        print("ratio so far: " + ratio_line(rate, rounds), flush=True)
        out["rates"][str(rate)] = {n: [{k: v for k, v in s.items() if k != "requests"}
                                       for s in runs] for n, runs in rounds.items()}
        out.setdefault("requests", {})[str(rate)] = {n: [s["requests"] for s in runs]
                                                     for n, runs in rounds.items()}
        save_json(args, out)  # after every round: a run cut short keeps what it measured
    out["placement"][str(rate)] = rate_summary(rate, rounds)
    out.setdefault("hit_rate", {})[str(rate)] = hits = {
        n: hit_rate(runs) for n, runs in rounds.items()}
    print(f"prefix-cache hit rate at rate {rate:g} (all rounds): " + ", ".join(
        f"{n} {h:.1%}" for n, h in hits.items()), flush=True)
    out.setdefault("preemptions", {})[str(rate)] = preempted = {
        n: sum(r.get("preemptions", 0.0) for r in runs) for n, runs in rounds.items()}
    print(f"sequences preempted at rate {rate:g} (all rounds): " + ", ".join(
        f"{n} {p:g}" for n, p in preempted.items()), flush=True)
    if adaptive is not None:
        depths = {k: v - depths_before.get(k, 0) for k, v in sorted(adaptive.depths.items())}
        out["depths"][str(rate)] = {str(k): v for k, v in depths.items() if v}
        print(f"adaptive depths sent at rate {rate:g}: {out['depths'][str(rate)]}", flush=True)
        reasons = {k: v - reasons_before.get(k, 0) for k, v in sorted(adaptive.reasons.items())}
        out.setdefault("reasons", {})[str(rate)] = reasons = {k: v for k, v in reasons.items() if v}
        print(f"adaptive decision reasons at rate {rate:g}: {reasons}", flush=True)
    save_json(args, out)


def save_json(args: argparse.Namespace, out: dict[str, Any]) -> None:
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))


# --- the summary, fixed before the measurements it reports --------------------------------------

def medians(out: dict[str, Any]) -> dict[str, dict[str, float]]:
    """policy -> rate -> median goodput over the rate's rounds."""
    med: dict[str, dict[str, float]] = {}
    for rate, rounds in out["rates"].items():
        for name, runs in rounds.items():
            med.setdefault(name, {})[rate] = statistics.median(r["goodput"] for r in runs)
    return med


def pooled_line(rate: str, rounds: dict[str, list[dict[str, Any]]]) -> str:
    """Requests that met their SLO over all rounds (every policy got the same requests)."""
    good = {n: sum(r["num_good"] for r in runs) for n, runs in rounds.items()}
    sent = sum(r["num_requests"] for r in rounds.get("adaptive", next(iter(rounds.values()))))
    parts = [f"{rate:>6} | met " + " / ".join(f"{n} {g}" for n, g in good.items())
             + f" of {sent}"]
    for top, base in COMPARISONS:
        if base in good and top in good and good[base]:
            parts.append(f"{top}/{base} {good[top] / good[base]:.2f}x")
    return " | ".join(parts)


def peak_summary(out: dict[str, Any]) -> list[str]:
    """Each policy's peak goodput over the sweep (median over rounds at each rate, then the
    max over rates) and the adaptive policy's ratio of peaks: a rate-independent summary."""
    med = medians(out)
    peaks = {n: max(by_rate.items(), key=lambda kv: kv[1]) for n, by_rate in med.items()}
    lines = [f"peak goodput {n}: {g:.3f} req/s at rate {r}" for n, (r, g) in peaks.items()]
    for top, base in COMPARISONS:
        if top in peaks and base in peaks and peaks[base][1] > 0:
            lines.append(f"peak ratio {top}/{base}: {peaks[top][1] / peaks[base][1]:.2f}x")
    return lines


# SLO attainment goals for :func:`goal_rate_summary` (the share of requests meeting their SLO)
ATTAINMENT_GOALS = (0.9, 0.8)


def attainment(runs: list[dict[str, Any]]) -> float:
    """Share of the requests of ``runs`` (one policy's rounds at one rate) that met their SLO."""
    return sum(r["num_good"] for r in runs) / max(sum(r["num_requests"] for r in runs), 1)


def goal_rate(points: list[tuple[float, float]], goal: float) -> tuple[str, float | None]:
    """The highest offered rate at which a policy's attainment is still ``goal`` or more,
    from its sweep ``points`` (rate, attainment): where it first falls below the goal,
    interpolated linearly from the last rate that met it. ("<", lowest rate) if even the
    lowest misses it, (">=", highest rate) if none does."""
    points = sorted(points)
    if not points or points[0][1] < goal:
        return "<", points[0][0] if points else None
    for (r0, a0), (r1, a1) in zip(points, points[1:], strict=False):
        if a1 < goal:
            return "", r0 + (r1 - r0) * (a0 - goal) / (a0 - a1)
    return ">=", points[-1][0]


def goal_rate_summary(out: dict[str, Any]) -> list[str]:
    """Each policy's highest rate holding each of :data:`ATTAINMENT_GOALS` of its requests
    to their SLO, and the ratios of those rates: goodput as a capacity at a stated
    attainment (DistServe's definition), beside the met-per-second goodput at each rate.
    Needs a sweep that brackets the goal; a rate outside it prints as a bound."""
    by_policy: dict[str, list[tuple[float, float]]] = {}
    for rate, rounds in out["rates"].items():
        for name, runs in rounds.items():
            by_policy.setdefault(name, []).append((float(rate), attainment(runs)))
    lines = []
    for goal in ATTAINMENT_GOALS:
        found = {n: goal_rate(points, goal) for n, points in by_policy.items()}
        lines.append(f"rate holding {goal:.0%} of SLOs: " + " / ".join(
            f"{n} {bound}{rate:.2f}" if rate is not None else f"{n} none"
            for n, (bound, rate) in found.items()))
        for top, base in COMPARISONS:
            if top in found and base in found:
                (tb, tr), (bb, br) = found[top], found[base]
                if not tr or not br:
                    continue
                exact = not tb and not bb
                lines.append(f"  {top}/{base} at {goal:.0%}: {tr / br:.2f}x"
                             + ("" if exact else f" (bounds: {tb or '='} / {bb or '='})"))
    return lines


def round_capacities(out: dict[str, Any], goal: float) -> dict[str, list[tuple[str, float]]]:
    """policy -> per round index: (bound, the highest rate holding ``goal`` of its SLOs), from
    that round alone at every rate (round r of every rate replays seed + r: one curve)."""
    curves: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for rate, rounds in out["rates"].items():
        for name, runs in rounds.items():
            for r, run in enumerate(runs):
                curves.setdefault(name, {}).setdefault(r, []).append(
                    (float(rate), attainment([run])))
    found: dict[str, list[tuple[str, float]]] = {}
    for name, by_round in curves.items():
        for _, points in sorted(by_round.items()):
            bound, rate = goal_rate(points, goal)
            if rate is not None:
                found.setdefault(name, []).append((bound, rate))
    return found


def interval(values: list[float]) -> str:
    return (f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
            if values else "none")


def capacity_summary(out: dict[str, Any]) -> list[str]:
    """Per goal of :data:`ATTAINMENT_GOALS`: each policy's capacity, median and range over
    the rounds, and each comparison's ratio of capacities round by round. A round whose
    capacity lies outside the sweep counts at the sweep's edge, flagged by its bound."""
    lines = []
    for goal in ATTAINMENT_GOALS:
        found = round_capacities(out, goal)
        lines.append(f"capacity at {goal:.0%} attainment, median (min-max) of rounds: " + " / ".join(
            f"{n} {interval([r for _, r in caps])}"
            + (f" [{','.join(b or '=' for b, _ in caps)}]" if any(b for b, _ in caps) else "")
            for n, caps in found.items()))
        for top, base in COMPARISONS:
            if top in found and base in found and len(found[top]) == len(found[base]):
                ratios = [t / b for (_, t), (_, b) in zip(found[top], found[base], strict=True)
                          if b > 0]
                lines.append(f"  {top}/{base} at {goal:.0%}: {interval(ratios)}")
    return lines


def never_worse_summary(out: dict[str, Any]) -> list[str]:
    """Pooled SLOs met adaptive / LO at every rate beside the A/A's (LO's twin / LO): the
    smallest effect the run can see."""
    def pooled(top: str, base: str) -> dict[str, float]:
        out_ = {}
        for rate, rounds in out["rates"].items():
            if top in rounds and base in rounds:
                b = sum(r["num_good"] for r in rounds[base])
                out_[rate] = sum(r["num_good"] for r in rounds[top]) / b if b else float("inf")
        return out_
    lines = []
    for top in ("adaptive", LO_TWIN):
        ratios = pooled(top, "least_outstanding")
        if ratios:
            lines.append(f"pooled SLOs met {top}/least_outstanding per rate: " + ", ".join(
                f"{r} {x:.2f}x" for r, x in ratios.items()) + f" | min {min(ratios.values()):.2f}x")
    return lines


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several runs' --json (a sweep split over calls: each its own rates):
    per-rate tables side by side; the SLOs of the first (the later runs are given them)."""
    merged: dict[str, Any] = {"slos": runs[0]["slos"]}
    for key in ("rates", "requests", "hit_rate", "reasons"):
        merged[key] = {}
        for run in runs:
            for rate, value in run.get(key, {}).items():
                if rate in merged[key]:
                    raise ValueError(f"rate {rate} is in more than one run")
                merged[key][rate] = value
    merged["rates"] = dict(sorted(merged["rates"].items(), key=lambda kv: float(kv[0])))
    return merged


def attainment_line(rate: str, out: dict[str, Any]) -> str:
    """Share of the rate's requests that met their SLO, and the fleet prefix-cache hit
    rate, per policy, over all rounds."""
    met = {n: attainment(runs) for n, runs in out["rates"][rate].items()}
    hits = out.get("hit_rate", {}).get(rate, {})
    return (f"{rate:>6} | SLOs met " + " / ".join(f"{n} {m:.0%}" for n, m in met.items())
            + " | hit rate " + " / ".join(f"{n} {h:.1%}" for n, h in hits.items()))


def print_report(out: dict[str, Any]) -> None:
    print("rate   | goodput (req/s meeting the SLO, median of rounds) per policy "
          "| ratios of rounds: median (min-max)")
    for rate, rounds in out["rates"].items():
        print(ratio_line(float(rate), rounds))
    print("pooled over rounds:")
    for rate, rounds in out["rates"].items():
        print(pooled_line(rate, rounds))
    print("SLO attainment and prefix-cache hit rate, over all rounds:")
    for rate in out["rates"]:
        print(attainment_line(rate, out))
    for line in peak_summary(out):
        print(line)
    if len(out["rates"]) > 1:
        for line in goal_rate_summary(out):
            print(line)
        for line in capacity_summary(out):
            print(line)
    for line in never_worse_summary(out):
        print(line)
    for rate, by_policy in out.get("requests", {}).items():
        for name, runs in by_policy.items():
            rows = [row for rows in runs for row in rows]
            print(f"classes {rate:>5} {name:<18} " + class_line(rows))
            print(f"misses {rate:>5} {name:<18} " + miss_line(rows, out["slos"]))


def class_line(rows: list[dict[str, Any]]) -> str:
    """Per class: met / sent, and how many were sent to each worker (met in brackets): where
    a policy put the classes whose SLO only some workers can meet."""
    cells: dict[str, dict[str, list[int]]] = {}
    for row in rows:
        cell = cells.setdefault(row["class"], {}).setdefault(row["worker"] or "none", [0, 0])
        cell[0] += 1
        cell[1] += row["good"]
    parts = []
    for cls, by_worker in sorted(cells.items()):
        sent, good = (sum(c[i] for c in by_worker.values()) for i in (0, 1))
        parts.append(f"{cls} {good}/{sent} (" + ", ".join(
            f"{w} {n}({g})" for w, (n, g) in sorted(by_worker.items())) + ")")
    return "; ".join(parts)


def miss_line(rows: list[dict[str, Any]], slos: dict[str, dict[str, float]]) -> str:
    """Requests that missed their SLO, per class and worker: by TTFT only, TPOT only, both,
    or not completed (err)."""
    cells: dict[str, Counter[str]] = {}
    for row in rows:
        if row["good"]:
            continue
        cls = row["class"]
        cell = cells.setdefault(f"{cls}@{row['worker'] or 'none'}", Counter())
        if not row["ok"] or row["ttft_s"] is None:
            cell["err"] += 1
            continue
        late = row["ttft_s"] > slos["ttft_s"][cls]
        slow = (row["tokens"] or 0) > 1 and (row["tpot_s"] or 0.0) > slos["tpot_s"][cls]
        cell["both" if late and slow else "ttft" if late else "tpot" if slow else "other"] += 1
    return f"{sum(sum(c.values()) for c in cells.values())} missed: " + ", ".join(
        f"{k} " + "/".join(f"{kind}{n}" for kind, n in sorted(c.items()))
        for k, c in sorted(cells.items()))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "data")
    ap.add_argument("--rates", type=float, nargs="+", help="mean req/s (default: 2)")
    ap.add_argument("--rate-multiples", type=float, nargs="+", metavar="M",
                    help="instead of --rates: rates set from this run's probe, m x this "
                         "machine's speed index against REF_PROBE (a reference probe), "
                         "i.e. m req/s on that machine")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of trace per round")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds per rate")
    ap.add_argument("--warmup", type=float, default=30.0,
                    help="seconds of unscored warm-up trace before every rate (--trace-windows "
                         "per-rate) or the first (forward); 0: none")
    ap.add_argument("--warmup-rate", type=float, default=0.0,
                    help="req/s (0: the rate it precedes)")
    ap.add_argument("--output-scale", type=float, default=0.25)
    ap.add_argument("--max-output", type=int, default=96)
    ap.add_argument("--slo-seconds", type=float, nargs=6,
                    metavar=("R_TTFT", "R_TPOT", "C_TTFT", "C_TPOT", "L_TTFT", "L_TPOT"),
                    help="SLOs in seconds per class (repetitive, conversational, long) instead "
                         "of the rule")
    ap.add_argument("--fit-only", action="store_true",
                    help="measure the fleet's fit (unloaded and loaded) and the SLOs, then stop")
    ap.add_argument("--fit-concurrency", type=int, default=4,
                    help="requests of one class at a time for the loaded fit (1: skip)")
    ap.add_argument("--probe-requests", type=int, default=4, help="rounds per worker and class")
    ap.add_argument("--probe-passes", type=int, default=1,
                    help="unloaded probe passes; the last sets the SLOs (and the rates with "
                         "--rate-multiples), the ones before only warm the workers up")
    ap.add_argument("--workload", choices=WORKLOADS, default="prefix-mix",
                    help="prefix-mix: Mooncake shared-prefix requests (--prefix-share of them) "
                         "mixed with the Spec-Bench workload; specbench: that workload alone")
    ap.add_argument("--trace", type=Path, metavar="PATH",
                    help="the trace workload (implies --workload trace): any trace the loadgen "
                         "readers read, e.g. data/traces/azure_llm_2023_code.csv; each round a "
                         "window of it picked by the round's seed, arrivals scaled to the rate")
    ap.add_argument("--trace-format", default="auto", help="--trace's loadgen reader")
    ap.add_argument("--trace-domain", default="chat",
                    help="--trace: the requests' domain; code: prompts of Python source, else "
                         "loadgen's English corpus")
    ap.add_argument("--trace-prompt-scale", type=float, default=0.25,
                    help="--trace: recorded prompt lengths x this (then clipped to the context)")
    ap.add_argument("--trace-start", type=int, default=3000,
                    help="prefix-mix: first measured Mooncake request (0-based); the warm-up "
                         "takes the ones just before, each round the next unused ones")
    ap.add_argument("--trace-windows", choices=TRACE_WINDOWS, default="per-rate",
                    help="prefix-mix: per-rate: every rate replays the same Mooncake windows "
                         "from --trace-start (block ids in a namespace per rate) after its own "
                         "--warmup; forward: each round the next unused window, one warm-up")
    ap.add_argument("--prefix-share", type=float, default=0.5,
                    help="prefix-mix: share of the requests (and of the rate) from Mooncake")
    ap.add_argument("--prefix-slo", type=float, nargs=2, metavar=("TTFT", "TPOT"),
                    help="prefix-mix: the prefix class's SLO in seconds instead of the rule "
                         "on this run's probe")
    ap.add_argument("--fleet", choices=FLEETS, default="equal",
                    help="equal: every worker one core (configs differ, resources do not); "
                         "fast-long: the long worker on --long-cores cores; gpu (with --device "
                         "cuda): n-gram at small batch, draft speculation, a large batch")
    ap.add_argument("--long-cores", type=int, default=2,
                    help="fast-long fleet: engine-core processes (one thread each) of the "
                         "long-prompt worker")
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=DEFAULT_POLICIES,
                    help="each on its own fleet (see POLICIES); least_outstanding-twin: "
                         "least_outstanding again (an A/A); a subset needs fewer cores")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="engine workers' torch device (cpu, cuda)")
    ap.add_argument("--json", type=Path, help="write the probe, SLOs and all rounds here")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "bench" / "out" / "routing",
                    help="worker configs and logs")
    ap.add_argument("--report", type=Path, nargs="+", metavar="JSON",
                    help="print the summary of earlier runs' --json files (a sweep split "
                         "over calls, each its own rates) and exit")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate the plan before any fleet starts (``ap.error`` exits)."""
    if args.rates and args.rate_multiples:
        ap.error("give --rates or --rate-multiples, not both")
    if args.trace is not None:
        args.workload = TRACE
    elif args.workload == TRACE:
        ap.error("--workload trace needs --trace PATH")
    if args.trace_prompt_scale <= 0:
        ap.error("--trace-prompt-scale must be positive")
    if args.rate_multiples:
        args.rate_multiples = sorted(args.rate_multiples)
    # NOTE: with --rate-multiples the trace check below sees the reference machine's rates;
    # main_async checks again once the probe has set them
    args.rates = sorted(args.rates or args.rate_multiples or [2.0])
    if min(args.rates) <= 0 or args.duration <= 0 or args.rounds <= 0 or args.warmup < 0:
        ap.error("rates, --duration and --rounds must be positive, --warmup >= 0")
    if len(set(args.policies)) != len(args.policies):
        ap.error("--policies: each name once")
    if args.fit_concurrency < 1 or args.probe_requests < 1 or args.probe_passes < 1:
        ap.error("--fit-concurrency, --probe-requests and --probe-passes must be >= 1")
    if not 0 < args.prefix_share < 1 or args.trace_start < 0:
        ap.error("--prefix-share must be in (0, 1) and --trace-start >= 0")
    try:
        Schedules(args)  # the trace covers the whole plan: fail before starting any fleet
    except ValueError as e:
        ap.error(str(e))


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.report:
        print_report(merge_runs([json.loads(path.read_text()) for path in args.report]))
        return
    check_args(ap, args)
    configs = fleet_configs(args.fleet, args.long_cores, args.device)
    print(f"workload {args.workload}" + (
        f" ({args.prefix_share:.0%} Mooncake from request {args.trace_start}, prompts x"
        f"{MOONCAKE_PROMPT_SCALE:g})" if args.workload == "prefix-mix" else "") + (
        f" ({args.trace}, domain {args.trace_domain}, prompts x{args.trace_prompt_scale:g})"
        if args.workload == TRACE else "") + "; "
          + (f"rates {args.rate_multiples} x the probe's speed index" if args.rate_multiples
             else f"rates {args.rates} req/s") + f" x {args.duration:g} s, {args.rounds} rounds each, warm-up "
          f"{args.warmup:g} s; workers: " + "; ".join(
              f"{n}: {c.engine.max_num_seqs} seqs, {c.engine.max_num_batched_tokens}-token "
              f"prefill, spec={c.engine.spec_method}(default k={c.engine.spec_default_depth}), "
              f"{max(c.engine.data_parallel_size, 1)} core(s), fit "
              f"{','.join(c.fit.domains)}" for n, c in configs.items()), flush=True)
    out = asyncio.run(main_async(args))
    save_json(args, out)
    if args.fit_only:
        return
    print_report(out)
    stats = out["adaptive_stats"]
    print("adaptive decisions (whole run):",
          json.dumps({k: stats.get(k) for k in ("reasons", "decisions", "depths")}))
    print("adaptive prediction error (whole run, RMS of ln(observed / predicted)):",
          json.dumps(stats.get("prediction_error", {}).get("fleet")))


if __name__ == "__main__":
    main()
