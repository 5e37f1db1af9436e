"""Prompt token counts and prefix-block identities, sized for the event loop.

Routing needs a prompt's token count to the precision of its latency model
(prefill time, prompt-length band, cached share), not to the token; it needs
the exact count only where a decision turns on it, near a worker's context
limit. So there are two counts:

- :meth:`TokenCounter.estimate`: UTF-8 bytes / the domain's bytes per token,
  O(1) once the bytes are known. The ratios are fitted at load on the served
  model's tokenizer (:meth:`TokenCounter.calibrate`) over a shipped sample of
  prompts of every domain (``router/data/token_calibration.json``, from the
  classifier's training side); without a tokenizer the ratios fitted on the
  bundled one are used. bench/classify.py measures the error on held-out
  prompts (on the bundled tokenizer: |relative error| p50 ~6%, p99 ~30%,
  mostly short prompts; ~4% / ~14% at >= 500 tokens).
- :meth:`TokenCounter.count_exact`: the tokenizer over the whole text. Its
  cost grows with the text (~0.3 us a character), so the shape estimator calls
  it inline only for short texts and otherwise off the event loop.

Chat messages are rendered as ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``
+ the generation prompt), which is exactly the bundled models' template and a
close approximation of other templates' overhead.

Exact counts encode word-aligned pieces of ~256 characters, cut at positions
that depend only on the text before them, memoised in a bounded LRU: prompts
that share a prefix encode only what is new; the count is the same either way.

Prefix identities: fixed blocks of ``block_chars`` bytes of the UTF-8 rendered
prompt, each identified by the CRC-32 of the whole prefix up to its end (it
chains, one C call a block: ~0.4 us a block here against ~1.4 us for blake2b)
and the block's offset, for at most ``max_hash_blocks`` blocks. Equal prefixes give equal
ids in every process. No tokenisation is needed: the router's prefix-cache
model (:mod:`router.affinity`) counts a request's cached tokens as matched
blocks x the prompt's own tokens per block (:func:`tokens_per_block`). The
blocks should be small against the shared prefixes of the traffic (a system
prompt, earlier turns) and large against the engine's 16-token KV blocks: the
default, 256 bytes, is about 64 tokens of English. The cost against
token-aligned blocks (a shared prefix is credited up to its last whole byte
block) is measured by bench/classify.py --prefix on Mooncake-shaped prompts.
"""

from __future__ import annotations

import functools
import json
import logging
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyinfer.config import DOMAINS, ConfigError

logger = logging.getLogger(__name__)


CHUNK_CHARS = 256  # encode in word-aligned pieces of about this many characters
# NOTE: below ~16 bytes a block is a few tokens (more hashing than the cache model can use:
# the engine caches 16-token KV blocks); above 64 kB one block is most prompts (no sharing seen).
MIN_BLOCK_CHARS, MAX_BLOCK_CHARS, MAX_HASH_BLOCKS = 16, 65536, 4096
GENERATION_PROMPT = "<|im_start|>assistant\n"  # ChatML's, after the messages
CALIBRATION_SAMPLE = Path(__file__).resolve().parent / "data" / "token_calibration.json"
# NOTE: UTF-8 bytes per token of the bundled tokenizer (models/tiny-target), fitted by
# TokenCounter.calibrate on CALIBRATION_SAMPLE; used without a tokenizer.
BUNDLED_BYTES_PER_TOKEN = {"chat": 3.398, "code": 3.848, "extraction": 3.032, "math": 3.579,
                           "qa": 3.166, "rag": 3.005, "summarization": 3.235,
                           "translation": 2.342}


def _chunk_end(text: str, target: int) -> int | None:
    """The first position in [target, target + CHUNK_CHARS) just before " <letter>" (a
    pre-token boundary); ``len(text)`` when target is past the end; None when none."""
    if target >= len(text):
        return len(text)
    stop = min(len(text) - 1, target + CHUNK_CHARS)
    i = text.find(" ", target, stop)
    while i != -1:
        if text[i + 1].isalpha() and not text[i - 1].isspace():
            return i
        i = text.find(" ", i + 1, stop)
    return None


