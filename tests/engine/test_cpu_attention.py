"""The fused CPU paged-attention kernel against the torch paths (SDPA and naive)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest
import torch

from engine.attention import SeqSlice, build_metadata, order_short_first, paged_attention
from engine.cpu_attention import (
    DISABLE_ENV,
    CpuPagedAttention,
    cpu_attention_for,
    load_cpu_attention,
)


@pytest.fixture(scope="module")
def kernel() -> CpuPagedAttention:
    k = load_cpu_attention()
    if k is None:
        pytest.fail("the CPU attention kernel did not build here (see the logged reason)")
    return k


def random_case(seed: int, num_heads: int, num_kv: int, head_dim: int, block_size: int,
                q_lens: list[int], starts: list[int]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(s + q) // block_size) for s, q in zip(starts, q_lens, strict=True)) + 3
    k = torch.randn(num_kv, num_blocks, block_size, head_dim, generator=gen)
    v = torch.randn(num_kv, num_blocks, block_size, head_dim, generator=gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    return q, k, v, torch.randperm(num_blocks, generator=gen)


def slices_for(q_lens: list[int], starts: list[int], perm: torch.Tensor,
               block_size: int) -> list[SeqSlice]:
    out, used = [], 0
    for q, s in zip(q_lens, starts, strict=True):
        n = -(-(s + q) // block_size)
        out.append(SeqSlice(q, s, perm[used:used + n].tolist()))  # scattered, unordered blocks
        used += n
    return out


CASES = [  # heads, kv heads, head_dim, block_size, q_lens, starts
    (4, 2, 64, 16, [1] * 9, [0, 1, 15, 16, 17, 40, 100, 255, 3]),  # decode, block edges
    (4, 2, 64, 16, [1, 4, 2, 5, 1], [30, 12, 0, 77, 200]),  # verification rows (k + 1)
    (8, 2, 32, 5, [3, 1, 1, 2], [11, 4, 0, 9]),  # 4 heads per KV head, odd block size
    (4, 4, 16, 8, [1, 3, 1], [20, 5, 63]),  # no GQA
    (6, 3, 64, 16, [1, 2, 40, 1], [10, 3, 7, 50]),  # a prefill chunk in the batch (SDPA)
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_sdpa_and_naive(kernel: CpuPagedAttention, case: tuple) -> None:
    num_heads, num_kv, head_dim, block_size, q_lens, starts = case
    q, k, v, perm = random_case(len(q_lens), num_heads, num_kv, head_dim, block_size, q_lens,
                                starts)
    slices = slices_for(q_lens, starts, perm, block_size)
    order = order_short_first(q_lens, 5)
    slices = [slices[i] for i in order]
    q = torch.cat([q[sum(q_lens[:i]):sum(q_lens[:i + 1])] for i in order])
    g = num_heads // num_kv
    scale = head_dim ** -0.5
    sdpa = paged_attention(q, k, v, build_metadata(slices, block_size, g, 5), scale)
    naive = paged_attention(q, k, v, build_metadata(slices, block_size, g, 5), scale, naive=True)
    meta = build_metadata(slices, block_size, g, 5, kernel=kernel)
    assert any(grp.mask is None for grp in meta.groups)  # the kernel did run
    got = paged_attention(q, k, v, meta, scale)
    assert got.shape == sdpa.shape
    assert (got - sdpa).abs().max().item() < 1e-5
    assert (got - naive).abs().max().item() < 1e-5


def test_kernel_reads_only_its_own_blocks(kernel: CpuPagedAttention) -> None:
    """NaN in every block no sequence owns (and past each context) never reaches the output."""
    q, k, v, perm = random_case(7, 4, 2, 64, 16, [1, 3], [20, 33])
    slices = slices_for([1, 3], [20, 33], perm, 16)
    owned = {b for s in slices for b in s.block_table}
    for b in range(k.shape[1]):
        if b not in owned:
            k[:, b] = float("nan")
            v[:, b] = float("nan")
    meta = build_metadata(slices, 16, 2, 5, kernel=kernel)
    assert not torch.isnan(paged_attention(q, k, v, meta, 0.125)).any()


def test_non_contiguous_query_rows_are_handled(kernel: CpuPagedAttention) -> None:
    """The model passes q as a view of [T, q + k heads, D]; the kernel walks its row stride."""
    q, k, v, perm = random_case(8, 4, 2, 64, 16, [1, 1, 2], [5, 40, 17])
    slices = slices_for([1, 1, 2], [5, 40, 17], perm, 16)
    wide = torch.cat([q, torch.randn(q.shape[0], 2, 64)], dim=1)[:, :4]
    assert not wide.is_contiguous()
    want = paged_attention(q, k, v, build_metadata(slices, 16, 2, 5), 0.125)
    got = paged_attention(wide, k, v, build_metadata(slices, 16, 2, 5, kernel=kernel), 0.125)
    assert (got - want).abs().max().item() < 1e-5


def test_kernel_applies_only_to_float32_cpu() -> None:
    assert cpu_attention_for("cpu", torch.bfloat16, 16) is None
    assert cpu_attention_for("cpu", torch.float32, 512) is None
    assert build_metadata([SeqSlice(1, 3, [0])], 16, 2, 5, device="meta",
                          kernel=load_cpu_attention()).kernel is None


def test_disabled_or_missing_compiler_falls_back_with_a_logged_reason(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert load_cpu_attention() is None
    monkeypatch.delenv(DISABLE_ENV)
    monkeypatch.setenv("POLYINFER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="engine.cpu_attention"):
        assert load_cpu_attention() is None
    assert "torch path" in caplog.text


def test_builds_from_source_into_an_empty_cache(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("POLYINFER_KERNEL_CACHE", str(tmp_path))
    assert load_cpu_attention() is not None
    assert len(list(tmp_path.rglob("*.so"))) == 1


def test_unwritable_cache_folder_falls_back_to_a_temporary_one(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("POLYINFER_KERNEL_CACHE", str(blocker))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    assert load_cpu_attention() is not None
    assert list((tmp_path / "tmp").rglob("*.so"))


@pytest.mark.parametrize("head_dim", [64, 32])  # the vectorised D = 64 path and the generic one
def test_a_row_does_not_depend_on_how_many_rows_share_the_step(kernel: CpuPagedAttention,
                                                               head_dim: int) -> None:
    """Verification rows (q_len = k + 1) give bit-for-bit what one decode row at the same
    position gives, so greedy speculative decoding can reproduce depth 0 exactly."""
    start, q_len, block_size = 37, 6, 16
    q, k, v, perm = random_case(3, 4, 2, head_dim, block_size, [q_len], [start])
    table = torch.tensor([slices_for([q_len], [start], perm, block_size)[0].block_table])
    together = kernel.attend(q, k, v, table, torch.tensor([start]), torch.tensor([q_len]), 0.125)
    for j in range(q_len):
        alone = kernel.attend(q[j:j + 1], k, v, table, torch.tensor([start + j]),
                              torch.tensor([1]), 0.125)
        assert torch.equal(alone[0], together[j]), j
