"""Automatic prefix caching: the block pool alone, the scheduler, then the real engine (greedy).

Every engine test runs the same requests on two cores that differ only in
``enable_prefix_caching`` and asserts identical tokens; the cache may only
save work, never change an output.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
import torch
from aiohttp.test_utils import TestServer

from engine.core import EngineCore, RequestOutput
from engine.kv_cache import ROOT_HASH, BlockAllocator, extend_block_hashes, hash_block
from engine.loader import load_core
from engine.scheduler import Scheduler
from engine.sequence import GenerationParams, Sequence
from engine.server import create_app
from polyinfer.config import CompiledConfig, ConfigError, EngineConfig
from polyinfer.sampling import SamplingParams
from specdec.base import Proposal
from tests.engine.conftest import EngineProcess
from tests.engine.prompts import chat_text, mixed_prompts

pytestmark = pytest.mark.timeout(300)
BS = 16  # the engine's block size

# -- the block pool alone ---------------------------------------------------------------------


def test_unhashed_blocks_behave_as_a_plain_free_list() -> None:
    a = BlockAllocator(4)
    assert a.allocate(3) == [0, 1, 2]
    a.free([1, 2])
    assert a.allocate(3) == [1, 2, 3] and a.num_free == 0 and a.num_cached == 0


def test_freed_hashed_blocks_stay_findable_and_are_evicted_lru_tail_first() -> None:
    a = BlockAllocator(5)
    assert a.allocate(3) == [0, 1, 2]
    for block, h in ((0, b"h0"), (1, b"h1")):
        a.register(block, h)
    a.free([0, 1, 2])  # 2 has no hash: free list; 1 then 0 parked (tail first)
    assert a.num_free == 5 and a.usage == 0.0 and a.num_cached == 2
    assert a.lookup([b"h0", b"h1", b"h2"]) == [0, 1]
    assert a.lookup([b"h1"]) == [1] and a.lookup([b"x", b"h1"]) == []
    # truly free blocks first (2, 3, 4), then the least recently parked cached one (1)
    assert a.allocate(4) == [2, 3, 4, 1]
    assert a.lookup([b"h0", b"h1"]) == [0] and a.num_cached == 1
    assert a.allocate(1) == [0] and a.lookup([b"h0"]) == [] and a.num_cached == 0


def test_taken_blocks_are_never_evicted_and_refcounts_count() -> None:
    a = BlockAllocator(3)
    [b0, b1] = a.allocate(2)
    a.register(b0, b"p")
    a.free([b0, b1])
    assert a.num_evictable([b0]) == 1
    a.take([b0])  # a prefix hit: referenced again, off the LRU
    assert a.num_evictable([b0]) == 0 and a.num_free == 2
    a.take([b0])  # a second sequence shares it
    assert sorted(a.allocate(2)) == [1, 2] and not a.can_allocate(1)
    a.free([b0])
    assert not a.can_allocate(1)  # still referenced once
    a.free([b0])
    assert a.allocate(1) == [b0]  # now evictable, and the only block left
    with pytest.raises(AssertionError):
        a.free([b1, b1, b1])  # more frees than references is a bug, not a silent no-op


def test_register_keeps_the_first_block_of_a_hash() -> None:
    a = BlockAllocator(2)
    x, y = a.allocate(2)
    a.register(x, b"same")
    a.register(y, b"same")  # computed twice concurrently: y stays private
    a.register(x, b"other")  # a block keeps its hash
    a.free([x, y])
    assert a.lookup([b"same"]) == [x] and a.lookup([b"other"]) == [] and a.num_cached == 1


def test_reset_forgets_every_hash_but_keeps_references() -> None:
    a = BlockAllocator(4)
    x, y, z = a.allocate(3)
    for block, h in ((x, b"x"), (y, b"y"), (z, b"z")):
        a.register(block, h)
    a.free([x, y])  # parked; z still referenced by a running sequence
    assert a.reset() == 3 and a.num_cached == 0 and a.lookup([b"x"]) == []
    assert a.num_free == 3 and not a.can_allocate(4)  # z is not handed out
    a.free([z])
    assert a.num_free == 4 and sorted(a.allocate(4)) == [0, 1, 2, 3]


def random_ops(seed: int, count: int) -> list[tuple[str, int, int]]:
    rng = random.Random(seed)
    kinds = ["alloc", "alloc", "free", "register", "hit", "hit", "reset"]
    return [(rng.choice(kinds), rng.randrange(6), rng.randrange(3)) for _ in range(count)]


@pytest.mark.parametrize("seed", range(40))
def test_pool_invariants_under_random_operations(seed: int) -> None:
    """Owners' blocks are never handed out again; every block is exactly one of free,
    evictable (cached, unreferenced) or referenced; a hit finds what was registered."""
    a = BlockAllocator(6)
    owners: list[list[int]] = []  # the blocks each live "sequence" holds, one ref each
    written: dict[int, int] = {}  # block -> the allocation that last wrote it
    registered: dict[bytes, int] = {}  # hash -> what its block held when registered
    for step, (op, n, k) in enumerate(random_ops(seed, 200)):
        held = [b for blocks in owners for b in blocks]
        if op == "alloc" and a.can_allocate(n % 3 + 1):
            got = a.allocate(n % 3 + 1)
            assert not set(got) & set(held)
            owners.append(got)
            written.update((b, step) for b in got)
        elif op == "free" and owners:
            a.free(owners.pop(n % len(owners)))
        elif op == "register" and owners:
            blocks = owners[n % len(owners)]
            block = blocks[n % len(blocks)]
            a.register(block, bytes([k]))
            if a.lookup([bytes([k])]) == [block]:
                registered.setdefault(bytes([k]), written[block])
        elif op == "hit":
            found = a.lookup([bytes([k])])
            if found:
                assert written[found[0]] == registered[bytes([k])]  # never a reused block
                a.take(found)
                owners.append(found)
        elif op == "reset":
            a.reset()
            registered.clear()
        registered = {h: w for h, w in registered.items() if a.lookup([h])}
        refs = Counter(b for blocks in owners for b in blocks)
        assert a.num_free == 6 - len(refs)  # free + evictable = unreferenced
        assert all(a._hash_of[block] == h for h, block in a._block_of.items())


def test_chain_hash_names_the_whole_prefix() -> None:
    h: list[bytes] = []
    extend_block_hashes(h, list(range(10)), 4)
    assert len(h) == 2 and h[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert h[1] == hash_block(h[0], [4, 5, 6, 7])
    other: list[bytes] = []
    extend_block_hashes(other, [9, 1, 2, 3, 4, 5, 6, 7], 4)  # same second block, other first
    assert other[1] != h[1]
    extend_block_hashes(h, list(range(12)), 4)  # incremental: only the new full block
    assert len(h) == 3 and h[2] == hash_block(h[1], [8, 9, 10, 11])


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_enable_prefix_caching_must_be_a_boolean(value: object) -> None:
    with pytest.raises(ConfigError, match="engine.enable_prefix_caching"):
        CompiledConfig.from_dict({"engine": {"enable_prefix_caching": value}})
    assert EngineConfig().enable_prefix_caching  # on by default, as in vLLM V1


# -- the scheduler ----------------------------------------------------------------------------


def seq(i: int, ids: list[int]) -> Sequence:
    return Sequence(i, f"r{i}", list(ids), len(ids), GenerationParams(8), 0.0)


def small_scheduler(num_blocks: int = 8, **knobs: object) -> Scheduler:
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_tokens=4 * num_blocks,
                       block_size=4, **knobs)  # type: ignore[arg-type]
    return Scheduler(cfg, BlockAllocator(cfg.num_kv_blocks))


def test_admission_reuses_cached_blocks_but_computes_the_last_token() -> None:
    s = small_scheduler()
    a = seq(0, list(range(1, 11)))  # 10 tokens: blocks [1-4] [5-8] + 2
    s.add(a)
    s.schedule({})
    a.num_computed = 10
    s.finish(a)  # 2 full blocks registered, parked
    b = seq(1, list(range(1, 11)) + [50, 51])
    c = seq(2, list(range(1, 9)))  # exactly 2 blocks: the last one is recomputed
    s.add(b)
    s.add(c)
    out = s.schedule({})
    assert [(x.seq.seq_id, x.seq.num_computed, x.num_new) for x in out.scheduled] == [
        (1, 8, 4), (2, 4, 4)]
    # a's blocks were [0, 1, 2]: 0 and 1 cached, 2 (partial) back on the free list
    assert b.block_table == [0, 1, 2] and c.block_table == [0, 3]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 4)
    assert (out.num_prefix_queries, out.num_prefix_hits) == (12 + 8, 8 + 4)


def test_preempted_sequence_readmits_on_its_own_blocks() -> None:
    s = small_scheduler(num_blocks=4)
    a, b = seq(0, list(range(1, 9))), seq(1, list(range(11, 19)))
    s.add(a)
    s.add(b)
    s.schedule({})  # both prefill: 2 blocks each, cache full
    for x in (a, b):
        x.num_computed = 8
        x.token_ids.append(7)
    b_blocks = list(b.block_table)
    out = s.schedule({})  # a needs a 3rd block: b is preempted, its blocks parked
    assert out.preempted == [b] and b.block_table == [] and a.block_table == [0, 1, 3]
    s.finish(a)
    out = s.schedule({})
    # a's 3rd block evicted b's tail block (released first); b's first block is still there
    assert [(x.seq.seq_id, x.seq.num_computed, x.num_new) for x in out.scheduled] == [(1, 4, 5)]
    assert b_blocks == [2, 3] and b.block_table[0] == 2
    assert b.num_cached_tokens == 0  # counted once, at first admission
    assert out.num_prefix_queries == 0


def test_only_blocks_inside_committed_tokens_are_registered() -> None:
    s = small_scheduler()
    a = seq(0, list(range(1, 7)))  # 6 prompt tokens
    s.add(a)
    s.schedule({})
    a.num_computed = 6
    a.token_ids.append(7)
    # a decode step feeds token 7 at position 6 and drafts 8..11 at positions 7..10
    s.schedule({0: Proposal(0, [8, 9, 10, 11])})
    assert a.block_table == [0, 1, 2]
    # every draft is rejected: the bonus token 90 completes block 1 in token_ids, but
    # position 7 still holds the K/V of the rejected draft 8
    a.num_computed = 7
    a.token_ids.append(90)
    s.cache_blocks(a)
    probe: list[bytes] = []
    extend_block_hashes(probe, [1, 2, 3, 4, 5, 6, 7, 90], 4)
    assert s.allocator.lookup(probe) == [0]
    # the next step feeds 90 at position 7: now block 1 holds committed K/V only
    a.num_computed = 8
    a.token_ids.append(91)
    s.cache_blocks(a)
    assert s.allocator.lookup(probe) == [0, 1]
    # a step that stopped inside its accepted drafts: num_computed passes the kept tokens
    a.num_computed = 12
    s.cache_blocks(a)
    assert s.allocator.num_cached == 2  # token_ids has 9 tokens: no 3rd full block


def test_eviction_under_a_full_cache_never_takes_a_running_sequences_block() -> None:
    s = small_scheduler(num_blocks=8)
    for i, ids in enumerate((list(range(1, 13)), list(range(100, 108)))):
        warm = seq(i, ids)  # 3 then 2 full blocks computed, cached, parked
        s.add(warm)
        s.schedule({})
        warm.num_computed = len(ids)
        s.finish(warm)
    assert s.allocator.num_cached == 5 and s.allocator.num_free == 8
    a = seq(2, list(range(1, 13)) + [99])  # hits the first 3 cached blocks
    s.add(a)
    s.schedule({})
    assert a.block_table == [0, 1, 2, 5] and a.num_computed == 12
    b = seq(3, list(range(200, 209)))  # 3 blocks: 2 free, then the LRU evictable one (4)
    c = seq(4, list(range(300, 312)))  # 3 more: only 1 evictable left, a's are taken
    s.add(b)
    s.add(c)
    out = s.schedule({})
    assert [x.seq.seq_id for x in out.scheduled] == [2, 3] and list(s.waiting) == [c]
    assert b.block_table == [6, 7, 4] and a.block_table == [0, 1, 2, 5]
    second_warm: list[bytes] = []
    extend_block_hashes(second_warm, list(range(100, 108)), 4)
    assert s.allocator.lookup(second_warm) == [3]  # block 4's hash went with it
    assert s.allocator.num_free == 1 and not s.allocator.can_allocate(3)


def test_prefix_caching_off_never_hashes() -> None:
    s = small_scheduler(enable_prefix_caching=False)
    a = seq(0, list(range(1, 11)))
    s.add(a)
    s.schedule({})
    a.num_computed = 10
    s.finish(a)
    b = seq(1, list(range(1, 11)))
    s.add(b)
    out = s.schedule({})
    assert out.scheduled[0].num_new == 10 and s.allocator.num_cached == 0
    assert b.block_hashes == [] and b.num_cached_tokens == 0 and out.num_prefix_queries == 0


# -- the real engine: caching on vs off ------------------------------------------------------


def engine_config(model_dir: Path, on: bool, **knobs: object) -> CompiledConfig:
    base: dict[str, object] = dict(max_num_seqs=16, max_num_batched_tokens=256,
                                   kv_cache_tokens=8192, spec_method="ngram", spec_max_depth=4,
                                   enable_prefix_caching=on)
    base.update(knobs)
    return CompiledConfig(model=str(model_dir), served_model_name="tiny",
                          engine=EngineConfig(**base))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cores(tiny_model_dir: Path) -> dict[bool, EngineCore]:
    return {on: load_core(engine_config(tiny_model_dir, on)) for on in (True, False)}


@pytest.fixture(scope="module")
def prompts(cores: dict[bool, EngineCore]) -> list[list[int]]:
    return [cores[True].tokenizer.encode(chat_text(p)) for p in mixed_prompts(12)]


def greedy(depth: int = 0, max_tokens: int = 24) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(0.0),
                            ignore_eos=True, spec_depth=depth)


@dataclass
class Ran:
    tokens: list[list[int]]  # per prompt
    cached: list[int]  # cached_tokens per prompt
    num_preempted: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def run(core: EngineCore, prompts: list[list[int]], depth: int = 0) -> Ran:
    """All prompts at once, stepped until every one finishes."""
    keys = [f"r{i}" for i in range(len(prompts))]
    for key, ids in zip(keys, prompts, strict=True):
        core.add_request(key, ids, greedy(depth))
    tokens: dict[str, list[int]] = {k: [] for k in keys}
    last: dict[str, RequestOutput] = {}
    preempted = 0
    for _ in range(5000):
        if not core.has_work:
            break
        outputs, stats = core.step()
        preempted += stats.num_preempted
        for o in outputs:
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                last[o.request_id] = o
    assert set(last) == set(keys), "every request must finish"
    return Ran([tokens[k] for k in keys], [last[k].num_cached_tokens for k in keys], preempted,
               sum(o.num_draft_tokens for o in last.values()),
               sum(o.num_accepted_tokens for o in last.values()))


def both(cores: dict[bool, EngineCore], prompts: list[list[int]], depth: int = 0) -> Ran:
    """Run on both cores; assert equal tokens; what the caching core did."""
    off = run(cores[False], prompts, depth)
    on = run(cores[True], prompts, depth)
    assert on.tokens == off.tokens
    assert off.cached == [0] * len(prompts)
    return on


def test_repeated_prompt_hits_all_but_the_last_partial_block(
        cores: dict[bool, EngineCore]) -> None:
    ids = [(7 * i) % 8000 + 10 for i in range(100)]
    assert both(cores, [ids]).cached == [0]
    assert both(cores, [ids]).cached == [96]  # floor((100 - 1) / 16) * 16


def test_shared_long_prefix_then_mixed_batch(cores: dict[bool, EngineCore],
                                             prompts: list[list[int]]) -> None:
    prefix = prompts[1][:200]
    variants = [prefix + p[:20] for p in prompts[2:6]]
    assert all(len(v) == 220 for v in variants)
    assert both(cores, variants[:1]).cached == [0]
    # a mixed batch: shared-prefix variants, a repeat, fresh prompts, short and long
    batch = variants + [variants[0], prompts[0], prompts[6][:300], prompts[7]]
    cached = both(cores, batch).cached
    assert cached[:5] == [208, 192, 192, 192, 208]  # 13 blocks (220 - 1), 12 (200 shared)
    assert cached[5:] == [0, 0, 0]  # never seen


def test_multi_turn_follow_up_reuses_the_previous_answer(cores: dict[bool, EngineCore],
                                                         prompts: list[list[int]]) -> None:
    first = prompts[8]
    [answer] = both(cores, [first]).tokens
    follow = first + answer + prompts[9][:30]
    # the answer's last token was never fed back, so its K/V does not exist
    expected = (len(first) + len(answer) - 1) // BS * BS
    assert both(cores, [follow]).cached == [expected] and expected > len(first) // BS * BS


def test_speculation_caches_only_committed_tokens(cores: dict[bool, EngineCore]) -> None:
    tok = cores[True].tokenizer
    ids = tok.encode("def add(a, b):\n    return a + b\n" * 6 + "def mul(a, b):\n    return")
    first = both(cores, [ids], depth=4)
    assert 0 < first.num_accepted_tokens < first.num_draft_tokens  # drafts were rejected
    [answer] = first.tokens
    follow = ids + answer + tok.encode(" and more")
    second = both(cores, [follow], depth=4)
    n = len(ids) + len(answer)
    # (n - 1): the last token is never fed; n: the run stopped inside accepted drafts
    assert second.cached[0] in ((n - 1) // BS * BS, n // BS * BS)
    assert second.tokens == run(cores[False], [follow]).tokens  # = plain decoding


def kv_of_blocks(core: EngineCore, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor(blocks)
    kv = core.runner.kv
    return kv.k.index_select(2, index).clone(), kv.v.index_select(2, index).clone()


def test_reused_blocks_hold_the_kv_a_fresh_prefill_computes(
        cores: dict[bool, EngineCore], prompts: list[list[int]]) -> None:
    warm = prompts[10] + prompts[11]
    assert len(warm) > 150
    run(cores[True], [warm])
    probe = warm[:150] + prompts[3][:40]
    got = {}
    for on, core in cores.items():
        core.add_request("kv", probe, greedy())
        core.step()  # the whole 190-token prompt fits one step's budget
        seq = core.requests["kv"]
        assert seq.num_cached_tokens == (144 if on else 0) and seq.num_computed == 190
        got[on] = kv_of_blocks(core, seq.block_table[:9])  # tokens 0..143
        while core.has_work:
            core.step()
    (k_hit, v_hit), (k_new, v_new) = got[True], got[False]
    assert k_hit.abs().sum() > 0
    torch.testing.assert_close(k_hit, k_new, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_hit, v_new, atol=1e-4, rtol=1e-4)


def test_preemption_and_eviction_under_a_tiny_cache(tiny_model_dir: Path,
                                                    prompts: list[list[int]]) -> None:
    # 20 blocks for requests that need far more: decoding preempts, admission evicts
    small = {on: load_core(engine_config(tiny_model_dir, on, kv_cache_tokens=320,
                                         max_model_len=320, spec_method="none"))
             for on in (True, False)}
    chosen = [p for p in prompts if len(p) <= 250][:8]
    batch = chosen + [chosen[0] + chosen[1][:40], chosen[2]]
    assert sum(len(p) + 24 for p in batch) > 2 * 320
    off = run(small[False], batch)
    on = run(small[True], batch)
    assert on.tokens == off.tokens and off.num_preempted > 0 and on.num_preempted > 0
    assert small[True].kv_usage == 0.0 and small[True].allocator.num_cached > 0
    assert run(small[True], batch).tokens == off.tokens  # again, on what is still cached


def test_reload_clears_the_cache(cores: dict[bool, EngineCore],
                                 prompts: list[list[int]]) -> None:
    core, ids = cores[True], prompts[4]
    run(core, [ids])
    assert core.allocator.num_cached > 0
    old = core.config
    core.reload(old.with_engine(max_num_seqs=8))
    assert core.allocator.num_cached == 0 and run(core, [ids]).cached == [0]
    core.reload(old.with_engine(enable_prefix_caching=False))
    assert run(core, [ids]).cached == [0] and core.allocator.num_cached == 0
    core.reload(old)
    run(core, [ids])
    assert run(core, [ids]).cached == [(len(ids) - 1) // BS * BS]


# -- over HTTP: usage and metrics, in-process and data-parallel -------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z0-9_:]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


async def cached_tokens(client: openai.AsyncOpenAI, ids: list[int]) -> int | None:
    r = await client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0.0)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens


async def reset(base_url: str) -> int:
    async with aiohttp.ClientSession() as s, s.post(base_url + "/reset_prefix_cache") as r:
        assert r.status == 200
        body = await r.json()
    return int(body["num_blocks_dropped"])


async def usage_and_metrics(base_url: str, ids: list[int],
                            num_requests: int) -> tuple[list[int | None], int | None,
                                                        dict[str, float]]:
    """Send ``ids`` ``num_requests`` times one by one, then once streamed; then reset the
    cache and send it once more, which must find nothing cached."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    cached = [await cached_tokens(client, ids) for _ in range(num_requests)]
    stream = await client.completions.create(model="tiny", prompt=ids, max_tokens=4,
                                             temperature=0.0, stream=True,
                                             stream_options={"include_usage": True})
    streamed = None
    async for chunk in stream:
        if chunk.usage is not None:
            assert chunk.usage.prompt_tokens_details is not None
            streamed = chunk.usage.prompt_tokens_details.cached_tokens
    assert await reset(base_url) > 0
    assert await cached_tokens(client, ids) == 0
    await client.close()
    async with aiohttp.ClientSession() as s, s.get(base_url + "/metrics") as resp:
        return cached, streamed, parse_metrics(await resp.text())


