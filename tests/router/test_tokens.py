"""Token counts (calibrated estimate / exact), ChatML rendering and prefix-block ids."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from polyinfer.config import TINY_TARGET, ConfigError
from router.corpus import spec_bench
from router.tokens import (
    BUNDLED_BYTES_PER_TOKEN,
    TokenConfig,
    TokenCounter,
    render_chat,
    tokens_per_block,
)

SPEC_BENCH = Path(__file__).resolve().parents[2] / "data/prompts/spec_bench_questions.jsonl"


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.load(TINY_TARGET)


def _tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TINY_TARGET / "tokenizer.json"))


def test_exact_count_matches_the_tokenizer(counter: TokenCounter) -> None:
    tok = _tokenizer()
    for text in ("The quick brown fox jumps over the lazy dog. " * 10,
                 ("Sentence number %d talks about forests and rivers. " * 300) % tuple(range(300))):
        assert counter.count_exact(text) == len(tok.encode(text, add_special_tokens=False).ids)


def test_calibrated_estimate_is_close_on_long_real_prompts(counter: TokenCounter) -> None:
    """Held-out-style prompts (Spec-Bench, every domain) of >= 2 kB: within 15% at the median,
    30% at worst; the estimate reads only the byte count."""
    tok = _tokenizer()
    errors = []
    for e in spec_bench(SPEC_BENCH):
        data = e.text.encode()
        if len(data) >= 2048:
            exact = len(tok.encode(e.text, add_special_tokens=False).ids)
            errors.append(abs(counter.estimate(len(data), e.domain) - exact) / exact)
    errors.sort()
    assert len(errors) > 20
    assert errors[len(errors) // 2] < 0.15 and errors[-1] < 0.3


def test_calibration_is_the_ratio_of_sums_per_domain() -> None:
    c = TokenCounter(TokenConfig(), _tokenizer())
    texts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"]
    ratios = c.calibrate({"code": texts})
    expected = sum(len(t.encode()) for t in texts) / sum(c.count_exact(t) for t in texts)
    assert ratios["code"] == pytest.approx(expected)
    assert ratios["math"] == BUNDLED_BYTES_PER_TOKEN["math"]  # no texts: kept
    assert c.estimate(int(expected * 100), "code") == 100


def test_the_bundled_ratios_are_the_bundled_tokenizers_calibration(counter: TokenCounter) -> None:
    for domain, ratio in BUNDLED_BYTES_PER_TOKEN.items():
        assert counter.bytes_per_token[domain] == pytest.approx(ratio, abs=0.01), domain


def test_without_tokenizer_estimates_from_the_bundled_ratios(tmp_path: Path) -> None:
    c = TokenCounter.load(tmp_path)  # no tokenizer.json there
    assert not c.has_tokenizer
    assert c.estimate(400, "math") == round(400 / BUNDLED_BYTES_PER_TOKEN["math"])
    assert c.estimate(0, "math") == 0 and c.estimate(1, "math") == 1
    assert c.count_exact("x" * 400) == c.estimate(400, "")  # no tokenizer: the estimate
    assert TokenCounter.load(None).estimate(10, "nonsense") >= 1  # unknown domain: the mean


def test_near_means_within_the_estimates_error_margin() -> None:
    c = TokenCounter(TokenConfig(exact_margin=0.25))
    assert c.near(1000, 1200) and c.near(1000, 800) and c.near(1000, 1250)
    assert not c.near(1000, 1300) and not c.near(1000, 700)


def test_render_chat_equals_the_models_template() -> None:
    cfg = json.loads((TINY_TARGET / "tokenizer_config.json").read_text())
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Translate 'cat' to French."}]
    plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else "Hi"}
             for m in messages]
    expected = jinja2.Template(cfg["chat_template"]).render(messages=plain,
                                                            add_generation_prompt=True)
    assert render_chat(messages) == expected


def test_prefix_hashes_share_leading_blocks_only() -> None:
    c = TokenCounter(TokenConfig(block_chars=100, max_hash_blocks=8))
    a = b"A" * 250 + b"tail one"
    b = b"A" * 150 + b"B" * 100
    ha, hb = c.prefix_hashes(a), c.prefix_hashes(b)
    assert len(ha) == 2 and len(hb) == 2
    assert ha[0] == hb[0] and ha[1] != hb[1]
    assert c.prefix_hashes(b"short") == ()
    assert all(0 <= h < 2**63 for h in ha)
    assert len(c.prefix_hashes(b"x" * 10_000)) == 8  # capped
    # an id names the whole prefix: the same second block after a different first one
    assert c.prefix_hashes(b"C" * 100 + b"A" * 100)[1] != ha[1]
    assert c.prefix_hashes(a) == ha  # deterministic (no per-process salt)


@pytest.mark.parametrize("kwargs, key", [
    ({"block_chars": 0}, "block_chars"), ({"block_chars": 8}, "block_chars"),
    ({"block_chars": 1 << 20}, "block_chars"), ({"block_chars": 256.0}, "block_chars"),
    ({"block_chars": True}, "block_chars"), ({"max_hash_blocks": -1}, "max_hash_blocks"),
    ({"max_hash_blocks": 10_000}, "max_hash_blocks"),
    ({"bytes_per_token": {"code": 0}}, "bytes_per_token"),
    ({"bytes_per_token": {"poetry": 3.0}}, "bytes_per_token"),
    ({"exact_margin": 1.0}, "exact_margin"), ({"exact_inline_chars": -1}, "exact_inline_chars"),
    ({"chunk_cache_entries": -1}, "chunk_cache_entries"),
])
def test_bad_config_is_a_config_error_naming_the_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        TokenConfig(**kwargs)  # type: ignore[arg-type]


def test_default_prefix_blocks_are_about_64_tokens_and_tokens_per_block_uses_the_ratio() -> None:
    c = TokenCounter(TokenConfig())
    assert c.config.block_chars == 256
    assert len(c.prefix_hashes(b"x" * 1000)) == 3
    assert tokens_per_block(num_tokens=500, num_bytes=2000, block_chars=256) == 64.0
    assert tokens_per_block(num_tokens=0, num_bytes=0, block_chars=256) == 0.0


def test_chunked_counting_is_exact_on_real_prompts(counter: TokenCounter) -> None:
    tok = _tokenizer()
    texts = [e.text for e in spec_bench(SPEC_BENCH)][::3]
    texts += ["a" * 3000, "  spaced   out  words " * 50, "日本語のテキスト " * 80, "x\n y" * 300]
    for text in texts:
        assert counter.count_exact(text) == len(tok.encode(text, add_special_tokens=False)), \
            text[:80]


def test_shared_prefix_reuses_cached_chunk_counts() -> None:
    counter = TokenCounter.load(TINY_TARGET, calibration=None)
    tok = _tokenizer()
    system = "You are a careful assistant. Answer briefly and cite the passage you used. " * 8
    first, second = system + "What is the capital of France?", system + "Who wrote Hamlet?"
    for text in (first, second):
        assert counter.count_exact(text) == len(tok.encode(text, add_special_tokens=False))
    info = counter.cache_info()
    assert info["hits"] >= 2  # the system prompt's chunks, encoded once
    assert info["misses"] == info["entries"] and info["entries"] < 2 * info["hits"] + 4
    uncached = TokenCounter(TokenConfig(chunk_cache_entries=0), tok)
    assert uncached.count_exact(second) == counter.count_exact(second)
    assert uncached.cache_info()["entries"] == 0
