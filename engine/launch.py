"""How the engine's Triton kernels launch: with programmatic dependent launch (PDL) or not.

In a captured batch-1 decode step a kernel's grid is launched only once the kernel before
it has finished, so each of the ~150 small kernels of a step pays its launch and the
scheduling of its programs after the last one drained. With PDL (Hopper and later) a
kernel launched with ``launch_pdl`` may start while the one before it runs: its programs
are made resident and wait in ``gdc_wait`` until that kernel has completed and its
writes are visible, so the waiting overlaps the previous kernel's tail. Every kernel
here waits before its first load or store, so it reads and writes exactly what it would
without PDL (a kernel after a non-PDL launch, cuBLAS's, is ordered as always).

The forward variant ``engine.forward.pdl`` sets this around each forward pass of the
model (:func:`dependent_launches`), so a CUDA graph captured during it records the
programmatic edges; off a CUDA device (Triton's interpreter) it changes nothing.

    with dependent_launches(True):
        kernel[grid](..., **pdl_args())    # USE_GDC=True, launch_pdl=True on CUDA
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_ON = False


@contextmanager
def dependent_launches(on: bool) -> Iterator[None]:
    """The Triton launches inside the block use PDL when ``on``."""
    global _ON
    before, _ON = _ON, on
    try:
        yield
    finally:
        _ON = before


def pdl_args(device_is_cuda: bool = True) -> dict[str, Any]:
    """The launch keywords of a kernel with a ``USE_GDC`` constexpr parameter."""
    if _ON and device_is_cuda:
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}


def pdl_disabled_reason(device: str) -> str | None:
    """Why ``engine.forward.pdl`` cannot launch dependently on ``device``, or None."""
    import torch

    if not str(device).startswith("cuda"):
        return None  # the interpreter: launches in order, the variant is a no-op
    if torch.cuda.get_device_capability(torch.device(device))[0] < 9:
        return "programmatic dependent launch needs compute capability 9.0 (Hopper) or later"
    return None
