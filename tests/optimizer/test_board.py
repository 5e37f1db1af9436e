from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from optimizer.board import Board, best_by_key
from optimizer.errors import BoardError


def claim_until_empty(path: str, campaign: str, claimer: str, out_path: str) -> None:
    """Child process: claim proposals until none are left, write the ids claimed."""
    board = Board(path)
    ids = []
    while (p := board.claim(campaign, claimer)) is not None:
        ids.append(p.id)
    Path(out_path).write_text("".join(f"{i}\n" for i in ids))


def test_two_processes_never_claim_the_same_proposal(tmp_path: Path) -> None:
    path = str(tmp_path / "board.sqlite")
    board = Board(path)
    posted = {board.post("c", f"k{i}", {"i": i}, agent="a") for i in range(300)}
    assert None not in posted and len(posted) == 300
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"claims{i}.txt" for i in range(2)]
    procs = [ctx.Process(target=claim_until_empty, args=(path, "c", f"m{i}", str(outs[i])))
             for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    claimed = [[int(x) for x in o.read_text().split()] for o in outs]
    assert not set(claimed[0]) & set(claimed[1])
    assert set(claimed[0]) | set(claimed[1]) == posted
    assert board.status_counts("c") == {"claimed": 300}
    by = {p.id: p.claimed_by for p in board.proposals("c")}
    assert all(by[i] == "m0" for i in claimed[0]) and all(by[i] == "m1" for i in claimed[1])


def test_duplicate_keys_are_refused_per_campaign(tmp_path: Path) -> None:
    board = Board(tmp_path / "b.sqlite")
    assert board.post("c1", "k", {}, agent="bayes") is not None
    assert board.post("c1", "k", {}, agent="evolution") is None
    assert board.post("c2", "k", {}, agent="evolution") is not None
    assert board.keys("c1") == {"k"}


def test_results_notes_promotions_roundtrip(tmp_path: Path) -> None:
    board = Board(tmp_path / "b.sqlite")
    a = board.post("c", "ka", {"x": 1}, agent="bayes", predicted=10.0, reason="EI")
    b = board.post("c", "kb", {"x": 2}, agent="costmodel")
    assert a is not None and b is not None
    p = board.claim("c", "m")
    assert p is not None and p.id == a and p.config == {"x": 1} and p.predicted == 10.0
    board.add_result(a, "fast", 10.0, 1.5, {"errors": 0})
    board.add_result(a, "fast", 12.0, 1.4)
    board.add_result(a, "slow", 9.0, 5.0)
    board.set_status(a, "measured")
    board.set_status(b, "pruned")
    fast = board.results("c", "fast")
    assert [r.value for r in fast] == [10.0, 12.0] and fast[0].details == {"errors": 0}
    assert best_by_key(fast) == {"ka": 11.0}
    assert board.status_counts("c") == {"measured": 1, "pruned": 1}
    board.note("c", "pruner", "prune_audit", {"wrong": False})
    board.note("c", "service", "incumbent", {"key": "ka"})
    assert [n.kind for n in board.notes("c")] == ["prune_audit", "incumbent"]
    assert board.notes("c", kind="incumbent")[0].body == {"key": "ka"}
    board.add_promotion("c", "w1", '{"max_num_seqs": 8}', "promoted", 1.3, {"reload_s": 0.1})
    assert board.promotions()[0]["key"] == {"max_num_seqs": 8}
    with pytest.raises(BoardError):
        board.set_status(a, "bogus")


def test_stale_claims_are_requeued(tmp_path: Path) -> None:
    board = Board(tmp_path / "b.sqlite")
    board.post("c", "k", {}, agent="a")
    assert board.claim("c", "dead") is not None
    assert board.claim("c", "alive") is None
    assert board.requeue_stale("c", older_than_s=-1.0) == 1
    p = board.claim("c", "alive")
    assert p is not None and p.claimed_by == "alive"


def test_unusable_path_is_a_board_error(tmp_path: Path) -> None:
    with pytest.raises(BoardError, match="cannot open"):
        Board(tmp_path / "no" / "such" / "dir" / "b.sqlite")
