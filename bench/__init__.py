"""Benchmarks that print ratios measured side by side (run each as ``python bench/NAME.py``),
and, under ``bench.sim``, the simulators and bounds they and the tests use."""
