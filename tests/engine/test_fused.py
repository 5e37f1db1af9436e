"""Fused forward-pass variants (engine.fused): config, the reference check, planted faults,
the whole model and a hot reload, the kernels run by Triton's CPU interpreter.

NOTE: the interpreter converts float32 to bfloat16 by truncation (the GPU rounds to
nearest even), so here the kernels are checked in float32 and float16; bf16 is checked
on the GPU (``-m gpu``) and by the engine itself whenever it builds with a variant.
"""

from __future__ import annotations

import pytest
import torch

from engine.errors import UnsupportedConfigError
from engine.fused import KernelCheck, error_bound
from polyinfer.config import (
    FUSED_FORWARD,
    GPU_FORWARD,
    CompiledConfig,
    ConfigError,
    EngineConfig,
    ForwardConfig,
)
from tests.engine.drive import run_interpreted

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _interpreted(code: str, timeout_s: float = 110) -> None:
    pytest.importorskip("triton")
    done = run_interpreted(code, timeout_s=timeout_s)
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]


# -- config and bounds, any machine ----------------------------------------------------------

def test_forward_variants_parse_validate_and_round_trip() -> None:
    cfg = CompiledConfig.from_dict({"engine": {"forward": {"fused_norm": True,
                                                           "fused_silu": True}}})
    assert cfg.engine.forward == ForwardConfig(fused_norm=True, fused_silu=True)
    assert cfg.engine.forward.enabled == ("fused_norm", "fused_silu")
    assert CompiledConfig.from_dict(cfg.to_dict()) == cfg
    assert EngineConfig().forward.enabled == ()
    assert FUSED_FORWARD.enabled == ("fused_norm", "fused_rope_kv", "fused_silu")
    with pytest.raises(ConfigError, match="engine.forward: unknown key"):
        CompiledConfig.from_dict({"engine": {"forward": {"fused_rope": True}}})
    with pytest.raises(ConfigError, match="engine.forward.fused_norm: expected true or false"):
        CompiledConfig.from_dict({"engine": {"forward": {"fused_norm": "yes"}}})
    with pytest.raises(ConfigError, match="execution 'compiled'"):
        EngineConfig(execution="compiled", forward=FUSED_FORWARD)


def test_the_error_bound_is_two_ulps_of_the_reference() -> None:
    ref = torch.tensor([1.0, -4.0, 0.0], dtype=torch.bfloat16)
    assert error_bound(ref).tolist() == pytest.approx([1e-6 + 2**-6, 1e-6 + 2**-4, 1e-6])
    assert error_bound(ref.half()).tolist() == pytest.approx([1e-6 + 2**-9, 1e-6 + 2**-7, 1e-6])
    assert KernelCheck("fused_norm", 1, 0.01, 1.0).ok
    assert not KernelCheck("fused_norm", 1, 0.02, 1.01).ok


def test_a_model_refuses_fused_kernels_on_a_cpu_without_the_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.checkpoint import load_weights, read_spec
    from engine.model import LlamaModel
    from polyinfer.config import TINY_TARGET

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = read_spec(TINY_TARGET)
    with pytest.raises(UnsupportedConfigError, match="CUDA device"):
        LlamaModel(spec, load_weights(TINY_TARGET, 1), variants=ForwardConfig(fused_silu=True))
    assert LlamaModel(spec, load_weights(TINY_TARGET, 1), variants=ForwardConfig()).variants == ()


# -- the kernels against their references, in the interpreter -------------------------------

def check_kernels(dtype: str) -> None:
    """Every variant at two shapes (GQA 4/2 and 32/8, odd head counts padded), fresh seeds."""
    from engine.fused import VARIANTS, ForwardShape, check_forward

    shapes = [ForwardShape(256, 768, 4, 2, 64), ForwardShape(320, 600, 5, 1, 32, 1e-6),
              ForwardShape(2048, 1024, 32, 8, 64, rope_theta=500000.0)]
    # check_skinny: smaller shapes; split_attention (contexts up to 600) at the first only
    apart = ("skinny_gemm", "split_attention", "fused_rope_attention", "prefill_attention")
    variants = [v for v in VARIANTS if v not in apart]
    for shape in shapes:
        for num_rows in (1, 6):
            checks = check_forward(variants, shape, "cpu", getattr(torch, dtype), num_rows)
            assert [c.variant for c in checks] == variants
            assert all(c.ok for c in checks), checks
    for num_rows in (1, 3):
        checks = check_forward(["split_attention", "fused_rope_attention"], shapes[0], "cpu",
                               getattr(torch, dtype), num_rows)
        assert all(c.ok for c in checks), checks
    for shape, num_rows in ((shapes[0], 40), (shapes[1], 23)):  # G 2 and 5 (a padded tile)
        [check] = check_forward(["prefill_attention"], shape, "cpu", getattr(torch, dtype),
                                num_rows)
        assert check.ok, check


