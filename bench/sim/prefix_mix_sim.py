"""A model of bench/routing.py's prefix-mix run on the simulated fleet (fleet_sim.py), for
closed-loop checks of the adaptive policy that the 2-core test box cannot run for real.

Fleet: the bench's ``equal`` fleet, one core each, every worker with a 32,768-token prefix
cache and chunked prefill: ``spec`` (4 sequences, 256-token chunks, n-gram speculation
that halves the step on the repetitive domains), ``batch`` (32 sequences, 256-token
chunks) and ``long`` (16 sequences, 2,048-token chunks), declared as the bench declares
them. Step and prefill costs are of the order the device's probe measured (a ~2.5 ms
decode step, ~0.2 ms per prompt token: bench/routing.py's REF_PROBE).

Workload: half shared-prefix requests (one of ``num_docs`` documents, popularity ~ 1/rank,
64-token blocks, plus a prompt-specific tail; outputs as short as Mooncake's, 8-96
tokens), half short Spec-Bench-like requests of the bench's three classes, each request
carrying its class's SLO as the bench sends it. Everything is seeded; it is a model,
not a measurement.

    python -m bench.sim.prefix_mix_sim  # a side-by-side table over rates and seeds
"""

from __future__ import annotations

import functools
import math
import random
import sys
from collections import Counter
from collections.abc import Callable

from bench.sim.fleet_sim import SimClock, SimResult, SimWorker, simulate
from polyinfer.config import CompiledConfig, DeclaredFit
from router.adaptive import AdaptivePolicy
from router.base import RequestShape, RoutingPolicy
from router.baselines import LeastOutstandingPolicy, RoundRobinPolicy

BLOCK = 64.0  # prompt tokens per prefix block
REPETITIVE, CONVERSATIONAL, LONG = ("translation", "code", "extraction"), ("chat", "math", "qa"), \
    ("summarization", "rag")
# (TTFT s, TPOT s) per class: what the bench's SLO rule gave on one calibration run (the
# device's 16 CPU cores, 2026-11-30), and its probe-derived prefix SLO
SLOS = {"repetitive": (0.30, 0.0050), "conversational": (0.24, 0.0090), "long": (1.0, 0.023),
        "prefix": (0.97, 0.0142)}
# a tight repetitive SLO that only ``spec`` meets (its unloaded repetitive TPOT is
# (2.5 + 0.15) x 0.5 = 1.3 ms, batch's and long's 2.65 ms), as the SLO rule made it on the
# device (3.1-3.2 ms against spec's 1.2-1.3 and batch's 2.4-3.4)
TIGHT_REPETITIVE = (0.15, 0.0024)
CLASS_OF = {**{d: "repetitive" for d in REPETITIVE}, **{d: "conversational" for d in CONVERSATIONAL},
            **{d: "long" for d in LONG}}
DT = 0.001  # simulation step, seconds
# seconds a step takes per context token of each request decoding in it. On the device spec
# decoded the shared-prefix prompts (800-2,000 tokens) at 4.5 ms a token unloaded and the
# short conversational ones at 1.9 ms (a bench probe): ~2 us per token.
CONTEXT_S = 2e-6


def bench_fleet(context_s: float = 0.0) -> list[SimWorker]:
    """``context_s``: step seconds per context token of each decoding request (0: a step's
    time does not depend on the prompts decoding in it; :data:`CONTEXT_S` models the
    device's long prompts decoding slower). With it, speculation does not speed up the
    shared-prefix requests either (a bench probe: 4.5 ms on spec, 6.5 on batch, where
    the repetitive class took 1.2 and 4.6)."""
    spec = CompiledConfig(fit=DeclaredFit(domains=REPETITIVE, prompt_tokens=(0, 600))
                          ).with_engine(max_num_seqs=4, max_num_batched_tokens=256,
                                        spec_method="ngram", spec_max_depth=8)
    batch = CompiledConfig(fit=DeclaredFit(domains=CONVERSATIONAL, prompt_tokens=(0, 600))
                           ).with_engine(max_num_seqs=32, max_num_batched_tokens=256)
    long = CompiledConfig(fit=DeclaredFit(domains=LONG)).with_engine(
        max_num_seqs=16, max_num_batched_tokens=2048)
    def worker(name: str, config: CompiledConfig, chunk: int, factor: dict[str, float]
               ) -> SimWorker:
        return SimWorker(name, config, base_s=0.0025, per_seq_s=0.00015, prefill_s=0.0002,
                         factor=factor, chunk=chunk, cache_tokens=32768, context_s=context_s,
                         prefix_factor=1.0 if context_s else None)
    return [worker("spec", spec, 256, {d: 0.5 for d in REPETITIVE}),
            worker("batch", batch, 256, {}), worker("long", long, 2048, {})]


