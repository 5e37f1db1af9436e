"""The trace record: what the proxy writes is what the optimizer and loadgen read."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from loadgen.readers import read_trace
from optimizer.profile import read_trace_files
from optimizer.sample import DomainPromptSynthesizer, build_replay
from polyinfer.config import TINY_TARGET
from polyinfer.trace import TraceRecord, parse_record
from proxy.record import RequestRecord
from router.base import RequestShape

PROMPT = "def add(a, b):\n    return a + b\n\nWhat does this function do?"


def _recorded(tmp_path: Path, prompt_text: str | None) -> Path:
    shape = RequestShape(domain="code", prompt_tokens=18, max_tokens=32,
                         predicted_output_tokens=32, prefix_hashes=(7, 9),
                         prefix_block_tokens=9.0)
    rec = RequestRecord(request_id="r1", ts=1_700_000_000.5, t0=0.0, endpoint="completions",
                        model="tiny-target", stream=True, shape=shape, worker="w0",
                        spec_depth=3, completion_tokens=20, spec_draft_tokens=12,
                        spec_accepted_tokens=8, ttft_s=0.05, e2e_s=0.43,
                        prompt_text=prompt_text)
    path = tmp_path / "traces.jsonl"
    path.write_bytes(orjson.dumps(rec.to_trace(), option=orjson.OPT_APPEND_NEWLINE))
    return path


def test_the_optimizer_replays_the_prompt_the_proxy_recorded(tmp_path: Path) -> None:
    # the proxy wrote `prompt_text` while the optimizer read `prompt`: recorded prompts
    # were never replayed, synthetic ones were sent instead
    read = read_trace_files([_recorded(tmp_path, PROMPT)])
    assert read.bad_lines == [] and read.records[0].prompt_text == PROMPT
    synth = DomainPromptSynthesizer(TINY_TARGET / "tokenizer.json", seed=0)
    (request,) = build_replay(read.records, synth)
    assert request.prompt == PROMPT


def test_loadgen_replays_the_prompt_the_proxy_recorded(tmp_path: Path) -> None:
    (request,) = read_trace(_recorded(tmp_path, PROMPT))
    assert request.prompt == PROMPT and request.hash_ids == (7, 9)
    assert request.block_tokens == 9.0 and request.output_tokens == 20


def test_a_record_round_trips_with_the_design_field_names(tmp_path: Path) -> None:
    obj = orjson.loads(_recorded(tmp_path, None).read_bytes())
    assert {"ts", "request_id", "model", "endpoint", "stream", "domain", "prompt_tokens",
            "max_tokens", "completion_tokens", "worker", "spec_depth", "spec_draft_tokens",
            "spec_accepted_tokens", "ttft_s", "tpot_s", "e2e_s", "status", "error",
            "prefix_hashes"} <= set(obj)
    assert "prompt_text" not in obj  # stored only when the operator turns it on
    record = parse_record(obj)
    assert record.to_dict() == obj
    assert record.tpot_s == pytest.approx((0.43 - 0.05) / 19)


@pytest.mark.parametrize(("field", "value"), [
    ("ts", "yesterday"), ("prompt_tokens", -1), ("spec_depth", 1.5),
    ("prefix_hashes", "abc"), ("prefix_block_tokens", 0.0), ("prompt_text", 3)])
def test_a_bad_field_is_named(field: str, value: object) -> None:
    obj = TraceRecord(ts=1.0, domain="chat", prompt_tokens=4).to_dict() | {field: value}
    with pytest.raises(ValueError, match=field):
        parse_record(obj)