def check_skinny(dtype: str) -> None:
    """The projections at 1, 7 and 16 rows (a full tile), the LM head too, K split in two
    and not, columns and K not multiples of the tile (K 300, N 320 + 2 x 32)."""
    from engine.fused import ForwardShape, check_forward
    from engine.skinny_gemm import SkinnyConfig

    wide, odd = SkinnyConfig(64, 256, 2), SkinnyConfig(16, 64, 1)
    for shape, num_rows, cfgs in ((ForwardShape(256, 768, 4, 2, 64, vocab=1000), 1, [wide]),
                                  (ForwardShape(256, 768, 4, 2, 64), 16, [wide]),
                                  (ForwardShape(320, 300, 5, 1, 32, 1e-6), 7, [wide, odd])):
        for cfg in cfgs:
            [check] = check_forward(["skinny_gemm"], shape, "cpu", getattr(torch, dtype),
                                    num_rows, impls={"skinny_gemm": Tuned(cfg)})
            assert check.ok, (shape, num_rows, cfg, check)


class Tuned:
    """A projection with one launch for every shape, gated gate|up and the norm in front
    included, called as the model calls :class:`engine.skinny_gemm.SkinnyGemm`. Planted
    faults: ``swap``, up's rows taken as gate's; ``norm_of_h``, the norm of the residual
    stream before the add (the add itself right)."""

    def __init__(self, cfg: object, swap: bool = False, norm_of_h: bool = False) -> None:
        self.cfg, self.swap, self.norm_of_h = cfg, swap, norm_of_h

    def norm_linear(self, h, delta, nw, eps, w, bias, gated):  # type: ignore[no-untyped-def]
        from engine.skinny_gemm import skinny_norm_linear

        if self.norm_of_h and delta is not None:
            y, _ = skinny_norm_linear(h, None, nw, eps, w, bias, self.cfg, gated)
            return y, h + delta
        return skinny_norm_linear(h, delta, nw, eps, w, bias, self.cfg, gated)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        from engine.skinny_gemm import skinny_linear

        return skinny_linear(x, w, b, self.cfg)  # type: ignore[arg-type]

    def gated(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from engine.skinny_gemm import skinny_gated

        if self.swap:
            half = w.shape[0] // 2
            w = torch.cat([w[half:], w[:half]])
        return skinny_gated(x, w, self.cfg)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_kernels_match_their_references_in_the_interpreter() -> None:
    _interpreted("from tests.engine.test_fused import check_kernels; "
                 "check_kernels('float32'); check_kernels('float16')")


@pytest.mark.timeout(150)
def test_skinny_projections_match_f_linear_in_the_interpreter() -> None:
    _interpreted("from tests.engine.test_fused import check_skinny; "
                 "check_skinny('float32'); check_skinny('float16')", timeout_s=140)


def check_planted_faults() -> None:
    """Broken kernels, each close to a real one, are all refused."""
    import dataclasses

    from engine import fused
    from engine.fused import ForwardShape, check_forward
    from engine.skinny_gemm import SkinnyConfig, skinny_linear

    def norm_without_residual_store(h, delta, w, eps):  # type: ignore[no-untyped-def]
        x, _ = fused.add_rms_norm(h, delta, w, eps)
        return x, h

    def norm_eps_inside_mean(h, delta, w, eps):  # type: ignore[no-untyped-def]
        x, h = fused.add_rms_norm(h, delta, w, 0.5)
        return x, h

    def rope_one_position_late(qkv, cos, sin, pos, *rest):  # type: ignore[no-untyped-def]
        return fused.rope_kv_write(qkv, cos, sin, pos + 1, *rest)

    def rope_without_v(qkv, cos, sin, pos, slots, k, v, nq, nkv):  # type: ignore[no-untyped-def]
        return fused.rope_kv_write(qkv, cos, sin, pos, slots, k, v.clone(), nq, nkv)

    def silu_of_up(gate_up):  # type: ignore[no-untyped-def]
        return fused.silu_mul(gate_up.flip(-1))

    def skinny_without_bias(x, w, bias):  # type: ignore[no-untyped-def]
        return skinny_linear(x, w, None)

    def skinny_without_last_block(x, w, bias):  # type: ignore[no-untyped-def]
        x = x.clone()
        x[:, -64:] = 0
        return skinny_linear(x, w, bias)

    def skinny_row_zero_everywhere(x, w, bias):  # type: ignore[no-untyped-def]
        return skinny_linear(x[:1].expand_as(x), w, bias)

    def skinny_a_thousandth_high(x, w, bias):  # type: ignore[no-untyped-def]
        return skinny_linear(x, w, bias, SkinnyConfig(16, 64, 4)) * (1 + 2**-10)

    def attention_without_the_new_token(q, k, v, meta, scale):  # type: ignore[no-untyped-def]
        from engine.triton_attention import decode_attention_split

        fewer = dataclasses.replace(meta, context_lens=(meta.context_lens - 1).clamp(min=1))
        return decode_attention_split(q, k, v, fewer, scale)

    def rope_attention_without_v(qkv, cos, sin, k, v, *rest):  # type: ignore[no-untyped-def]
        return fused.rope_attention(qkv, cos, sin, k, v.clone(), *rest)

    def rope_attention_a_position_late(qkv, cos, sin, k, v, meta, *rest):  # type: ignore[no-untyped-def]
        late = dataclasses.replace(meta, positions=meta.positions + 1)
        return fused.rope_attention(qkv, cos, sin, k, v, late, *rest)

    shape = ForwardShape(256, 768, 4, 2, 64)
    planted = [("fused_rope_attention", rope_attention_without_v),
               ("fused_rope_attention", rope_attention_a_position_late),
               ("split_attention", attention_without_the_new_token),
               ("fused_norm", norm_without_residual_store), ("fused_norm", norm_eps_inside_mean),
               ("fused_rope_kv", rope_one_position_late), ("fused_rope_kv", rope_without_v),
               ("fused_silu", silu_of_up), ("skinny_gemm", skinny_without_bias),
               ("skinny_gemm", skinny_without_last_block),
               ("skinny_gemm", skinny_row_zero_everywhere),
               ("skinny_gemm", skinny_a_thousandth_high),
               ("skinny_gemm", Tuned(SkinnyConfig(16, 64, 2), swap=True)),
               ("skinny_gemm", Tuned(SkinnyConfig(16, 64, 1), norm_of_h=True))]
    for name, impl in planted:
        [check] = check_forward([name], shape, "cpu", torch.float32, 3, impls={name: impl})
        assert not check.ok, (getattr(impl, "__name__", impl), check)


@pytest.mark.timeout(200)
def test_planted_faults_are_refused_in_the_interpreter() -> None:
    _interpreted("from tests.engine.test_fused import check_planted_faults; "
                 "check_planted_faults()", timeout_s=190)


# -- the whole model and a hot reload, in the interpreter -----------------------------------

def check_model_and_reload() -> None:
    """The tiny model with every variant: logits as the reference's, greedy text equal, and
    a hot reload onto the variants (and back) reuses the weights; a reload onto a planted
    faulty kernel is refused and the previous config keeps serving."""
    import dataclasses

    from engine import fused
    from engine.errors import EngineError
    from engine.loader import load_core
    from engine.sequence import GenerationParams
    from polyinfer.config import TINY_TARGET
    from tests.engine.drive import generate

    base = CompiledConfig(model=str(TINY_TARGET), engine=EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=64, kv_cache_tokens=1024, max_model_len=128,
        measure_num_layers=2))
    core = load_core(base)
    prompts = [list(range(5, 25)), list(range(40, 47)), [9] * 12]
    params = [GenerationParams(max_tokens=6, ignore_eos=True)] * 3
    want, _, _ = generate(core, prompts, params)
    embed = core.model.embed
    core.reload(base.with_engine(forward=FUSED_FORWARD))
    assert core.model.variants == FUSED_FORWARD.enabled and core.model.embed is embed
    got, _, _ = generate(core, prompts, params)
    assert got == want, (got, want)
    core.reload(base.with_engine(forward=ForwardConfig(fused_rope_kv=True)))
    assert generate(core, prompts, params)[0] == want
    fused._FUSED["fused_silu"] = lambda gate_up: fused.silu_mul(gate_up) * 1.01
    try:
        core.reload(base.with_engine(forward=FUSED_FORWARD))
        raise AssertionError("a faulty kernel was accepted")
    except EngineError as e:
        assert "fused_silu" in str(e), e
    assert core.config.engine.forward == ForwardConfig(fused_rope_kv=True)
    assert generate(core, prompts, params)[0] == want
    fused._FUSED["fused_silu"] = fused.silu_mul
    core.reload(base.with_engine(forward=GPU_FORWARD))  # the projections too
    assert core.model.skinny is not None and core.model.variants == GPU_FORWARD.enabled
    assert generate(core, prompts, params)[0] == want
    # pdl and l2_prefetch (no-ops in the interpreter): their plumbing; fused_rope_attention:
    # prompts here run eager, its decode path is tests/engine/test_look_ahead.py's
    best = dataclasses.replace(GPU_FORWARD, pdl=True, fused_rope_attention=True,
                               l2_prefetch=True)
    embed = core.model.embed
    core.reload(base.with_engine(forward=best))
    assert core.model.variants == best.enabled and core.model.embed is embed
    assert generate(core, prompts, params)[0] == want
    core.reload(dataclasses.replace(base))
    assert core.model.variants == () and generate(core, prompts, params)[0] == want