# prompt tokens of a class's median request in prefix_mix: the short classes 30-400, the long
# ones 600-1,500, a shared-prefix one 4-24 document blocks and its own
MEDIAN_PROMPT = {"repetitive": 215, "conversational": 215, "long": 1050, "prefix": 15 * 64}


@functools.cache
def _slo_rule() -> dict[str, tuple[float, float]]:
    """bench/routing.py's SLO_RULE (imported when first asked for: the bench imports the
    proxy and loadgen)."""
    from bench import routing

    return routing.SLO_RULE


def rule_slos(context_s: float = 0.0) -> dict[str, tuple[float, float]]:
    """(TTFT, TPOT) per class by bench/routing.py's SLO rule (SLO_RULE x the class's best
    unloaded latency on any worker) on this model's fleet, as the bench sets them on the
    device from its probe: a median prompt's prefill + one step, and one sequence's step x
    the worker's factor for the class (+ its context with ``context_s``). Both short classes
    come out tight, as on the device (conversational 2.5 x its best TPOT, where
    :data:`SLOS` gives it 3.4x)."""
    domain = {"repetitive": REPETITIVE[0], "conversational": CONVERSATIONAL[0], "long": LONG[0],
              "prefix": "code"}
    out = {}
    for c, (k_ttft, k_tpot) in _slo_rule().items():
        if c not in MEDIAN_PROMPT:  # the bench's --trace class: not in this workload
            continue
        prompt = MEDIAN_PROMPT[c]
        ttft, tpot = math.inf, math.inf
        for w in bench_fleet(context_s):
            factor = w.factor.get(domain[c], 1.0)
            if c == "prefix" and w.prefix_factor is not None:
                factor = w.prefix_factor
            step = w.base_s + w.per_seq_s + w.context_s * prompt
            ttft = min(ttft, prompt * w.prefill_s + step)
            tpot = min(tpot, step * factor)
        out[c] = (k_ttft * ttft, k_tpot * tpot)
    return out


def class_of(shape: RequestShape) -> str:
    return "prefix" if shape.prefix_hashes else CLASS_OF.get(shape.domain, "conversational")


def prefix_mix(rate: float, num: int, seed: int, num_docs: int = 60, tight: bool = False,
               slos: dict[str, tuple[float, float]] | None = None
               ) -> list[tuple[float, RequestShape]]:
    """``num`` Poisson arrivals at ``rate`` req/s, half shared-prefix, half short requests.
    ``tight``: the repetitive class gets :data:`TIGHT_REPETITIVE` (met on ``spec`` alone) and
    the shared-prefix requests are labelled ``code``, one of spec's declared domains, as the
    classifier labels the Mooncake prompts on the device. ``slos``: every class's SLO (e.g.
    :func:`rule_slos`) in place of those."""
    rng = random.Random(seed)
    if slos is None:
        slos = {**SLOS, "repetitive": TIGHT_REPETITIVE} if tight else SLOS
    prefix_domain = "code" if tight else "rag"
    doc_blocks = [rng.randint(4, 24) for _ in range(num_docs)]  # 256-1,536-token documents
    weights = [1.0 / (1 + d) for d in range(num_docs)]
    t, out = 0.0, []
    for i in range(num):
        t += rng.expovariate(rate)
        if rng.random() < 0.5:
            doc = rng.choices(range(num_docs), weights)[0]
            blocks = (*(1000 * doc + b for b in range(doc_blocks[doc])), 10**6 + i)
            output = max(8, min(96, int(rng.lognormvariate(3.3, 1.2))))
            ttft, tpot = slos["prefix"]
            shape = RequestShape(prefix_domain, int(len(blocks) * BLOCK), None, output,
                                 prefix_hashes=blocks, prefix_block_tokens=BLOCK,
                                 slo_ttft_s=ttft, slo_tpot_s=tpot)
        else:
            domain = rng.choices(REPETITIVE + CONVERSATIONAL + LONG,
                                 [1, 1, 1, 2, 2, 2, 1, 1])[0]
            prompt = rng.randint(600, 1500) if domain in LONG else rng.randint(30, 400)
            ttft, tpot = slos[CLASS_OF[domain]]
            shape = RequestShape(domain, prompt, None, rng.choice((14, 24, 60, 96, 96)),
                                 slo_ttft_s=ttft, slo_tpot_s=tpot)
        out.append((t, shape))
    return out


