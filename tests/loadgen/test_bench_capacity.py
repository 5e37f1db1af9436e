"""bench/loadgen_capacity.py's GC pause accounting (the send-time lag tail it explains)."""

from __future__ import annotations

import gc
import time

from bench import loadgen_capacity as BENCH


def test_gc_pauses_counts_the_collections_inside_the_window_only() -> None:
    with BENCH.GcPauses() as pauses:
        gc.collect()  # before the window
        time.sleep(0.01)
        start = time.time()
        gc.collect(0)
        gc.collect()
        end = time.time()
        time.sleep(0.01)
        gc.collect(1)  # after it
    gc.collect()  # outside the block: not seen at all
    assert len(pauses.pauses) == 4
    s = pauses.summary(start, end)
    assert s["gc_collections"] == 2 and s["gc_full"] == 1
    assert 0.0 < s["gc_max_ms"] < (end - start) * 1e3 + 1.0
    assert gc.callbacks.count(pauses._callback) == 0
