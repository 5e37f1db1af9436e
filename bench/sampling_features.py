"""What each sampling feature costs on the engine's decode step, and what seeded
(keyed) verification costs in acceptance against rejection sampling.

In-process on the bundled tiny model (``EngineCore``, no HTTP): a batch of
``--batch`` chat prompts decodes ``--max-tokens`` tokens each (``ignore_eos``), once
per feature, paired with a baseline run in AB / BA order over ``--rounds``; each row
prints the mean step time per generated token beside the baseline's (temperature 0.8,
unseeded, no penalties) measured in pairs with it, and the ratio. Then, per proposer
(n-gram, draft model) at
depth 4 and temperature 0.8, the acceptance rate (accepted / drafted) of unseeded
requests (rejection sampling) and of seeded ones (drafts accepted where they equal the
keyed sample; the draft draws with the same key).

    python bench/sampling_features.py                 # both tables (a few minutes, 2 cores)
    python bench/sampling_features.py --quick         # smaller
    python bench/sampling_features.py --skip-steps    # sampler micro-costs + acceptance

The sampler table ends with a json_schema grammar mask on every row (engine.grammar).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core import EngineCore
from engine.loader import load_core
from engine.sequence import GenerationParams
from polyinfer.config import TINY_DRAFT, TINY_TARGET, CompiledConfig, EngineConfig
from polyinfer.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

SPEC_BENCH = Path(__file__).resolve().parents[1] / "data" / "prompts" / "spec_bench_questions.jsonl"


def mixed_prompts(n: int) -> list[str]:
    """``n`` Spec-Bench first turns, one category after another (deterministic)."""
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()]
    by_cat: dict[str, list[str]] = {}
    for row in rows:
        by_cat.setdefault(row["category"], []).append(row["turns"][0])
    cats = sorted(by_cat)
    return [by_cat[cats[i % len(cats)]][i // len(cats)] for i in range(n)]


def chat_text(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


BASE = SamplingParams(0.8)
FEATURES: dict[str, tuple[SamplingParams, int | None]] = {
    "baseline (t=0.8)": (BASE, None),  # the reference every other row is paired with
    "greedy (t=0)": (SamplingParams(0.0), None),
    "seed (keyed draws)": (dataclasses.replace(BASE, seed=42), None),
    "presence+frequency": (dataclasses.replace(BASE, presence_penalty=0.5,
                                               frequency_penalty=0.5), None),
    "repetition_penalty": (dataclasses.replace(BASE, repetition_penalty=1.2), None),
    "logit_bias (8 tokens)": (dataclasses.replace(
        BASE, logit_bias=tuple((t, 1.0) for t in range(100, 108))), None),
    "min_tokens": (dataclasses.replace(BASE, min_tokens=10_000,
                                       min_tokens_ban=frozenset({2})), None),
    "min_p 0.05": (dataclasses.replace(BASE, min_p=0.05), None),
    "logprobs (top 5)": (BASE, 5),
    "all of the above": (dataclasses.replace(
        BASE, seed=42, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
        logit_bias=tuple((t, 1.0) for t in range(100, 108)), min_p=0.05), 5),
}


def _core(method: str) -> EngineCore:
    return load_core(CompiledConfig(model=str(TINY_TARGET), engine=EngineConfig(
        max_num_seqs=32, max_num_batched_tokens=1024, kv_cache_tokens=32768,
        spec_method=method, spec_max_depth=4,
        draft_model=str(TINY_DRAFT) if method == "draft" else "")))


def _run(core: EngineCore, prompts: list[list[int]], sampling: SamplingParams,
         logprobs: int | None, max_tokens: int, depth: int = 0) -> tuple[float, int, int, int]:
    """(decode seconds, generated tokens, drafted, accepted) for the batch."""
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, GenerationParams(
            max_tokens=max_tokens, sampling=sampling, ignore_eos=True, spec_depth=depth,
            logprobs=logprobs))
    seconds, num_tokens, drafted, accepted = 0.0, 0, {}, {}
    while core.has_work:
        t0 = time.perf_counter()
        outputs, stats = core.step()
        if stats.decode_step is not None and not stats.num_prompt_tokens:
            seconds += time.perf_counter() - t0
            num_tokens += stats.num_generated
        for o in outputs:
            drafted[o.request_id], accepted[o.request_id] = (o.num_draft_tokens,
                                                             o.num_accepted_tokens)
    return seconds, num_tokens, sum(drafted.values()), sum(accepted.values())


def step_costs(args: argparse.Namespace) -> None:
    """Each feature against the baseline run next to it (AB, then BA, ``--rounds`` pairs):
    the shared box's drift moves both sides of a ratio alike."""
    core = _core("none")
    prompts = [core.tokenizer.encode(chat_text(p)) for p in mixed_prompts(args.batch)]
    _run(core, prompts, BASE, None, 8)  # warm-up
    print(f"decode step per generated token, batch {args.batch}, {args.max_tokens} tokens, "
          f"{args.rounds} paired rounds (CPU, tiny model)")
    print(f"{'feature':24s} {'ms/token':>9s} {'baseline':>9s} {'ratio':>6s}")
    for name, (sampling, logprobs) in list(FEATURES.items())[1:]:
        sums = {"feature": [0.0, 0], "base": [0.0, 0]}
        for r in range(args.rounds):
            sides = [("base", BASE, None), ("feature", sampling, logprobs)]
            for side, sp, lp in (sides if r % 2 == 0 else sides[::-1]):
                s, n, _, _ = _run(core, prompts, sp, lp, args.max_tokens)
                sums[side][0] += s
                sums[side][1] += n
        per = sums["feature"][0] / sums["feature"][1]
        base = sums["base"][0] / sums["base"][1]
        print(f"{name:24s} {per * 1e3:9.3f} {base * 1e3:9.3f} {per / base:6.2f}", flush=True)


