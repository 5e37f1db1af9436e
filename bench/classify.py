"""Request-shape estimation: its cost on this CPU beside a baseline, and its routing quality.

Cost (default). Prompts: every turn-prefix of the Spec-Bench questions (480
questions, 30 B - 7 kB) plus 500 GSM8K problems; prompts of ~2,000 tokens
(Spec-Bench prompts of one domain joined); 1 MB prompts. Each as a chat body,
and every call's text new: "(call k) " in front shifts every memoised chunk
and window, as production traffic does. Thread CPU time per call (on a shared
box, wall p99 is mostly preemption; CPU time is the cost of the call itself)
and wall time, which is how long the call holds the proxy's event loop.
``--baseline-src DIR`` (a source tree of an earlier commit, e.g.
``git archive HEAD~1 | tar -x -C DIR``) loads that tree's estimator into the
same process: they are timed alternately on the same prompts, so all see the
same noise; give it twice for an A/A pair (the spread between the two copies).
``--cold-mb 8`` adds the same timings with 8 MB of memory written before each call, as the
rest of a request's work leaves the caches in the proxy.

Quality (``--quality``), on the held-out split of router.dataset (half the
Spec-Bench question ids, 20% of GSM8K rows, 25% of stdlib modules; never
tuned on): classifier macro-F1 / accuracy per domain, and the token count's
error against the tokenizer's exact count of the rendered prompt, for this
estimator and the baseline. ``--train-full`` also trains a classifier that
reads the whole text (no head/tail windows) on the same training split and
scores it the same way (minutes).

Prefix (``--prefix``): Mooncake-shaped prompts (data/traces/mooncake_synthetic.jsonl
``hash_ids`` made into text by loadgen's synthesizer, each prompt capped at
``--prefix-max-tokens``), sent in order to one worker with an unbounded prefix
cache. The engine reuses whole 16-token KV blocks of the exact token ids; the
router's model credits matched prefix blocks x tokens per block. Printed: the
cached share of prompt tokens, engine vs model, for this estimator's byte
blocks, the baseline's, and token-aligned 64-token blocks (what tokenising
every prompt would give), with the per-request error of the model;
``--prefix-max-blocks N ...`` adds this estimator hashing at most N blocks.

``--write-calibration PATH`` writes the token calibration sample (prompts of
every domain from the training side) that router.tokens fits on at load.

    nice -n 10 .venv/bin/python bench/classify.py --baseline-src /tmp/shape-base
    nice -n 10 .venv/bin/python bench/classify.py --quality --prefix --baseline-src /tmp/shape-base
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from polyinfer.config import TINY_TARGET  # noqa: E402
from router.corpus import Example, gsm8k, spec_bench  # noqa: E402
from router.shape import ShapeConfig, ShapeEstimator  # noqa: E402
from router.tokens import TokenConfig, render_chat  # noqa: E402

CHAT = "/v1/chat/completions"
PARTS = ("polyinfer", "router")  # the packages a baseline tree brings its own copy of
ENGINE_KV_BLOCK = 16  # tokens per KV block the engine's prefix cache reuses
TOKEN_BLOCK = 64  # token-aligned model blocks (the tokenise-everything alternative)


# -- the baseline estimator, from another source tree, in this process -----------------------

def load_baseline(src: Path) -> Any:
    """``src``'s ``router.shape.ShapeEstimator`` class; this tree's modules are restored after."""
    ours = {k: v for k, v in sys.modules.items() if k.split(".")[0] in PARTS}
    for k in ours:
        del sys.modules[k]
    sys.path.insert(0, str(src.resolve()))
    try:
        cls = importlib.import_module("router.shape").ShapeEstimator
    finally:
        sys.path.remove(str(src.resolve()))
        for k in [k for k in sys.modules if k.split(".")[0] in PARTS]:
            del sys.modules[k]
        sys.modules.update(ours)
    return cls


class Side:
    """One estimator as the bench calls it: the whole estimate (sync), its parts."""

    def __init__(self, name: str, est: Any) -> None:
        self.name, self.est = name, est
        self.new_api = hasattr(est, "estimate_bounded")

    def estimate(self, body: dict) -> Any:
        if self.new_api:
            return self.est.estimate_bounded(body, CHAT)[0]
        return self.est.estimate(body, CHAT)

    def classify(self, body: dict) -> str:
        return str(self.est.classifier.predict(body["messages"][0]["content"]))


def sides(args: argparse.Namespace) -> list[Side]:
    out = [Side("new", ShapeEstimator.load(TINY_TARGET))]
    for i, src in enumerate(args.baseline_src):  # the same tree twice: an A/A pair
        name = "base" if i == 0 else f"base#{i + 1}"
        out.append(Side(name, load_baseline(src).load(TINY_TARGET)))
    return out


# -- prompts ---------------------------------------------------------------------------------

def real_prompts(data: Path) -> list[Example]:
    return [*spec_bench(data / "prompts/spec_bench_questions.jsonl"),
            *gsm8k(data / "prompts/gsm8k_train.jsonl", 500)]


def long_prompts(examples: Sequence[Example], count_exact: Callable[[str], int],
                 target_tokens: int = 2000, n: int = 64) -> list[str]:
    """``n`` prompts of >= ``target_tokens`` tokens: Spec-Bench prompts of one domain joined."""
    rng = random.Random(0)
    by_domain: dict[str, list[str]] = {}
    for e in examples:
        if e.source == "spec_bench":
            by_domain.setdefault(e.domain, []).append(e.text)
    domains = sorted(by_domain)
    out = []
    for i in range(n):
        pool = by_domain[domains[i % len(domains)]]
        parts = [rng.choice(pool)]
        while count_exact("\n\n".join(parts)) < target_tokens:
            parts += [rng.choice(pool) for _ in range(4)]
        text = "\n\n".join(parts)
        while count_exact(text) > target_tokens * 1.1:  # trim whole words to ~target
            text = text[: int(len(text) * 0.95)].rsplit(" ", 1)[0]
        out.append(text)
    return out


def chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


# -- cost ------------------------------------------------------------------------------------

def percentiles(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    return (xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))], xs[-1])


def time_rows(rows: list[tuple[str, Callable[[dict], object]]], texts: list[str],
              repeat: int, cold_mb: int = 0) -> None:
    """Each row called on every text made new for it, rows alternating per call (so that
    co-tenants' load falls on all of them alike). ``cold_mb``: every cache line of that many
    MB written before each call (what the rest of a request's work does to the caches in the
    proxy), outside the timed part."""
    junk = bytearray(cold_mb << 20)
    zeros = bytes(len(junk) // 64)
    wall: dict[str, list[float]] = {name: [] for name, _ in rows}
    cpu: dict[str, list[float]] = {name: [] for name, _ in rows}
    for k in range(repeat):
        for i, text in enumerate(texts):
            order = rows if (i + k) % 2 == 0 else rows[::-1]
            for name, fn in order:
                body = chat(f"(call {k} {name}{' cold' if cold_mb else ''}) {text}")
                if cold_mb:
                    junk[::64] = zeros
                c, t = time.thread_time_ns(), time.perf_counter_ns()
                fn(body)
                wall[name].append((time.perf_counter_ns() - t) * 1e-3)
                cpu[name].append((time.thread_time_ns() - c) * 1e-3)
    for name, _ in rows:
        p50, p99, mx = percentiles(wall[name])
        c50, c99, _ = percentiles(cpu[name])
        print(f"  {name:<24} n={len(wall[name]):>5}  cpu p50 {c50:7.1f} p99 {c99:7.1f} us | "
              f"wall p50 {p50:7.1f} p99 {p99:7.1f} max {mx:8.1f} us")


def cost(args: argparse.Namespace, ss: list[Side]) -> None:
    examples = real_prompts(args.data)
    texts = [e.text for e in examples]
    longs = long_prompts(examples, ss[0].est.counter.count_exact)
    huge = [t * (1_000_000 // len(t)) for t in texts[:20]]
    for s in ss:  # warm-up (imports, first allocations)
        for t in texts[:50]:
            s.estimate(chat(t))
    rows: list[tuple[str, Callable[[dict], object]]] = []
    for s in ss:
        rows.append((f"{s.name} classify", s.classify))
        if not s.new_api:
            counter = s.est.counter
            rows.append((f"{s.name} count tokens",
                         lambda b, c=counter: c.count(render_chat(b["messages"]))))
        rows.append((f"{s.name} estimate", s.estimate))
    lens = [len(t) for t in texts]
    print(f"# real prompts: {len(texts)}, chars p50 {statistics.median(lens):.0f} max "
          f"{max(lens)}; x{args.repeat}, every call's text new")
    time_rows(rows, texts, args.repeat)
    n = [ss[0].est.counter.count_exact(t) for t in longs]
    print(f"# ~2,000-token prompts: {len(longs)}, tokens {min(n)}-{max(n)}, chars "
          f"{min(map(len, longs))}-{max(map(len, longs))}; x{4 * args.repeat}")
    time_rows(rows, longs, 4 * args.repeat)
    print(f"# 1 MB prompts: {len(huge)}; x{args.repeat}")
    time_rows([r for r in rows if r[0].endswith("estimate")], huge, args.repeat)
    if args.cold_mb:  # NOTE: last: freeing the sweep's buffer moves malloc's mmap threshold
        print(f"# real prompts again, {args.cold_mb} MB swept before each call (cold caches)")
        time_rows(rows, texts, args.repeat, args.cold_mb)
        print(f"# ~2,000-token prompts again, {args.cold_mb} MB swept before each call")
        time_rows(rows, longs, 4 * args.repeat, args.cold_mb)


# -- quality ---------------------------------------------------------------------------------

def held_out(data: Path) -> tuple[list[Example], list[Example]]:
    from router.dataset import build_default

    split = build_default(data)
    return split.train, split.test


def classifier_quality(ss: list[Side], test: list[Example], more: Sequence[str] = ()) -> None:
    from router.training import evaluate

    sb = [e for e in test if e.source == "spec_bench"]
    for s in ss:
        for name, exs in (("held-out Spec-Bench ids", sb), ("all held-out", test)):
            r = evaluate(s.est.classifier, exs)
            per = " ".join(f"{d} {v['f1']:.3f}" for d, v in r["per_domain"].items())
            print(f"  {s.name:<5} {name:<24} macro-F1 {r['macro_f1']:.3f} accuracy "
                  f"{r['accuracy']:.3f} (n={r['num_examples']}) | F1 {per}")
    texts = [e.text for e in test] + list(more)
    ours = [ss[0].est.classifier.predict(t) for t in texts]
    for s in ss[1:]:
        differ = sum(a != s.est.classifier.predict(t) for a, t in zip(ours, texts, strict=True))
        print(f"  {s.name} decides otherwise than {ss[0].name} on {differ} of {len(texts)} prompts "
              f"(every held-out prompt and the cost prompts)")


def shape_agreement(ss: list[Side], texts: Sequence[str]) -> None:
    """How many bodies each baseline shapes otherwise than this estimator (every field of the
    RequestShape): each text as a one-message chat with a new head, as a four-message chat
    and as a completions prompt of 1-9 copies."""
    bodies: list[tuple[dict, str]] = []
    for i, t in enumerate(texts):
        bodies.append((chat(f"(request {i}) {t}"), CHAT))
        bodies.append(({"model": "m", "max_tokens": 7, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": t},
            {"role": "assistant", "content": t[:50]},
            {"content": [{"type": "text", "text": t[-80:]}]}]}, CHAT))
        bodies.append(({"model": "m", "prompt": t * (1 + i % 9)}, "/v1/completions"))
    ours = [ss[0].est.estimate_bounded(b, ep) for b, ep in bodies]
    for s in ss[1:]:
        if not s.new_api:
            continue
        differ = sum((vars(a[0]), a[1]) != (vars(s.est.estimate_bounded(b, ep)[0]),
                                            s.est.estimate_bounded(b, ep)[1])
                     for a, (b, ep) in zip(ours, bodies, strict=True))
        print(f"  {s.name} shapes otherwise than {ss[0].name}: {differ} of {len(bodies)} bodies")


def train_full_text(train: list[Example], test: list[Example]) -> None:
    """Bounded windows (the shipped features) against the whole text, same split."""
    from router.classifier import FeatureConfig
    from router.training import evaluate
    from router.training import train as fit

    sb = [e for e in test if e.source == "spec_bench"]
    big = 1 << 30
    for name, fc in (("windows", FeatureConfig()),
                     ("whole text", FeatureConfig(head_chars=big, tail_chars=0))):
        t = time.perf_counter()
        clf = fit(train, None, fc)
        r, ra = evaluate(clf, sb), evaluate(clf, test)
        print(f"  trained, {name:<10} held-out Spec-Bench macro-F1 {r['macro_f1']:.3f} "
              f"accuracy {r['accuracy']:.3f} | all held-out {ra['macro_f1']:.3f} / "
              f"{ra['accuracy']:.3f} ({time.perf_counter() - t:.0f} s)")


def error_line(name: str, est: np.ndarray, exact: np.ndarray) -> str:
    rel = np.abs(est - exact) / np.maximum(exact, 1)
    ab = np.abs(est - exact)
    q = np.percentile(rel, [50, 90, 99])
    return (f"  {name:<28} n={len(exact):>4} |rel err| p50 {q[0]:.3f} p90 {q[1]:.3f} p99 "
            f"{q[2]:.3f} max {rel.max():.3f} bias {np.mean((est - exact) / np.maximum(exact, 1)):+.3f}"
            f" | |err| tokens p50 {np.percentile(ab, 50):.0f} p99 {np.percentile(ab, 99):.0f}")


def token_quality(ss: list[Side], test: list[Example], longs: list[str]) -> None:
    counter = ss[0].est.counter
    print("  calibrated bytes/token: "
          + " ".join(f"{d} {v:.2f}" for d, v in sorted(counter.bytes_per_token.items())))
    for set_name, texts, domains in (
            ("held-out", [e.text for e in test], [e.domain for e in test]),
            ("~2,000-token", longs, ["-"] * len(longs))):
        bodies = [chat(t) for t in texts]
        exact = np.array([counter.count_exact(render_chat(b["messages"])) for b in bodies], float)
        for s in ss:
            est = np.array([s.estimate(b).prompt_tokens for b in bodies], float)
            print(error_line(f"{s.name} {set_name}", est, exact))
            if set_name != "held-out":
                continue
            big = exact >= 500
            print(error_line(f"{s.name} held-out >= 500 tokens", est[big], exact[big]))
            if s is ss[0]:
                for d in sorted(set(domains)):
                    m = np.array([x == d for x in domains])
                    print(error_line(f"{s.name}   {d}", est[m], exact[m]))


# -- prefix blocks ---------------------------------------------------------------------------

def mooncake_prompts(path: Path, offset: int, count: int, max_tokens: int) -> list[str]:
    from loadgen.synth import PromptSynthesizer
    from loadgen.tokenizer import load_token_counter

    synth = PromptSynthesizer(load_token_counter(TINY_TARGET), block_tokens=512)
    rows = [json.loads(line) for line in path.read_text().splitlines()[offset:offset + count]]
    out = []
    for i, row in enumerate(rows):
        n = min(int(row["input_length"]), max_tokens)
        out.append(synth.prompt(n, offset + i, tuple(row["hash_ids"][: -(-n // 512)])))
    return out


def leading_in(hashes: Sequence[int], seen: set[int]) -> int:
    n = 0
    for h in hashes:
        if h not in seen:
            break
        n += 1
    seen.update(hashes)
    return n


def token_block_hashes(ids: list[int], size: int) -> list[int]:
    """Chained ids of the whole ``size``-token blocks (equal = same token prefix)."""
    out, h = [], 0
    for i in range(len(ids) // size):
        h = hash((h, tuple(ids[i * size:(i + 1) * size])))
        out.append(h)
    return out


def prefix_quality(ss: list[Side], args: argparse.Namespace) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_TARGET / "tokenizer.json"))
    prompts = mooncake_prompts(args.data / "traces/mooncake_synthetic.jsonl", args.prefix_offset,
                               args.prefix_requests, args.prefix_max_tokens)
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    total = sum(map(len, ids))
    seen: set[int] = set()
    engine = np.array([ENGINE_KV_BLOCK * leading_in(token_block_hashes(x, ENGINE_KV_BLOCK), seen)
                       for x in ids], float)
    print(f"# {len(prompts)} Mooncake-shaped prompts (offset {args.prefix_offset}, <= "
          f"{args.prefix_max_tokens} tokens, {total} tokens); engine reuses "
          f"{engine.sum() / total:.3f} of prompt tokens ({ENGINE_KV_BLOCK}-token KV blocks)")
    models: list[tuple[str, np.ndarray]] = []
    seen = set()
    models.append((f"token-aligned {TOKEN_BLOCK}-token blocks", np.array(
        [TOKEN_BLOCK * leading_in(token_block_hashes(x, TOKEN_BLOCK), seen) for x in ids],
        float)))
    for blocks in args.prefix_max_blocks:  # the same estimator with fewer blocks hashed
        ss = [*ss, Side(f"new, <= {blocks} blocks", ShapeEstimator.load(
            TINY_TARGET, config=ShapeConfig(tokens=TokenConfig(max_hash_blocks=blocks))))]
    for s in ss:
        seen = set()
        cached = []
        for p, x in zip(prompts, ids, strict=True):
            shape = s.est.estimate_bounded({"prompt": p}, "/v1/completions")[0] if s.new_api \
                else s.est.estimate({"prompt": p}, "/v1/completions")
            n = leading_in(shape.prefix_hashes, seen)
            cached.append(min(n * shape.prefix_block_tokens, float(len(x))))
        models.append((f"{s.name} byte blocks", np.array(cached)))
    for name, model in models:
        err = np.abs(model - engine)
        print(f"  {name:<32} modelled cached share {model.sum() / total:.3f} "
              f"(engine {engine.sum() / total:.3f}); per-request |model - engine| mean "
              f"{err.mean():.0f} p90 {np.percentile(err, 90):.0f} tokens")


# -- calibration sample ----------------------------------------------------------------------

def write_calibration(path: Path, train: list[Example], per_domain: int = 16,
                      max_chars: int = 1500) -> None:
    """Real prompts of each domain first (templates only where too few are real)."""
    rng = random.Random(0)
    texts = {}
    for d in sorted({e.domain for e in train}):
        real = [e.text for e in train if e.domain == d and e.source != "template"]
        made = [e.text for e in train if e.domain == d and e.source == "template"]
        picked = rng.sample(real, min(per_domain, len(real)))
        picked += rng.sample(made, min(per_domain - len(picked), len(made)))
        texts[d] = [t if len(t) <= max_chars else t[:max_chars].rsplit(" ", 1)[0]
                    for t in picked]
    path.write_text(json.dumps({
        "source": "router.dataset.build_default(data).train (none held out): per domain, real "
                  "prompts (Spec-Bench, GSM8K, stdlib) first, router.templates rows where too "
                  "few are real",
        "texts": texts}, ensure_ascii=False, indent=0) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes): " + ", ".join(
        f"{d} {len(v)}" for d, v in texts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=REPO / "data")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline-src", type=Path, action="append", default=[],
                    help="a source tree to time beside this one (repeatable)")
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--cold-mb", type=int, default=0, metavar="MB",
                    help="also time every call after sweeping MB of memory (cold caches)")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--train-full", action="store_true")
    ap.add_argument("--prefix", action="store_true")
    ap.add_argument("--prefix-offset", type=int, default=3500)
    ap.add_argument("--prefix-requests", type=int, default=400)
    ap.add_argument("--prefix-max-tokens", type=int, default=4096)
    ap.add_argument("--prefix-max-blocks", type=int, nargs="*", default=[],
                    help="with --prefix: also this estimator hashing at most N blocks")
    ap.add_argument("--write-calibration", type=Path, default=None, metavar="PATH")
    args = ap.parse_args()
    if args.write_calibration:
        write_calibration(args.write_calibration, held_out(args.data)[0])
        return
    ss = sides(args)
    if not args.no_cost:
        cost(args, ss)
    if args.quality or args.train_full:
        train, test = held_out(args.data)
        print("# classifier, held out")
        classifier_quality(ss, test, [e.text for e in real_prompts(args.data)])
        shape_agreement(ss, [e.text for e in test + train]
                        + [e.text for e in real_prompts(args.data) if e.source == "spec_bench"])
        if args.train_full:
            train_full_text(train, test)
        print("# token count against the tokenizer's exact count of the rendered prompt")
        longs = long_prompts(real_prompts(args.data), ss[0].est.counter.count_exact, n=32)
        token_quality(ss, test, longs)
    if args.prefix:
        prefix_quality(ss, args)
    print(json.dumps({s.name: s.est.classifier.meta.get("version") for s in ss}))


if __name__ == "__main__":
    main()
