"""The accept scan of rejection sampling as one Triton kernel (CUDA); torch elsewhere.

For each sequence b with ``k_b`` draft positions starting at flat row ``s_b``,
the kernel computes ``num_accepted[b]``: the length of the leading run of
positions with ``u * q(x) < p(x)`` (greedy callers pass ``p = [draft ==
argmax]``, ``q = 1``, ``u = 0``). One program per sequence loads its k values
as one vector, so the scan is a single launch with no host round-trip; the
torch path in :func:`specdec.verify._leading_true` is the reference the GPU
test compares against.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

try:  # NOTE: optional: CPU-only installs may lack triton, and it only runs on CUDA here.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:

    @triton.jit
    def _accept_kernel(p_ptr, q_ptr, u_ptr, starts_ptr, ks_ptr, out_ptr,  # type: ignore[no-untyped-def]
                       BLOCK_K: tl.constexpr):
        b = tl.program_id(0)
        start = tl.load(starts_ptr + b)
        k = tl.load(ks_ptr + b)
        offs = tl.arange(0, BLOCK_K)
        mask = offs < k
        p = tl.load(p_ptr + start + offs, mask=mask, other=0.0)
        q = tl.load(q_ptr + start + offs, mask=mask, other=1.0)
        u = tl.load(u_ptr + start + offs, mask=mask, other=1.0)
        ok = (u * q < p) & mask
        first_rejected = tl.min(tl.where(ok, BLOCK_K, offs), axis=0)
        tl.store(out_ptr + b, tl.minimum(first_rejected, k).to(tl.int64))


def accept_counts(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor,
                  starts: torch.Tensor, num_draft: torch.Tensor, max_k: int) -> torch.Tensor:
    """[B] int64 accepted counts; inputs ``[T]`` float32 (flat rows) and ``[B]`` int64, on CUDA."""
    assert triton is not None and p_draft.is_cuda
    out = torch.empty_like(num_draft)
    if num_draft.numel() == 0:
        return out
    block = max(2, triton.next_power_of_2(max(max_k, 1)))
    _accept_kernel[(num_draft.numel(),)](p_draft.float().contiguous(), q_draft.float().contiguous(),
                                         u.float().contiguous(), starts.contiguous(),
                                         num_draft.contiguous(), out, BLOCK_K=block)
    return out