def sampler_costs(args: argparse.Namespace) -> None:
    """The sampler alone on [batch, vocab] logits (median of 50 calls): what each feature
    adds to a step, steadier than whole steps on a shared box."""
    import statistics

    import torch

    from polyinfer.sampling import Row, sample

    torch.set_num_threads(1)  # NOTE: the engine's own setting on this box (engine.core)
    vocab = 8192
    logits = torch.randn(args.batch, vocab)
    output = list(range(100, 100 + args.max_tokens))
    rows = [Row(300 + i, list(range(200)), output) for i in range(args.batch)]
    print(f"\nsampler per step, batch {args.batch}, vocab {vocab}, {args.max_tokens} output "
          f"tokens of history (median of 50 calls, ms)")
    print(f"{'feature':24s} {'ms/step':>9s} {'+ms/row':>8s}")
    base = None
    for name, (sampling, logprobs) in FEATURES.items():
        params = [sampling] * args.batch
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            tokens = sample(logits, params, rows)
            if logprobs:
                lp = torch.log_softmax(logits, dim=1)
                lp.gather(1, tokens.unsqueeze(1)).tolist()
                lp.topk(logprobs, dim=1).values.tolist()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        base = ms if base is None else base
        print(f"{name:24s} {ms:9.3f} {(ms - base) / args.batch:8.3f}")
    assert base is not None
    ms = _grammar_step_ms(args.batch, vocab, logits)
    print(f"{'json_schema mask':24s} {ms:9.3f} {(ms - base) / args.batch:8.3f}")


# a small schema of each JSON kind, for the grammar mask's row (engine.grammar)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}


def _grammar_step_ms(batch: int, vocab: int, logits: torch.Tensor) -> float:
    """Median ms of a baseline sampler step whose every row is masked by a json_schema
    matcher first (fill each row's bitmask, apply it), the matchers advanced by the
    sampled tokens (restarted when their JSON closes)."""
    import statistics

    from engine.grammar import GrammarSpec, grammars_for, mask_rows
    from engine.tokenizer import TextTokenizer
    from polyinfer.sampling import sample

    grammars = grammars_for(TextTokenizer(TINY_TARGET, (2,)), vocab)
    matchers = [grammars.matcher(GrammarSpec.json_schema(SCHEMA)) for _ in range(batch)]
    params = [BASE] * batch
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        tokens = sample(mask_rows(logits, matchers), params).tolist()
        times.append(time.perf_counter() - t0)
        for m, t in zip(matchers, tokens, strict=True):
            m.accept_token(t)
            if m.is_terminated():
                m.reset()
    return statistics.median(times) * 1e3


def acceptance(args: argparse.Namespace) -> None:
    print(f"\nacceptance at depth 4, temperature 0.8, batch {args.batch}, "
          f"{args.max_tokens} tokens: accepted / drafted")
    print(f"{'proposer':10s} {'rejection (unseeded)':>22s} {'keyed (seeded)':>16s} {'ratio':>6s}")
    for method in ("ngram", "draft"):
        core = _core(method)
        prompts = [core.tokenizer.encode(chat_text(p)) for p in mixed_prompts(args.batch)]
        rates = {}
        for label, sampling in (("unseeded", BASE), ("seeded", dataclasses.replace(BASE,
                                                                                   seed=7))):
            drafted = accepted = 0
            for _ in range(args.rounds):
                _, _, d, a = _run(core, prompts, sampling, None, args.max_tokens, depth=4)
                drafted, accepted = drafted + d, accepted + a
            rates[label] = accepted / max(drafted, 1)
        print(f"{method:10s} {rates['unseeded']:22.3f} {rates['seeded']:16.3f} "
              f"{rates['seeded'] / max(rates['unseeded'], 1e-9):6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-steps", action="store_true", help="no whole-step table")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.max_tokens, args.rounds = 4, 24, 1
    if not args.skip_steps:
        step_costs(args)
    sampler_costs(args)
    acceptance(args)


if __name__ == "__main__":
    main()
