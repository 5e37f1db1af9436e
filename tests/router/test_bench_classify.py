"""bench/classify.py's pure parts: the engine-side prefix reuse and a baseline tree loaded
beside this one; bench/proxy_overhead.py's target names for several source trees."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench import classify
from bench import proxy_overhead as overhead

REPO = Path(__file__).resolve().parents[2]


def test_token_blocks_chain_and_reuse_counts_leading_blocks_only() -> None:
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    ha, hb = classify.token_block_hashes(a, 16), classify.token_block_hashes(b, 16)
    assert len(ha) == 2 and ha[0] == hb[0] and ha[1] == hb[1]  # 8 tail tokens: no block
    c = [7] * 16 + list(range(16, 32))
    hc = classify.token_block_hashes(c, 16)
    assert hc[1] != ha[1]  # same second block, other first: another prefix
    seen: set[int] = set()
    assert classify.leading_in(ha, seen) == 0
    assert classify.leading_in(hb, seen) == 2
    assert classify.leading_in(hc, seen) == 0  # its second block alone does not count


def test_a_baseline_tree_loads_beside_this_one(tmp_path: Path) -> None:
    for package in ("router", "polyinfer"):  # a second tree, as `git archive` would give
        shutil.copytree(REPO / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "models"))
    import sys

    import router.shape

    base = classify.load_baseline(tmp_path)
    assert base is not router.shape.ShapeEstimator
    assert Path(base.__init__.__code__.co_filename).is_relative_to(tmp_path)
    assert sys.modules["router.shape"] is router.shape  # this tree's modules are back


def test_source_labels_name_trees_and_number_repeats() -> None:
    labels = overhead.source_labels([Path("/tmp/new"), Path("/x/new"), Path("/tmp/base")])
    assert labels == ["@new", "@new#2", "@base"]
