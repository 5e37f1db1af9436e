"""SLO pacing of chunked prefill (engine.pacing): the cost model, the budget, the scheduler
and the engine core on the tiny model."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from engine.core import EngineCore
from engine.kv_cache import BlockAllocator
from engine.loader import load_core
from engine.pacing import (
    MIN_CHUNK,
    MIN_FIT_STEPS,
    SLO_TARGET,
    PrefillBudget,
    PrefillPacer,
    StepCostModel,
    step_terms,
)
from engine.scheduler import Scheduler
from engine.sequence import GenerationParams, Sequence
from polyinfer.config import CompiledConfig, EngineConfig
from polyinfer.sampling import SamplingParams

# seconds per term of step_terms: fixed, per decoding sequence, per decode row, per
# 1,024 tokens of decode context, per prompt token, per prompt token x 1,024 of its context
TRUE_COEF = np.array([4e-3, 2e-4, 3e-4, 1e-3, 2.5e-4, 2e-4])


def fitted(coef: np.ndarray = TRUE_COEF, seed: int = 0) -> StepCostModel:
    """A model fitted on steps whose seconds follow ``coef`` exactly."""
    rng = np.random.default_rng(seed)
    model = StepCostModel()
    for _ in range(200):
        n = int(rng.integers(1, 8))
        rows = n * int(rng.integers(1, 5))
        chunks = [(int(rng.integers(0, 1500)), int(rng.integers(1, 256)))] \
            if rng.random() < 0.6 else []
        terms = step_terms(n, rows, int(rng.integers(50, 3000)), chunks)
        model.observe(terms, float(terms @ coef))
    return model


def decoding(i: int, slo: float | None, after_first: int, elapsed: float, now: float,
             max_tokens: int = 400, steps: int | None = None) -> Sequence:
    """A sequence decoding for ``elapsed`` seconds since its first token, ``after_first``
    tokens since."""
    params = GenerationParams(max_tokens=max_tokens, slo_tpot_s=slo)
    seq = Sequence(i, f"d{i}", list(range(1, 42 + after_first)), 40, params, now - elapsed - 0.1)
    seq.num_computed = seq.num_tokens - 1
    seq.first_token_s = now - elapsed
    seq.num_decode_steps = after_first if steps is None else steps
    return seq


def prompt(i: int, n: int, arrival: float, slo_ttft: float | None = None) -> Sequence:
    return Sequence(i, f"p{i}", list(range(1, n + 1)), n,
                    GenerationParams(max_tokens=8, slo_ttft_s=slo_ttft), arrival)


def test_cost_model_recovers_the_step_costs_it_saw() -> None:
    model = fitted()
    assert model.ready
    np.testing.assert_allclose(model.coef, TRUE_COEF, rtol=1e-3, atol=1e-6)
    # the prompt part of a step alone, by the quadratic in the chunk's own context
    assert model.prefill_cost(512, 100) == pytest.approx(100 * 2.5e-4 + 2e-4 * 100 * 562 / 1024,
                                                         rel=1e-4)


def test_cost_model_forgets_old_steps() -> None:
    model = fitted()
    slower = TRUE_COEF * 2
    rng = np.random.default_rng(1)
    for _ in range(3000):
        terms = step_terms(2, 4, 500, [(int(rng.integers(0, 1000)), int(rng.integers(1, 200)))])
        model.observe(terms, float(terms @ slower))
    terms = step_terms(2, 4, 500, [(300, 100)])
    assert model.predict(terms) == pytest.approx(float(terms @ slower), rel=0.02)


def test_cost_model_is_not_ready_without_prompt_steps() -> None:
    model = StepCostModel()
    for _ in range(100):
        model.observe(step_terms(3, 3, 300, ()), 5e-3)
    for _ in range(MIN_FIT_STEPS - 1):
        model.observe(step_terms(3, 3, 300, [(0, 64)]), 0.02)
    assert not model.ready
    model.observe(step_terms(3, 3, 300, [(0, 64)]), 0.02)
    assert model.ready
    prompts_only = StepCostModel()
    for _ in range(100):
        prompts_only.observe(step_terms(0, 0, 0, [(0, 64)]), 0.02)
    assert not prompts_only.ready


@pytest.mark.parametrize("start", [0, 300, 1900])
@pytest.mark.parametrize("seconds", [1e-4, 3e-3, 0.02, 0.2])
def test_prefill_tokens_is_the_largest_chunk_that_fits(start: int, seconds: float) -> None:
    model = fitted()
    n = model.prefill_tokens(start, seconds)
    assert model.prefill_cost(start, n) <= seconds + 1e-12
    assert model.prefill_cost(start, n + 1) > seconds


def test_no_pacing_before_the_model_is_fitted() -> None:
    now = time.monotonic()
    d = decoding(0, slo=0.01, after_first=20, elapsed=0.2, now=now)
    assert PrefillPacer().budget([(d, 1)], now) is None


def test_budget_is_the_tightest_allowance_less_the_decode_rows() -> None:
    now = time.monotonic()
    pacer = PrefillPacer(fitted())
    # on its target exactly (bank 0) at 2 tokens a step: the next step may take s x 2
    tight = decoding(0, slo=0.010, after_first=40, elapsed=40 * 0.010 * SLO_TARGET, now=now,
                     steps=20)
    loose = decoding(1, slo=0.100, after_first=40, elapsed=0.5, now=now)
    free = decoding(2, slo=None, after_first=40, elapsed=5.0, now=now)
    rows = [(tight, 3), (loose, 1), (free, 1)]
    budget = pacer.budget(rows, now)
    assert budget is not None
    base = float(step_terms(3, 5, sum(s.num_tokens for s, _ in rows), ()) @ TRUE_COEF)
    assert budget.base == pytest.approx(base, rel=1e-3)
    assert budget.seconds == pytest.approx(0.010 * SLO_TARGET * 2 - base, rel=1e-3)
    # ahead of its target, a sequence spends half its bank
    ahead = decoding(0, slo=0.010, after_first=40, elapsed=0.2, now=now, steps=20)
    bank = 0.010 * SLO_TARGET * 40 - 0.2
    got = pacer.budget([(ahead, 3), (loose, 1), (free, 1)], now)
    assert got is not None and got.seconds == pytest.approx(0.016 + 0.5 * bank - base, rel=1e-3)


def test_a_decode_that_cannot_recover_is_not_protected() -> None:
    now = time.monotonic()
    pacer = PrefillPacer(fitted())
    # 1 s behind an 8 ms target with 10 tokens to go: nothing can bring it back
    late = decoding(0, slo=0.010, after_first=50, elapsed=0.4 + 1.0, now=now, max_tokens=62)
    assert pacer.budget([(late, 1)], now) is None
    # the same debt with 2,000 tokens to go can be won back: protected (and held to nothing)
    behind = decoding(0, slo=0.010, after_first=50, elapsed=0.4 + 1.0, now=now, max_tokens=2000)
    budget = pacer.budget([(behind, 1)], now)
    assert budget is not None and budget.seconds < 0


def test_budget_grants_the_floor_then_holds_prompts_back() -> None:
    model = fitted()
    now = time.monotonic()
    budget = PrefillBudget(model, seconds=0.0, base=0.005, now=now)
    a, b = prompt(0, 800, now), prompt(1, 800, now)
    assert budget.take(a, 0, 256) == MIN_CHUNK
    assert budget.take(b, 0, 256) == 0
    assert budget.paced
    roomy = PrefillBudget(model, seconds=1.0, base=0.005, now=now)
    assert roomy.take(a, 0, 256) == 256 and not roomy.paced


def test_a_prompt_with_a_ttft_slo_goes_just_in_time() -> None:
    model = fitted()
    now = time.monotonic()
    base = 0.005
    early = prompt(0, 1000, arrival=now, slo_ttft=5.0)  # a lot of time left: it waits
    budget = PrefillBudget(model, seconds=0.0, base=base, now=now)
    n = budget.take(early, 0, 256)
    spare = SLO_TARGET * 5.0 - model.prefill_cost(0, 1000)
    assert n == int(np.ceil(1000 * base / spare)) and n < MIN_CHUNK
    late = prompt(1, 1000, arrival=now - 2.0, slo_ttft=3.0)  # 0.4 s left: it must hurry
    budget = PrefillBudget(model, seconds=0.0, base=base, now=now)
    spare = SLO_TARGET * 3.0 - 2.0 - model.prefill_cost(0, 1000)
    assert budget.take(late, 0, 256) == min(256, int(np.ceil(1000 * base / spare)))
    assert budget.take(late, 0, 256) > MIN_CHUNK
    # past saving at full speed: the shared floor, like a prompt without a TTFT SLO
    lost = prompt(2, 1000, arrival=now - 10.0, slo_ttft=3.0)
    assert PrefillBudget(model, seconds=0.0, base=base, now=now).take(lost, 0, 256) == MIN_CHUNK


def test_scheduler_paces_prompt_chunks_but_never_decodes() -> None:
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, kv_cache_tokens=8192)
    s = Scheduler(cfg, BlockAllocator(cfg.num_kv_blocks))
    s.pacer = PrefillPacer(fitted())
    now = time.monotonic()
    tight = decoding(0, slo=0.010, after_first=40, elapsed=40 * 0.010 * SLO_TARGET, now=now)
    free = decoding(1, slo=None, after_first=40, elapsed=1.0, now=now)
    for d in (tight, free):
        d.block_table = s.allocator.allocate(-(-d.num_tokens // cfg.block_size))
        s.running.append(d)
        d.status = tight.status.RUNNING
    s.add(prompt(2, 900, now))
    s.add(prompt(3, 900, now))
    out = s.schedule({})
    assert out.paced
    chunks = {x.seq.request_id: x.num_new for x in out.scheduled}
    assert chunks["d0"] == 1 and chunks["d1"] == 1  # decodes always run
    assert sum(n for r, n in chunks.items() if r.startswith("p")) < 256
    # without a decode that names a TPOT SLO, the prompts take the whole budget
    tight.params = GenerationParams(max_tokens=400)
    s2 = Scheduler(cfg, BlockAllocator(cfg.num_kv_blocks))
    s2.pacer = s.pacer
    for d in (tight, free):
        d.block_table = s2.allocator.allocate(-(-d.num_tokens // cfg.block_size))
        s2.running.append(d)
    s2.add(prompt(4, 900, now))
    out = s2.schedule({})
    assert not out.paced
    assert sum(x.num_new for x in out.scheduled) == 256


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path) -> EngineCore:
    cfg = CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=256, kv_cache_tokens=16384,
        spec_method="ngram", spec_max_depth=4, max_model_len=2048))
    return load_core(cfg)


def generate(core: EngineCore, slo_tpot: float | None) -> tuple[dict[str, list[int]], int]:
    """Three decodes, then a long prompt beside them; token ids per request, paced steps."""
    greedy = SamplingParams(0.0)
    core.reset_prefix_cache()  # the long prompt is computed afresh every time
    for i in range(3):
        core.add_request(f"d{i}", [10 + i, 20, 30, 40] * 10, GenerationParams(
            max_tokens=60, sampling=greedy, ignore_eos=True, spec_depth=2, slo_tpot_s=slo_tpot))
    out: dict[str, list[int]] = {name: [] for name in ("d0", "d1", "d2", "p")}
    num_paced = 0
    for step in range(2000):
        if step == 3:
            core.add_request("p", [(7 * j) % 4000 + 5 for j in range(1900)],
                             GenerationParams(max_tokens=4, sampling=greedy, ignore_eos=True))
        if step > 3 and not core.has_work:
            break
        outputs, stats = core.step()
        num_paced += stats.paced
        for o in outputs:
            out[o.request_id].extend(o.new_token_ids)
    assert all(len(v) == (4 if k == "p" else 60) for k, v in out.items()), "all finish"
    return out, num_paced


def test_pacing_changes_when_prompts_run_not_what_anyone_gets(core: EngineCore) -> None:
    free, num_free = generate(core, slo_tpot=None)
    pacer = core.scheduler.pacer
    assert num_free == 0
    assert not pacer.engaged and pacer.model.num_prefill_steps == 0, "no SLO, no cost model"
    # an SLO no step comes near: the cost model learns from these steps (prompt chunks beside
    # decodes) and paces nothing; it paces nothing either before MIN_FIT_STEPS of each
    loose, num_loose = generate(core, slo_tpot=10.0)
    assert num_loose == 0 and pacer.engaged and pacer.model.ready
    # an SLO a step with a full prompt chunk breaks but decode-only steps keep
    decode_only = pacer.model.predict(step_terms(3, 9, 150, ()))
    tight, num_tight = generate(core, slo_tpot=3 * decode_only / SLO_TARGET)
    assert num_tight > 0, "a tight TPOT SLO held prompt chunks back"
    assert tight == free and loose == free, "pacing must not change any output"
