"""ShapeEstimator: bodies of both endpoints, malformed input, learned output lengths, exact
counts near a context limit."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyinfer.config import TINY_TARGET, ConfigError
from router.base import RequestOutcome, RequestShape
from router.shape import ShapeConfig, ShapeEstimator
from router.tokens import render_chat


@pytest.fixture(scope="module")
def est() -> ShapeEstimator:
    return ShapeEstimator.load(TINY_TARGET, config=ShapeConfig(slo_ttft_s={"code": 0.5}))


def estimate(est: ShapeEstimator, body: Any, endpoint: str) -> RequestShape:
    return asyncio.run(est.estimate(body, endpoint))


def test_chat_body(est: ShapeEstimator) -> None:
    body = {"model": "m", "stream": True, "max_tokens": 33, "speculative_depth": 2,
            "messages": [{"role": "user", "content": "Translate German to English: Guten Tag ."}]}
    s = estimate(est, body, "/v1/chat/completions")
    assert s.domain == "translation"
    assert s.stream and s.max_tokens == 33 and s.predicted_output_tokens == 33
    assert s.speculative_depth == 2
    # the template's tokens exactly, the content's estimated from its bytes (no context limit
    # configured): the rendered ChatML prompt, special tokens counted once each
    content = "Translate German to English: Guten Tag ."
    rendered = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    template = est.counter.count_exact(rendered) - est.counter.count_exact(content)
    assert template == 8
    assert s.prompt_tokens == template + est.counter.estimate(len(content), "translation")
    assert abs(s.prompt_tokens - est.counter.count_exact(rendered)) <= 0.2 * s.prompt_tokens


def test_completions_body_and_domain_slo(est: ShapeEstimator) -> None:
    s = estimate(est, {"prompt": "Write a Python function that merges two sorted lists."},
                     "completions")
    assert s.domain == "code" and s.max_tokens is None
    assert s.slo_ttft_s == 0.5  # per-domain default from the config
    s2 = estimate(est, {"prompt": "Write a Python function.", "slo_ttft_s": 0.1}, "completions")
    assert s2.slo_ttft_s == 0.1  # per-request wins


def test_token_id_prompts(est: ShapeEstimator) -> None:
    assert estimate(est, {"prompt": [1, 2, 3, 4]}, "completions").prompt_tokens == 4
    assert estimate(est, {"prompt": [[5, 6], [7]]}, "completions").prompt_tokens == 2


@pytest.mark.parametrize("body", [
    {}, {"messages": "nope"}, {"messages": [None, 3, {"role": "user"}]}, {"prompt": None},
    {"prompt": "", "max_tokens": -1}, {"prompt": "x", "max_tokens": True},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
])
def test_malformed_bodies_never_raise(est: ShapeEstimator, body: dict) -> None:
    s = estimate(est, body, "/v1/chat/completions" if "messages" in body else "completions")
    assert isinstance(s, RequestShape)
    assert s.max_tokens is None and s.predicted_output_tokens >= 1


def test_output_length_is_learned_per_domain() -> None:
    est = ShapeEstimator.load(TINY_TARGET)
    body = {"prompt": "Translate German to English: Wir gehen heute ins Kino ."}
    shape = estimate(est, body, "completions")
    assert shape.predicted_output_tokens == 64  # the translation prior
    for n in (10, 20, 30):
        est.observe(RequestOutcome("w", shape, "ok", completion_tokens=n))
    est.observe(RequestOutcome("w", shape, "error", completion_tokens=999))  # ignored
    assert estimate(est, body, "completions").predicted_output_tokens == 20  # mean of 10, 20, 30
    assert est.stats()["output_tokens"]["translation"]["num_observed"] == 3


def test_config_rejects_unknown_domains() -> None:
    with pytest.raises(ValueError, match="poetry"):
        ShapeConfig(slo_ttft_s={"poetry": 1.0})


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                       children, max_size=4),
    max_leaves=12)
_bodies = st.fixed_dictionaries({}, optional={
    "messages": st.lists(st.fixed_dictionaries({}, optional={"role": _json, "content": _json}) | _json,
                         max_size=3) | _json,
    "prompt": _json, "max_tokens": _json, "stream": _json, "speculative_depth": _json,
    "slo_ttft_s": _json})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies, chat=st.booleans())
def test_any_json_body_gives_a_valid_shape(est: ShapeEstimator, body: dict, chat: bool) -> None:
    s = estimate(est, body, "/v1/chat/completions" if chat else "/v1/completions")
    assert s.domain in est.classifier.classes and s.prompt_tokens >= 0
    assert s.predicted_output_tokens >= 0 and isinstance(s.prefix_hashes, tuple)


def test_cache_hits_return_what_a_miss_computes() -> None:
    cached = ShapeEstimator.load(TINY_TARGET)
    uncached = ShapeEstimator.load(TINY_TARGET, config=ShapeConfig(cache_entries=0))
    bodies = [{"messages": [{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": f"Translate to French: item {i}"}]}
              for i in range(3)]
    # a long assistant turn: rendered (not classified), over eight 256-byte hash blocks
    bodies.append({"messages": [{"role": "user", "content": "Summarize our chat."},
                                {"role": "assistant", "content": "word " * 420}]})
    for _ in range(2):  # second round: every text is cached
        for body in bodies:
            assert estimate(cached, body, "/v1/chat/completions") == estimate(
                uncached, body, "/v1/chat/completions")
    long_shape = estimate(cached, bodies[-1], "/v1/chat/completions")
    assert len(long_shape.prefix_hashes) == 8
    # tokens per block from the prompt's own ratio: 256 bytes x tokens / rendered bytes
    assert 0 < long_shape.prefix_block_tokens < 256
    assert cached.stats()["cache"] == {"hits": 5, "misses": 4, "entries": 4}
    assert estimate(cached, bodies[0], "/v1/chat/completions").prefix_block_tokens == 0.0
    assert uncached.stats()["cache"]["entries"] == 0


def test_cache_is_bounded_and_skips_long_prompts() -> None:
    est = ShapeEstimator.load(TINY_TARGET, config=ShapeConfig(cache_entries=2,
                                                              cache_max_chars=200))
    for i in range(5):
        estimate(est, {"prompt": f"Solve {i} + {i}."}, "completions")
    long_body = {"prompt": "Explain this passage. " * 20}  # 440 chars, over the limit
    first = estimate(est, long_body, "completions")
    assert estimate(est, long_body, "completions") == first
    info = est.stats()["cache"]
    assert info["entries"] == 2 and info["hits"] == 0 and info["misses"] == 5


def test_cache_config_is_checked() -> None:
    with pytest.raises(ValueError, match="cache_entries"):
        ShapeConfig(cache_entries=-1)
    with pytest.raises(ValueError, match="exact_edges_tokens"):
        ShapeConfig(exact_edges_tokens=(0,))


def _chat(text: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


def test_near_a_context_limit_the_count_is_exact_off_the_loop() -> None:
    est = ShapeEstimator.load(TINY_TARGET, config=ShapeConfig(exact_edges_tokens=(2048,)))
    long_text = "Summarize: " + "The committee met on Tuesday to review the budget. " * 120
    body = _chat(long_text, 100)
    rendered = render_chat(body["messages"])
    exact = est.counter.count_exact(rendered)
    assert 1500 < exact < 2300  # near 2048 - 100 for the estimate's margin
    bounded, pending = est.estimate_bounded(body, "/v1/chat/completions")
    assert pending == rendered  # left to the executor
    shape = estimate(est, body, "/v1/chat/completions")
    assert shape.prompt_tokens == exact
    assert shape.prefix_block_tokens == pytest.approx(
        bounded.prefix_block_tokens * exact / bounded.prompt_tokens)
    assert shape.prefix_hashes == bounded.prefix_hashes
    # far from the limit: the estimate, nothing pending
    short = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    assert est.estimate_bounded(short, "/v1/chat/completions")[1] is None


def test_a_short_prompt_near_a_limit_is_counted_inline() -> None:
    body = _chat("Translate to French: " + "good morning, " * 10, 0)
    plain = ShapeEstimator.load(TINY_TARGET)
    estimated, _ = plain.estimate_bounded(body, "/v1/chat/completions")
    exact = plain.counter.count_exact(render_chat(body["messages"]))
    est = ShapeEstimator.load(TINY_TARGET, config=ShapeConfig(
        exact_edges_tokens=(estimated.prompt_tokens,)))
    shape, pending = est.estimate_bounded(body, "/v1/chat/completions")
    assert pending is None and shape.prompt_tokens == exact


def test_a_megabyte_prompt_is_bounded_work() -> None:
    est = ShapeEstimator.load(TINY_TARGET)
    text = "Explain this passage. " * 50_000  # 1.1 MB
    shape, pending = est.estimate_bounded({"prompt": text}, "/v1/completions")
    assert pending is None and len(shape.prefix_hashes) == est.counter.config.max_hash_blocks
    assert shape.prompt_tokens == est.counter.estimate(len(text), shape.domain)
    wide = "日本語の文章です。" * 100_000  # non-ASCII: bytes counted on a sample
    shape = est.estimate_bounded({"prompt": wide}, "/v1/completions")[0]
    assert shape.prompt_tokens == est.counter.estimate(len(wide.encode()), shape.domain)


def test_the_proxy_config_sets_the_prefix_block_and_refuses_bad_ones() -> None:
    import dataclasses

    from proxy.app import default_estimator
    from proxy.config import ProxyConfig, RoutingConfig, default_config

    base = default_config()
    config = dataclasses.replace(base, routing=RoutingConfig(prefix_block_chars=512))
    est = default_estimator(config)
    assert isinstance(est, ShapeEstimator) and est.counter.config.block_chars == 512
    for bad in (8, 1 << 20, "256", True):
        with pytest.raises(ConfigError, match="routing.prefix_block_chars"):
            ProxyConfig.from_dict({"routing": {"prefix_block_chars": bad}})


def test_chat_texts_render_as_render_chat_and_shapes_as_the_constructor() -> None:
    """The estimator renders, picks the classified texts and builds the shape in one pass
    each; the results are render_chat's and RequestShape's own."""
    import dataclasses

    from router.shape import _chat_texts, _new_shape

    messages: list[Any] = [
        {"role": "system", "content": "Be terse."}, {"content": "no role"}, None, 3,
        {"role": None, "content": "a None role"}, {"role": 7, "content": [{"text": "a"}, {}]},
        {"role": "assistant", "content": "earlier turn"}, {"role": "user", "content": "Now?"}]
    for msgs in (messages, messages[:1], [], messages[3:]):
        rendered, asked, roles = _chat_texts(msgs)
        assert rendered == render_chat(msgs)
        assert roles == tuple(str(m.get("role", "user")) for m in msgs if isinstance(m, dict))
        assert asked == "\n\n".join(m["content"] for m in msgs if isinstance(m, dict)
                                    and m.get("role") in ("user", "system"))
    fields = {f.name: i for i, f in enumerate(dataclasses.fields(RequestShape))}
    fast = _new_shape(dict(fields))
    assert fast == RequestShape(**fields) and hash(fast) == hash(RequestShape(**fields))
    assert dataclasses.replace(fast, domain="code").domain == "code"
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.domain = "code"  # type: ignore[misc]
