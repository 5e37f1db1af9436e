"""The sampling API of a real engine worker, through the real `openai` client on loopback:
logprobs, n, penalties, logit_bias, min_tokens, stop token ids, seeds across speculative
depths, and OpenAI's validation."""

from __future__ import annotations

import collections
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.engine.conftest import EngineProcess, draft_engine_config, serving

pytestmark = pytest.mark.timeout(300)
CHAT = [{"role": "user", "content": "Write a short python function that adds two numbers."}]
EOS = 2


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[EngineProcess]:
    """A draft-model engine: sampled drafts, so seeded requests exercise coupled drafting."""
    yield from serving(draft_engine_config(tiny_model_dir), tmp_path_factory)


def client(server: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def chat(server: EngineProcess, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 24)
    return client(server).chat.completions.create(model="tiny", messages=CHAT, **kwargs)


def test_seeded_text_is_the_same_at_every_speculative_depth(server: EngineProcess) -> None:
    for extra in ({}, {"presence_penalty": 0.6, "frequency_penalty": 0.4,
                       "logit_bias": {"13": 3.0}, "repetition_penalty": 1.2}):
        texts = collections.Counter()
        accepted = 0
        for depth in (0, 1, 2, 4, 0, 4):
            r = chat(server, temperature=0.8, seed=42, max_tokens=40,
                     extra_body={"speculative_depth": depth, **{
                         k: v for k, v in extra.items() if k == "repetition_penalty"}},
                     **{k: v for k, v in extra.items() if k != "repetition_penalty"})
            texts[r.choices[0].message.content] += 1
            accepted += r.usage.model_extra["spec_decode"]["num_accepted_tokens"]
        assert len(texts) == 1, texts
        assert accepted > 0  # drafts were accepted, not only bonus tokens
    other = chat(server, temperature=0.8, seed=43, max_tokens=40)
    assert other.choices[0].message.content not in texts


def test_greedy_penalties_are_lossless_under_speculation(server: EngineProcess) -> None:
    plain = chat(server, temperature=0, max_tokens=48, extra_body={"speculative_depth": 0})
    outs = {d: chat(server, temperature=0, max_tokens=48, frequency_penalty=1.5,
                    extra_body={"speculative_depth": d}).choices[0].message.content
            for d in (0, 4)}
    assert outs[0] == outs[4]
    assert outs[0] != plain.choices[0].message.content


def test_chat_logprobs_shape(server: EngineProcess) -> None:
    r = chat(server, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(values[0], abs=1e-4)
    plain = chat(server, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_chat_logprobs_stream_cover_every_token(server: EngineProcess) -> None:
    stream = chat(server, temperature=0.7, seed=1, logprobs=True, top_logprobs=2, stream=True,
                  stream_options={"include_usage": True})
    entries, text, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.logprobs is not None:
                entries.extend(c.logprobs.content)
            text.append(c.delta.content or "")
    assert usage is not None and len(entries) == usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in entries)
    same = chat(server, temperature=0.7, seed=1)
    assert "".join(text) == same.choices[0].message.content


def test_completion_logprobs_shape(server: EngineProcess) -> None:
    r = client(server).completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12,
                                          temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # sampled: as OpenAI's, each position's top_logprobs holds the sampled token too
    r = client(server).completions.create(model="tiny", prompt="def add(a, b):", max_tokens=24,
                                          temperature=1.0, seed=4, logprobs=2)
    lp = r.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value and 2 <= len(top) <= 3
    assert any(len(top) == 3 for top in lp.top_logprobs)  # a sampled token outside the top 2


def test_n_samples(server: EngineProcess) -> None:
    r = chat(server, n=3, temperature=1.0, seed=5, max_tokens=16)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    one = chat(server, temperature=1.0, seed=5, max_tokens=16)
    assert r.choices[0].message.content == one.choices[0].message.content
    counted = chat(server, n=3, temperature=1.0, seed=5, max_tokens=16, logprobs=True)
    assert [c.message.content for c in counted.choices] == [c.message.content for c in r.choices]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in counted.choices)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    stream = chat(server, n=2, temperature=1.0, seed=5, max_tokens=16, stream=True)
    texts: dict[int, str] = collections.defaultdict(str)
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in r.choices[:2]]


def test_logit_bias_and_min_tokens(server: EngineProcess) -> None:
    forced = client(server).completions.create(model="tiny", prompt="hello", max_tokens=5,
                                               temperature=0, logit_bias={"100": 100})
    assert forced.usage.completion_tokens == 5
    ids = client(server).completions.create(model="tiny", prompt="hello", max_tokens=5,
                                            temperature=0, logit_bias={"100": 100}, logprobs=0)
    assert ids.choices[0].logprobs.tokens == [ids.choices[0].logprobs.tokens[0]] * 5
    # EOS pushed to the top: the request ends at once, unless min_tokens holds it back
    ends = client(server).completions.create(model="tiny", prompt="hello", max_tokens=20,
                                             temperature=0, logit_bias={str(EOS): 100})
    assert ends.usage.completion_tokens == 1 and ends.choices[0].finish_reason == "stop"
    held = client(server).completions.create(
        model="tiny", prompt="hello", max_tokens=20, temperature=0,
        logit_bias={str(EOS): 100}, extra_body={"min_tokens": 6, "speculative_depth": 4})
    assert held.usage.completion_tokens == 7 and held.choices[0].finish_reason == "stop"


def test_stop_token_ids(server: EngineProcess) -> None:
    r = client(server).completions.create(
        model="tiny", prompt="hello", max_tokens=8, temperature=0, logit_bias={"100": 100},
        extra_body={"stop_token_ids": [100], "speculative_depth": 2})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == 100


def _post(server: EngineProcess, body: Any, content_type: str | None) -> tuple[int, Any]:
    """POST ``body`` as JSON bytes with exactly this Content-Type (None: no such header)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {"Content-Type": content_type} if content_type else {}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers=headers)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


@pytest.mark.parametrize("change, param", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
])
def test_openai_validation(server: EngineProcess, change: dict[str, Any], param: str) -> None:
    status, body = _post(server, {"model": "tiny", "messages": CHAT, "max_tokens": 2, **change},
                         "application/json")
    assert status == 400 and body["error"]["param"] == param, body


def test_json_bodies_only(server: EngineProcess) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2}
    status, err = _post(server, body, "text/plain")
    assert status == 400 and "Content-Type" in err["error"]["message"]
    assert _post(server, body, None)[0] == 200
    assert _post(server, body, "application/json; charset=utf-8")[0] == 200


@pytest.mark.parametrize("extra, param", [
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"extra_body": {"structured_outputs": {"structural_tag": '{"type": "x"}'}}},
     "structured_outputs.structural_tag"),
    # the bundled model's chat template renders no tools
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
])
def test_what_is_not_served_is_a_clear_400(server: EngineProcess, extra: dict[str, Any],
                                           param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, **extra)
    assert e.value.code == "unsupported_option" and e.value.param == param, e.value.body
