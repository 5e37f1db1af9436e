"""Rebuild the bundled tiny model pair (tiny-target, tiny-draft) from local text only.

Stages (run all with ``--stage all``):

  corpus     assemble text from local sources: the Python standard library's
             source (code), GSM8K train problems (math, as chat turns), the
             Spec-Bench prompts and pydoc's topic help (prose / chat), and
             the licence texts under /usr/share/common-licenses (prose).
             A deterministic split by document hash holds out ~2% per domain.
  tokenizer  one byte-level BPE tokenizer (vocab 8192, ChatML special tokens)
             shared by both models.
  train      the target (Llama, 8 layers x 256, head_dim 64) on next-token
             loss, then the draft (2 layers x 128) on next-token loss plus
             distillation from the target's distribution, which raises the
             greedy acceptance rate that speculative decoding needs.
  eval       held-out perplexity of both models per domain and the greedy
             acceptance rate (draft argmax == target argmax) per domain.

CPU: ``python models/train.py --stage all --device cpu --steps 200`` gives a
working (weaker) pair in minutes. The shipped weights were trained on one GPU
with the defaults; models/README.md records the numbers and the command.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent / "data"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
VOCAB_SIZE = 8192
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TARGET_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)
DRAFT_SHAPE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=64)
MAX_POSITIONS = 2048


# ---------------------------------------------------------------- corpus


def chat(turns: list[tuple[str, str]]) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)


def iter_code(limit_bytes: int) -> Iterator[tuple[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    random.Random(0).shuffle(files)
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not 200 <= len(text) <= 200_000:
            continue
        yield str(path.relative_to(stdlib)), text
        total += len(text)
        if total >= limit_bytes:
            return


def iter_math(shared: Path) -> Iterator[tuple[str, str]]:
    with open(shared / "prompts" / "gsm8k_train.jsonl") as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            answer = row["answer"].replace("<<", "").replace(">>", " ")
            # alternate plain and chat renderings so both formats are learned
            if i % 2:
                yield f"gsm8k-{i}", chat([("user", row["question"]), ("assistant", answer)])
            else:
                yield f"gsm8k-{i}", f"Question: {row['question']}\nAnswer: {answer}\n"


def iter_prose(shared: Path) -> Iterator[tuple[str, str]]:
    with open(shared / "prompts" / "spec_bench_questions.jsonl") as f:
        for line in f:
            row = json.loads(line)
            yield f"specbench-{row['question_id']}", chat([("user", t) for t in row["turns"]])
    import pydoc_data.topics as topics

    for name, text in sorted(topics.topics.items()):
        yield f"pydoc-{name}", text
    licences = Path("/usr/share/common-licenses")
    if licences.is_dir():
        for p in sorted(licences.iterdir()):
            if p.is_file():
                yield f"licence-{p.name}", p.read_text(errors="ignore")


def is_held_out(doc_id: str, fraction: float = 0.02) -> bool:
    h = int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def build_corpus(shared: Path, out: Path, code_bytes: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    sources = {"code": iter_code(code_bytes), "math": iter_math(shared),
               "prose": iter_prose(shared)}
    stats = {}
    with gzip.open(out / "train.jsonl.gz", "wt") as train, \
            gzip.open(out / "heldout.jsonl.gz", "wt") as held:
        for domain, docs in sources.items():
            n_train = n_held = 0
            for doc_id, text in docs:
                sink = held if is_held_out(doc_id) else train
                sink.write(json.dumps({"domain": domain, "id": doc_id, "text": text}) + "\n")
                if sink is held:
                    n_held += len(text)
                else:
                    n_train += len(text)
            stats[domain] = {"train_chars": n_train, "heldout_chars": n_held}
    (out / "corpus_stats.json").write_text(json.dumps(stats, indent=2))
    print("corpus:", json.dumps(stats))


def read_docs(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(work: Path, out_dirs: list[Path]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = read_docs(work / "train.jsonl.gz")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator((d["text"] for d in docs), trainer=trainer)
    for out in out_dirs:
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "tokenizer.json"))
        write_tokenizer_config(out)
    print("tokenizer: vocab", tok.get_vocab_size())


def write_tokenizer_config(out: Path) -> None:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def encode_docs(tok_path: Path, docs: list[dict]) -> dict[str, list[list[int]]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    eot = tok.token_to_id("<|endoftext|>")
    by_domain: dict[str, list[list[int]]] = {}
    encodings = tok.encode_batch([d["text"] for d in docs])
    for d, enc in zip(docs, encodings, strict=True):
        by_domain.setdefault(d["domain"], []).append(enc.ids + [eot])
    return by_domain


# ---------------------------------------------------------------- training


def llama_config(shape: dict, tok_dir: Path):
    from transformers import LlamaConfig

    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = {t["content"]: t["id"] for t in tok["added_tokens"]}
    return LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                       bos_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|im_end|>"],
                       pad_token_id=vocab["<|pad|>"], hidden_act="silu",
                       attention_bias=False, mlp_bias=False, **shape)


def batches(stream, batch_size: int, seq_len: int, device, seed: int):
    import torch

    rng = random.Random(seed)
    n = stream.numel() - seq_len - 1
    while True:
        starts = torch.tensor([rng.randrange(n) for _ in range(batch_size)])
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
        chunk = stream[idx].to(device, non_blocking=True)
        yield chunk[:, :-1], chunk[:, 1:]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_model(shape: dict, work: Path, out: Path, args, teacher=None):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    ids = torch.load(work / "train_ids.pt").long()  # stored as int16: vocab < 32768
    model = LlamaForCausalLM(llama_config(shape, out)).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    data = batches(ids, args.batch_size, args.seq_len, device, args.seed)
    t0 = time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x, y = next(data)
        with autocast:
            logits = model(input_ids=x).logits.float()
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(input_ids=x).logits.float()
                kd = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits, -1),
                              log_target=True, reduction="batchmean") / x.size(1)
                loss = 0.3 * loss + 0.7 * kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"  step {step:5d} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
    model.eval()
    tokens_seen = args.steps * args.batch_size * args.seq_len
    save_model(model, out, num_params, tokens_seen)
    return model


def save_model(model, out: Path, num_params: int, tokens_seen: int) -> None:
    import torch
    from transformers import GenerationConfig

    # bf16 on disk keeps the pair well under the repo's weight budget; the
    # engines load it into float32 (or whatever dtype the config asks for).
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    # Older transformers and other loaders read these top-level keys.
    config_path = out / "config.json"
    raw = json.loads(config_path.read_text())
    raw.setdefault("rope_theta", raw.get("rope_parameters", {}).get("rope_theta", 10000.0))
    raw.setdefault("torch_dtype", "bfloat16")
    config_path.write_text(json.dumps(raw, indent=2))
    cfg = model.config
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=[cfg.eos_token_id, 0],
                     pad_token_id=cfg.pad_token_id, do_sample=False).save_pretrained(out)
    (out / "training.json").write_text(json.dumps(
        {"parameters": num_params, "training_tokens": tokens_seen}, indent=2))
    print(f"saved {out.name}: {num_params / 1e6:.2f} M parameters, {tokens_seen / 1e6:.1f} M tokens")


# ---------------------------------------------------------------- eval


def evaluate(work: Path, target_dir: Path, draft_dir: Path, device: str, seq_len: int) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    held = encode_docs(target_dir / "tokenizer.json", read_docs(work / "heldout.jsonl.gz"))
    target = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).to(device)
    draft = LlamaForCausalLM.from_pretrained(draft_dir, torch_dtype=torch.float32).to(device)
    report: dict = {}
    for domain, docs in held.items():
        flat = torch.tensor([t for d in docs for t in d])
        n = (flat.numel() - 1) // seq_len
        n = min(n, 64)
        x = flat[: n * seq_len].view(n, seq_len).to(device)
        y = flat[1: n * seq_len + 1].view(n, seq_len).to(device)
        sums = {"target": 0.0, "draft": 0.0}
        agree = total = 0
        with torch.no_grad():
            for i in range(0, n, 8):
                xb, yb = x[i:i + 8], y[i:i + 8]
                lt = target(input_ids=xb).logits.float()
                ld = draft(input_ids=xb).logits.float()
                sums["target"] += F.cross_entropy(lt.flatten(0, 1), yb.flatten(), reduction="sum").item()
                sums["draft"] += F.cross_entropy(ld.flatten(0, 1), yb.flatten(), reduction="sum").item()
                agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
                total += yb.numel()
        report[domain] = {
            "heldout_tokens": total,
            "target_ppl": round(math.exp(sums["target"] / total), 2),
            "draft_ppl": round(math.exp(sums["draft"] / total), 2),
            "greedy_acceptance": round(agree / total, 3),
        }
    print("eval:", json.dumps(report, indent=2))
    return report


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=["corpus", "tokenizer", "train", "eval", "all"], default="all")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="folder with prompts/gsm8k_train.jsonl and prompts/spec_bench_questions.jsonl "
                        "(default: the repository's data/, which keeps 2,500 of GSM8K's 7,473 rows)")
    p.add_argument("--work", type=Path, default=HERE / ".work", help="corpus and token cache")
    p.add_argument("--out", type=Path, default=HERE, help="where tiny-target/ and tiny-draft/ go")
    p.add_argument("--code-bytes", type=int, default=24_000_000)
    p.add_argument("--device", default="cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") != "" else "cpu")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--draft-steps", type=int, default=None, help="default: --steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        args.device = "cpu"
    target_dir, draft_dir = args.out / "tiny-target", args.out / "tiny-draft"
    stages = ["corpus", "tokenizer", "train", "eval"] if args.stage == "all" else [args.stage]
    if "corpus" in stages:
        build_corpus(args.data, args.work, args.code_bytes)
    if "tokenizer" in stages:
        train_tokenizer(args.work, [target_dir, draft_dir])
    if "train" in stages:
        docs = read_docs(args.work / "train.jsonl.gz")
        by_domain = encode_docs(target_dir / "tokenizer.json", docs)
        flat = [t for seqs in by_domain.values() for s in seqs for t in s]
        torch.save(torch.tensor(flat, dtype=torch.int16), args.work / "train_ids.pt")
        print(f"training tokens in corpus: {len(flat) / 1e6:.1f} M "
              + str({k: sum(map(len, v)) for k, v in by_domain.items()}))
        target = train_model(TARGET_SHAPE, args.work, target_dir, args)
        for prm in target.parameters():
            prm.requires_grad_(False)
        draft_args = argparse.Namespace(**{**vars(args), "steps": args.draft_steps or args.steps})
        train_model(DRAFT_SHAPE, args.work, draft_dir, draft_args, teacher=target)
    if "eval" in stages:
        report = evaluate(args.work, target_dir, draft_dir, args.device, args.seq_len)
        (args.out / "eval.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
