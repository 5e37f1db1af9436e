"""Simulators and bounds for the routing policies, importable by benchmarks and tests.

- ``fleet_sim``: a time-stepped model of continuous-batching workers (closed loop).
- ``prefix_mix_sim``: bench/routing.py's prefix-mix run on that model
  (``python -m bench.sim.prefix_mix_sim``).
- ``placement_bound``: a hindsight search over placements, a bound for any policy
  (``python -m bench.sim.placement_bound``).
- ``lookahead_bound``: planning ahead with an exact model but no future arrivals
  (``python -m bench.sim.lookahead_bound``).
"""
