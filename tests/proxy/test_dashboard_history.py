"""The dashboard's data: proxy.history's rings and proxy.timeline's board reads, on tiny
inputs with the answers written out."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from optimizer.board import Board
from polyinfer.trace import STATUS_ERROR
from proxy.history import COARSE_SLOTS, FINE_SLOTS, History, Sample
from proxy.history_slot import BUCKET_RATIO, bucket_of, bucket_value
from proxy.history_window import percentiles
from proxy.record import RequestRecord
from proxy.timeline import OptimizerTimeline, read_board
from router.base import RequestShape


class Clock:
    """Unix seconds that the test moves."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def rec(worker: str = "w1", domain: str = "code", ttft_s: float | None = 0.1,
        e2e_s: float | None = 0.5, tokens: int = 5, depth: int | None = 3,
        reason: str = "fit", status: str = "ok", http_status: int = 200) -> RequestRecord:
    shape = RequestShape(domain=domain, prompt_tokens=10, max_tokens=8,
                         predicted_output_tokens=8)
    return RequestRecord(request_id="r", ts=0.0, t0=0.0, endpoint="completions", shape=shape,
                         worker=worker, reason=reason, spec_depth=depth, status=status,
                         http_status=http_status, completion_tokens=tokens, ttft_s=ttft_s,
                         e2e_s=e2e_s)


def no_sample() -> Sample:
    return Sample(gauges={}, spec_tokens={})


def test_buckets_stand_for_their_members_within_ten_percent():
    for value in (2e-4, 0.00123, 0.0375, 0.1, 0.25, 1.0, 7.5, 60.0):
        assert abs(bucket_value(bucket_of(value)) / value - 1) <= BUCKET_RATIO ** 0.5 - 1
    assert bucket_of(0.0) == bucket_of(-1.0) == bucket_of(float("nan")) == 0
    assert bucket_of(1e9) == bucket_of(1e12)  # the last bucket holds the rest


def test_percentiles_are_the_nearest_rank_buckets():
    values = [0.010] * 50 + [0.100] * 40 + [1.0] * 10  # p50 0.010, p90 0.100, p99 1.0
    hist: dict[int, int] = {}
    for v in values:
        hist[bucket_of(v)] = hist.get(bucket_of(v), 0) + 1
    p50, p90, p99 = percentiles(hist)
    assert p50 == pytest.approx(0.010, rel=0.1)
    assert p90 == pytest.approx(0.100, rel=0.1)
    assert p99 == pytest.approx(1.0, rel=0.1)
    assert percentiles({bucket_of(0.5): 1}) == (0.4808,) * 3  # one sample: its bucket, 4 digits


def test_a_second_of_requests_becomes_one_point_of_every_series():
    clock = Clock(1000.0)
    h = History(clock)
    h.record(rec("w1", "code", ttft_s=0.1, e2e_s=0.5, tokens=5, depth=3))  # tpot 0.1
    h.record(rec("w1", "code", ttft_s=0.2, e2e_s=1.0, tokens=9, depth=1, reason="balance"))
    h.record(rec("w2", "chat", status=STATUS_ERROR, ttft_s=None, e2e_s=None, http_status=502))
    h.record(rec(worker="", http_status=429))  # shed before any worker
    h.record(rec(worker="", http_status=429))
    clock.now = 1001.0
    h.tick(Sample(gauges={("outstanding", "w1"): 2, ("running", "w1"): 1, ("waiting", "w1"): 0},
                  spec_tokens={("w1", "code"): [10, 7]}, prediction_error={"tpot": 0.25}))
    doc = h.window(300, step_s=1)
    i = doc["t"].index(1000.0)
    s = doc["series"]
    assert doc["step_s"] == 1 and doc["end_s"] == 1001.0
    assert s["requests_per_s"]["w1"][i] == 2 and s["requests_per_s"]["w2"][i] == 1
    assert s["errors_per_s"]["w1"][i] == 0 and s["errors_per_s"]["w2"][i] == 1
    assert s["refused_per_s"] == {"429": [None] * i + [2.0]}
    assert s["ttft_s"]["worker"]["w1"]["p50"][i] == pytest.approx(0.1, rel=0.1)
    assert s["ttft_s"]["worker"]["w1"]["p99"][i] == pytest.approx(0.2, rel=0.1)
    assert s["tpot_s"]["domain"]["code"]["p90"][i] == pytest.approx(0.1, rel=0.1)
    assert "w2" not in s["ttft_s"]["worker"]  # its request failed: no latency
    assert s["outstanding"]["w1"][i] == 2 and s["running"]["w1"][i] == 1
    assert s["spec_depth"]["code"][i] == 2.0  # (3 + 1) / 2
    assert s["acceptance"]["code"][i] == 0.7
    assert s["prediction_error"]["tpot"][i] == 0.25
    assert doc["routing"] == {"matrix": {"code": {"w1": 2}, "chat": {"w2": 1}},
                              "reasons": {"code": {"w1": {"fit": 1, "balance": 1}},
                                          "chat": {"w2": {"fit": 1}}}}


