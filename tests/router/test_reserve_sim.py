"""The slot reserve (router.reserve) on the model of the bench's prefix-mix run
(tests/router/prefix_mix_sim.py) with a tight repetitive class that only the fast ``spec``
worker meets and shared-prefix requests labelled ``code`` (spec's domain), as on the
device in session 7: with the reserve, fewer shared-prefix requests take spec's slots and
more repetitive requests meet their SLO, at no loss of goodput. Seeded and time-stepped;
the values measured when this was written are in comments, the held-out seeds in
bench/RESULTS.md ("Routing policies, session 8, round 6")."""

from __future__ import annotations

from tests.router.prefix_mix_sim import by_class, prefix_mix, run_results, variant

SEEDS = (1, 2, 3)
RATE = 16.0


def test_the_reserve_keeps_the_fast_worker_for_the_class_that_needs_it() -> None:
    totals = {True: [0, 0, 0], False: [0, 0, 0]}  # met, repetitive met, prefix on spec
    for seed in SEEDS:
        arrivals = prefix_mix(RATE, int(RATE * 40), seed, tight=True)
        for on in (True, False):
            results = run_results(variant(reserve_slots=on), arrivals)
            classes = by_class(results)
            t = totals[on]
            t[0] += sum(met for met, _, _ in classes.values())
            t[1] += classes["repetitive"][0]
            t[2] += classes["prefix"][2]
    print(totals)
    # measured: met 1,759 vs 1,746 of 1,920 (goodput 0.916 vs 0.909); repetitive met 166 vs
    # 151 of 276; shared-prefix requests on spec 366 vs 433 of 959
    on, off = totals[True], totals[False]
    assert on[0] >= off[0]
    assert on[1] >= 1.05 * off[1]
    assert on[2] <= 0.95 * off[2]
