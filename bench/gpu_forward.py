"""GPU decode per forward-pass variant: batch 1 / 8 / 64 against the roofline and transformers.

On a random bf16 checkpoint of the Llama-3.2-1B shape (hidden 2048, intermediate
8192, 16 layers, GQA 32/8, head_dim 64, vocab 128,256, tied embeddings: 2.47 GB),
in one process on one GPU:

1. the device's copy bandwidth, and the batch-1 roofline ``bandwidth / weight bytes``;
2. the kernels against their torch references at the model's shapes (engine.fused);
3. for each variant set (``engine.forward``), applied by hot reload onto one engine
   (the reload's seconds are printed: weights stay, graphs are captured again), the
   decode rate of ``b`` requests decoding together through ``EngineCore.step`` (the
   engine's own loop: scheduler, graph replay, sampling, detokenizer), decode steps
   only, and the device's share (one graph replay of the batch's bucket); with
   ``--serial`` also the same loop with no step launched ahead (engine.runner);
4. transformers' eager ``generate`` on the same checkpoint and batches (greedy);
5. with ``--prefill-tokens N``: one N-token prompt's prefill per variant set, prompt tok/s
   (chunks of the step budget through the graphs);
6. with ``--profile``: the kernels of one uncaptured decode step per variant set and
   batch, by CUDA time (torch.profiler), appended to that file;
7. the projections alone at 1 and 8 rows (``skinny_gemm``'s tuned launch against cuBLAS,
   weights from HBM): device us and the bandwidth they reach;
8. with ``--profile-host``: the host functions of each variant set's loop by own time
   (cProfile), appended to that file.

    python bench/gpu_forward.py [--batches 1 8 64] [--tokens 256]
        [--variants default all] [--serial] [--budget 64] [--graph-sizes 1 2 4 8 64]
        [--json out.json]
        [--profile kernels.txt] [--profile-host host.txt]

Needs CUDA. The checkpoint is written to a temporary folder with the bundled
tokenizer, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu_decode import measure_bandwidth  # noqa: E402
from engine.cuda_graph import DecodeRow  # noqa: E402
from engine.fused import VARIANTS, ForwardShape, check_forward  # noqa: E402
from engine.loader import load_core  # noqa: E402
from engine.sequence import GenerationParams  # noqa: E402
from engine.skinny_gemm import CUBLAS, SkinnyGemm, skinny_linear, time_ms  # noqa: E402
from polyinfer.config import (  # noqa: E402
    FUSED_FORWARD,
    GPU_FORWARD,
    TINY_TARGET,
    CompiledConfig,
    EngineConfig,
    ForwardConfig,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT_TOKENS = 32
VARIANT_SETS = {"default": ForwardConfig(),
                "fused_norm": ForwardConfig(fused_norm=True),
                "fused_rope_kv": ForwardConfig(fused_rope_kv=True),
                "fused_silu": ForwardConfig(fused_silu=True),
                "skinny_gemm": ForwardConfig(skinny_gemm=True),
                "split_attention": ForwardConfig(split_attention=True),
                "all": FUSED_FORWARD, "all+skinny": GPU_FORWARD,
                "all+skinny+split": dataclasses.replace(GPU_FORWARD, split_attention=True),
                "all+skinny+pdl": dataclasses.replace(GPU_FORWARD, pdl=True),
                "all+skinny+split+pdl": dataclasses.replace(GPU_FORWARD, split_attention=True,
                                                            pdl=True),
                "all+skinny+ropeattn": dataclasses.replace(GPU_FORWARD, fused_rope_attention=True),
                "all+skinny+ropeattn+pdl": dataclasses.replace(
                    GPU_FORWARD, fused_rope_attention=True, pdl=True),
                "all+skinny+split+ropeattn+pdl": dataclasses.replace(
                    GPU_FORWARD, split_attention=True, fused_rope_attention=True, pdl=True),
                "all+skinny+split+ropeattn+pdl+l2": dataclasses.replace(
                    GPU_FORWARD, split_attention=True, fused_rope_attention=True, pdl=True,
                    l2_prefetch=True),
                "all+skinny+split+ropeattn+pdl+l2+prefill": dataclasses.replace(
                    GPU_FORWARD, split_attention=True, fused_rope_attention=True, pdl=True,
                    l2_prefetch=True, prefill_attention=True),
                # the same kernels with the norms and gate|up's SiLU kernels of their own
                # (an A/B of SkinnyGemm.norm_linear and .gated, patched here only)
                "all+skinny-unfused": GPU_FORWARD}


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    intermediate: int = 8192
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256
    rope_theta: float = 500000.0


def write_checkpoint(out: Path, s: Shape) -> int:
    """A random bf16 Llama checkpoint with tied embeddings; returns its weight bytes."""
    head_dim = s.hidden // s.heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
        "intermediate_size": s.intermediate, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": head_dim, "vocab_size": s.vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": s.rope_theta, "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16", "hidden_act": "silu",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_TARGET / name, out / name)
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16).cpu()

    def norm() -> torch.Tensor:
        return w(s.hidden, scale=0.1) + 1

    t = {"model.embed_tokens.weight": w(s.vocab, s.hidden), "model.norm.weight": norm()}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm()
        t[p + "post_attention_layernorm.weight"] = norm()
        t[p + "self_attn.q_proj.weight"] = w(s.heads * head_dim, s.hidden)
        t[p + "self_attn.k_proj.weight"] = w(s.kv_heads * head_dim, s.hidden)
        t[p + "self_attn.v_proj.weight"] = w(s.kv_heads * head_dim, s.hidden)
        t[p + "self_attn.o_proj.weight"] = w(s.hidden, s.heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = w(s.intermediate, s.hidden)
        t[p + "mlp.up_proj.weight"] = w(s.intermediate, s.hidden)
        t[p + "mlp.down_proj.weight"] = w(s.hidden, s.intermediate)
    save_file(t, str(out / "model.safetensors"))
    return sum(v.numel() * v.element_size() for v in t.values())


def engine_config(model_dir: Path, max_batch: int, forward: ForwardConfig,
                  budget: int = 64, graph_sizes: tuple[int, ...] = ()) -> CompiledConfig:
    return CompiledConfig(model=str(model_dir), engine=EngineConfig(
        device="cuda", dtype="bfloat16", execution="cuda_graph", max_num_seqs=max_batch,
        max_num_batched_tokens=max(max_batch, budget), kv_cache_tokens=65536,
        max_model_len=2048, enable_prefix_caching=False, forward=forward,
        graph_sizes=graph_sizes))


def decode_rate(core: Any, batch: int, num_tokens: int, run: str,
                prompt_tokens: int = PROMPT_TOKENS) -> float:
    """Output tokens per second of ``batch`` requests decoding together (decode steps only)."""
    params = GenerationParams(max_tokens=num_tokens, ignore_eos=True)
    for i in range(batch):  # distinct prompts: nothing shared, every row its own context
        core.add_request(f"{run}-{i}", [(7 * i + j) % 5000 + 5 for j in range(prompt_tokens)],
                         params)
    produced = 0
    while core.num_waiting or any(s.num_computed < prompt_tokens for s in core.requests.values()):
        outputs, _ = core.step()  # prefill (and the first tokens)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while core.has_work:
        outputs, _ = core.step()
        produced += sum(len(o.new_token_ids) for o in outputs)
    torch.cuda.synchronize()
    return produced / (time.perf_counter() - t0)


def host_profile(core: Any, batch: int, num_tokens: int, run: str, out: Path) -> None:
    """cProfile of one decode run's loop (by own time), appended to ``out``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    decode_rate(core, batch, num_tokens, run)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with out.open("a") as f:
        f.write(f"\n== host, {run}: batch {batch}, {num_tokens} tokens ==\n{text.getvalue()}")


