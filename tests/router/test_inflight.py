"""InFlight bookkeeping and the adaptive policy's pricing of prefill/decode interference."""

from __future__ import annotations

import pytest

from polyinfer.config import CompiledConfig
from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.base import RequestOutcome, RequestShape, WorkerView
from router.inflight import Flight, InFlight


def flight(worker: str = "a", sent: float = 0.0, ttft: float = 1.0, tpot: float = 0.01,
           tokens: int = 101, prefill: float = 0.8) -> Flight:
    return Flight(worker, 0, 1, 0, sent, ttft, tpot, tokens, prefill)


def test_active_prefilling_and_prefill_ahead() -> None:
    f = InFlight(capacity=10)
    f.add(1, flight(sent=0.0, ttft=1.0, prefill=0.8))  # prefilling until t=1
    f.add(2, flight(sent=0.0, ttft=0.1, prefill=0.05))  # decoding from t=0.1
    f.add(3, flight("b", sent=0.0, ttft=1.0, prefill=0.9))
    assert f.prefill_ahead_s("a", 0.5) == pytest.approx(0.5)  # min(0.8, 1.0 - 0.5)
    assert f.prefill_ahead_s("a", 0.1) == pytest.approx(0.8)
    assert f.prefill_ahead_s("a", 1.5) == 0.0
    assert len(list(f.active("a", 1.5))) == 2
    # stale past 4x the predicted e2e (1.0 + 100 * 0.01 = 2 s): a lost outcome stops counting
    assert list(f.active("a", 8.5)) == []
    assert f.pop(1) is not None and f.pop(1) is None
    assert [x.prefill_s for x in f.active("a", 0.0)] == [0.05]


def test_bounded_fifo() -> None:
    f = InFlight(capacity=2)
    for key in range(5):
        f.add(key, flight())
    assert len(f) == 2
    assert f.pop(0) is None and f.pop(4) is not None
    assert len(list(f.active("a", 0.0))) == 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pair() -> list[WorkerView]:
    cfg = CompiledConfig().with_engine(max_num_seqs=8)
    return [WorkerView(n, f"http://{n}", "engine", cfg, outstanding_requests=4)
            for n in ("a", "b")]


def short(**kw: object) -> RequestShape:
    return RequestShape("chat", 50, None, 60, **kw)  # type: ignore[arg-type]


def long_prompt(**kw: object) -> RequestShape:
    return RequestShape("summarization", 1800, None, 60, **kw)  # type: ignore[arg-type]


def test_short_request_avoids_a_worker_busy_prefilling() -> None:
    clock = Clock()
    p = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0, confidence=None), clock=clock)
    ws = pair()
    held = [long_prompt()]  # the proxy keeps each shape until its outcome (id() is the key)
    assert p.choose(held[0], ws[:1]).worker == "a"  # a 1,800-token prefill on "a"
    clock.now = 0.05
    # same load on both views: only the prefill in progress tells them apart
    assert p.choose(short(slo_tpot_s=0.03), ws).worker == "b"


def test_long_prompt_avoids_tight_slo_decoders() -> None:
    clock = Clock()
    p = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0, confidence=None), clock=clock)
    ws = pair()
    # NOTE: the shapes are held, as the proxy holds them until their outcome: the policy
    # keys its in-flight records by id(shape), and a freed shape's id can be reused
    held = []
    for _ in range(4):  # tight-TPOT requests decoding on "a", loose ones on "b"
        held += [short(slo_tpot_s=0.025), short(slo_tpot_s=1.0)]
        p.choose(held[-2], ws[:1])
        p.choose(held[-1], ws[1:])
    clock.now = 0.5  # all past their first token
    d = p.choose(long_prompt(slo_ttft_s=5.0, slo_tpot_s=1.0), ws)
    assert d.worker == "b"
    a, b = (p.candidate(long_prompt(slo_ttft_s=5.0, slo_tpot_s=1.0), w) for w in ws)
    # the prefill delays four requests either way; on "a" it also breaks their SLO
    assert a.cost_s > b.cost_s > 4 * b.prefill_s


