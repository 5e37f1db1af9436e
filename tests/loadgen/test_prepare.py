"""Request bodies: endpoints, lengths as the server will count them, clipping of trace text."""

from __future__ import annotations

import orjson

from loadgen.config import ClientConfig, LengthConfig
from loadgen.prepare import RequestBuilder
from loadgen.request import TraceRequest
from loadgen.synth import PromptSynthesizer
from loadgen.tokenizer import HfTokenCounter
from polyinfer.config import TINY_TARGET

COUNTER = HfTokenCounter(TINY_TARGET)
LONG = " ".join(f"word{i}" for i in range(400))


def _builder(synth: PromptSynthesizer | None = None, endpoint: str = "auto",
             **lengths: object) -> RequestBuilder:
    return RequestBuilder(ClientConfig("http://h:1", endpoint=endpoint), "m",  # type: ignore[arg-type]
                          LengthConfig(**lengths), COUNTER, synth)  # type: ignore[arg-type]


def test_text_prompts_and_their_endpoints() -> None:
    b = _builder()
    plain = b.build(0, 0.0, TraceRequest(line=1, prompt="Hello there", output_tokens=7))
    chat = b.build(1, 0.5, TraceRequest(line=2, messages=({"role": "user", "content": "Hi"},),
                                        reference_output="one two three", domain="qa"))
    assert plain.path == "/v1/completions" and chat.path == "/v1/chat/completions"
    body = orjson.loads(plain.body)
    assert body == {"model": "m", "prompt": "Hello there", "max_tokens": 7, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
    assert plain.prompt_tokens == COUNTER.count("Hello there")
    templated = COUNTER.chat_prompt([{"role": "user", "content": "Hi"}])
    assert templated is not None and chat.prompt_tokens == COUNTER.count(templated)
    assert chat.max_tokens == COUNTER.count("one two three") and chat.domain == "qa"
    assert chat.arrival_s == 0.5


def test_trace_text_is_clipped_not_scaled() -> None:
    b = _builder(max_prompt_tokens=100, prompt_scale=0.5)
    req = b.build(0, 0.0, TraceRequest(line=1, prompt=LONG, output_tokens=4))
    sent = orjson.loads(req.body)["prompt"]
    assert LONG.startswith(sent) and req.prompt_tokens == COUNTER.count(sent)
    assert 95 <= req.prompt_tokens <= 100  # decode/re-encode at the cut may shift a token
    assert b.stats.num_truncated_text == 1
    short = b.build(1, 0.0, TraceRequest(line=2, prompt="short text", output_tokens=4))
    assert orjson.loads(short.body)["prompt"] == "short text"  # never scaled


def test_synthetic_chat_counts_the_template(synth: PromptSynthesizer) -> None:
    b = _builder(synth, endpoint="chat")
    req = b.build(0, 0.0, TraceRequest(line=1, prompt_tokens=300, output_tokens=3))
    messages = orjson.loads(req.body)["messages"]
    templated = COUNTER.chat_prompt(messages)
    assert templated is not None and COUNTER.count(templated) == 300 == req.prompt_tokens


def test_no_stream_and_no_ignore_eos() -> None:
    b = RequestBuilder(ClientConfig("http://h:1", stream=False, ignore_eos=False), "m",
                       LengthConfig(), COUNTER, None)
    body = orjson.loads(b.build(0, 0.0, TraceRequest(line=1, prompt="x")).body)
    assert body == {"model": "m", "prompt": "x", "max_tokens": 128, "stream": False}
