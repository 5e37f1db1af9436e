"""What a speculative verify step costs against a plain decode step, and where it goes.

Runs the engine's real :class:`engine.runner.ModelRunner` (packed weights, the CPU
attention kernel, greedy verification in waves) on the bundled tiny target, one
intra-op thread as the engine's lanes use. For each batch size and depth k every
sequence verifies k draft tokens after ``--context`` cached tokens, either all
accepted (the drafts are the model's own greedy continuation) or all rejected
(the first draft is wrong, so only the first wave of rows is scored). Steps of
every depth are timed interleaved, CPU time of this process, best of
``--repeats`` rounds, and split into projections (every ``linear`` call),
attention, and the rest (norms, RoPE, cache writes, metadata, sampling, Python):

    python bench/verify_step.py                    # batch 1 at k = 0 1 2 4 8 16; 4, 16 at k = 2
    python bench/verify_step.py --batch 1 --depths 0 8

The last column is the projections' rate: k rows more cost k times a row's FLOPs
(2 x 6.3 M multiply-adds through the layers, plus 2 x 2.1 M for each row whose
logits are scored), so once the projections run at the core's FMA rate the
remaining lever is the rest, not the rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import model as model_module  # noqa: E402
from engine.checkpoint import load_weights, read_spec  # noqa: E402
from engine.model import LlamaModel  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from engine.scheduler import ScheduledSeq  # noqa: E402
from engine.sequence import GenerationParams, Sequence  # noqa: E402
from polyinfer.config import TINY_TARGET  # noqa: E402

BLOCK = 16


class PhaseClock:
    """Wraps the model's projection and attention calls to add up their CPU seconds."""

    def __init__(self, model: LlamaModel) -> None:
        self.seconds = {"projections": 0.0, "attention": 0.0}
        self.rows_flops = 0.0
        linear, attention = model.linear, model_module.paged_attention

        def timed_linear(x: torch.Tensor, w: object, *a: object) -> torch.Tensor:
            t0 = time.process_time()
            out = linear(x, w, *a)
            self.seconds["projections"] += time.process_time() - t0
            self.rows_flops += 2.0 * out.shape[0] * out.shape[1] * x.shape[1]
            return out

        def timed_attention(*a: object, **kw: object) -> torch.Tensor:
            t0 = time.process_time()
            out = attention(*a, **kw)  # type: ignore[arg-type]
            self.seconds["attention"] += time.process_time() - t0
            return out

        model.linear = timed_linear
        model_module.paged_attention = timed_attention  # type: ignore[assignment]

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.rows_flops = 0.0


def make_sequences(runner: ModelRunner, batch: int, context: int, max_depth: int,
                   gen: torch.Generator) -> list[Sequence]:
    """``batch`` sequences whose first ``context`` tokens are cached (random ids and K/V)."""
    per_seq = -(-(context + max_depth + 1) // BLOCK)
    seqs = []
    for i in range(batch):
        ids = torch.randint(0, runner.model.spec.vocab_size, (context + 1,), generator=gen)
        seq = Sequence(i, f"s{i}", ids.tolist(), context + 1, GenerationParams(max_tokens=64),
                       0.0)
        seq.num_computed = context
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(seq)
    return seqs


def greedy_continuation(runner: ModelRunner, seq: Sequence, length: int) -> list[int]:
    """The model's own next ``length`` tokens: drafts that verification accepts in full."""
    drafts: list[int] = []
    while len(drafts) < length:
        drafts = runner.execute([ScheduledSeq(seq, 1, drafts)])[0].tokens[:length]
    return drafts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    p.add_argument("--batched-depths", type=int, nargs="+", default=[0, 2],
                   help="depths for batches above 1")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    spec = read_spec(TINY_TARGET)
    model = LlamaModel(spec, load_weights(TINY_TARGET, spec.num_layers),
                       max_positions=args.context + 64)
    max_depth = max(args.depths + args.batched_depths)
    per_seq = -(-(args.context + max_depth + 1) // BLOCK)
    kv = model.new_kv_cache(max(args.batch) * per_seq, BLOCK)
    gen = torch.Generator().manual_seed(0)
    kv.k.normal_(generator=gen)
    kv.v.normal_(generator=gen)
    runner = ModelRunner(model, kv, short_q=max(max_depth + 1, 8))
    clock = PhaseClock(model)
    print(f"verify step vs plain decode step, {args.context}-token context, one thread, "
          "CPU ms (best of rounds)")
    print("| batch | k | drafts | step ms | x k=0 | projections ms | attention ms | rest ms "
          "| projection GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        depths = args.depths if batch == 1 else args.batched_depths
        seqs = make_sequences(runner, batch, args.context, max_depth, gen)
        accepted = [greedy_continuation(runner, s, max_depth) for s in seqs]
        steps = {(k, mode): step_fn(runner, seqs, accepted, k, mode)
                 for k in depths for mode in ("accepted", "rejected") if k or mode == "accepted"}
        best = time_interleaved(steps, clock, args.iters, args.repeats)
        base = best[(0, "accepted")][0]
        for (k, mode), (ms, proj, attn, gflops) in best.items():
            print(f"| {batch} | {k} | {mode if k else '-'} | {ms:.2f} | {ms / base:.2f} "
                  f"| {proj:.2f} | {attn:.2f} | {ms - proj - attn:.2f} | {gflops:.0f} |",
                  flush=True)


def step_fn(runner: ModelRunner, seqs: list[Sequence], accepted: list[list[int]], k: int,
            mode: str) -> Callable[[], object]:
    """One verify step of every sequence at depth ``k``; the cache is left as it was."""
    def drafts(cont: list[int]) -> list[int]:
        if mode == "accepted":
            return cont[:k]
        return [(cont[0] + 1) % runner.model.spec.vocab_size, *cont[1:k]]

    items = [ScheduledSeq(s, 1, drafts(c)) for s, c in zip(seqs, accepted, strict=True)]
    return lambda: runner.execute(items)


def time_interleaved(steps: dict[tuple[int, str], Callable[[], object]], clock: PhaseClock,
                     iters: int, repeats: int
                     ) -> dict[tuple[int, str], tuple[float, float, float, float]]:
    """Per step: (ms, projections ms, attention ms, projection GFLOP/s) of its best round."""
    best: dict[tuple[int, str], tuple[float, float, float, float]] = {}
    for fn in steps.values():
        fn()
    for _ in range(repeats):
        for key, fn in steps.items():
            clock.reset()
            t0 = time.process_time()
            for _ in range(iters):
                fn()
            ms = (time.process_time() - t0) / iters * 1e3
            proj = clock.seconds["projections"] / iters * 1e3
            attn = clock.seconds["attention"] / iters * 1e3
            gflops = clock.rows_flops / iters / (proj * 1e-3) / 1e9 if proj else 0.0
            if key not in best or ms < best[key][0]:
                best[key] = (ms, proj, attn, gflops)
    return best


if __name__ == "__main__":
    main()
