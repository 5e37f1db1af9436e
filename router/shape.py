"""Request shape estimation: OpenAI request body -> :class:`router.base.RequestShape`.

The proxy builds one :class:`ShapeEstimator` at start-up (loading the
tokenizer, calibrating the token estimate on it and loading the classifier
artefact there, never in a handler) and awaits ``estimate(body, endpoint)`` for
every request. The work on the event loop is bounded whatever the prompt's
size, and spent on what routing needs (bench/classify.py measures cost and
quality, side by side with the previous estimator):

- the domain from the classifier's fixed head and tail windows of the text;
- the token count estimated from the prompt's UTF-8 bytes and the domain's
  calibrated bytes per token (:mod:`router.tokens`), made exact where a
  decision turns on it: when ``prompt + max_tokens`` may be on either side of
  one of ``ShapeConfig.exact_edges_tokens`` (the workers' context limits).
  That count runs inline for short texts and in the loop's default executor
  otherwise (the tokenizer releases the GIL);
- prefix-block ids from the first ``max_hash_blocks`` byte blocks, with no
  tokenisation.

It never raises on a malformed body; the proxy validates bodies itself.

Identical prompts (a benchmark's fixed prompt, a retried request, a popular
template) are common, so the text-dependent part of the estimate (domain,
token estimate, prefix hashes) is memoised in a bounded LRU keyed by the exact
texts (``ShapeConfig.cache_entries``; prompts longer than ``cache_max_chars``
are not cached, which bounds its memory). A hit returns exactly what a miss
would compute.

It also learns the output length per domain: the proxy passes each finished
request to ``observe`` (the same :class:`RequestOutcome` it gives the policy).

Example::

    est = ShapeEstimator.load("models/tiny-target")
    shape = await est.estimate({"messages": [{"role": "user", "content": "Summarize: ..."}]},
                               "/v1/chat/completions")
    shape.domain, shape.prompt_tokens, shape.predicted_output_tokens
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyinfer.config import DOMAINS
from router.base import RequestOutcome, RequestShape, fast_constructor
from router.classifier import DomainClassifier
from router.tokens import (
    GENERATION_PROMPT,
    TokenConfig,
    TokenCounter,
    message_text,
    render_chat,
    tokens_per_block,
)

logger = logging.getLogger(__name__)

# (domain, estimated prompt tokens, prefix-block hashes, prompt tokens per prefix block)
TextShape = tuple[str, int, tuple[int, ...], float]
# NOTE: a prompt's bytes are counted from at most this many characters and extrapolated
# (an ASCII prompt's byte count is its length, whatever its size).
COUNT_BYTES_CHARS = 65536
MAX_ROLES = 64  # chat template sizes memoised per role (system, user, assistant, tool, ...)
# NOTE: priors only (rough typical answer lengths); replaced by each domain's
# observed mean after a few requests.
OUTPUT_PRIOR_TOKENS = {"code": 256, "math": 192, "chat": 256, "qa": 64, "summarization": 128,
                       "translation": 64, "rag": 96, "extraction": 96}


@dataclass(frozen=True)
class ShapeConfig:
    tokens: TokenConfig = field(default_factory=TokenConfig)
    output_prior_tokens: dict[str, int] = field(default_factory=lambda: dict(OUTPUT_PRIOR_TOKENS))
    output_ewma_alpha: float = 0.05  # weight of each new observation in the per-domain mean
    max_predicted_output_tokens: int = 4096
    slo_ttft_s: dict[str, float] = field(default_factory=dict)  # per-domain defaults, seconds
    slo_tpot_s: dict[str, float] = field(default_factory=dict)
    default_domain: str = "chat"  # for empty / unreadable prompts
    cache_entries: int = 4096  # memoised text shapes (0 = no cache)
    # NOTE: keys are the texts themselves, so memory is bounded by entries x this:
    # at most ~16 MB of keys.
    cache_max_chars: int = 4096  # prompts longer than this (rendered + classified) bypass it
    # prompt + max_tokens limits (the workers' context lengths) near which the count is exact
    exact_edges_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.cache_entries < 0 or self.cache_max_chars < 0:
            raise ValueError("cache_entries and cache_max_chars must be >= 0")
        if any(isinstance(e, bool) or not isinstance(e, int) or e <= 0
               for e in self.exact_edges_tokens):
            raise ValueError(f"exact_edges_tokens: expected positive integers, got "
                             f"{self.exact_edges_tokens!r}")
        for name in ("output_prior_tokens", "slo_ttft_s", "slo_tpot_s"):
            unknown = set(getattr(self, name)) - set(DOMAINS)
            if unknown:
                raise ValueError(f"{name}: unknown domain(s) {sorted(unknown)}")
        if not 0.0 < self.output_ewma_alpha <= 1.0:
            raise ValueError(f"output_ewma_alpha: expected (0, 1], got {self.output_ewma_alpha}")
        if self.default_domain not in DOMAINS:
            raise ValueError(f"default_domain: expected one of {DOMAINS}")


class OutputLengthPredictor:
    """Per-domain exponentially weighted mean of completion tokens, from a prior."""

    def __init__(self, prior: Mapping[str, int], alpha: float, cap: int) -> None:
        self._mean = {d: float(prior.get(d, 128)) for d in DOMAINS}
        self._num = dict.fromkeys(DOMAINS, 0)
        self._alpha = alpha
        self._cap = cap

    def predict(self, domain: str) -> int:
        return max(1, min(self._cap, round(self._mean.get(domain, 128.0))))

    def observe(self, domain: str, completion_tokens: int) -> None:
        if domain not in self._mean or completion_tokens <= 0:
            return
        self._num[domain] += 1
        # NOTE: a plain mean for the first 1/alpha samples, so the prior washes out fast.
        a = max(self._alpha, 1.0 / self._num[domain])
        self._mean[domain] += a * (completion_tokens - self._mean[domain])

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {d: {"mean_tokens": round(self._mean[d], 1), "num_observed": self._num[d]}
                for d in DOMAINS}


class ShapeEstimator:
    """Computes a RequestShape from a request body; learns output lengths from outcomes."""

    def __init__(self, classifier: DomainClassifier, counter: TokenCounter,
                 config: ShapeConfig | None = None) -> None:
        self.config = config or ShapeConfig()
        self.classifier = classifier
        self.counter = counter
        self.output = OutputLengthPredictor(self.config.output_prior_tokens,
                                            self.config.output_ewma_alpha,
                                            self.config.max_predicted_output_tokens)
        # NOTE: per instance (no module-level cache); functools' C LRU costs ~0.1 us a hit.
        self._role_templates: dict[str, tuple[int, int]] = {}  # role -> (bytes, tokens)
        self._cached_text_shape = functools.lru_cache(maxsize=self.config.cache_entries)(
            self._text_shape)

    @classmethod
    def load(cls, tokenizer_dir: str | Path | None = None, classifier_path: str | Path | None = None,
             config: ShapeConfig | None = None) -> ShapeEstimator:
        """Blocking (reads files): call at start-up. ``None`` paths = estimate / shipped artefact."""
        config = config or ShapeConfig()
        return cls(DomainClassifier.load(classifier_path),
                   TokenCounter.load(tokenizer_dir, config.tokens), config)

    async def estimate(self, body: Mapping[str, Any], endpoint: str) -> RequestShape:
        """The shape; an exact count of a long prompt near an edge runs off the loop."""
        shape, text = self.estimate_bounded(body, endpoint)
        if text is None:
            return shape
        loop = asyncio.get_running_loop()
        num_tokens = await loop.run_in_executor(None, self.counter.count_exact, text)
        return self._with_tokens(shape, num_tokens)

    def estimate_bounded(self, body: Mapping[str, Any], endpoint: str
                         ) -> tuple[RequestShape, str | None]:
        """The shape from bounded work, and the text still to count exactly (or None).

        Synchronous: what ``estimate`` does on the event loop.
        """
        rendered, classify_text, roles = _prompt_texts(body, endpoint)
        text_shape: TextShape
        if rendered is None:  # token ids: nothing to tokenize or hash
            text_shape = (self._classify(classify_text), _token_ids_len(body), (), 0.0)
        elif len(rendered) + len(classify_text) <= self.config.cache_max_chars:
            text_shape = self._cached_text_shape(rendered, classify_text, roles)
        else:
            text_shape = self._text_shape(rendered, classify_text, roles)
        domain, num_tokens, hashes, block_tokens = text_shape
        max_tokens = _int_or_none(body.get("max_completion_tokens", body.get("max_tokens")))
        predicted = max_tokens if max_tokens is not None else self.output.predict(domain)
        shape = _new_shape({
            "domain": domain, "prompt_tokens": num_tokens, "max_tokens": max_tokens,
            "predicted_output_tokens": predicted, "stream": body.get("stream") is True,
            "prefix_hashes": hashes, "prefix_block_tokens": block_tokens,
            "speculative_depth": _int_or_none(body.get("speculative_depth")),
            "slo_ttft_s": (_float_or_none(body.get("slo_ttft_s"))
                           or self.config.slo_ttft_s.get(domain)),
            "slo_tpot_s": (_float_or_none(body.get("slo_tpot_s"))
                           or self.config.slo_tpot_s.get(domain)),
        })
        if not rendered or not self._near_an_edge(num_tokens, max_tokens or 0):
            return shape, None
        if len(rendered) <= self.config.tokens.exact_inline_chars:
            return self._with_tokens(shape, self.counter.count_exact(rendered)), None
        return shape, rendered

    def _near_an_edge(self, num_tokens: int, max_tokens: int) -> bool:
        """``counter.near(num_tokens, edge - max_tokens)`` for some edge (a loop, no
        generator: it runs for every request)."""
        near = self.counter.near
        for edge in self.config.exact_edges_tokens:
            if near(num_tokens, edge - max_tokens):
                return True
        return False

    def _with_tokens(self, shape: RequestShape, num_tokens: int) -> RequestShape:
        """``shape`` with an exact count (tokens per prefix block rescaled to it)."""
        scale = num_tokens / shape.prompt_tokens if shape.prompt_tokens else 0.0
        return dataclasses.replace(shape, prompt_tokens=num_tokens,
                                   prefix_block_tokens=shape.prefix_block_tokens * scale)

    def observe(self, outcome: RequestOutcome) -> None:
        if outcome.status == "ok":
            self.output.observe(outcome.shape.domain, outcome.completion_tokens)

    def stats(self) -> dict[str, Any]:
        info = self._cached_text_shape.cache_info()
        return {"tokenizer": self.counter.has_tokenizer,
                "classifier": self.classifier.meta.get("version", "unknown"),
                "output_tokens": self.output.snapshot(),
                "cache": {"hits": info.hits, "misses": info.misses, "entries": info.currsize}}

    def _text_shape(self, rendered: str, classify_text: str, roles: tuple[str, ...] | None
                    ) -> TextShape:
        """Everything that depends on the texts (bounded work, whatever their size)."""
        domain = self._classify(classify_text)
        tc = self.config.tokens
        head = rendered[: tc.block_chars * tc.max_hash_blocks]
        data = head.encode("utf-8", "surrogatepass")
        num_bytes = _num_bytes(rendered, head, len(data))
        template_bytes, template_tokens = self._template(roles) if roles is not None else (0, 0)
        num_tokens = template_tokens + self.counter.estimate(num_bytes - template_bytes, domain)
        hashes = self.counter.prefix_hashes(data)
        block_tokens = tokens_per_block(num_tokens, num_bytes, tc.block_chars) if hashes else 0.0
        return domain, num_tokens, hashes, block_tokens

    def _template(self, roles: tuple[str, ...]) -> tuple[int, int]:
        """UTF-8 bytes and tokens of the chat template around messages of ``roles``, plus
        the generation prompt (counted exactly, once per role)."""
        num_bytes, num_tokens = self._role_template("")
        for role in roles:
            b, t = self._role_template(role)
            num_bytes, num_tokens = num_bytes + b, num_tokens + t
        return num_bytes, num_tokens

    def _role_template(self, role: str) -> tuple[int, int]:
        """("": the generation prompt.) NOTE: roles are few; a client's odd ones are not kept."""
        got = self._role_templates.get(role)
        if got is None:
            text = render_chat([], True) if role == "" else render_chat(
                [{"role": role, "content": ""}], add_generation_prompt=False)
            got = len(text.encode("utf-8", "surrogatepass")), self.counter.count_exact(text)
            if len(self._role_templates) < MAX_ROLES:
                self._role_templates[role] = got
        return got

    def _classify(self, text: str) -> str:
        if not text.strip():
            return self.config.default_domain
        return self.classifier.predict(text)


