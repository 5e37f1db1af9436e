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
    python bench/sampling_features.py --masks-only --device cuda   # grammar masks alone

The sampler table ends with a json_schema grammar mask on every row (engine.grammar); the
mask table (``--masks-only``, and after the sampler table) times each kind of constraint
(json_schema, regex, choice, EBNF grammar) alone on ``--device``'s logits, at batch 1 and
``--batch``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core import EngineCore
from engine.grammar import GrammarSpec
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
         logprobs: int | None, max_tokens: int, depth: int = 0,
         grammar: GrammarSpec | None = None) -> tuple[float, int, int, int]:
    """(decode seconds, generated tokens, drafted, accepted) for the batch."""
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, GenerationParams(
            max_tokens=max_tokens, sampling=sampling, ignore_eos=True, spec_depth=depth,
            logprobs=logprobs, grammar=grammar))
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

    from engine.grammar import grammars_for, mask_rows
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


# one constraint of each kind that structured_outputs takes (engine.grammar)
MASKS = {
    "json_schema": ("json_schema", SCHEMA),
    "regex": ("regex", r"[a-z]{3,8}-\d{2,4}( [A-Z][a-z]{1,8})?"),
    "choice (4)": ("choice", ["positive", "negative", "neutral", "mixed feelings"]),
    "grammar (EBNF)": ("grammar", 'root ::= greeting " " name ("," " " name)? "!"\n'
                                  'greeting ::= "hello" | "hi"\n'
                                  'name ::= [A-Z] [a-z] [a-z]? [a-z]?'),
}


def mask_costs(args: argparse.Namespace) -> None:
    """Each kind of constraint's mask alone (fill every row's bitmask on the host, apply it
    to ``--device``'s logits, read the argmax back), minus the same step unmasked: median
    of 200 steps, the matchers advanced by the argmax and restarted when they close."""
    import statistics

    import torch

    from engine.grammar import grammars_for, mask_rows
    from engine.tokenizer import TextTokenizer

    torch.set_num_threads(1)
    vocab = 8192
    grammars = grammars_for(TextTokenizer(TINY_TARGET, (2,)), vocab)
    print(f"\ngrammar mask per decode step on {args.device}, vocab {vocab} (median of 200 "
          f"steps, ms; + = added to an unmasked argmax step)")
    print(f"{'constraint':16s} {'batch':>5s} {'ms/step':>8s} {'+ms/row':>8s}")
    for batch in sorted({1, args.batch}):
        logits = torch.randn(batch, vocab, device=args.device)
        for name, (kind, source) in MASKS.items():
            spec = getattr(GrammarSpec, kind)(source)
            matchers = [grammars.matcher(spec) for _ in range(batch)]
            times: dict[bool, list[float]] = {False: [], True: []}
            for step in range(400):
                masked = step % 2 == 1
                t0 = time.perf_counter()
                out = mask_rows(logits, matchers) if masked else logits
                tokens = out.argmax(dim=1).tolist()
                times[masked].append(time.perf_counter() - t0)
                if masked:
                    for m, t in zip(matchers, tokens, strict=True):
                        assert m.accept_token(t)
                        if m.is_terminated():
                            m.reset()
            ms = statistics.median(times[True]) * 1e3
            base = statistics.median(times[False]) * 1e3
            print(f"{name:16s} {batch:5d} {ms:8.3f} {(ms - base) / batch:8.3f}", flush=True)


def seed_texts(args: argparse.Namespace) -> None:
    """The text of one seeded request (temperature 0.8, seed 42, 32 tokens) on each
    ``--seed-texts`` DEVICE:DTYPE, to see where a seed gives the same text and where not."""
    prompt = chat_text(mixed_prompts(1)[0])
    print("\nseed 42, temperature 0.8, 32 tokens, depth 0 and 4 (draft model):")
    for where in args.seed_texts.split(","):
        device, dtype = where.split(":")
        core = load_core(CompiledConfig(model=str(TINY_TARGET), engine=EngineConfig(
            device=device, dtype=dtype, spec_method="draft", draft_model=str(TINY_DRAFT))))
        for depth in (0, 4):
            core.add_request("r", core.tokenizer.encode(prompt), GenerationParams(
                max_tokens=32, sampling=dataclasses.replace(BASE, seed=42), spec_depth=depth))
            text = ""
            while core.has_work:
                text += "".join(o.text for o in core.step()[0])
            print(f"{device:5s} {dtype:9s} depth {depth}: {text!r}", flush=True)


