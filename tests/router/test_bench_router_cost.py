"""bench/router_cost.py's loop: deterministic, without exploration, over the prefix mix
(the new / base "same decisions" column compares two runs of it)."""

from __future__ import annotations

from bench import router_cost as BENCH


def test_run_level_repeats_itself_without_exploring() -> None:
    workers = {"spec", "batch", "long"}
    for inflight in (0, 8):
        median_s, decisions = BENCH.run_level(inflight, 30, seed=1)
        assert median_s > 0 and len(decisions) == 30
        assert {w for w, _, _ in decisions} <= workers
        assert all(r != "explore" for _, _, r in decisions)  # exploration is off
        assert BENCH.run_level(inflight, 30, seed=1)[1] == decisions


def test_shapes_mix_shared_prefix_and_single_requests() -> None:
    shapes = BENCH._shapes(200, seed=0)
    prefixed = [s for s in shapes if s.prefix_hashes]
    assert 60 < len(prefixed) < 140
    assert all(s.slo_ttft_s and s.slo_tpot_s for s in shapes)


def test_opcode_counts_are_deterministic_and_grow_with_the_flights() -> None:
    idle, decisions = BENCH.run_level(0, 20, seed=1, opcodes=True)
    assert BENCH.run_level(0, 20, seed=1, opcodes=True) == (idle, decisions)
    assert decisions == BENCH.run_level(0, 20, seed=1)[1]  # counting changes no decision
    assert BENCH.run_level(32, 20, seed=1, opcodes=True)[0] > idle > 1000
