"""The torch decoder matches transformers' logits (fp32) on Llama and Qwen2-style checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention import SeqSlice, build_metadata, order_short_first
from engine.checkpoint import load_weights, read_spec
from engine.cpu_attention import CpuPagedAttention, load_cpu_attention
from engine.kv_cache import blocks_needed
from engine.model import LlamaModel
from tests.engine.conftest import save_random_checkpoint

BLOCK = 16


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def load(model_dir: Path, num_layers: int | None = None) -> LlamaModel:
    spec = read_spec(model_dir)
    return LlamaModel(spec, load_weights(model_dir, num_layers or spec.num_layers))


def run_chunks(model: LlamaModel, seqs: list[list[int]], chunk: int,
               kernel: CpuPagedAttention | None = None) -> list[torch.Tensor]:
    """Feed every sequence in chunks of ``chunk`` tokens, all sequences in each step."""
    kv = model.new_kv_cache(256, BLOCK)
    tables, next_block = [], 0
    for s in seqs:
        n = blocks_needed(len(s), BLOCK)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs, strict=False)):
        active = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        q_lens = [min(chunk, len(seqs[i]) - done[i]) for i in active]
        order = [active[j] for j in order_short_first(q_lens, 5)]
        slices = [SeqSlice(min(chunk, len(seqs[i]) - done[i]), done[i], tables[i]) for i in order]
        ids = torch.tensor([t for i, sl in zip(order, slices, strict=False)
                            for t in seqs[i][sl.start:sl.start + sl.q_len]])
        meta = build_metadata(slices, BLOCK, model.spec.num_heads // model.spec.num_kv_heads, 5,
                              kernel=kernel)
        out = model.forward(ids, meta, kv)
        row = 0
        for i, sl in zip(order, slices, strict=False):
            logits[i].append(out[row:row + sl.q_len])
            row += sl.q_len
            done[i] += sl.q_len
    return [torch.cat(x) for x in logits]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_logits_match_transformers(tmp_path: Path, model_type: str) -> None:
    shape = {"num_hidden_layers": 2, "tie_word_embeddings": model_type == "llama"}
    model_dir = save_random_checkpoint(tmp_path / model_type, model_type, **shape)
    ids = torch.randint(0, 8192, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(model_dir, ids)
    got = run_chunks(load(model_dir), [ids], chunk=64)[0]
    assert (got - expected).abs().max().item() < 1e-4


def test_bundled_model_matches_transformers(tiny_model_dir: Path) -> None:
    ids = torch.randint(0, 8192, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = hf_logits(tiny_model_dir, ids)
    got = run_chunks(load(tiny_model_dir), [ids], chunk=64)[0]
    assert (got - expected).abs().max().item() < 1e-4


def test_chunked_mixed_batch_matches_whole_prompt(tiny_model_dir: Path) -> None:
    """Chunks of 1, 3 and 7 tokens, mixed with other sequences, give the same logits."""
    model = load(tiny_model_dir)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in (5, 23, 40, 17)]
    whole = run_chunks(model, seqs, chunk=64)
    for chunk in (1, 3, 7):
        got = run_chunks(model, seqs, chunk=chunk)
        for a, b in zip(got, whole, strict=False):
            assert (a - b).abs().max().item() < 1e-4


def test_measure_num_layers_loads_only_first_layers(tiny_model_dir: Path) -> None:
    model = load(tiny_model_dir, num_layers=2)
    assert model.num_layers == 2


def test_naive_attention_matches_sdpa(tiny_model_dir: Path) -> None:
    spec = read_spec(tiny_model_dir)
    weights = load_weights(tiny_model_dir, spec.num_layers)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in (9, 30)]
    sdpa = run_chunks(LlamaModel(spec, weights), seqs, chunk=4)
    naive = run_chunks(LlamaModel(spec, weights, attention="naive"), seqs, chunk=4)
    for a, b in zip(sdpa, naive, strict=True):
        assert (a - b).abs().max().item() < 1e-4


def test_cpu_kernel_decode_matches_transformers(tiny_model_dir: Path) -> None:
    """Chunks of 1 and 3 tokens go through the fused CPU kernel; logits stay within 1e-4."""
    kernel = load_cpu_attention()
    if kernel is None:
        pytest.fail("the CPU attention kernel did not build here (see the logged reason)")
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in (40, 19, 33)]
    model = load(tiny_model_dir)
    expected = [hf_logits(tiny_model_dir, ids) for ids in seqs]
    for chunk in (1, 3):
        got = run_chunks(model, seqs, chunk=chunk, kernel=kernel)
        for want, logits in zip(expected, got, strict=True):
            assert (logits - want).abs().max().item() < 1e-4


def test_cuda_only_options_are_refused_on_cpu(tiny_model_dir: Path) -> None:
    from engine.errors import UnsupportedConfigError

    spec = read_spec(tiny_model_dir)
    weights = load_weights(tiny_model_dir, 1)
    with pytest.raises(UnsupportedConfigError, match="CUDA"):
        LlamaModel(spec, weights, execution="cuda_graph")
    with pytest.raises(UnsupportedConfigError, match="CUDA"):
        LlamaModel(spec, weights, attention="triton")


def test_packed_weights_match_plain_weights(tiny_model_dir: Path) -> None:
    """oneDNN-packed projections give F.linear's logits, alone and in a shared step."""
    spec = read_spec(tiny_model_dir)
    weights = load_weights(tiny_model_dir, spec.num_layers)
    packed = LlamaModel(spec, weights)
    plain = LlamaModel(spec, weights, pack_weights=False)
    assert packed.packed and not plain.packed
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in (21, 7, 30)]
    together = run_chunks(packed, seqs, chunk=5)
    for a, b in zip(together, run_chunks(plain, seqs, chunk=5), strict=True):
        assert (a - b).abs().max().item() < 1e-4
    alone = run_chunks(packed, seqs[:1], chunk=5)[0]
    assert (alone - together[0]).abs().max().item() < 1e-4


def test_weights_stay_plain_where_packing_does_not_apply(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.model import PACK_ENV, packing_disabled_reason

    spec = read_spec(tiny_model_dir)
    weights = load_weights(tiny_model_dir, 1)
    assert packing_disabled_reason("cpu", torch.float32, "eager") is None
    assert "float32" in str(packing_disabled_reason("cpu", torch.bfloat16, "eager"))
    assert "float32" in str(packing_disabled_reason("cuda:0", torch.float32, "eager"))
    assert "compiled" in str(packing_disabled_reason("cpu", torch.float32, "compiled"))
    assert not LlamaModel(spec, weights, dtype="bfloat16").packed
    monkeypatch.setenv(PACK_ENV, "0")
    assert not LlamaModel(spec, weights).packed
