"""Short garbage-collector pauses for a long-running server process.

Everything built at start-up (imported modules, the model's Python objects, CUDA
graphs, the tokenizer, the config) lives as long as the process, yet a full
collection re-scans all of it: ~2e5 objects in an engine process took ~200 ms per
full collection on the 2-core dev box. Under load a full collection comes every few
hundred steps and stalls the step thread and the event loop together (the GIL): on
the H200 at concurrency 16 it showed as a block of 16 requests whose first token came
240-350 ms late. :func:`settle_heap` collects once, freezes what survived (the
collector never scans it again) and raises the young-generation threshold.

:func:`settled_heap` does the same for one bounded run inside a process that may be
someone else's (loadgen's send loop, as a library call), and puts the collector back
as it found it afterwards. Nothing here imports more than the standard library, so
any package may use it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

# allocations between young-generation collections (CPython's default is 700). NOTE: a
# request allocates a few hundred container objects, nearly all freed by reference counting
# when it ends; at 700 the proxy's young generation was collected every ~2 requests and the
# collector took ~7% of its CPU (py-spy). A larger young generation mostly holds garbage
# already freed, so each collection costs about the same and runs ~30x less often.
YOUNG_THRESHOLD = 20_000
OLDER_THRESHOLD = 20  # collections of the younger generation before an older one is collected


def settle_heap(young_threshold: int = YOUNG_THRESHOLD) -> int:
    """Collect, freeze the survivors, raise the collection thresholds; returns the number of
    frozen objects. Call once, after start-up built everything that lives for good."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, OLDER_THRESHOLD, OLDER_THRESHOLD)
    frozen = gc.get_freeze_count()
    logger.info("froze %d start-up objects (%.0f ms); gc thresholds %s", frozen,
                (time.perf_counter() - t0) * 1e3, gc.get_threshold())
    return frozen


class _Scopes:
    """The open :func:`settled_heap` scopes of this process: the first one in settles the
    heap, the last one out puts the collector back (scopes may overlap in any order, as
    concurrent replays on one event loop do)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = 0
        self.thresholds: tuple[int, int, int] = gc.get_threshold()
        self.froze = False


_SCOPES = _Scopes()


@contextmanager
def settled_heap(young_threshold: int = YOUNG_THRESHOLD) -> Iterator[None]:
    """:func:`settle_heap` for the duration of a ``with`` block: collect, freeze what is
    alive, raise the thresholds; once the last open scope exits, restore the thresholds and
    unfreeze. A process that froze its heap already (:func:`settle_heap`) keeps its own
    freeze: only the thresholds change then. While scopes overlap, the first one's
    ``young_threshold`` holds."""
    with _SCOPES.lock:
        if _SCOPES.open == 0:
            _SCOPES.thresholds = gc.get_threshold()
            _SCOPES.froze = gc.get_freeze_count() == 0 and gc.isenabled()
            if _SCOPES.froze:
                gc.collect()
                gc.freeze()
            gc.set_threshold(young_threshold, OLDER_THRESHOLD, OLDER_THRESHOLD)
        _SCOPES.open += 1
    try:
        yield
    finally:
        with _SCOPES.lock:
            _SCOPES.open -= 1
            if _SCOPES.open == 0:
                gc.set_threshold(*_SCOPES.thresholds)
                if _SCOPES.froze:
                    gc.unfreeze()
