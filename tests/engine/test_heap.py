"""polyinfer.heap: start-up objects frozen out of full collections, in the processes that serve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.engine.conftest import EngineProcess

CHECK = """
import gc
from polyinfer.heap import OLDER_THRESHOLD, YOUNG_THRESHOLD, settle_heap
kept = [[i] for i in range(5000)]  # long-lived: built at start-up
gc.collect()
assert len(gc.get_objects(generation=2)) > 5000
frozen = settle_heap()
assert frozen >= 5000, frozen
# a full collection no longer scans them, and the thresholds are raised
assert len(gc.get_objects(generation=2)) < 100, len(gc.get_objects(generation=2))
assert gc.get_threshold() == (YOUNG_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD)
assert all(x == [i] for i, x in enumerate(kept))  # frozen objects are untouched
print("ok", frozen)
"""


def test_settle_heap_freezes_the_survivors_and_raises_the_thresholds() -> None:
    # NOTE: a fresh interpreter: freezing the test process's heap would outlive this test
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok ")


SCOPED = """
import gc
from polyinfer.heap import OLDER_THRESHOLD, YOUNG_THRESHOLD, settle_heap, settled_heap
kept = [[i] for i in range(5000)]
before = gc.get_threshold()
with settled_heap():
    assert gc.get_freeze_count() >= 5000
    assert gc.get_threshold() == (YOUNG_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD)
assert gc.get_freeze_count() == 0 and gc.get_threshold() == before  # put back as found
# overlapping scopes, closed in the order they opened (concurrent replays): the collector
# stays settled until the last one closes, then is put back as the first one found it
a, b = settled_heap(), settled_heap()
a.__enter__()
frozen_a = gc.get_freeze_count()
b.__enter__()
assert gc.get_freeze_count() == frozen_a  # the second scope found it settled
a.__exit__(None, None, None)
assert gc.get_freeze_count() == frozen_a
assert gc.get_threshold() == (YOUNG_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD)
b.__exit__(None, None, None)
assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
frozen = settle_heap()
gc.set_threshold(700, 10, 10)
with settled_heap(100):
    assert gc.get_threshold() == (100, OLDER_THRESHOLD, OLDER_THRESHOLD)
assert gc.get_freeze_count() == frozen  # a server's own freeze is kept
assert gc.get_threshold() == (700, 10, 10)
print("ok")
"""


def test_settled_heap_is_scoped_and_keeps_a_servers_own_freeze() -> None:
    done = subprocess.run([sys.executable, "-c", SCOPED], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_engine_server_settles_its_heap_once_the_engine_is_built(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = {"backend": "engine", "model": str(tiny_model_dir),
              "engine": {"max_num_seqs": 4, "kv_cache_tokens": 2048, "max_model_len": 512}}
    proc = EngineProcess(config, tmp_path, log_level="INFO")
    try:
        proc.wait_ready()
    finally:
        proc.stop()
    log = (tmp_path / "engine.log").read_text()
    found = re.search(r"froze (\d+) start-up objects", log)
    assert found is not None, log[-2000:]
    # the model, tokenizer and imported modules: far more than a bare interpreter's ~1e4
    assert int(found.group(1)) > 50_000
    assert log.index("engine built") < found.start()  # after the engine, not before
