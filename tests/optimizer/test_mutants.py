"""The mutation suite: every planted engine fault is rejected by verification, a clean run passes.

One engine worker runs under the test-only fault injector (tests.optimizer.faults),
started by the optimizer's own EngineProcess; the incumbent's reference comes
from it with no fault armed. Then the same candidate (max_num_seqs 16, the
batch where the cross-request fault arms) is verified once clean (it must pass:
no false alarm) and once per fault (each must be rejected, and the fault must
have fired). Prints caught / planted.
"""

from __future__ import annotations

import time

import aiohttp
import pytest

from optimizer.engine_proc import EngineProcess
from optimizer.measure import EngineClient
from optimizer.sample import DomainPromptSynthesizer
from optimizer.verify import VerifyConfig, reference_outputs, verification_plan, verify_candidate
from polyinfer.config import TINY_TARGET, CompiledConfig
from tests.optimizer.faults import FAULTS, LAUNCHER

INCUMBENT = CompiledConfig(model=str(TINY_TARGET)).with_engine(
    kv_cache_tokens=8192, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512)
CANDIDATE = INCUMBENT.with_engine(max_num_seqs=16, max_num_batched_tokens=1024)
VERIFY = VerifyConfig(max_batch=16)


async def _arm(session: aiohttp.ClientSession, url: str, name: str) -> None:
    async with session.post(f"{url}/test/fault", json={"name": name}) as resp:
        assert resp.status == 200, await resp.text()


async def _num_triggered(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/test/fault") as resp:
        return int((await resp.json())["num_triggered"])


@pytest.mark.asyncio
async def test_every_planted_fault_is_rejected_and_a_clean_candidate_passes(tmp_path) -> None:
    if not (TINY_TARGET / "config.json").exists():
        pytest.fail("the bundled tiny-target weights are missing (models/tiny-target)")
    synth = DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=0)
    plan = verification_plan(synth, VERIFY)
    proc = EngineProcess(INCUMBENT, log_path=tmp_path / "engine.log", launcher=LAUNCHER)
    t0 = time.perf_counter()
    async with proc, aiohttp.ClientSession() as session:
        engine = EngineClient(proc.url, session)
        await engine.wait_ready()
        reference = await reference_outputs(engine, INCUMBENT, plan)
        clean = await verify_candidate(engine, CANDIDATE, plan, reference, VERIFY)
        assert clean.ok, (clean.reason, clean.details)
        assert clean.batch == 16
        caught = {}
        for fault in FAULTS[1:]:
            await _arm(session, proc.url, fault)
            report = await verify_candidate(engine, CANDIDATE, plan, reference, VERIFY)
            assert await _num_triggered(session, proc.url) > 0, f"{fault} never fired"
            await _arm(session, proc.url, "none")
            caught[fault] = not report.ok
            print(f"{fault}: {'caught' if not report.ok else 'MISSED'} ({report.reason})")
    print(f"mutants caught / planted: {sum(caught.values())} / {len(caught)} "
          f"in {time.perf_counter() - t0:.0f} s")
    assert all(caught.values()), caught
