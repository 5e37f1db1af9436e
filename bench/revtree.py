"""Another git revision's tree, for the benchmarks that run two commits side by side
(``--new REV`` / ``--baseline REV`` in bench/router_cost.py and bench/engine_host.py).

The tree is ``git archive REV`` unpacked into a temporary folder, removed when the
caller's ExitStack closes."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def export(rev: str, stack: contextlib.ExitStack, prefix: str = "polyinfer-rev-") -> Path:
    """A temporary copy of revision ``rev``'s tree, deleted when ``stack`` closes."""
    out = Path(tempfile.mkdtemp(prefix=prefix))
    stack.callback(shutil.rmtree, out, ignore_errors=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out