def _prompt_texts(body: Mapping[str, Any], endpoint: str
                  ) -> tuple[str | None, str, tuple[str, ...] | None]:
    """(rendered prompt or None for token-id prompts, text to classify, the chat messages'
    roles or None for a plain prompt)."""
    messages = body.get("messages")
    if "chat" in endpoint or isinstance(messages, list):
        if not isinstance(messages, list):
            return "", "", None
        return _chat_texts(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]  # NOTE: batched prompts: shape of the first
    if isinstance(prompt, str):
        return prompt, prompt, None
    if isinstance(prompt, list):
        return None, "", None
    return "", "", None


def _chat_texts(messages: list[Any]) -> tuple[str, str, tuple[str, ...]]:
    """(``render_chat(messages)``, the user and system messages' texts joined, the roles),
    each message's text read once (tests/router/test_shape.py checks the rendering is
    render_chat's)."""
    parts, asked, roles = [], [], []
    for m in messages:
        if not isinstance(m, Mapping):
            continue
        role = m.get("role", "user")
        text = message_text(m)
        parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
        if role in ("user", "system") and "role" in m:
            asked.append(text)
        roles.append(str(role))
    parts.append(GENERATION_PROMPT)
    return "".join(parts), "\n\n".join(asked), tuple(roles)


def _num_bytes(text: str, head: str, num_head_bytes: int) -> int:
    """UTF-8 bytes of ``text`` (``head`` is its start, ``num_head_bytes`` long), counted on
    at most COUNT_BYTES_CHARS characters."""
    if text.isascii():  # NOTE: O(1) in CPython (the string's kind)
        return len(text)
    if len(text) == len(head):
        return num_head_bytes
    sample = text[:COUNT_BYTES_CHARS]
    return round(len(sample.encode("utf-8", "surrogatepass")) * len(text) / len(sample))


_new_shape = fast_constructor(RequestShape)  # RequestShape(**fields), every field given


def _token_ids_len(body: Mapping[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    return len(prompt) if isinstance(prompt, list) else 0


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _float_or_none(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None
