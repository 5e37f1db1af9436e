"""A second process joins a campaign through the board file only."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optimizer.board import Board
from optimizer.join import open_campaign

pytestmark = pytest.mark.timeout(180)


def test_another_process_joins_the_open_campaign(tmp_path: Path, model_dir: Path) -> None:
    path = str(tmp_path / "board.sqlite")
    board = Board(path)
    assert open_campaign(board) is None
    board.note("old", "service", "incumbent", {"key": "k0"})
    board.note("old", "service", "campaign_done", {"status": "no_candidate"})
    # an incumbent key from some other space must not stop the evolution agent
    board.note("c2", "service", "incumbent", {"key": "{\"max_num_seqs\": 3}"})
    assert open_campaign(board) == "c2"
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "--log-level", "WARNING", "optimize", "--join",
         "--board", path, "--model", str(model_dir), "--memory-gb", "0.25"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(board.proposals("c2")) < 4:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            time.sleep(0.5)
        agents = {p.agent for p in board.proposals("c2")}
        assert agents == {"bayes", "evolution"}
        assert board.proposals("old") == []
        board.note("c2", "service", "campaign_done", {"status": "within_noise"})
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert json.loads(out.decode().strip().splitlines()[-1]) == {"joined": "c2"}
