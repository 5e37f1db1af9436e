"""Weights pulled into the L2 cache ahead of their projection, on a stream of their own.

At batch 1 a decode step reads 2.47 GB of weights in ~1 ms on an H200, yet the memory
is busy for only ~0.6 ms of it: attention, the norms and the small kernels between the
projections read almost nothing, and the short projections (q|k|v, o) are
latency-bound, reaching 1.6-2 TB/s of the 4.2. :class:`L2Prefetcher` fills that idle
time: it forks a side stream off the step's stream at a point the caller names and asks
the L2 for a weight there (Hopper's bulk prefetch, :func:`engine.fused_kernels.
l2_prefetch_kernel`: no data enters an SM, no register holds it), so the projection that
follows reads it from L2. The fork records an event on the step's stream; the side
stream waits for it, so the prefetch starts no earlier than the kernel before the fork
has been launched, and :meth:`join` makes the step's stream wait for every prefetch
before the step ends (a CUDA graph capture must end on its origin stream).

A prefetch changes no value: it is the ``l2_prefetch`` forward variant
(``engine.forward.l2_prefetch``), judged by speed alone; off a CUDA device it does
nothing. The model asks for each layer's o weight once its q|k|v projection is queued,
so the prefetch runs beside decode attention, which reads only the KV cache: ~1% of a
batch-1 step of the 1B Llama on the H200. Asking for the next layer's q|k|v during the
MLP's down projection cost ~5% instead (that projection already streams at the memory's
speed, and the two evict each other): bench/RESULTS.md, GPU decode.

    pf = L2Prefetcher("cuda")
    pf.fetch(layer.o)        # while the attention kernels run
    ...
    pf.join()                # before the step's last kernel is waited on
"""

from __future__ import annotations

import torch

CHUNK = 16 << 10  # bytes per bulk prefetch (one lane)
LANES = 32  # lanes per program: one warp


def prefetch_disabled_reason(device: str) -> str | None:
    """Why ``engine.forward.l2_prefetch`` cannot run on ``device``, or None."""
    if not str(device).startswith("cuda"):
        return None  # the interpreter: nothing to prefetch into, the variant is a no-op
    if torch.cuda.get_device_capability(torch.device(device))[0] < 9:
        return "the bulk L2 prefetch needs compute capability 9.0 (Hopper) or later"
    return None


class L2Prefetcher:
    """Bulk L2 prefetches of tensors on a side stream forked from the current one."""

    def __init__(self, device: str | torch.device) -> None:
        self.on_cuda = str(device).startswith("cuda")
        self._stream = torch.cuda.Stream(torch.device(device)) if self.on_cuda else None
        self._forked = False

    def fetch(self, t: torch.Tensor) -> None:
        """Ask L2 for ``t``'s bytes, after the work queued so far on the current stream."""
        if self._stream is None or not t.is_cuda:
            return
        from engine.fused_kernels import l2_prefetch_kernel

        num_bytes = t.numel() * t.element_size()
        if not t.is_contiguous() or num_bytes % 16 or t.data_ptr() % 16:
            return  # the bulk prefetch takes 16-byte aligned, 16-byte multiple ranges
        self._stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self._stream):
            per_program = CHUNK * LANES
            l2_prefetch_kernel[(-(-num_bytes // per_program),)](
                t, num_bytes, CHUNK=CHUNK, LANES=LANES, num_warps=1)
        self._forked = True

    def join(self) -> None:
        """The current stream waits for every prefetch forked since the last join."""
        if self._stream is not None and self._forked:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._forked = False
