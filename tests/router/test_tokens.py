"""Token counts (exact / extrapolated / estimated), ChatML rendering and prefix hashes."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from polyinfer.config import TINY_TARGET, ConfigError
from router.tokens import TokenConfig, TokenCounter, render_chat, tokens_per_block


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.load(TINY_TARGET)


def test_exact_count_matches_the_tokenizer(counter: TokenCounter) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_TARGET / "tokenizer.json"))
    text = "The quick brown fox jumps over the lazy dog. " * 10
    got = counter.count(text)
    assert got.exact and got.num_tokens == len(tok.encode(text, add_special_tokens=False).ids)


def test_long_prompt_extrapolates_from_its_own_head(counter: TokenCounter) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_TARGET / "tokenizer.json"))
    text = ("Sentence number %d talks about forests and rivers. " * 300) % tuple(range(300))
    true = len(tok.encode(text, add_special_tokens=False).ids)
    got = counter.count(text)
    assert not got.exact
    assert abs(got.num_tokens - true) / true < 0.1


def test_without_tokenizer_estimates_from_length(tmp_path: Path) -> None:
    c = TokenCounter.load(tmp_path)  # no tokenizer.json there
    assert not c.has_tokenizer
    assert c.count("x" * 400).num_tokens == 100
    assert c.count("").num_tokens == 0
    assert TokenCounter.load(None).count("abcd").num_tokens == 1


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
    a = "A" * 250 + "tail one"
    b = "A" * 150 + "B" * 100
    ha, hb = c.prefix_hashes(a), c.prefix_hashes(b)
    assert len(ha) == 2 and len(hb) == 2
    assert ha[0] == hb[0] and ha[1] != hb[1]
    assert c.prefix_hashes("short") == ()
    assert all(0 <= h < 2**63 for h in ha)
    assert len(c.prefix_hashes("x" * 10_000)) == 8  # capped


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        TokenConfig(exact_max_chars=100, sample_chars=200)


@pytest.mark.parametrize("kwargs, key", [
    ({"block_chars": 0}, "block_chars"), ({"block_chars": 8}, "block_chars"),
    ({"block_chars": 1 << 20}, "block_chars"), ({"block_chars": 256.0}, "block_chars"),
    ({"block_chars": True}, "block_chars"), ({"max_hash_blocks": -1}, "max_hash_blocks"),
    ({"max_hash_blocks": 10_000}, "max_hash_blocks"), ({"chars_per_token": 0}, "chars_per_token"),
])
def test_bad_prefix_block_config_is_a_config_error_naming_the_key(
        kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        TokenConfig(**kwargs)  # type: ignore[arg-type]


def test_default_prefix_blocks_are_about_64_tokens_and_tokens_per_block_uses_the_ratio() -> None:
    c = TokenCounter(TokenConfig())
    assert c.config.block_chars == 256
    assert len(c.prefix_hashes("x" * 1000)) == 3
    assert tokens_per_block(num_tokens=500, num_chars=2000, block_chars=256) == 64.0
    assert tokens_per_block(num_tokens=0, num_chars=0, block_chars=256) == 0.0


def test_chunked_counting_is_exact_on_real_prompts(counter: TokenCounter) -> None:
    from tokenizers import Tokenizer

    from router.corpus import spec_bench

    tok = Tokenizer.from_file(str(TINY_TARGET / "tokenizer.json"))
    path = Path(__file__).resolve().parents[2] / "data/prompts/spec_bench_questions.jsonl"
    texts = [e.text for e in spec_bench(path)][::3]
    texts += ["a" * 3000, "  spaced   out  words " * 50, "日本語のテキスト " * 80, "x\n y" * 300]
    for text in texts:
        piece = text[:1024]
        assert counter._encoded_len(piece) == len(tok.encode(piece, add_special_tokens=False)), \
            piece[:80]


def test_shared_prefix_reuses_cached_chunk_counts() -> None:
    from tokenizers import Tokenizer

    counter = TokenCounter.load(TINY_TARGET)
    tok = Tokenizer.from_file(str(TINY_TARGET / "tokenizer.json"))
    system = "You are a careful assistant. Answer briefly and cite the passage you used. " * 8
    first, second = system + "What is the capital of France?", system + "Who wrote Hamlet?"
    for text in (first, second):
        assert counter.count(text).num_tokens == len(tok.encode(text, add_special_tokens=False))
    info = counter.cache_info()
    assert info["hits"] >= 2  # the system prompt's chunks, encoded once
    assert info["misses"] == info["entries"] and info["entries"] < 2 * info["hits"] + 4
    uncached = TokenCounter(TokenConfig(chunk_cache_entries=0), tok)
    assert uncached.count(second) == counter.count(second)
    assert uncached.cache_info()["entries"] == 0
