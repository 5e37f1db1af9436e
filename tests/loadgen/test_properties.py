"""Property tests: exact synthesis for any length/blocks; the SSE parser under any chunking."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from loadgen.client import StreamParser
from loadgen.config import ClientConfig, TraceConfig
from loadgen.errors import LoadgenConfigError
from loadgen.synth import PromptSynthesizer
from polyinfer.config import TINY_TARGET

TOK = Tokenizer.from_file(str(TINY_TARGET / "tokenizer.json"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 1500), key=st.integers(0, 10**6),
       blocks=st.lists(st.integers(0, 50), max_size=30))
def test_any_length_and_blocks_is_exact(synth: PromptSynthesizer, n: int, key: int,
                                        blocks: list[int]) -> None:
    text = synth.prompt(n, key, tuple(blocks))
    assert len(TOK.encode(text, add_special_tokens=False).ids) == n


STREAM = (b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
          b'data: {"choices":[{"index":0,"text":""}]}\n\n'
          b'data: {"choices":[{"index":0,"text":" b\\n"}]}\n\n'
          b'data: {"choices":[{"index":0,"text":"c","finish_reason":"length"}]}\n\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}\n\n'
          b"data: [DONE]\n\n")


@given(cuts=st.lists(st.integers(1, len(STREAM) - 1), unique=True, max_size=12))
def test_parser_is_independent_of_read_boundaries(cuts: list[int]) -> None:
    p = StreamParser()
    bounds = [0, *sorted(cuts), len(STREAM)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        p.feed(STREAM[a:b], float(i))
    p.close(float(len(bounds)))
    assert p.num_chunks == 3 and p.done and p.error is None
    assert p.usage == {"prompt_tokens": 4, "completion_tokens": 3}
    assert p.first_s is not None and p.last_s is not None
    assert p.first_s + sum(p.itl_s) == pytest.approx(p.last_s)


def test_bad_client_and_trace_configs() -> None:
    with pytest.raises(LoadgenConfigError, match="target"):
        ClientConfig("localhost:8000")
    with pytest.raises(LoadgenConfigError, match="max_concurrency"):
        ClientConfig("http://h:1", max_concurrency=0)
    with pytest.raises(LoadgenConfigError, match="format"):
        TraceConfig("x", format="csv")
    assert ClientConfig("http://h:1/v1/").base_url == "http://h:1"