def test_slot_wait_is_the_time_until_enough_of_those_ahead_finish() -> None:
    f = InFlight(capacity=10)
    for key, tokens in enumerate((101, 201, 301)):  # predicted e2e 2, 3, 4 s (ttft 1 s)
        f.add(key, flight(tokens=tokens))
    assert f.slot_wait_s("a", 0.5, 0, 3, 9.0) == 0.0
    assert f.slot_wait_s("a", 0.5, 1, 3, 9.0) == pytest.approx(1.5)  # the soonest: 2 - 0.5
    assert f.slot_wait_s("a", 0.5, 3, 3, 9.0) == pytest.approx(3.5)
    # two more ahead than this policy knows of: each a third of the known mean cost (3 s)
    assert f.slot_wait_s("a", 0.5, 5, 3, 9.0) == pytest.approx(3.5 + 2 / 3 * 3.0)
    # a request running late still counts a tenth of its cost, not zero
    assert f.slot_wait_s("a", 2.5, 1, 3, 9.0) == pytest.approx(0.2)
    assert f.slot_wait_s("b", 0.0, 2, 4, 8.0) == pytest.approx(4.0)  # none known: fallback


def no_prefill(**kw: object) -> RequestShape:
    return RequestShape("chat", 0, None, 60, **kw)  # type: ignore[arg-type]


def test_crowding_spills_before_the_batch_cap() -> None:
    """Same load and no prefill either way: joining "a" slows four tight-TPOT decodes past
    their SLO, joining "b" four loose ones; only the crowding term tells them apart."""
    clock = Clock()
    p = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0, confidence=None), clock=clock)
    ws = pair()
    held = []  # kept until the end, as the proxy keeps them (see above)
    for _ in range(4):
        held += [no_prefill(slo_tpot_s=0.0245), no_prefill(slo_tpot_s=1.0)]
        p.choose(held[-2], ws[:1])
        p.choose(held[-1], ws[1:])
    clock.now = 0.1
    a, b = (p.candidate(no_prefill(), w) for w in ws)
    assert not a.saturated and a.queue < 8  # well below the batch cap
    assert p.choose(no_prefill(), ws).worker == "b"
    assert a.cost_s > b.cost_s


def test_a_full_batch_charges_the_wait_not_crowding_and_learns_ttft_without_it() -> None:
    clock = Clock()
    p = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0), clock=clock)
    cfg = CompiledConfig().with_engine(max_num_seqs=2)
    full = WorkerView("a", "http://a", "engine", cfg)
    shapes = [no_prefill() for _ in range(3)]
    for s in shapes:
        p.choose(s, [full])
        full.outstanding_requests += 1
    third = p._inflight.pop(id(shapes[2]))
    assert third is not None and third.wait_s > 0  # two running ahead: it waits for a slot
    p._inflight.add(id(shapes[2]), third)
    before = p.profile(full).predict("chat", 0, 2, 2, 0).ttft_s
    p.observe(RequestOutcome("a", shapes[2], "ok", completion_tokens=60,
                             ttft_s=third.wait_s + before, tpot_s=0.02))
    # what it learned is the TTFT without the wait: the prediction barely moves
    assert p.profile(full).predict("chat", 0, 2, 2, 0).ttft_s == pytest.approx(before, rel=0.2)


def test_prefill_ahead_is_spread_over_tpot() -> None:
    """A prompt routed earlier is still prefilling (0.3 s of it left): the request waits it
    out in its decode, 0.3 s over its 59 gaps (60 output tokens)."""
    clock = Clock()
    p = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0), clock=clock)
    w = pair()[0]
    base = p.candidate(no_prefill(), w)
    p._inflight.add(1, flight("a", sent=0.0, ttft=0.5, prefill=0.3))
    clock.now = 0.2  # min(0.3, 0.5 - 0.2) = 0.3 s still ahead
    ahead = p.candidate(no_prefill(), w)
    assert ahead.tpot_s - base.tpot_s == pytest.approx(0.3 / 59)
    assert ahead.ttft_s == pytest.approx(base.ttft_s)


def test_each_prompt_is_charged_its_own_stall() -> None:
    """One request decoding on "a": TTFT 0.1 s, 10 gaps at 5 ms, TPOT SLO 10 ms (cost
    0.15 s). A 0.04 s prefill stalls it to 9 ms: within the SLO, harm 0.04 s; each
    further prompt is priced against the flight as predicted when it was sent."""
    p = AdaptivePolicy(AdaptiveConfig(), clock=Clock())
    p._inflight.add(1, Flight("a", 0, 1, 0, 0.0, 0.1, 0.005, 11, 0.0, None, 0.010))
    assert p._interference("a", 0.0, 0.04, 0.0, 1.0) == pytest.approx(0.04)
    # 0.08 s takes it to 13 ms: 30% over, penalty 1 + 4 x 0.3: (0.15 + 0.08) x 2.2 - 0.15
    assert p._interference("a", 0.0, 0.08, 0.0, 1.0) == pytest.approx(0.356)
