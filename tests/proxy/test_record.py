"""The trace line a request record writes is its trace record's ``to_dict()``."""

from __future__ import annotations

import math

import orjson

from polyinfer.trace import parse_record
from proxy.record import RequestRecord
from router.base import RequestShape


def records() -> list[RequestRecord]:
    shape = RequestShape(domain="rag", prompt_tokens=900, max_tokens=64, predicted_output_tokens=64,
                         stream=True, prefix_hashes=(11, 22, 33), prefix_block_tokens=63.27)
    return [
        RequestRecord(request_id="ok", ts=1.5, t0=0.0, endpoint="chat/completions",
                      model="m", stream=True, shape=shape, worker="w1", reason="fit",
                      spec_depth=3, num_attempts=2, completion_tokens=40, spec_draft_tokens=30,
                      spec_accepted_tokens=21, ttft_s=0.1, e2e_s=0.5, queue_s=0.01),
        RequestRecord(request_id="rejected", ts=2.0, t0=0.0, endpoint="completions",
                      status="error", http_status=400, error="invalid_request_error: x"),
        RequestRecord(request_id="text", ts=3.0, t0=0.0, endpoint="completions", worker="w2",
                      shape=RequestShape(domain="chat", prompt_tokens=5, max_tokens=None,
                                         predicted_output_tokens=9,
                                         prefix_block_tokens=math.nan),
                      prompt_text="hello", completion_tokens=1, ttft_s=0.2, e2e_s=0.2),
    ]


def test_trace_line_equals_the_trace_records_dict() -> None:
    for rec in records():
        line = rec.to_trace()
        assert line == rec.trace_record().to_dict(), rec.request_id
        assert list(line) == list(rec.trace_record().to_dict())  # the same key order
        assert parse_record(orjson.loads(orjson.dumps(line))) == rec.trace_record()


def test_outcome_equals_the_constructed_one() -> None:
    from dataclasses import FrozenInstanceError, fields

    import pytest

    from router.base import RequestOutcome
    for rec in records() + [RequestRecord(request_id="cached", ts=0.0, t0=0.0,
                                          endpoint="completions", worker="w", cached_tokens=7,
                                          shape=records()[0].shape, batch_size=3)]:
        got = rec.outcome()
        if rec.shape is None or not rec.worker:
            assert got is None
            continue
        queue_s = rec.queue_s
        want = RequestOutcome(
            worker=rec.worker, shape=rec.shape, status=rec.status,
            completion_tokens=rec.completion_tokens or 0,
            ttft_s=None if rec.ttft_s is None else rec.ttft_s - queue_s, tpot_s=rec.tpot_s,
            e2e_s=None if rec.e2e_s is None else rec.e2e_s - queue_s, spec_depth=rec.spec_depth,
            spec_draft_tokens=rec.spec_draft_tokens,
            spec_accepted_tokens=rec.spec_accepted_tokens, batch_size=rec.batch_size,
            extra={} if rec.cached_tokens is None else {"cached_tokens": rec.cached_tokens})
        assert type(got) is RequestOutcome and got == want and hash(got.shape) == hash(want.shape)
        assert [f.name for f in fields(got)] == list(vars(got))  # every field, in order
        with pytest.raises(FrozenInstanceError):
            got.worker = "other"  # type: ignore[misc]
