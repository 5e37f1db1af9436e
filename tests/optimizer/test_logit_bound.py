"""The logit-error bound for candidates that change floating point (optimizer.numerics).

Written-out positions check the rule; then a real engine under the test-only
fault injector (tests/optimizer/faults.py) serves a candidate with another
attention kernel: clean, and with planted logit noise inside and beyond the
bound.
"""

from __future__ import annotations

import aiohttp
import pytest

from optimizer.engine_proc import EngineProcess
from optimizer.measure import EngineClient
from optimizer.numerics import LogitBound, Position, changes_numerics, check_logit_bound, compare
from optimizer.sample import DomainPromptSynthesizer
from optimizer.verify import VerifyConfig, reference_outputs, verification_plan, verify_candidate
from polyinfer.config import TINY_TARGET, CompiledConfig
from tests.optimizer.faults import LAUNCHER

pytestmark = pytest.mark.timeout(300)

BASE = CompiledConfig(model=str(TINY_TARGET)).with_engine(kv_cache_tokens=8192,
                                                          max_model_len=1024, max_num_seqs=8)
BOUND = LogitBound()  # 0.1 nats + 5% of |logp|


def pos(token: str, **top: float) -> Position:
    return Position(token, top)


def test_the_rule_on_written_positions() -> None:
    ref = [pos("a", a=-0.1, b=-2.5), pos("b", b=-0.70, c=-0.72), pos("x", x=-0.5, y=-1.0)]
    # within: each logprob moved 0.05 nats; the split at a 0.02-nat margin goes to the
    # runner-up, so the rest (other contexts) is not compared
    near = [pos("a", a=-0.15, b=-2.45), pos("c", b=-0.74, c=-0.69), pos("q", q=-0.1)]
    c = compare(ref, near, BOUND)
    assert c.why == "" and c.diverged and c.num_positions == 2
    assert c.max_abs_diff == pytest.approx(0.05)
    # beyond: 0.3 nats off where the tolerance is 0.1 + 0.05 * 2.5
    far = [pos("a", a=-0.1, b=-2.8)]
    assert "logprob differs by 0.3000" in compare(ref, far, BOUND).why
    # a split where the incumbent's margin (2.4 nats) is far beyond twice the bound
    split = [pos("b", a=-0.12, b=-2.45)]
    assert "top-2 margin is 2.4000" in compare(ref, split, BOUND).why
    assert changes_numerics(BASE, BASE.with_engine(attention="naive"))
    assert not changes_numerics(BASE, BASE.with_engine(max_num_seqs=4))


async def _fault(session: aiohttp.ClientSession, url: str, **body: object) -> None:
    async with session.post(f"{url}/test/fault", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def _triggered(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/test/fault") as resp:
        return int((await resp.json())["num_triggered"])


async def test_a_kernel_inside_the_bound_passes_and_one_beyond_it_is_rejected() -> None:
    vcfg = VerifyConfig(max_batch=8, prompt_tokens=(56, 96), max_tokens=(8, 12))
    plan = verification_plan(DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=0),
                             vcfg)
    candidate = BASE.with_engine(attention="naive")  # the reference kernel: other rounding
    async with EngineProcess(BASE, launcher=LAUNCHER) as proc, aiohttp.ClientSession() as s:
        engine = EngineClient(proc.url, s)
        await engine.wait_ready()
        reference = await reference_outputs(engine, BASE, plan)
        clean = await verify_candidate(engine, candidate, plan, reference, vcfg)
        assert clean.ok, (clean.reason, clean.details)
        assert clean.coverage["logit_positions"] >= 0.5 * 4 * 8
        assert clean.coverage["logit_max_abs_diff"] < 1e-3

        await _fault(s, proc.url, name="logit_noise", scale=1e-3)
        inside = await check_logit_bound(engine, BASE, candidate, plan, vcfg.logits)
        assert await _triggered(s, proc.url) > 0
        assert inside.ok and 0 < inside.max_abs_diff < vcfg.logits.atol, inside

        await _fault(s, proc.url, name="logit_noise", scale=0.5)
        beyond = await verify_candidate(engine, candidate, plan, reference, vcfg)
        assert await _triggered(s, proc.url) > 0
        assert not beyond.ok and "logits" in beyond.mismatches
        assert "beyond the bound" in beyond.reason
        await _fault(s, proc.url, name="none")
