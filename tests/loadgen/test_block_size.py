"""Trace block size: a polyinfer trace says how many tokens its prefix blocks are.

The proxy records ``prefix_block_tokens`` (its shape estimate) with
``prefix_hashes``; the replay synthesises blocks of that many tokens, and of
512 tokens (``--block-tokens``) for traces that do not say.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from tokenizers import Tokenizer

from loadgen.config import ClientConfig, LengthConfig
from loadgen.errors import TraceLineError
from loadgen.prepare import RequestBuilder
from loadgen.readers import BadLines, read_trace
from loadgen.request import TraceRequest
from loadgen.synth import PromptSynthesizer, load_corpus_words
from loadgen.tokenizer import HfTokenCounter
from polyinfer.config import TINY_TARGET
from proxy.record import RequestRecord
from router.base import RequestShape

COUNTER = HfTokenCounter(TINY_TARGET)
TOK = Tokenizer.from_file(str(TINY_TARGET / "tokenizer.json"))


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


def _record(request_id: str, hashes: tuple[int, ...], block_tokens: float,
            prompt_tokens: int) -> dict[str, object]:
    shape = RequestShape(domain="chat", prompt_tokens=prompt_tokens, max_tokens=4,
                         predicted_output_tokens=4, prefix_hashes=hashes,
                         prefix_block_tokens=block_tokens)
    rec = RequestRecord(request_id=request_id, ts=100.0, t0=0.0, endpoint="completions",
                        shape=shape, worker="w", completion_tokens=4, ttft_s=0.1, e2e_s=0.2)
    return rec.to_trace()


def _write(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def _prompts(records: list[TraceRequest], synth: PromptSynthesizer,
             lengths: LengthConfig) -> list[list[int]]:
    builder = RequestBuilder(ClientConfig("http://h:1", endpoint="completions"), "m",
                             lengths, COUNTER, synth)
    bodies = [orjson.loads(builder.build(i, 0.0, r).body) for i, r in enumerate(records)]
    return [_ids(b["prompt"]) for b in bodies]


def _shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_the_proxy_record_states_its_block_size() -> None:
    assert _record("a", (1, 2), 63.27, 200)["prefix_block_tokens"] == 63.3
    assert _record("b", (), 63.27, 200)["prefix_block_tokens"] is None  # no blocks, no size
    assert _record("c", (1,), float("nan"), 200)["prefix_block_tokens"] is None
    assert _record("d", (1,), 0.0, 200)["prefix_block_tokens"] is None


def test_replay_synthesises_blocks_of_the_recorded_size(tmp_path: Path, synth: PromptSynthesizer) -> None:
    # two estimates of one trace (40.4 and 39.6 tokens) both mean 40-token blocks; the
    # session synthesizer's own default is 64, so sharing 2 x 40 proves the record was read
    rows = [_record("a", (9001, 9002, 9003), 40.4, 150), _record("b", (9001, 9002, 9004), 39.6, 150)]
    records = list(read_trace(_write(tmp_path, rows), "auto"))
    assert [r.block_tokens for r in records] == [40.4, 39.6]
    a, b = _prompts(records, synth, LengthConfig())
    assert len(a) == len(b) == 150 and _shared(a, b) == 80


def test_prompt_scale_scales_the_recorded_block(tmp_path: Path, synth: PromptSynthesizer) -> None:
    rows = [_record("a", (9101, 9102, 9103), 40.0, 300), _record("b", (9101, 9102, 9104), 40.0, 300)]
    records = list(read_trace(_write(tmp_path, rows), "auto"))
    a, b = _prompts(records, synth, LengthConfig(prompt_scale=0.5))
    assert len(a) == len(b) == 150 and _shared(a, b) == 40  # two 20-token blocks


def test_traces_without_a_block_size_replay_512_token_blocks(tmp_path: Path) -> None:
    rows = [_record("a", (1, 2, 3), 40.0, 1200), _record("b", (1, 2, 4), 40.0, 1200)]
    for row in rows:
        del row["prefix_block_tokens"]  # a trace written before the field existed
    records = list(read_trace(_write(tmp_path, rows), "auto"))
    assert [r.block_tokens for r in records] == [None, None]
    lengths = LengthConfig()
    synth = PromptSynthesizer(COUNTER, lengths.scaled_block_tokens,
                              words=load_corpus_words()[:4000])  # as replay builds it
    a, b = _prompts(records, synth, lengths)
    assert len(a) == len(b) == 1200 and _shared(a, b) == 1024


@pytest.mark.parametrize("value", [0, -3, 0.5, 1e9, "64", True, [64]])
def test_a_bad_block_size_is_a_bad_line_and_the_rest_replays(tmp_path: Path, value: object) -> None:
    rows = [_record("a", (1, 2), 40.0, 100), _record("b", (1, 3), 40.0, 100),
            _record("c", (1, 4), 40.0, 100)]
    rows[1]["prefix_block_tokens"] = value
    path = _write(tmp_path, rows)
    bad = BadLines("skip")
    assert [r.line for r in read_trace(path, "auto", bad)] == [1, 3]
    assert bad.num_bad == 1 and bad.first[0].startswith(f"{path}:2: prefix_block_tokens:")
    with pytest.raises(TraceLineError) as err:
        list(read_trace(path, "auto", BadLines("fatal")))
    assert err.value.line == 2 and "prefix_block_tokens" in str(err.value)


def test_a_block_seen_first_keeps_its_text_whatever_size_later_requests_name(
        synth: PromptSynthesizer) -> None:
    first = _ids(synth.prompt(100, key=1, hash_ids=(9201, 9202), block_tokens=30))
    later = _ids(synth.prompt(100, key=2, hash_ids=(9201, 9205), block_tokens=33))
    assert _shared(first, later) == 30 and synth.block(9201)[1] == 30
    with pytest.raises(ValueError, match="block_tokens"):
        synth.prompt(100, key=3, hash_ids=(9201,), block_tokens=0)
