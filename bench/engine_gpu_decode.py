"""Batch-1 decode on a GPU against the HBM-bandwidth roofline, eager vs CUDA graphs.

At batch 1 every decode step reads all weights once, so the roofline is
``weight_bytes / memory_bandwidth`` seconds per token. This script measures the
device's bandwidth (a large device-to-device copy) and the engine's batch-1
decode rate on the same GPU in one run, for each execution mode side by side
(``eager`` and ``cuda_graph`` by default), and prints the fraction of the
roofline reached, for a random Llama-family checkpoint (bf16; about 0.75 B
parameters by default: the roofline is per weight byte, so the model's size is
a free choice and is printed) and for the bundled tiny target (launch-bound at
that size; shown for scale).

The rate is the engine's own loop (``EngineCore.step``: scheduling, the
forward, sampling, detokenization), decode steps only, after a warm-up run.

    python bench/engine_gpu_decode.py [--layers 16 --hidden 2048] [--tokens 256]
        [--executions eager cuda_graph]

Needs CUDA. The random checkpoint is written to a temporary folder with the
bundled tokenizer, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cuda_graph import DecodeRow  # noqa: E402
from engine.loader import load_core  # noqa: E402
from engine.sequence import GenerationParams  # noqa: E402
from polyinfer.config import TINY_TARGET, CompiledConfig, EngineConfig  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_random_llama(out: Path, hidden: int, layers: int, intermediate: int, heads: int,
                       kv_heads: int, vocab: int = 8192) -> int:
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 2, "torch_dtype": "bfloat16", "hidden_act": "silu",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_TARGET / name, out / name)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # drawing GBs on a CPU is slow
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()

    t = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
         "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, intermediate)
    save_file(t, str(out / "model.safetensors"))
    return sum(v.numel() for v in t.values())


def measure_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Bytes moved per second by a device-to-device copy (read + write counted)."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 10
    for _ in range(n):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * n / (time.perf_counter() - t0)


def decode_rate(model_dir: Path, num_tokens: int, execution: str) -> tuple[float, float | None]:
    """Output tokens per second of one request (decode steps only), and for cuda_graph the
    milliseconds of one graph replay + argmax alone (the device's share of a step)."""
    cfg = CompiledConfig(model=str(model_dir), engine=EngineConfig(
        device="cuda", dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=512,
        kv_cache_tokens=8192, max_model_len=4096, execution=execution))  # type: ignore[arg-type]
    core = load_core(cfg)
    params = GenerationParams(max_tokens=num_tokens, ignore_eos=True)
    for run in range(2):  # the first run warms up kernels and allocator
        core.add_request(f"r{run}", list(range(5, 37)), params)
        core.step()  # prefill + first token
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        produced = 0
        while core.has_work:
            outputs, _ = core.step()
            produced += sum(len(o.new_token_ids) for o in outputs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    graphs = core.runner.graphs
    replay_ms = None
    if graphs is not None:
        row = DecodeRow(token=5, position=100, block_table=list(range(8)))
        n = 100
        t0 = time.perf_counter()
        for _ in range(n):
            graphs.run([row]).argmax(dim=1).tolist()
        replay_ms = (time.perf_counter() - t0) / n * 1e3
    del core
    torch.cuda.empty_cache()
    return produced / elapsed, replay_ms


def weight_bytes(model_dir: Path) -> int:
    return (model_dir / "model.safetensors").stat().st_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--executions", nargs="+", default=["eager", "cuda_graph"],
                   choices=["eager", "compiled", "cuda_graph"])
    p.add_argument("--skip-tiny", action="store_true", help="only the random checkpoint")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    bw = measure_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  measured copy bandwidth {bw / 1e12:.2f} TB/s")
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "random-llama"
        n = write_random_llama(big, args.hidden, args.layers, args.intermediate, args.heads,
                               args.kv_heads)
        print(f"{'model':<22}{'execution':>11}{'params':>8}{'weights MB':>11}{'tok/s':>8}"
              f"{'ms/token':>9}{'roofline tok/s':>15}{'fraction':>9}{'graph-only ms':>14}")
        models: list[tuple[str, Path, int | None]] = [("random-llama (bf16)", big, n)]
        if not args.skip_tiny:
            models.append(("tiny-target (bf16)", TINY_TARGET, None))
        for name, path, count in models:
            nbytes = weight_bytes(path)
            roof = bw / nbytes
            params = f"{(count or nbytes / 2) / 1e6:.0f}M"
            rates: dict[str, float] = {}
            for execution in args.executions:
                rate, replay_ms = decode_rate(path, args.tokens, execution)
                rates[execution] = rate
                replay = f"{replay_ms:.3f}" if replay_ms is not None else "-"
                print(f"{name:<22}{execution:>11}{params:>8}{nbytes / 1e6:>11.0f}{rate:>8.0f}"
                      f"{1e3 / rate:>9.3f}{roof:>15.0f}{rate / roof:>9.2f}{replay:>14}",
                      flush=True)
            if "eager" in rates and "cuda_graph" in rates:
                print(f"{name:<22} cuda_graph / eager = {rates['cuda_graph'] / rates['eager']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