def _check_int(value: object, key: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{key}: expected an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class TokenConfig:
    # UTF-8 bytes per token per domain before calibration (no tokenizer: these are used)
    bytes_per_token: dict[str, float] = field(
        default_factory=lambda: dict(BUNDLED_BYTES_PER_TOKEN))
    # NOTE: the estimate's relative error at ~p99 on held-out prompts (bench/classify.py);
    # a decision edge (a context limit) this close to the estimate gets an exact count.
    exact_margin: float = 0.35
    exact_inline_chars: int = 512  # exact counts of texts up to this size run inline (~150 us)
    block_chars: int = 256  # prefix-hash block in UTF-8 bytes, ~64 tokens of English
    max_hash_blocks: int = 128  # hash at most this many leading blocks (~8k tokens)
    chunk_cache_entries: int = 8192  # memoised chunk counts of exact counts (0 = none)

    def __post_init__(self) -> None:
        if self.chunk_cache_entries < 0:
            raise ConfigError(f"chunk_cache_entries: expected >= 0, got {self.chunk_cache_entries!r}")
        bad = {d: v for d, v in self.bytes_per_token.items()
               if d not in DOMAINS or not isinstance(v, (int, float)) or not v > 0}
        if bad:
            raise ConfigError(f"bytes_per_token: expected > 0 for domains of {DOMAINS}, got {bad}")
        if not 0.0 <= self.exact_margin < 1.0:
            raise ConfigError(f"exact_margin: expected [0, 1), got {self.exact_margin!r}")
        _check_int(self.exact_inline_chars, "exact_inline_chars", 0, 1 << 20)
        _check_int(self.block_chars, "block_chars", MIN_BLOCK_CHARS, MAX_BLOCK_CHARS)
        _check_int(self.max_hash_blocks, "max_hash_blocks", 0, MAX_HASH_BLOCKS)


def tokens_per_block(num_tokens: int, num_bytes: int, block_chars: int) -> float:
    """Prompt tokens in one ``block_chars``-byte prefix block, from the prompt's own ratio."""
    return block_chars * num_tokens / num_bytes if num_bytes > 0 else 0.0


class TokenCounter:
    """Estimates prompt tokens from bytes, counts them exactly on request, hashes prefix
    blocks."""

    def __init__(self, config: TokenConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        self._tok = tokenizer  # tokenizers.Tokenizer or None
        self.bytes_per_token = dict(config.bytes_per_token)  # replaced by calibrate()
        self._default_bpt = sum(self.bytes_per_token.values()) / max(1, len(self.bytes_per_token))
        # NOTE: per instance, not module-level; functools' C LRU costs ~0.1 us a hit.
        self._chunk_len = functools.lru_cache(maxsize=config.chunk_cache_entries)(
            self._encode_len)
        size = config.block_chars
        self._blocks = [(slice(start, start + size), start << 32)
                        for start in range(0, size * config.max_hash_blocks, size)]

    @classmethod
    def load(cls, tokenizer_dir: str | Path | None, config: TokenConfig | None = None,
             calibration: Path | None = CALIBRATION_SAMPLE) -> TokenCounter:
        """Load ``tokenizer.json`` from a model directory and calibrate on it (blocking:
        start-up only); ``None`` (or no file) = estimates from the bundled ratios."""
        config = config or TokenConfig()
        if tokenizer_dir is None:
            return cls(config)
        path = Path(tokenizer_dir) / "tokenizer.json"
        if not path.is_file():
            logger.warning("no tokenizer at %s; prompt tokens will be estimated", path)
            return cls(config)
        from tokenizers import Tokenizer

        counter = cls(config, Tokenizer.from_file(str(path)))
        if calibration is not None:
            counter.calibrate(load_calibration_sample(calibration))
        return counter

    @property
    def has_tokenizer(self) -> bool:
        return self._tok is not None

    def calibrate(self, texts: Mapping[str, Sequence[str]]) -> dict[str, float]:
        """Fit each domain's bytes per token on this tokenizer (ratio of sums, so long
        prompts weigh as they cost); domains without texts keep their ratio."""
        for domain, sample in texts.items():
            num_tokens = sum(self.count_exact(t) for t in sample)
            if domain in DOMAINS and num_tokens > 0:
                self.bytes_per_token[domain] = sum(len(t.encode()) for t in sample) / num_tokens
        self._default_bpt = sum(self.bytes_per_token.values()) / len(self.bytes_per_token)
        return dict(self.bytes_per_token)

    def estimate(self, num_bytes: int, domain: str) -> int:
        """Tokens of a text of ``num_bytes`` UTF-8 bytes in ``domain``."""
        if num_bytes <= 0:
            return 0
        return max(1, round(num_bytes / self.bytes_per_token.get(domain, self._default_bpt)))

    def near(self, num_tokens: int, edge: int) -> bool:
        """Whether the exact count could fall on either side of ``edge``."""
        return abs(num_tokens - edge) <= self.config.exact_margin * max(num_tokens, 1)

    def count_exact(self, text: str) -> int:
        """Token count of ``text`` with the tokenizer (the estimate without one).

        Blocking, ~0.3 us a character: off the event loop for long texts.

        NOTE: the tokenizers library's encode cost grows faster than linearly past a
        few hundred characters here (~0.3 us/char at 256, ~0.8 at 1024, ~1.9 at
        2048). Chunks end just before a " <letter>" boundary, where a GPT-2 style
        (ByteLevel) pre-tokenizer splits anyway, so BPE sees the same words and the
        count is the same (tests/router/test_tokens.py checks it on real prompts).
        """
        if self._tok is None:
            return self.estimate(len(text.encode("utf-8", "surrogatepass")), "")
        total, start = 0, 0
        while start < len(text):
            # no boundary nearby (one huge "word"): encode the rest whole
            end = _chunk_end(text, start + CHUNK_CHARS) or len(text)
            total += self._chunk_len(text[start:end])
            start = end
        return total

    def _encode_len(self, chunk: str) -> int:
        assert self._tok is not None
        return len(self._tok.encode(chunk, add_special_tokens=False))

    def cache_info(self) -> dict[str, int]:
        info = self._chunk_len.cache_info()
        return {"hits": info.hits, "misses": info.misses, "entries": info.currsize}

    def prefix_hashes(self, data: bytes) -> tuple[int, ...]:
        """Ids of the leading whole ``block_chars``-byte blocks of ``data`` (UTF-8), each
        identifying the whole prefix up to its block's end.

        NOTE: an id is the CRC-32 of the whole prefix (it chains: the previous block's value
        is the next call's start) above the block's byte offset. 32 bits suffice for a
        routing estimate: only prefixes of the same length can share an id, with chance
        2**-32 a pair, so a worker's model of 100k blocks credits a wrong block in fewer
        than 1 in 40,000 lookups. One C call a block; a second checksum (Adler-32, for 63
        bits) cost ~40% more.
        """
        crc32, crc = zlib.crc32, 0
        out: list[int] = []
        append = out.append
        # NOTE: (slice, offset << 32) built once: a loop over them costs ~15% less than
        # slicing by a range's start each time; a bytes slice (a 256-byte copy) costs less
        # than a memoryview slice object
        for block, offset in self._blocks[: len(data) // self.config.block_chars]:
            crc = crc32(data[block], crc)
            append(offset | crc)
        return tuple(out)


def load_calibration_sample(path: Path) -> dict[str, list[str]]:
    """``{"texts": {domain: [prompt, ...]}}`` as written by bench/classify.py."""
    try:
        texts = json.loads(path.read_text())["texts"]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{path}: cannot read the token calibration sample: {e}") from e
    return {d: [t for t in v if isinstance(t, str)] for d, v in texts.items() if d in DOMAINS}


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """ChatML rendering of OpenAI chat messages (text parts only)."""
    parts = [f"<|im_start|>{m.get('role', 'user')}\n{message_text(m)}<|im_end|>\n"
             for m in messages if isinstance(m, Mapping)]
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)


def message_text(message: Mapping[str, Any]) -> str:
    """The text of one message: a string, or the ``text`` parts of a content list."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content
                         if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""