def run_results(make: Callable[[SimClock], RoutingPolicy],
                arrivals: list[tuple[float, RequestShape]], context_s: float = 0.0,
                dt: float = DT) -> list[SimResult]:
    """Every finished request of one simulated run."""
    clock = SimClock()
    results: list[SimResult] = []
    simulate(make(clock), bench_fleet(context_s), arrivals, 1.0, 1.0, dt=dt, clock=clock,
             results=results)
    return results


def run(make: Callable[[SimClock], RoutingPolicy], arrivals: list[tuple[float, RequestShape]]
        ) -> tuple[float, Counter[str]]:
    """(share of requests meeting both SLOs, misses by kind: ttft, tpot, both)."""
    results = run_results(make, arrivals)
    good = sum(r.ttft_ok and r.tpot_ok for r in results) / len(arrivals)
    misses: Counter[str] = Counter()
    for r in results:
        if not (r.ttft_ok and r.tpot_ok):
            misses["both" if not (r.ttft_ok or r.tpot_ok) else "ttft" if r.tpot_ok else "tpot"] += 1
    return good, misses


POLICIES: dict[str, Callable[[SimClock], RoutingPolicy]] = {
    "round_robin": lambda clock: RoundRobinPolicy(),
    "least_outstanding": lambda clock: LeastOutstandingPolicy(),
    "adaptive": lambda clock: AdaptivePolicy(clock=clock),
}


def by_class(results: list[SimResult]) -> dict[str, tuple[int, int, int]]:
    """class -> (met, sent, sent to spec)."""
    out: dict[str, tuple[int, int, int]] = {}
    for r in results:
        met, sent, spec = out.get(class_of(r.shape), (0, 0, 0))
        out[class_of(r.shape)] = (met + (r.ttft_ok and r.tpot_ok), sent + 1,
                                  spec + (r.worker == "spec"))
    return out


def main(argv: list[str]) -> None:
    """``[--tight | --rule] [--context] [--seeds A-B] [rate ...]``: a side-by-side table,
    one line per (rate, seed, policy) with goodput share and per class met / sent / sent to
    spec.
    ``--tight``: the tight repetitive class; ``--rule``: labelled as with ``--tight``, every
    class's SLO by the bench's rule (:func:`rule_slos`); ``--context``: steps pay :data:`CONTEXT_S` per
    context token (long prompts decode slower)."""
    tight, context = "--tight" in argv or "--rule" in argv, "--context" in argv
    slos = rule_slos(CONTEXT_S if context else 0.0) if "--rule" in argv else None
    if slos is not None:
        print("SLOs (rule): " + "; ".join(f"{c} {t:.3f} s / {p * 1e3:.1f} ms"
                                           for c, (t, p) in slos.items()), flush=True)
    seeds = range(1, 4)
    if "--seeds" in argv:
        lo, hi = argv[argv.index("--seeds") + 1].split("-")
        seeds = range(int(lo), int(hi) + 1)
        argv = [a for a in argv if a != argv[argv.index("--seeds") + 1]]
    rates = [float(a) for a in argv if not a.startswith("--")] or [12.0, 16.0, 20.0, 24.0]
    for rate in rates:
        for seed in seeds:
            arrivals = prefix_mix(rate, int(rate * 40), seed, tight=tight, slos=slos)
            for name, make in POLICIES.items():
                results = run_results(make, arrivals, CONTEXT_S if context else 0.0)
                good = sum(r.ttft_ok and r.tpot_ok for r in results) / len(arrivals)
                print(f"rate {rate:g} seed {seed} {name} {good:.3f} " + " ".join(
                    f"{c} {m}/{n}/{sp}" for c, (m, n, sp) in sorted(by_class(results).items())),
                    flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