def test_points_merge_their_slots_and_divide_by_the_seconds_covered():
    clock = Clock(1000.0)
    h = History(clock)
    for second in range(4):  # one request per second, 1000..1003
        h.record(rec(ttft_s=0.1 * (second + 1)))
        clock.now += 1
        h.tick(Sample(gauges={("outstanding", "w1"): second}, spec_tokens={}))
    doc = h.window(300, step_s=2)
    t, s = doc["t"], doc["series"]
    assert t[-2:] == [1000.0, 1002.0]  # aligned to multiples of the step
    assert s["requests_per_s"]["w1"][-2:] == [1.0, 1.0]
    assert s["outstanding"]["w1"][-2:] == [0.5, 2.5]  # means of (0, 1) and (2, 3)
    assert s["ttft_s"]["worker"]["w1"]["p99"][-1] == pytest.approx(0.4, rel=0.1)
    assert all(v is None for v in s["requests_per_s"]["w1"][:-2])  # before the proxy ran


def test_acceptance_counts_only_what_was_drafted_since_the_last_tick():
    clock = Clock(1000.0)
    h = History(clock)
    for drafted, accepted in ((10, 5), (10, 5), (30, 20)):
        clock.now += 1
        h.tick(Sample(gauges={}, spec_tokens={("w1", "code"): [drafted, accepted],
                                              ("w2", "code"): [4, 4]}))
    doc = h.window(300, step_s=1)
    # first tick: (10 + 4 drafted, 5 + 4 accepted); second: nothing new; third: (20, 15)
    assert doc["series"]["acceptance"]["code"][-3:] == [round(9 / 14, 4), None, 0.75]


def test_rings_are_bounded_and_the_hour_folds_ten_seconds_a_slot():
    clock = Clock(10_000.0)
    h = History(clock)
    for _ in range(COARSE_SLOTS * 10 + 500):
        h.record(rec())
        clock.now += 1
        h.tick(no_sample())
    assert len(h.fine) == FINE_SLOTS and len(h.coarse) == COARSE_SLOTS
    doc = h.window(3600)
    assert doc["step_s"] == 20  # 3600 / 150 points, rounded to the 10 s slots
    rates = [v for v in doc["series"]["requests_per_s"]["w1"] if v is not None]
    assert len(rates) == 180 and set(rates) == {1.0}
    with_step = h.window(3600, step_s=60)
    assert len(with_step["t"]) == 60 and with_step["step_s"] == 60  # the end is on a minute


