"""ShapeEstimator: bodies of both endpoints, malformed input, learned output lengths."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyinfer.config import TINY_TARGET, ConfigError
from router.base import RequestOutcome, RequestShape
from router.shape import ShapeConfig, ShapeEstimator


@pytest.fixture(scope="module")
def est() -> ShapeEstimator:
    return ShapeEstimator.load(TINY_TARGET, config=ShapeConfig(slo_ttft_s={"code": 0.5}))


def test_chat_body(est: ShapeEstimator) -> None:
    body = {"model": "m", "stream": True, "max_tokens": 33, "speculative_depth": 2,
            "messages": [{"role": "user", "content": "Translate German to English: Guten Tag ."}]}
    s = est.estimate(body, "/v1/chat/completions")
    assert s.domain == "translation"
    assert s.stream and s.max_tokens == 33 and s.predicted_output_tokens == 33
    assert s.speculative_depth == 2
    # exact: the rendered ChatML prompt, special tokens counted once each
    rendered = "<|im_start|>user\nTranslate German to English: Guten Tag .<|im_end|>\n" \
               "<|im_start|>assistant\n"
    assert s.prompt_tokens == est.counter.count(rendered).num_tokens


def test_completions_body_and_domain_slo(est: ShapeEstimator) -> None:
    s = est.estimate({"prompt": "Write a Python function that merges two sorted lists."},
                     "completions")
    assert s.domain == "code" and s.max_tokens is None
    assert s.slo_ttft_s == 0.5  # per-domain default from the config
    s2 = est.estimate({"prompt": "Write a Python function.", "slo_ttft_s": 0.1}, "completions")
    assert s2.slo_ttft_s == 0.1  # per-request wins


def test_token_id_prompts(est: ShapeEstimator) -> None:
    assert est.estimate({"prompt": [1, 2, 3, 4]}, "completions").prompt_tokens == 4
    assert est.estimate({"prompt": [[5, 6], [7]]}, "completions").prompt_tokens == 2


@pytest.mark.parametrize("body", [
    {}, {"messages": "nope"}, {"messages": [None, 3, {"role": "user"}]}, {"prompt": None},
    {"prompt": "", "max_tokens": -1}, {"prompt": "x", "max_tokens": True},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
])
def test_malformed_bodies_never_raise(est: ShapeEstimator, body: dict) -> None:
    s = est.estimate(body, "/v1/chat/completions" if "messages" in body else "completions")
    assert isinstance(s, RequestShape)
    assert s.max_tokens is None and s.predicted_output_tokens >= 1


def test_output_length_is_learned_per_domain() -> None:
    est = ShapeEstimator.load(TINY_TARGET)
    body = {"prompt": "Translate German to English: Wir gehen heute ins Kino ."}
    shape = est.estimate(body, "completions")
    assert shape.predicted_output_tokens == 64  # the translation prior
    for n in (10, 20, 30):
        est.observe(RequestOutcome("w", shape, "ok", completion_tokens=n))
    est.observe(RequestOutcome("w", shape, "error", completion_tokens=999))  # ignored
    assert est.estimate(body, "completions").predicted_output_tokens == 20  # mean of 10, 20, 30
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
    s = est.estimate(body, "/v1/chat/completions" if chat else "/v1/completions")
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
            assert cached.estimate(body, "/v1/chat/completions") == uncached.estimate(
                body, "/v1/chat/completions")
    long_shape = cached.estimate(bodies[-1], "/v1/chat/completions")
    assert len(long_shape.prefix_hashes) == 8
    # tokens per block from the prompt's own ratio: 256 bytes x tokens / rendered chars
    assert 0 < long_shape.prefix_block_tokens < 256
    assert cached.stats()["cache"] == {"hits": 5, "misses": 4, "entries": 4}
    assert cached.estimate(bodies[0], "/v1/chat/completions").prefix_block_tokens == 0.0
    assert uncached.stats()["cache"]["entries"] == 0


def test_cache_is_bounded_and_skips_long_prompts() -> None:
    est = ShapeEstimator.load(TINY_TARGET, config=ShapeConfig(cache_entries=2,
                                                              cache_max_chars=200))
    for i in range(5):
        est.estimate({"prompt": f"Solve {i} + {i}."}, "completions")
    long_body = {"prompt": "Explain this passage. " * 20}  # 440 chars, over the limit
    first = est.estimate(long_body, "completions")
    assert est.estimate(long_body, "completions") == first
    info = est.stats()["cache"]
    assert info["entries"] == 2 and info["hits"] == 0 and info["misses"] == 5


def test_cache_config_is_checked() -> None:
    with pytest.raises(ValueError, match="cache_entries"):
        ShapeConfig(cache_entries=-1)


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