def projection_rates(shape: Shape, nbytes_per: int = 2) -> list[dict[str, Any]]:
    """Each projection of the shape alone at 1 and 8 rows: cuBLAS vs the tuned skinny launch."""
    head_dim = shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    shapes = {"qkv": (q + 2 * kv, shape.hidden), "o": (shape.hidden, q),
              "gate_up": (2 * shape.intermediate, shape.hidden),
              "down": (shape.hidden, shape.intermediate), "lm_head": (shape.vocab, shape.hidden)}
    gemm = SkinnyGemm.for_shapes(shapes.values(), "cuda", torch.bfloat16)
    out = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        cfg = gemm.configs[(n, k)]
        for rows in (1, 8):
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            cublas, skinny = (time_ms(functools.partial(skinny_linear, x, w, None, c), iters=50)
                              for c in (CUBLAS, cfg))
            gb = n * k * nbytes_per / 1e9
            out.append({"proj": name, "rows": rows, "n": n, "k": k, "config": str(cfg),
                        "cublas_us": cublas * 1e3, "skinny_us": skinny * 1e3,
                        "cublas_TBps": gb / cublas, "skinny_TBps": gb / skinny})
            print(f"proj {name:<8} [{n:>6}, {k:>5}] rows {rows}: cuBLAS {cublas * 1e3:7.1f} us "
                  f"({gb / cublas:.2f} TB/s)  skinny {skinny * 1e3:7.1f} us "
                  f"({gb / skinny:.2f} TB/s)  {cfg}", flush=True)
    return out