@pytest.mark.timeout(200)
def test_variants_hot_reload_and_keep_greedy_outputs_in_the_interpreter() -> None:
    _interpreted("from tests.engine.test_fused import check_model_and_reload; "
                 "check_model_and_reload()", timeout_s=190)


def check_argmax(device: str = "cpu") -> None:
    """The two-pass argmax equals torch's on vocabularies cut unevenly into blocks, with
    ties inside a block and across blocks (the first column wins) and rows of -inf."""
    from engine.gpu_sampling import ARGMAX_BLOCK, argmax_rows

    g = torch.Generator(device="cpu").manual_seed(7)
    for rows, cols in ((1, 20000), (5, 3 * ARGMAX_BLOCK), (3, 128256)):
        x = torch.randn(rows, cols, generator=g)
        x[1 % rows, [17, ARGMAX_BLOCK + 3]] = 50.0  # a tie across blocks
        x[2 % rows, [cols - 1, cols - 2]] = 60.0  # a tie inside the last, partial block
        if rows > 3:
            x[3] = float("-inf")
        x = x.to(device)
        got = argmax_rows(x, interpret=device == "cpu")
        assert got.dtype == torch.int64 and got.tolist() == x.argmax(dim=1).tolist(), (
            rows, cols, got.tolist(), x.argmax(dim=1).tolist())