def acceptance(args: argparse.Namespace) -> None:
    print(f"\nacceptance at depth 4, temperature 0.8, batch {args.batch}, "
          f"{args.max_tokens} tokens: accepted / drafted")
    print(f"{'proposer':10s} {'rejection (unseeded)':>22s} {'keyed (seeded)':>16s} {'ratio':>6s}")
    for method in ("ngram", "draft"):
        core = _core(method)
        prompts = [core.tokenizer.encode(chat_text(p)) for p in mixed_prompts(args.batch)]
        for grammar in (None, GrammarSpec.json_schema(SCHEMA)):
            rates = {}
            for label, sampling in (("unseeded", BASE), ("seeded", dataclasses.replace(
                    BASE, seed=7))):
                drafted = accepted = 0
                for _ in range(args.rounds):
                    _, _, d, a = _run(core, prompts, sampling, None, args.max_tokens, depth=4,
                                      grammar=grammar)
                    drafted, accepted = drafted + d, accepted + a
                rates[label] = accepted / max(drafted, 1)
            name = method + (" json" if grammar else "")
            print(f"{name:10s} {rates['unseeded']:22.3f} {rates['seeded']:16.3f} "
                  f"{rates['seeded'] / max(rates['unseeded'], 1e-9):6.2f}", flush=True)


def constrained_speed(args: argparse.Namespace) -> None:
    """A json_schema-constrained batch at depth 0 against depth 4, per proposer, paired in
    AB / BA order (seeded, temperature 0.8): ms per generated token of decode steps."""
    grammar = GrammarSpec.json_schema(SCHEMA)
    print(f"\njson_schema-constrained decode, batch {args.batch}, seeded t=0.8: ms per "
          "generated token at depth 0 and 4")
    print(f"{'proposer':10s} {'depth 0':>8s} {'depth 4':>8s} {'0 / 4':>6s}")
    sampling = dataclasses.replace(BASE, seed=7)
    for method in ("ngram", "draft"):
        core = _core(method)
        prompts = [core.tokenizer.encode(chat_text(p)) for p in mixed_prompts(args.batch)]
        _run(core, prompts, sampling, None, 8, grammar=grammar)  # warm-up
        sums = {0: [0.0, 0], 4: [0.0, 0]}
        for r in range(args.rounds):
            for depth in ((0, 4) if r % 2 == 0 else (4, 0)):
                sec, n, _, _ = _run(core, prompts, sampling, None, args.max_tokens, depth,
                                    grammar)
                sums[depth][0] += sec
                sums[depth][1] += n
        ms = {d: v[0] / max(v[1], 1) * 1e3 for d, v in sums.items()}
        print(f"{method:10s} {ms[0]:8.3f} {ms[4]:8.3f} {ms[0] / ms[4]:6.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-steps", action="store_true", help="no whole-step table")
    parser.add_argument("--masks-only", action="store_true", help="only the mask table")
    parser.add_argument("--constrained-only", action="store_true",
                        help="only the constrained decode's speed at depth 0 and 4")
    parser.add_argument("--device", default="cpu", help="the mask table's logits device")
    parser.add_argument("--seed-texts", default="", metavar="DEVICE:DTYPE,...",
                        help="only the seeded texts on each device and dtype")
    args = parser.parse_args()
    if args.seed_texts:
        seed_texts(args)
        return
    if args.constrained_only:
        constrained_speed(args)
        return
    if args.quick:
        args.batch, args.max_tokens, args.rounds = 4, 24, 1
    if not args.masks_only:
        if not args.skip_steps:
            step_costs(args)
        sampler_costs(args)
    mask_costs(args)
    if not args.masks_only:
        acceptance(args)
        constrained_speed(args)


if __name__ == "__main__":
    main()