def replay_ms(core: Any, batch: int, context: int, iters: int = 50) -> float:
    """Device ms of one graph replay for ``batch`` rows at ``context`` tokens each."""
    graphs = core.runner.graphs
    blocks = list(range(-(-context // 16) + 1))
    rows = [DecodeRow(token=5 + i, position=context - 1, block_table=blocks)
            for i in range(batch)]
    graphs.run(rows)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graphs.run(rows)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def prefill_rate(core: Any, prompt_tokens: int, run: str, repeats: int = 3) -> float:
    """Prompt tokens per second of one request's prefill alone (its chunks of the step
    budget, through the graphs that fit them), median of ``repeats`` prompts."""
    params = GenerationParams(max_tokens=1, ignore_eos=True)
    rates = []
    for r in range(repeats + 1):  # the first warms the chunk shapes
        core.add_request(f"{run}-prefill-{r}",
                         [(11 * r + 3 * j) % 5000 + 5 for j in range(prompt_tokens)], params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while core.has_work:
            core.step()
        torch.cuda.synchronize()
        if r:
            rates.append(prompt_tokens / (time.perf_counter() - t0))
    return sorted(rates)[len(rates) // 2]


def profile_step(core: Any, batch: int, context: int, out: Path,
                 title: str) -> list[tuple[str, int, float]]:
    """The kernels of one uncaptured decode step by CUDA time: (name, calls, total us)."""
    from torch.profiler import ProfilerActivity, profile

    graphs = core.runner.graphs
    blocks = list(range(-(-context // 16) + 1))
    rows = [DecodeRow(token=5 + i, position=context - 1, block_table=blocks)
            for i in range(batch)]
    graphs.run(rows)  # fills the inputs of the batch's bucket
    bucket = graphs._bucket_for[batch]
    for _ in range(3):
        graphs._forward(bucket, graphs.one_row_each)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graphs._forward(bucket, graphs.one_row_each)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    with out.open("a") as f:
        f.write(f"\n== {title}: 5 steps ==\n{table}\n")
        f.write(replay_timeline(graphs.decode_graph(bucket)))
    rows_out = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total > 0 and e.count:
            rows_out.append((e.key, e.count // 5, total / 5))
    return sorted(rows_out, key=lambda r: -r[2])


def profile_loop(core: Any, prompt_tokens: int, out: Path, title: str) -> None:
    """The device timeline of 4 batch-1 steps of the engine's loop: the work between two
    replays (sampling, copies, launch gaps) and the step's period."""
    from torch.profiler import ProfilerActivity, profile

    params = GenerationParams(max_tokens=64, ignore_eos=True)
    core.add_request(f"{title}-loop", [(5 + j) % 5000 + 5 for j in range(prompt_tokens)], params)
    for _ in range(24):
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            core.step()
        torch.cuda.synchronize()
    while core.has_work:
        core.step()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                     and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
    lines, end = [], None
    for e in events:
        gap = 0.0 if end is None else e.time_range.start - end
        end = max(end or 0, e.time_range.end)
        lines.append((e.time_range.start, e.time_range.end - e.time_range.start, gap, e.name))
    embeds = [t for t, _, _, n in lines if "embedding" in n.lower() or "indexSelect" in n]
    period = (embeds[-1] - embeds[0]) / max(1, len(embeds) - 1) if len(embeds) > 1 else 0.0
    gaps = sorted(lines, key=lambda r: -r[2])[:12]
    text = [f"== loop {title}: {len(lines)} device events over 4 steps, period {period:.1f} us"]
    text += [f"  gap {g:7.2f} us before {n[:80]} ({d:.2f} us)" for _, d, g, n in gaps]
    small = [r for r in lines if "Memcpy" in r[3] or "argmax" in r[3].lower()
             or "reduce" in r[3].lower() or "copy" in r[3].lower()]
    text += [f"  {d:7.2f} us  gap {g:6.2f}  {n[:90]}" for _, d, g, n in small[:24]]
    print("\n".join(text[:14]), flush=True)
    with out.open("a") as f:
        f.write("\n".join(text) + "\n" + "\n".join(
            f"{t:12.1f} {d:8.2f} gap {g:6.2f} {n[:100]}" for t, d, g, n in lines) + "\n")


def replay_timeline(graph: torch.cuda.CUDAGraph) -> str:
    """The kernels of one replay of ``graph`` in launch order: each one's us and the gap
    before it (the device idle between kernels), then per kernel name calls, us and gaps."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                      and e.time_range.elapsed_us() > 0 and "Memcpy" not in e.name
                      and "Memset" not in e.name), key=lambda e: e.time_range.start)
    if not kernels:
        return "replay: the profiler saw no kernels inside the graph\n"
    lines, by_name, end = [], {}, None
    for e in kernels:
        gap = 0.0 if end is None else e.time_range.start - end
        end = e.time_range.end
        dur = e.time_range.end - e.time_range.start
        lines.append(f"{dur:8.2f} us  gap {gap:6.2f}  {e.name[:90]}")
        c = by_name.setdefault(e.name[:90], [0, 0.0, 0.0])
        c[0] += 1
        c[1] += dur
        c[2] += gap
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    busy = sum(v[1] for v in by_name.values())
    head = (f"replay: {len(kernels)} kernels over {span:.1f} us, busy {busy:.1f} us, "
            f"gaps {span - busy:.1f} us\n")
    summary = "".join(f"{v[0]:5d} x {v[1]:9.1f} us (gaps {v[2]:7.1f})  {k}\n" for k, v in
                      sorted(by_name.items(), key=lambda kv: -kv[1][1]))
    print("  " + head.strip() + "\n" + summary, flush=True)
    return head + summary + "\n".join(lines) + "\n"


def transformers_rate(model_dir: Path, batch: int, num_tokens: int) -> float:
    """Greedy ``generate`` tok/s (eager, bf16): new tokens over the time beyond a 1-token call."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16).to("cuda").eval()
    ids = torch.tensor([[(7 * i + j) % 5000 + 5 for j in range(PROMPT_TOKENS)]
                        for i in range(batch)], device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(2)  # warm-up
    first = timed(1)
    total = timed(num_tokens)
    return batch * (num_tokens - 1) / (total - first)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--tokens", type=int, default=256, help="decode steps per batch-1 run")
    p.add_argument("--variants", nargs="+", default=list(VARIANT_SETS), choices=VARIANT_SETS)
    p.add_argument("--transformers-tokens", type=int, default=24, help="0 skips transformers")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                   help="prompt length (the context decoded over; split_attention is for long)")
    p.add_argument("--graph-sizes", type=int, nargs="*", default=[],
                   help="then the last variant set with engine.graph_sizes these")
    p.add_argument("--serial", action="store_true",
                   help="also each batch with every step in series (no step launched ahead)")
    p.add_argument("--skip-checks", action="store_true",
                   help="no kernel checks nor projection timings (the engine checks at build)")
    p.add_argument("--json", type=Path)
    p.add_argument("--profile", type=Path, help="file the per-kernel profiles go to")
    p.add_argument("--profile-loop", type=Path, help="file the batch-1 loop timelines go to")
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="also time one prompt of this many tokens' prefill (0: no)")
    p.add_argument("--profile-host", type=Path, help="file the host (cProfile) profiles go to")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(),
                              "torch": torch.__version__}
    bw = measure_bandwidth()
    print(f"device: {result['device']}  torch {torch.__version__}  copy bandwidth "
          f"{bw / 1e12:.2f} TB/s", flush=True)
    shape = Shape(layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "random-llama-1b"
        nbytes = write_checkpoint(model_dir, shape)
        roof = bw / nbytes
        result.update(bandwidth_Bps=bw, weight_bytes=nbytes, roofline_tok_s=roof)
        print(f"checkpoint {nbytes / 1e9:.2f} GB -> batch-1 roofline {roof:.0f} tok/s", flush=True)
        if not args.skip_checks:
            result["checks"] = check_kernels(shape)
            result["projections"] = projection_rates(shape)
        result["engine"] = run_engine(model_dir, args, roof)
        if args.transformers_tokens:
            result["transformers"] = {}
            for b in args.batches:
                rate = transformers_rate(model_dir, b, args.transformers_tokens)
                torch.cuda.empty_cache()
                result["transformers"][str(b)] = rate
                print(f"transformers eager generate  batch {b:>3}: {rate:9.0f} tok/s", flush=True)
        summarize(result, args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def check_kernels(shape: Shape) -> list[dict[str, Any]]:
    fs = ForwardShape(shape.hidden, shape.intermediate, shape.heads, shape.kv_heads,
                      shape.hidden // shape.heads, 1e-5, shape.rope_theta, shape.vocab)
    tuned: dict[str, Any] = {
        "skinny_gemm": SkinnyGemm.for_shapes(fs.projections(), "cuda", torch.bfloat16)}
    out = []
    for rows in (1, 8, 64, 512):
        for c in check_forward(VARIANTS, fs, "cuda", torch.bfloat16, rows, impls=tuned):
            out.append(dataclasses.asdict(c) | {"ok": c.ok})
            print(f"check {c.variant:<14} rows {rows:>3}: max |err| {c.max_abs_err:.3g}, "
                  f"{c.worst_ratio:.2f} of the bound  {'ok' if c.ok else 'FAILED'}", flush=True)
    return out


def run_engine(model_dir: Path, args: argparse.Namespace, roof: float) -> dict[str, Any]:
    max_batch = max(args.batches)
    core = load_core(engine_config(model_dir, max_batch, VARIANT_SETS[args.variants[0]],
                                   args.budget))
    out: dict[str, Any] = {}
    runs = [(name, ()) for name in args.variants]
    if args.graph_sizes:  # the last set again, capturing only these sizes
        runs.append((args.variants[-1], tuple(args.graph_sizes)))
    for name, sizes in runs:
        cfg = engine_config(model_dir, max_batch, VARIANT_SETS[name], args.budget, sizes)
        unfused = name.endswith("-unfused")
        SkinnyGemm.gated = _ungated if unfused else GATED  # type: ignore[method-assign]
        SkinnyGemm.norm_linear = _norm_apart if unfused else NORM_LINEAR  # type: ignore
        if sizes:
            name = f"{name}, graphs {list(sizes)}"
        try:
            reload_s = core.reload(cfg)
        except Exception as e:  # a variant refused (its check) or failing to capture
            print(f"engine {name}: reload failed: {type(e).__name__}: {e}", flush=True)
            out[name] = {"error": f"{type(e).__name__}: {e}"}  # the old config serves on
            continue
        if core.model.skinny is not None:
            print(f"engine {name}: projections {core.model.skinny.configs}", flush=True)
        graphs = core.runner.graphs
        print(f"engine {name}: reload {reload_s:.2f} s, {len(graphs.buckets)} graphs "
              f"(rows {graphs.buckets[0]}..{graphs.buckets[-1]}) captured in "
              f"{graphs.capture_s:.2f} s, replays timed in {graphs.timing_s:.2f} s", flush=True)
        entry: dict[str, Any] = {"reload_s": reload_s, "tok_s": {}, "replay_ms": {},
                                 "serial_tok_s": {}, "ahead_used": {}}
        if args.prefill_tokens:
            entry["prefill_tok_s"] = prefill_rate(core, args.prefill_tokens, name)
            print(f"engine {name:<14} prefill of a {args.prefill_tokens}-token prompt: "
                  f"{entry['prefill_tok_s']:9.0f} prompt tok/s", flush=True)
        for b in args.batches:
            tokens = max(64, args.tokens // max(1, b // 4)) if b > 1 else args.tokens
            prompt = args.prompt_tokens
            decode_rate(core, b, 16, f"{name}-warm-{b}", prompt)
            if args.serial:  # the same loop with every step in series (no launch ahead)
                core.runner.look_ahead = False
                serial = decode_rate(core, b, tokens, f"{name}-serial-{b}", prompt)
                core.runner.look_ahead = True
                entry["serial_tok_s"][str(b)] = serial
                print(f"engine {name:<14} batch {b:>3} in series: {serial:9.0f} tok/s", flush=True)
            used = core.runner.num_ahead_used
            rate = decode_rate(core, b, tokens, f"{name}-{b}", prompt)
            entry["ahead_used"][str(b)] = core.runner.num_ahead_used - used
            ms = replay_ms(core, b, prompt + tokens // 2)
            entry["tok_s"][str(b)], entry["replay_ms"][str(b)] = rate, ms
            frac = f"  {rate / roof:.2f} of the roofline" if b == 1 else ""
            print(f"engine {name:<14} reload {reload_s:5.2f} s  batch {b:>3}: {rate:9.0f} tok/s "
                  f"(graph replay {ms:.3f} ms/step = {b / ms * 1e3:9.0f} tok/s){frac}; "
                  f"{entry['ahead_used'][str(b)]} steps launched ahead", flush=True)
            if args.profile is not None and b == 1:
                top = profile_step(core, b, prompt + tokens // 2, args.profile,
                                   f"{name}, batch {b}")
                entry.setdefault("profile", {})[str(b)] = top[:25]
                total = sum(t for _, _, t in top)
                calls = sum(c for _, c, _ in top)
                print(f"  profile: {calls} kernels, {total:.0f} us of kernel time per step; top: "
                      + "; ".join(f"{k[:40]} x{c} {t:.0f}us" for k, c, t in top[:6]), flush=True)
            if args.profile_loop is not None and b == 1:
                profile_loop(core, prompt, args.profile_loop, name)
            if args.profile_host is not None and b in (1, max(args.batches)):
                host_profile(core, b, 64, f"{name}-host-{b}", args.profile_host)
        out[name] = entry
    return out


GATED, NORM_LINEAR = SkinnyGemm.gated, SkinnyGemm.norm_linear


def _ungated(self: SkinnyGemm, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from engine.fused import silu_mul

    return silu_mul(self(x, w))


def _norm_apart(self: SkinnyGemm, h: torch.Tensor, delta: torch.Tensor | None,
                nw: torch.Tensor, eps: float, w: torch.Tensor,
                bias: torch.Tensor | None = None, gated: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    from engine.fused import add_rms_norm

    x, h = add_rms_norm(h, delta, nw, eps)
    return (_ungated(self, x, w) if gated else self(x, w, bias)), h


def summarize(result: dict[str, Any], args: argparse.Namespace) -> None:
    engine, roof = result["engine"], result["roofline_tok_s"]
    base = engine.get("default")
    print("\n| variant set | " + " | ".join(f"batch {b}" for b in args.batches) + " | reload s |")
    print("|---|" + "---|" * len(args.batches) + "---|")
    for name, entry in engine.items():
        if "error" in entry:
            print(f"| {name} | " + " | ".join("-" for _ in args.batches) + " | failed |")
            continue
        cells, serial = [], []
        for b in args.batches:
            rate = entry["tok_s"][str(b)]
            ratio = f" ({rate / base['tok_s'][str(b)]:.2f}x)" if base and name != "default" else ""
            frac = f" [{rate / roof:.2f} roof]" if b == 1 else ""
            cells.append(f"{rate:,.0f}{ratio}{frac}")
            if str(b) in entry["serial_tok_s"]:
                s = entry["serial_tok_s"][str(b)]
                serial.append(f"{s:,.0f} ({rate / s:.2f}x ahead)"
                              + (f" [{s / roof:.2f} roof]" if b == 1 else ""))
        print(f"| {name} | " + " | ".join(cells) + f" | {entry['reload_s']:.2f} |")
        if serial:
            print(f"| {name}, in series | " + " | ".join(serial) + " | - |")
    if "transformers" in result:
        print("| transformers eager | " + " | ".join(
            f"{result['transformers'][str(b)]:,.0f}" for b in args.batches) + " | - |")


if __name__ == "__main__":
    sys.exit(main())
