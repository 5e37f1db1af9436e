"""Two-lane steps (engine.lanes): balanced splits, ordered results, same tokens as one lane."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from engine.lanes import EXPLORE_EVERY, LaneChooser, Lanes, split_lanes
from engine.loader import load_core
from polyinfer.config import CompiledConfig, EngineConfig
from tests.engine.prompts import chat_text, mixed_prompts
from tests.engine.test_core import greedy, run


def test_split_balances_tokens_and_keeps_order() -> None:
    # one 200-token prefill chunk against eight decodes: the chunk gets a lane of its own
    lanes = split_lanes([16, 16, 16, 16, 200, 16, 16, 16, 16], [300] * 9, 2)
    assert sorted(i for lane in lanes for i in lane) == list(range(9))
    assert [4] in lanes
    assert all(lane == sorted(lane) for lane in lanes)


def test_split_weighs_context_for_decodes() -> None:
    # equal query lengths: the two long contexts go to different lanes
    lanes = split_lanes([4] * 8, [9000, 9000, 10, 10, 10, 10, 10, 10], 2)
    assert {0, 1} not in [set(lane) & {0, 1} for lane in lanes]
    assert sorted(len(lane) for lane in lanes) == [4, 4]


def test_small_steps_stay_in_one_lane() -> None:
    assert split_lanes([1], [10], 2) == [[0]]
    assert split_lanes([1] * 31, [10] * 31, 2) == [list(range(31))]  # < MIN_LANE_TOKENS each
    assert split_lanes([5, 5], [10, 10], 1) == [[0, 1]]


def test_chooser_keeps_the_faster_choice_and_retries_the_other() -> None:
    chooser = LaneChooser(2)
    assert chooser.lanes_for(8) == 1  # small steps never split
    assert chooser.lanes_for(64) == 1  # each choice is measured once first
    chooser.record(1, 64, 0.064)  # 1 ms per token in one lane
    assert chooser.lanes_for(64) == 2
    chooser.record(2, 64, 0.032)  # 0.5 ms per token in two
    picks = [chooser.lanes_for(64) for _ in range(2 * EXPLORE_EVERY)]
    assert picks.count(2) == 2 * EXPLORE_EVERY - 2 and picks.count(1) == 2
    for _ in range(20):  # the box got busy: two lanes now take 2 ms per token
        chooser.record(2, 64, 0.128)
    assert chooser.lanes_for(64) == 1 or chooser.lanes_for(64) == 1


def test_one_lane_chooser_never_splits() -> None:
    chooser = LaneChooser(1)
    assert all(chooser.lanes_for(n) == 1 for n in (1, 64, 4096))


def test_lanes_run_on_two_threads_in_order_and_raise() -> None:
    lanes = Lanes(2, 1)
    try:
        seen: list[int] = []
        assert lanes.run([lambda: 1, lambda: seen.append(threading.get_ident()) or 2]) == [1, 2]
        assert seen and seen[0] != threading.get_ident()

        def boom() -> int:
            raise ValueError("lane failed")

        with pytest.raises(ValueError, match="lane failed"):
            lanes.run([lambda: 1, boom])
    finally:
        lanes.close()


def test_two_lanes_give_the_same_greedy_tokens_as_one(tiny_model_dir: Path) -> None:
    """Mixed prefill chunks, decodes and speculative verification, split over two lanes."""
    def core_with(num_threads: int):  # type: ignore[no-untyped-def]
        return load_core(CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
            max_num_seqs=40, max_num_batched_tokens=2048, kv_cache_tokens=16384,
            spec_method="ngram", spec_max_depth=3, num_threads=num_threads)))

    one, two = core_with(1), core_with(2)
    prompts = [one.tokenizer.encode(chat_text(p)) for p in mixed_prompts(36)]
    params = [greedy(depth=i % 4, max_tokens=16) for i in range(36)]
    want = run(one, prompts, params)
    split = two.runner._lane_parts
    num_parts: list[int] = []
    two.runner._lane_parts = (  # type: ignore[method-assign]
        lambda s, n: num_parts.append(len(split(s, n))) or split(s, n))
    got = run(two, prompts, params)
    assert two.runner.lanes.num_lanes == 2 and one.runner.lanes.num_lanes == 1
    assert 2 in num_parts and 1 in num_parts  # big steps split, the small tail did not
    assert got == want