def test_board_read_gives_events_experiments_and_candidates(tmp_path: Path):
    board = Board(tmp_path / "b.sqlite")
    board.note("c1", "service", "incumbent", {"key": "{}"})
    good = board.post("c1", json.dumps({"max_num_seqs": 16}), {}, "bayes", predicted=50.0)
    guess = board.post("c1", json.dumps({"max_num_seqs": 4}), {}, "evolution", predicted=60.0)
    bad = board.post("c1", json.dumps({"max_num_seqs": 64}), {}, "costmodel", predicted=40.0)
    assert good and guess and bad
    board.add_result(good, "fast", 52.0, 1.0)
    board.add_result(bad, "fast", 20.0, 1.0)
    board.add_result(good, "slow", 51.0, 3.0)
    board.set_status(good, "measured")
    board.add_promotion("c1", "http://w", json.dumps({"max_num_seqs": 16}), "promoted", 0.3)
    board.note("c1", "service", "campaign_done", {"status": "promoted", "gain": 0.3})
    doc = read_board(board, since_s=0.0, campaign=None)
    assert [e["kind"] for e in doc["events"]] == ["campaign", "promoted", "campaign_done"]
    assert [tier for _, tier in doc["experiments"]] == ["fast", "fast", "slow"]
    cands = doc["candidates"]
    assert cands["campaign"] == "c1" and cands["tiers"] == ["fast", "slow"]
    assert cands["counts"] == {"measured": 1, "proposed": 2}
    # measured ones by their fast value, then the rest by prediction
    assert [r["key"] for r in cands["top"]] == [{"max_num_seqs": 16}, {"max_num_seqs": 64},
                                                {"max_num_seqs": 4}]
    assert cands["top"][0]["values"] == {"fast": 52.0, "slow": 51.0}


async def test_timeline_counts_experiments_on_the_history_points(tmp_path: Path):
    path = tmp_path / "b.sqlite"
    timeline = OptimizerTimeline(path)
    assert (await timeline.doc([0.0], 1.0, 1.0))["candidates"] is None  # no board file yet
    assert not path.exists()  # and the dashboard did not create it
    off = OptimizerTimeline(None)
    assert await off.doc([0.0], 1.0, 1.0) == {"enabled": False}
    board = Board(path)
    pid = board.post("c1", "{}", {}, "bayes")
    assert pid is not None
    board.add_result(pid, "fast", 1.0, 1.0)
    board.add_result(pid, "fast", 1.0, 1.0)
    timeline = OptimizerTimeline(path)
    timeline.observe(100.0, {"state": "screening", "campaign": {"id": "c1"}})
    timeline.observe(101.0, {"state": "screening", "campaign": {"id": "c1"}})
    timeline.observe(105.0, {"state": "confirming", "campaign": {"id": "c1"}})
    now = time.time()
    t = [now - 30.0, now - 20.0, now - 10.0]  # the results were written just now
    doc = await timeline.doc(t, 10.0, now)
    assert doc["experiments"] == {"fast": [0, 0, 2]}
    assert doc["states"] == [[now - 30.0, "confirming"]]  # the state in force all along
    assert doc["candidates"]["campaign"] == "c1"  # the live campaign's
    assert timeline.states_since(50.0) == [[100.0, "screening"], [105.0, "confirming"]]
    assert timeline.states_since(103.0) == [[103.0, "screening"], [105.0, "confirming"]]


def test_a_refreshed_window_equals_one_built_from_scratch():
    """The finished points a view keeps between calls (proxy.history_window.Frame) give the
    same answer as a history asked once, as the window slides past them."""
    import random
    rng = random.Random(7)
    asked, fresh = History(Clock(5000.0)), History(Clock(5000.0))
    for second in range(700):
        for _ in range(rng.randint(0, 3)):
            r = rec(rng.choice(["w1", "w2"]), rng.choice(["code", "chat", "math"]),
                    ttft_s=rng.uniform(0.01, 0.5), depth=rng.choice([None, 2, 4]),
                    reason=rng.choice(["fit", "balance"]))
            asked.record(r)
            fresh.record(r)
        sample = Sample(gauges={("outstanding", "w1"): second % 5},
                        spec_tokens={("w1", "code"): [second * 3, second * 2]})
        for h in (asked, fresh):
            h.clock.now += 1  # type: ignore[attr-defined]
            h.tick(sample)
        if second % 7 == 0:
            asked.window(300, step_s=2)
            asked.window(3600)
    assert asked.window(300, step_s=2) == fresh.window(300, step_s=2)
    slices = 0
    while not fresh.prepare(3600, max_points=10):  # a first build in slices
        slices += 1
    assert slices >= 17  # the hour's 180 points of 20 s (most of them empty), 10 a slice
    assert asked.window(3600) == fresh.window(3600)
