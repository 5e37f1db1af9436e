"""Context load (router.context): a long prompt's decode slows every step of its worker, and
the adaptive policy prices that in the TPOT it predicts there, in the harm to the requests
running there and in the harm to the arrivals to come. Answers written out."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.config import CompiledConfig
from router.adaptive import AdaptiveConfig, AdaptivePolicy, Candidate
from router.base import RequestOutcome, RequestShape, WorkerView
from router.context import ContextConfig, ContextLoad
from router.inflight import Flight
from router.profiles import LatencyPrior, PriorConfig, WorkerProfile

SPEC = CompiledConfig().with_engine(max_num_seqs=4, max_num_batched_tokens=256,
                                    spec_method="ngram", spec_max_depth=4)
BATCH = CompiledConfig().with_engine(max_num_seqs=32, max_num_batched_tokens=256)
TIGHT = (0.2, 0.0039)  # the tight class's SLO (TTFT s, TPOT s), as on the device in round 7
LOOSE = (1.5, 0.024)  # the shared-prefix class's


def req(domain: str, prompt_tokens: int, num_tokens: int,
        slo: tuple[float, float] | tuple[None, None] = (None, None)) -> RequestShape:
    return RequestShape(domain, prompt_tokens, None, num_tokens, slo_ttft_s=slo[0],
                        slo_tpot_s=slo[1], speculative_depth=0)


def short_flight(sent_s: float = 0.0) -> Flight:
    """A tight short request as predicted on spec: 55 tokens at 2.5 ms, cost 0.14 s."""
    return Flight("spec", 0, 1, 0, sent_s, 0.005, 0.0025, 55, 0.001, *TIGHT)


def test_mean_s_time_averages_the_windows_and_finish_ends_them() -> None:
    ctx = ContextLoad()
    ctx.record("w", 1, 0.0, 1.0, 0.004)
    # half of [0.5, 1.5] under a 4-ms window: 2 ms on average
    assert ctx.mean_s("w", 0.5, 1.5) == pytest.approx(0.002)
    ctx.record("w", 2, 0.5, 1.5, 0.002)
    assert ctx.mean_s("w", 0.5, 1.5) == pytest.approx(0.004)
    # request 1 finished at 0.5: its window ends there, its extra comes back
    assert ctx.finish("w", 1, 0.0, 0.5) == pytest.approx(0.004)
    assert ctx.mean_s("w", 0.5, 1.5) == pytest.approx(0.002)
    assert ctx.mean_s("w", 0.0, 0.5) == pytest.approx(0.004)
    # nothing to price or to end
    for extra in (0.0, -1.0, math.nan, math.inf):
        ctx.record("w", 3, 0.0, 1.0, extra)
    assert ctx.finish("w", 3, 0.0, 1.0) == 0.0
    assert ctx.mean_s("other", 0.0, 1.0) == 0.0
    assert ctx.mean_s("w", 1.0, 1.0) == 0.0
    # an empty window (it ended before it began) is dropped
    assert ctx.finish("w", 2, 1.0, 1.0) == pytest.approx(0.002)
    assert ctx.mean_s("w", 0.5, 1.5) == 0.0


def test_future_harm_is_rate_x_service_x_the_recent_arrivals_harm() -> None:
    ctx = ContextLoad()
    for _ in range(20):  # 20 arrivals at t=0 with a 10-s time constant: 2 / s
        ctx.arrive("spec", 0.0, short_flight())
    assert ctx.rate("spec", 0.0) == pytest.approx(2.0)
    assert ctx.rate("spec", 10.0) == pytest.approx(2.0 / math.e)
    # unpenalised: each of the 2 x 0.9 = 1.8 arrivals shares min(0.45, 0.14) s, 56 of its
    # steps at 2.5 ms, each 4.5 ms slower: 0.252 s
    assert ctx.future_harm("spec", 0.0, 0.0045, 0.9, lambda g, d: d) == pytest.approx(
        1.8 * 0.252)
    # the policy's penalised harm: TPOT 2.5 + 252 / 54 = 7.17 ms against 3.9: a miss of
    # 0.8376, penalty 4.3504, cost (0.14 + 0.252) x 4.3504 = 1.7054 against 0.14
    p = AdaptivePolicy()
    assert ctx.future_harm("spec", 0.0, 0.0045, 0.9, p._harm_of) == pytest.approx(
        1.8 * 1.5654, rel=1e-4)
    # 0.5 ms of extra (the long worker's): 28 ms more, 3.02 ms a token, a meet: 1.8 x 0.028
    assert ctx.future_harm("spec", 0.0, 0.0005, 0.9, p._harm_of) == pytest.approx(1.8 * 0.028)
    # arrivals that had another worker 0.1 s dearer lose at most that: they would go there
    soft = ContextLoad()
    for _ in range(20):
        soft.arrive("spec", 0.0, dataclasses.replace(short_flight(), loss_s=0.1))
    assert soft.future_harm("spec", 0.0, 0.0045, 0.9, p._harm_of) == pytest.approx(1.8 * 0.1)
    # an arrival predicted to miss its SLO anyway loses the delay, no more: 0.252 s
    late = dataclasses.replace(short_flight(), penalty=2.0)
    assert p._miss_harm_of(late, 0.252) == pytest.approx(0.252)
    assert p._miss_harm_of(short_flight(), 0.252) == pytest.approx(1.5654, rel=1e-4)
    # nothing without an extra, a service, arrivals, or with future pricing off
    assert ctx.future_harm("spec", 0.0, 0.0, 0.9, p._harm_of) == 0.0
    assert ctx.future_harm("spec", 0.0, 0.0045, math.inf, p._harm_of) == 0.0
    assert ctx.future_harm("batch", 0.0, 0.0045, 0.9, p._harm_of) == 0.0
    off = ContextLoad(ContextConfig(future=False))
    off.arrive("spec", 0.0, short_flight())
    assert off.future_harm("spec", 0.0, 0.0045, 0.9, p._harm_of) == 0.0


def test_a_requests_loss_is_its_own_cost_elsewhere_less_here() -> None:
    a = Candidate("a", 1.0, 1.0, 0, 0, 1, False, True)
    # b's 2.5 s carry 1 s charged for the reserve and 0.5 s for the arrivals to come: its own
    # cost is 1.0, c's 1.8 s; picking a loses nothing against b
    b = Candidate("b", 2.5, 1.0, 0, 0, 1, False, True, reserve_s=1.0, context_future_s=0.5)
    c = Candidate("c", 1.8, 1.0, 0, 0, 1, False, True)
    assert AdaptivePolicy._loss(a, [a, b, c]) == 0.0
    assert AdaptivePolicy._loss(c, [a, b, c]) == 0.0
    assert AdaptivePolicy._loss(a, [a, c]) == pytest.approx(0.8)
    assert AdaptivePolicy._loss(a, [a]) == math.inf


def test_config_rejects_bad_values() -> None:
    for bad in ({"window_s": 0.0}, {"recent": 0}, {"max_events": 0}, {"min_samples": 0}):
        with pytest.raises(ValueError):
            ContextConfig(**bad)  # type: ignore[arg-type]


def test_a_prompts_extra_is_its_band_fit_less_the_short_bands() -> None:
    prof = WorkerProfile(LatencyPrior(SPEC, PriorConfig()))
    for _ in range(100):
        prof.observe("chat", 100, 0, 1, 0, 0.02, 0.002, step_ratio=1.0)
    assert prof.context_extra_s("chat", 1500, 0) == 0.0  # no long-band sample yet
    for i in range(100):
        prof.observe("chat", 1500, 0, 1, 0, 0.3, 0.006, step_ratio=1.0)
        if i == 6:  # 7 long samples: below the 8 the policy asks for
            assert prof.context_extra_s("chat", 1500, 0, min_samples=8) == 0.0
    # 6 ms against 2 ms at batch 1: 4 ms more for everyone decoding beside it (3.91 ms after
    # 100 samples each: the short band's fit is still coming down from its 22-ms prior)
    assert prof.context_extra_s("chat", 1500, 0, min_samples=8) == pytest.approx(0.004, rel=0.03)
    assert prof.context_extra_s("chat", 100, 0) == 0.0  # a short prompt adds none
    assert prof.context_extra_s("chat", 600, 0) == 0.0  # its band has no sample
    off = WorkerProfile(LatencyPrior(SPEC, PriorConfig()), band_tpot=False)
    off.observe("chat", 100, 0, 1, 0, 0.02, 0.002, step_ratio=1.0)
    off.observe("chat", 1500, 0, 1, 0, 0.3, 0.006, step_ratio=1.0)
    assert off.context_extra_s("chat", 1500, 0) == 0.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run_one(p: AdaptivePolicy, clock: Clock, s: RequestShape, view: WorkerView,
            tpot_s: float, ttft_s: float = 0.02) -> None:
    """Route ``s`` to ``view`` alone, and finish it after its decode (depth 0)."""
    p.choose(s, [view])
    clock.t += ttft_s + (s.predicted_output_tokens - 1) * tpot_s
    p.observe(RequestOutcome(view.name, s, "ok", completion_tokens=s.predicted_output_tokens,
                             ttft_s=ttft_s, tpot_s=tpot_s,
                             e2e_s=ttft_s + (s.predicted_output_tokens - 1) * tpot_s,
                             spec_depth=0))


def taught(on: bool) -> tuple[AdaptivePolicy, Clock, list[WorkerView]]:
    """Round 7's fleet, in small: on spec short prompts decode at 2 ms, 1,500-token ones at
    6.5 ms (4.5 ms of it their context); on batch at 4.5 and 7 ms. Then spec's recent
    traffic is tight short requests at 2 / s, none running."""
    clock = Clock()
    p = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0, price_context=on), clock=clock)
    spec, batch = WorkerView("spec", "u", "engine", SPEC), WorkerView("batch", "u", "engine", BATCH)
    for _ in range(12):
        for view, short_s, long_s in ((spec, 0.002, 0.0065), (batch, 0.0045, 0.007)):
            run_one(p, clock, req("chat", 100, 40),
                    view, short_s)
            run_one(p, clock, req("code", 1500, 40),
                    view, long_s, ttft_s=0.3)
    for _ in range(20):
        run_one(p, clock, req("chat", 100, 55, TIGHT),
                spec, 0.002)
        clock.t += 0.4
    return p, clock, [spec, batch]


def test_a_slack_rich_long_prompt_is_kept_off_the_tight_traffics_worker() -> None:
    picks, charges = {}, {}
    for on in (True, False):
        p, _, ws = taught(on)
        long = req("code", 1500, 40, LOOSE)
        on_spec = p.candidate(long, ws[0])
        charges[on] = (on_spec.context_extra_s, on_spec.context_future_s)
        d = p.choose(long, ws)
        picks[on] = (d.worker, d.reason)
    # spec's extra for it: 4.5 ms (4.2 as learned from 12 samples a band); the tight arrivals
    # to come would miss their SLO beside it: charged over 0.5 s
    assert charges[True][0] == pytest.approx(0.0045, rel=0.1) and charges[True][1] > 0.5
    assert charges[False] == (0.0, 0.0)
    assert picks == {True: ("batch", "context"), False: ("spec", "fit")}


def test_a_short_tight_request_still_goes_to_the_fast_worker() -> None:
    p, _, ws = taught(True)
    short = req("chat", 100, 55, TIGHT)
    c = p.candidate(short, ws[0])
    assert (c.context_extra_s, c.context_future_s) == (0.0, 0.0)
    assert p.choose(short, ws).worker == "spec"


def test_a_running_long_prompt_adds_its_extra_to_the_tpot_predicted_beside_it() -> None:
    p, clock, ws = taught(True)
    short = req("chat", 100, 55, TIGHT)
    alone = p.candidate(short, ws[0]).tpot_s
    long = req("code", 1500, 400, LOOSE)
    p.choose(long, [ws[0]])  # decoding on spec for the next ~2.6 s
    beside = p.candidate(short, ws[0])
    # 4.5 ms (4.2 as learned), over the whole of its decode
    assert beside.context_met_s == pytest.approx(0.0045, rel=0.1)
    assert beside.tpot_s - alone == pytest.approx(beside.context_met_s, rel=1e-9)
    # it reports back: its window ends, and the next short request meets no extra
    clock.t += 0.5
    p.observe(RequestOutcome("spec", long, "error"))
    assert p.candidate(short, ws[0]).context_met_s == 0.0


def test_the_profile_learns_a_short_requests_tpot_without_its_neighbours_context() -> None:
    p, clock, ws = taught(True)
    long = req("code", 1500, 400, LOOSE)
    p.choose(long, [ws[0]])
    short = req("chat", 100, 55, TIGHT)
    p.choose(short, [ws[0]])
    pending = p._inflight.pop(id(short))
    assert pending is not None
    # its first token after the long prompt's prefill; it decoded at 6.5 ms beside it: 2.3 ms
    # without the 4.2 ms learned for the long prompt's context
    clock.t += 0.7
    out = RequestOutcome("spec", short, "ok", completion_tokens=55, ttft_s=0.33,
                         tpot_s=0.0065, e2e_s=0.33 + 54 * 0.0065)
    extra = p.candidate(long, ws[0]).context_extra_s
    assert p._without_context(out, pending, 0.0065, 0.0) == pytest.approx(0.0065 - extra)
    # and no more than 3/4 of a sample comes off
    assert p._without_context(out, pending, 0.003, 0.0) == pytest.approx(0.00075)
