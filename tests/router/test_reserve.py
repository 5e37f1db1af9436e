"""router.reserve (slot reserves for the requests that meet their SLO on one worker alone)
and its use by the adaptive policy. Answers written out."""

from __future__ import annotations

import math

import pytest

from router.adaptive import AdaptiveConfig, AdaptivePolicy
from router.base import RequestOutcome, WorkerView
from router.reserve import ReserveConfig, SlotReserve, decayed, hold_s, poisson_quantile
from tests.router.test_adaptive import shape, teach, views


def test_poisson_quantile() -> None:
    # P(0) = e^-0.24 = 0.787 < 0.9 <= P(<= 1) = 0.976
    assert poisson_quantile(0.24, 0.9, 4) == 1
    # mean 2: P(<= 3) = 0.857, P(<= 4) = 0.947
    assert poisson_quantile(2.0, 0.9, 8) == 4
    assert poisson_quantile(2.0, 0.9, 3) == 3  # at most the limit
    assert poisson_quantile(0.1, 0.9, 4) == 0  # P(0) = 0.905: nothing reserved
    assert poisson_quantile(0.0, 0.9, 4) == 0
    assert poisson_quantile(5.0, 0.9, 0) == 0


def test_hold() -> None:
    # takes a reserved slot (0 free after it, 1 reserved): held for its 0.5 s in service
    assert hold_s(0, 1, 0.5, 0.1, 0.2) == 0.5
    # leaves the reserved slot free, but its 0.35 s prefill is 0.25 s past a 0.1 s slack
    assert hold_s(2, 1, 0.5, 0.35, 0.1) == pytest.approx(0.25)
    assert hold_s(2, 1, 0.5, 0.05, 0.1) == 0.0
    assert hold_s(0, 0, 0.5, 0.35, 0.1) == 0.0  # nothing reserved


def test_decayed_count() -> None:
    assert decayed(2.0, 10.0, 10.0) == pytest.approx(2.0 / math.e)
    assert decayed(2.0, -1.0, 10.0) == 2.0  # a clock that went back decays nothing


def test_rate_service_reserve_and_charge() -> None:
    r = SlotReserve(ReserveConfig(window_s=10.0))
    for t in range(8):  # arrivals at 0, 1, ..., 7 s, each 0.3 s in service, 0.2 s loss
        r.observe("fast", float(t), 0.3, 0.2, slack_s=0.1)
    # rate at 7 s: sum_i e^(-i / 10) / 10 over i = 0..7 = (1 - e^-0.8) / (1 - e^-0.1) / 10
    rate = (1 - math.exp(-0.8)) / (1 - math.exp(-0.1)) / 10
    assert rate == pytest.approx(0.5787, abs=1e-4)
    assert r.mean_in_service("fast", 7.0) == pytest.approx(0.3 * rate)  # 0.174
    assert r.slots("fast", 7.0, 4) == 1  # P(0) = e^-0.174 = 0.84 < 0.9
    # 3 of 4 slots taken: a request with 0.5 s in service would take the reserved one
    assert r.hold_s("fast", 7.0, 3, 4, 0.5, 0.0) == 0.5
    assert r.hold_s("fast", 7.0, 1, 4, 0.5, 0.0) == 0.0
    assert r.hold_s("fast", 7.0, 1, 4, 0.5, 0.3) == pytest.approx(0.2)  # prefill past slack
    assert r.charge_s("fast", 7.0, 0.5) == pytest.approx(rate * 0.5 * 0.2)
    assert r.hold_s("slow", 7.0, 3, 4, 0.5, 0.3) == 0.0  # no exclusive traffic seen
    assert r.charge_s("slow", 7.0, 0.5) == 0.0
    r.forget_worker("fast")
    assert r.slots("fast", 7.0, 4) == 0


def test_service_and_slack_are_ewmas() -> None:
    r = SlotReserve(ReserveConfig(service_alpha=0.1))
    r.observe("w", 0.0, 0.3, 1.0)  # no TTFT SLO: slack unknown
    r.observe("w", 0.0, 0.5, 1.0, slack_s=0.2)
    r.observe("w", 0.0, 0.5, 2.0, slack_s=0.1)
    snap = r.snapshot(0.0)["w"]
    assert snap["service_s"] == pytest.approx(0.3 + 0.1 * 0.2 + 0.1 * (0.5 - 0.32))
    assert snap["ttft_slack_s"] == pytest.approx(0.2 - 0.1 * 0.1)
    assert snap["loss_s"] == pytest.approx(1.0 + 0.1 * 1.0)