def test_two_pass_argmax_matches_torch_in_the_interpreter() -> None:
    _interpreted("from tests.engine.test_fused import check_argmax; check_argmax()")


# -- on a GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_two_pass_argmax_matches_torch_on_the_gpu() -> None:
    check_argmax("cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_match_their_references_on_the_gpu(dtype: torch.dtype) -> None:
    from engine.fused import VARIANTS, ForwardShape, check_forward
    from engine.launch import dependent_launches

    for shape in (ForwardShape(2048, 8192, 32, 8, 64, rope_theta=500000.0),
                  ForwardShape(4096, 14336, 32, 8, 128), ForwardShape(896, 4864, 14, 2, 64)):
        for num_rows in (1, 8, 64, 512):
            checks = check_forward(VARIANTS, shape, "cuda", dtype, num_rows)
            assert all(c.ok for c in checks), checks
        with dependent_launches(True):  # engine.forward.pdl: the same kernels, launched so
            checks = check_forward(VARIANTS, shape, "cuda", dtype, 8)
        assert all(c.ok for c in checks), checks


def _gpu_core(model_dir, dtype: str, forward: ForwardConfig):  # type: ignore[no-untyped-def]
    from engine.loader import load_core

    return load_core(CompiledConfig(model=str(model_dir), engine=EngineConfig(
        device="cuda", dtype=dtype, execution="cuda_graph", max_num_seqs=8,  # type: ignore[arg-type]
        max_num_batched_tokens=128, kv_cache_tokens=8192, max_model_len=1024, forward=forward)))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(500)
def test_greedy_outputs_equal_with_every_variant_set_on_the_gpu(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """float32, cuda_graph, batches 1..8 and prompts longer than a chunk: the fused engine
    answers token for token as the reference one; a hot reload swaps the variants in."""
    import dataclasses

    from engine.sequence import GenerationParams
    from tests.engine.drive import generate

    prompts = [[(13 * i + 7 * j) % 8000 + 5 for j in range(n)]
               for i, n in enumerate([40, 7, 300, 16, 25, 12, 140, 3])]
    params = [GenerationParams(max_tokens=n, ignore_eos=True)
              for n in (40, 33, 12, 45, 20, 8, 30, 25)]
    core = _gpu_core(tiny_model_dir, "float32", ForwardConfig())
    want = [generate(core, [p], [q])[0][0] for p, q in zip(prompts[:2], params[:2], strict=True)]
    want_batch = generate(core, prompts, params)[0]
    embed = core.model.embed
    for forward in (FUSED_FORWARD, ForwardConfig(fused_norm=True),
                    ForwardConfig(fused_rope_kv=True), ForwardConfig(fused_silu=True),
                    ForwardConfig(skinny_gemm=True), GPU_FORWARD,
                    dataclasses.replace(GPU_FORWARD, pdl=True),
                    dataclasses.replace(GPU_FORWARD, pdl=True, fused_rope_attention=True),
                    dataclasses.replace(GPU_FORWARD, pdl=True, split_attention=True),
                    dataclasses.replace(GPU_FORWARD, pdl=True, split_attention=True,
                                        fused_rope_attention=True),
                    dataclasses.replace(GPU_FORWARD, pdl=True, split_attention=True,
                                        fused_rope_attention=True, l2_prefetch=True),
                    dataclasses.replace(GPU_FORWARD, pdl=True, split_attention=True,
                                        fused_rope_attention=True, l2_prefetch=True,
                                        prefill_attention=True)):
        # the first reload onto skinny_gemm tunes its launches (~30 s of Triton compiles
        # on a fresh machine); the weights stay: the same embedding tensor serves
        core.reload(core.config.with_engine(forward=forward))
        assert core.model.variants == forward.enabled, (core.model.variants, forward)
        assert core.model.embed is embed
        assert [generate(core, [p], [q])[0][0] for p, q in zip(prompts[:2], params[:2], strict=True)] == want
        assert generate(core, prompts, params)[0] == want_batch


@pytest.mark.gpu
@needs_cuda
def test_bf16_step_logits_within_bound_of_the_reference_on_the_gpu(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """bf16: one decode step's logits through the graphs, fused vs reference, close."""
    from engine.cuda_graph import DecodeRow

    ref = _gpu_core(tiny_model_dir, "bfloat16", ForwardConfig())
    fused_core = _gpu_core(tiny_model_dir, "bfloat16", FUSED_FORWARD)
    rows = [DecodeRow.chunk(list(range(5, 5 + 20)), 0, [0, 1])]
    want = ref.runner.graphs.run(rows).clone()
    got = fused_core.runner.graphs.run(rows)
    assert (got - want).abs().max().item() < 0.1 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_skinny_choices_are_kept_apart_with_and_without_pdl() -> None:
    """A launch is chosen as the model's graph runs it, with PDL or without; a reload that
    turns PDL on keeps the choices made without it (and tunes only the new flag's)."""
    from engine.skinny_gemm import CUBLAS, DEFAULT, SkinnyGemm

    plain = SkinnyGemm.for_shapes([(32, 64)], "cpu", torch.float32)
    plain.configs[(32, 64)] = CUBLAS  # as a device's timing might choose
    on = SkinnyGemm.for_shapes([(32, 64)], "cpu", torch.float32, share=plain, pdl=True)
    assert on.pdl and on.configs == {(32, 64): DEFAULT}  # tuned afresh (the interpreter's)
    assert on.tuned[False] == {(32, 64): CUBLAS}
    back = SkinnyGemm.for_shapes([(32, 64)], "cpu", torch.float32, share=on)
    assert back.configs == {(32, 64): CUBLAS}  # nothing tuned again
    other = SkinnyGemm.for_shapes([(32, 64)], "cpu", torch.float16, share=on, pdl=True)
    assert other.tuned == {True: {(32, 64): DEFAULT}}  # another dtype lends nothing
