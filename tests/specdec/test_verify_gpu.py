"""verify() and the shared sampler on CUDA tensors: same answers as on the CPU, still lossless."""

from __future__ import annotations

import pytest
import torch

from polyinfer.sampling import SamplingParams, process_logits, sample
from specdec.base import Proposal
from specdec.verify import verify
from tests.specdec.test_verify import (
    ALPHA,
    SAMPLED,
    chi_square_p_value,
    emitted_counts,
    target_probs,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_greedy_verify_on_cuda_equals_cpu() -> None:
    torch.manual_seed(0)
    depths = [0, 1, 3, 6, 2, 4, 0, 5]
    logits = torch.randn(sum(k + 1 for k in depths), 512)
    argmax = logits.argmax(dim=1).tolist()
    proposals, row = [], 0
    for i, k in enumerate(depths):
        # half of each proposal matches the argmax, then it diverges
        tokens = [argmax[row + j] if j < k // 2 else (argmax[row + j] + 1) % 512
                  for j in range(k)]
        proposals.append(Proposal(i, tokens))
        row += k + 1
    params = [SamplingParams(0.0)] * len(depths)
    assert verify(logits.cuda(), proposals, params) == verify(logits, proposals, params)


def test_process_logits_on_cuda_matches_cpu() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 300)
    params = [SamplingParams(1.0), SamplingParams(0.0), SamplingParams(0.7, top_p=0.8),
              SamplingParams(1.3, top_k=20), SamplingParams(0.9, top_p=0.5, top_k=50),
              SamplingParams(2.0)]
    torch.testing.assert_close(process_logits(logits.cuda(), params).cpu(),
                               process_logits(logits, params), rtol=1e-5, atol=1e-6)
    seeded = [SamplingParams.seeded(i, 1.0) for i in range(6)]
    again = [SamplingParams.seeded(i, 1.0) for i in range(6)]
    assert sample(logits.cuda(), seeded).tolist() == sample(logits, again).tolist()


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft-probs", "point-mass"])
@pytest.mark.parametrize("params", SAMPLED, ids=["t1", "t0.8-p0.9", "t1.2-k4"])
def test_speculative_sampling_on_cuda_matches_target(params: SamplingParams,
                                                     with_probs: bool) -> None:
    torch.manual_seed(11)
    first, second = emitted_counts(verify, params, with_probs, device="cuda")
    p = target_probs(params)
    assert chi_square_p_value(first, p[0]) > ALPHA
    assert chi_square_p_value(second, p[1]) > ALPHA


@pytest.mark.parametrize("max_k", [1, 3, 6, 16])
def test_triton_accept_kernel_matches_torch(max_k: int) -> None:
    from specdec import triton_accept
    from specdec.verify import _Layout, _leading_true

    if triton_accept.triton is None:
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(max_k)
    ks = torch.randint(0, max_k + 1, (64,), generator=gen)
    counts = ks + 1
    starts = torch.cumsum(counts, 0) - counts
    total = int(counts.sum())
    is_draft = torch.ones(total, dtype=torch.bool)
    is_draft[starts + ks] = False
    p = torch.rand(total, generator=gen)
    q = torch.rand(total, generator=gen) * 0.5 + 0.5
    u = torch.rand(total, generator=gen) * 0.8
    layout = _Layout(ks, starts, torch.zeros(total, dtype=torch.int64), is_draft, max_k)
    expected = _leading_true(is_draft & (u * q < p), layout)
    got = triton_accept.accept_counts(p.cuda(), q.cuda(), u.cuda(), starts.cuda(), ks.cuda(), max_k)
    assert got.cpu().tolist() == expected.tolist()
    assert 0 < int(expected.sum()) < int(ks.sum())  # both accepts and rejections happened
