"""The bfloat16-weight projection kernel against F.linear, and where it must not be used."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_gemm import (
    DISABLE_ENV,
    SMALL_ROWS,
    CpuGemm,
    CpuProjection,
    load_cpu_gemm,
    project,
)


@pytest.fixture(scope="module")
def kernel() -> CpuGemm:
    k = load_cpu_gemm()
    if k is None:
        pytest.fail("the projection kernel did not build here (see the logged reason)")
    return k


def bf16_exact(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen).to(torch.bfloat16).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 17, 24, 25, SMALL_ROWS,
                                  SMALL_ROWS + 1, 40])
@pytest.mark.parametrize(("n", "k"), [(64, 48), (512, 256), (256, 771)])
def test_matches_f_linear_at_every_row_count(kernel: CpuGemm, rows: int, n: int, k: int) -> None:
    w = bf16_exact(n, k, rows)
    proj = CpuProjection.pack(w, kernel)
    assert proj.kernel is kernel
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    got = project(x, proj)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_bias_and_a_strided_input(kernel: CpuGemm) -> None:
    w = bf16_exact(96, 64, 1)
    bias = torch.randn(96)
    proj = CpuProjection.pack(w, kernel)
    wide = torch.randn(6, 128)
    x = wide[:, 32:96]  # row stride 128, unit column stride: used in place
    torch.testing.assert_close(project(x, proj, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    cols = torch.randn(64, 6).t()  # column stride != 1: copied first
    torch.testing.assert_close(project(cols, proj), F.linear(cols, w), rtol=1e-5, atol=1e-4)


def test_weights_that_bfloat16_would_round_keep_only_onednn(kernel: CpuGemm) -> None:
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))  # float32 mantissas
    proj = CpuProjection.pack(w, kernel)
    assert proj.bf16 is None and proj.kernel is None
    x = torch.randn(3, 32)
    torch.testing.assert_close(project(x, proj), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_column_counts_off_the_block_keep_only_onednn(kernel: CpuGemm) -> None:
    w = bf16_exact(60, 32, 3)
    proj = CpuProjection.pack(w, kernel)
    assert proj.kernel is None
    x = torch.randn(2, 32)
    torch.testing.assert_close(project(x, proj), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="60 output columns"):
        kernel.linear(x, torch.zeros(60 * 32, dtype=torch.int16), 60, None)


def test_disabled_or_missing_compiler_gives_none_with_a_logged_reason(
        monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert load_cpu_gemm() is None
    monkeypatch.delenv(DISABLE_ENV)
    monkeypatch.setenv("POLYINFER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.INFO, logger="engine.cpu_gemm"):
        assert load_cpu_gemm() is None
    assert "oneDNN" in caplog.text
    w = bf16_exact(64, 32, 4)
    proj = CpuProjection.pack(w, None)
    x = torch.randn(2, 32)
    torch.testing.assert_close(project(x, proj), F.linear(x, w), rtol=1e-5, atol=1e-4)
