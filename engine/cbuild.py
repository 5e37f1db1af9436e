"""Build a small C library once per source, compiler and CPU, and load it with ``ctypes``.

The engine's CPU kernels (:mod:`engine.cpu_attention`, :mod:`engine.cpu_gemm`) are
plain C: gcc builds each in well under a second, and ``ctypes`` releases the GIL
during a call. A built library is cached under ``$POLYINFER_KERNEL_CACHE`` (else
the user's cache folder, else a per-user temporary one), keyed by a hash of the
source, the compiler, the flags and the CPU's feature flags, so later loads cost
a ``dlopen``. Without a compiler, or when the build fails, :func:`load_library`
returns the reason instead, and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE_ENV = "POLYINFER_KERNEL_CACHE"  # where built libraries live
# NOTE: no -ffast-math: linking a shared library with it sets flush-to-zero for the whole
# process (crtfastmath.o). These flags only let gcc vectorize the float reductions.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros", "-freciprocal-math", "-shared", "-fPIC", "-std=gnu99")
BUILD_TIMEOUT_S = 60.0


def load_library(name: str, source: str,
                 disable_env: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """``(library, "")`` once built (or found in the cache); ``(None, reason)`` if not,
    including when ``disable_env`` is set to "0"."""
    if disable_env is not None and os.environ.get(disable_env, "1") == "0":
        return None, f"disabled by {disable_env}=0"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler found"
    key = hashlib.sha256("\0".join([source, compiler, *CFLAGS, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    error: Exception | None = None
    for folder in _cache_dirs():
        path = folder / f"{name}_{key}.so"
        try:
            if not path.exists():
                _build(compiler, source, path)
            return ctypes.CDLL(str(path)), ""
        except subprocess.CalledProcessError as e:  # the compiler refused: no folder helps
            error = e
            break
        except (OSError, subprocess.SubprocessError) as e:  # e.g. a read-only cache folder
            error = e
    detail = getattr(error, "stderr", "") or error
    return None, str(detail).strip()[:500]


def _cache_dirs() -> list[Path]:
    """The user's cache folder, then a per-user temporary one if that is not writable."""
    base = os.environ.get(CACHE_ENV) or os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    user = os.getuid() if hasattr(os, "getuid") else 0
    return [Path(base).expanduser() / "polyinfer" / "kernels",
            Path(tempfile.gettempdir()) / f"polyinfer-kernels-{user}"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, source: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / out.with_suffix(".c").name
        src.write_text(source)
        lib = Path(tmp) / out.name
        subprocess.run([compiler, *CFLAGS, str(src), "-o", str(lib), "-lm"], check=True,
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(lib, out)  # atomic: concurrent builders never load a partial file