def test_non_finite_samples_are_ignored() -> None:
    r = SlotReserve()
    r.observe("w", 0.0, 0.3, 0.2, slack_s=0.1)
    r.observe("w", 1.0, math.inf, 0.2)
    r.observe("w", 1.0, 0.3, math.nan)
    r.observe("w", 1.0, 0.3, 0.2, slack_s=math.nan)
    snap = r.snapshot(0.0)["w"]
    assert (snap["service_s"], snap["loss_s"], snap["ttft_slack_s"]) == (0.3, 0.2, 0.1)
    assert snap["rate"] == pytest.approx(0.1)  # one arrival counted, a 10-s window


def test_config_validation() -> None:
    for bad in ({"window_s": 0.0}, {"service_alpha": 0.0}, {"quantile": 1.0},
                {"mode": "evict"}):
        with pytest.raises(ValueError):
            ReserveConfig(**bad)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def trained(mode: str | None) -> tuple[AdaptivePolicy, list[WorkerView], Clock]:
    """small: code at 10 ms per token, chat at 8 ms; big: 30 ms and 20 ms. Then 10 code
    requests with a 15-ms TPOT SLO (met on small alone), one a second, none left running."""
    clock = Clock()
    cfg = AdaptiveConfig(explore_prob=0.0, reserve_slots=mode is not None,
                         reserve=ReserveConfig(mode=mode or "charge"))
    p, ws = AdaptivePolicy(cfg, clock=clock), views()
    teach(p, ws, "small", "code", 0.010)
    teach(p, ws, "big", "code", 0.030)
    teach(p, ws, "small", "chat", 0.008)
    teach(p, ws, "big", "chat", 0.020)
    for _ in range(10):
        clock.now += 1.0
        s = shape("code", slo_tpot_s=0.015)
        d = p.choose(s, ws)
        assert d.worker == "small"
        p.observe(RequestOutcome("small", s, "ok", completion_tokens=100, ttft_s=0.05,
                                 tpot_s=0.010, e2e_s=1.04))
    return p, ws, clock


@pytest.mark.parametrize("mode", ["charge", "refuse"])
def test_a_request_with_slack_keeps_off_the_reserved_slot(mode: str) -> None:
    p, ws, _ = trained(mode)
    res = p.stats()["reserve"]["small"]
    # 10 arrivals a second apart: rate (1 - e^-1) / (1 - e^-0.1) / 10 = 0.664 / s; ~1.04 s
    # in service: ~0.69 in service; P(0) = 0.50, P(<= 1) = 0.85 < 0.9 <= P(<= 2): 2 slots
    assert res["rate"] == pytest.approx(0.664, abs=1e-3)
    assert p.reserve.slots("small", p.clock(), 4) == 2
    ws[0].outstanding_requests = 2  # 2 of small's 4 slots taken
    chat = shape("chat", slo_tpot_s=0.05)  # met on both
    d = p.choose(chat, ws)
    assert (d.worker, d.reason) == ("big", "reserve")
    # the exclusive traffic itself still goes there
    assert p.choose(shape("code", slo_tpot_s=0.015), ws).worker == "small"


def test_without_the_reserve_the_request_with_slack_takes_the_fast_slot() -> None:
    p, ws, _ = trained(None)
    ws[0].outstanding_requests = 2
    assert p.choose(shape("chat", slo_tpot_s=0.05), ws).worker == "small"
    assert p.stats()["reserve"] == {}


def test_no_reserve_when_every_worker_meets_the_slo() -> None:
    p, ws = AdaptivePolicy(AdaptiveConfig(explore_prob=0.0)), views()
    teach(p, ws, "small", "code", 0.010)
    teach(p, ws, "big", "code", 0.030)
    for _ in range(10):
        p.choose(shape("code", slo_tpot_s=0.05), ws)
    assert p.stats()["reserve"] == {}
    assert "reserve" not in p.stats()["reasons"]