async def test_usage_reports_cached_tokens_and_metrics_count_them(tiny_model_dir: Path) -> None:
    app = create_app(engine_config(tiny_model_dir, True).with_engine(kv_cache_tokens=2048))
    ids = [(11 * i) % 8000 + 10 for i in range(100)]
    async with TestServer(app, host="127.0.0.1") as server:
        base = str(server.make_url("")).rstrip("/")
        cached, streamed, m = await usage_and_metrics(base, ids, 2)
    assert cached == [0, 96] and streamed == 96
    assert m["vllm:prefix_cache_queries_total"] == 400
    assert m["vllm:prefix_cache_hits_total"] == m["vllm:prompt_tokens_cached_total"] == 192
    assert m["vllm:prompt_tokens_total"] == 400  # computed and cached, as vLLM counts


def test_data_parallel_cores_cache_separately_and_metrics_add_up(tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    config = engine_config(tiny_model_dir, True, kv_cache_tokens=2048, data_parallel_size=2,
                           num_threads=0)
    proc = EngineProcess(config.to_dict(), tmp_path)
    ids = [(13 * i) % 8000 + 10 for i in range(100)]
    try:
        proc.wait_ready()
        cached, streamed, m = asyncio.run(usage_and_metrics(proc.base_url, ids, 4))
    finally:
        proc.stop()
    # one request at a time alternates between the two cores: each misses once
    assert cached == [0, 0, 96, 96] and streamed == 96  # the reset reached the next core too
    assert m["vllm:prefix_cache_queries_total"] == 600
    assert m["vllm:prefix_cache_hits_total"] == 3 * 96
    assert m["vllm:prompt_tokens_total"] == 600
