"""Import a script under bench/ (not a package) as a module, for tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_bench(filename: str, module_name: str) -> ModuleType:
    """``bench/<filename>`` as ``module_name``, registered in ``sys.modules`` (dataclasses
    look their module up while it loads); the caller pops it when done, if it must."""
    spec = importlib.util.spec_from_file_location(module_name, BENCH_DIR / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
