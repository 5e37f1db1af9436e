"""One request's facts as the proxy learns them, and the trace record made of them.

A :class:`RequestRecord` is created when a request arrives, filled in by the
relay, and handed to stats, the routing policy and the trace writer when the
request ends. It is the only per-request object the proxy allocates besides
the HTTP ones. :meth:`RequestRecord.trace_record` turns it into the
:class:`polyinfer.trace.TraceRecord` that the trace writer appends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from polyinfer.trace import STATUS_OK, TraceRecord
from router.base import RequestOutcome, RequestShape, fast_constructor

BLOCK_TOKENS_DECIMALS = 1  # the shape's per-prompt estimate; more digits are noise


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    ts: float  # unix seconds, arrival
    t0: float  # perf_counter at arrival
    endpoint: str  # "chat/completions" | "completions"
    model: str = ""
    stream: bool = False
    shape: RequestShape | None = None
    worker: str = ""
    reason: str = ""  # routing decision label
    spec_depth: int | None = None  # speculative_depth sent (None = worker default)
    num_attempts: int = 0
    status: str = STATUS_OK
    http_status: int = 200
    error: str = ""
    completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None  # usage.prompt_tokens, as the worker counted them
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    ttft_s: float | None = None
    e2e_s: float | None = None
    batch_size: int | None = None  # worker's scraped running requests when sent
    queue_s: float = 0.0  # waited in the proxy for room under the workers' caps
    responded: bool = False  # the whole response reached the client's socket
    prompt_text: str | None = field(default=None, repr=False)  # only when enabled

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or not self.completion_tokens:
            return None
        if self.completion_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def domain(self) -> str:
        return self.shape.domain if self.shape is not None else ""

    def outcome(self) -> RequestOutcome | None:
        if self.shape is None or not self.worker:
            return None
        # NOTE: what the worker did: the wait in the proxy before it was sent is not its
        queue_s = self.queue_s
        return _new_outcome({
            "worker": self.worker, "shape": self.shape, "status": self.status,
            "completion_tokens": self.completion_tokens or 0,
            "ttft_s": None if self.ttft_s is None else self.ttft_s - queue_s,
            "tpot_s": self.tpot_s, "e2e_s": None if self.e2e_s is None else self.e2e_s - queue_s,
            "spec_depth": self.spec_depth,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens, "batch_size": self.batch_size,
            "extra": {} if self.cached_tokens is None else {"cached_tokens": self.cached_tokens}})

    def trace_record(self) -> TraceRecord:
        shape = self.shape
        return TraceRecord(
            ts=self.ts, request_id=self.request_id, model=self.model, endpoint=self.endpoint,
            stream=self.stream, domain=self.domain,
            prompt_tokens=shape.prompt_tokens if shape else None,
            max_tokens=shape.max_tokens if shape else None,
            completion_tokens=self.completion_tokens, worker=self.worker,
            spec_depth=self.spec_depth, spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens, ttft_s=self.ttft_s,
            tpot_s=self.tpot_s, e2e_s=self.e2e_s, queue_s=self.queue_s,
            num_attempts=self.num_attempts, status=self.status,
            error=self.error or None,
            prefix_hashes=shape.prefix_hashes if shape else (),
            prefix_block_tokens=_block_tokens(shape), prompt_text=self.prompt_text)

    def to_trace(self) -> dict[str, Any]:
        """The JSON object of this request's trace line: ``trace_record().to_dict()``.

        NOTE: built directly, for every request: the frozen record's ~23 field assignments
        cost more than this dict (tests/proxy/test_record.py checks the two are equal).
        """
        shape = self.shape
        out: dict[str, Any] = {
            "ts": self.ts, "request_id": self.request_id, "model": self.model,
            "endpoint": self.endpoint, "stream": self.stream, "domain": self.domain,
            "prompt_tokens": shape.prompt_tokens if shape else None,
            "max_tokens": shape.max_tokens if shape else None,
            "completion_tokens": self.completion_tokens, "worker": self.worker,
            "spec_depth": self.spec_depth, "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens, "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s, "e2e_s": self.e2e_s, "queue_s": self.queue_s,
            "num_attempts": self.num_attempts, "status": self.status,
            "error": self.error or None,
            "prefix_hashes": list(shape.prefix_hashes) if shape else [],
            "prefix_block_tokens": _block_tokens(shape),
        }
        if self.prompt_text is not None:
            out["prompt_text"] = self.prompt_text
        return out


_new_outcome = fast_constructor(RequestOutcome)  # RequestOutcome(**fields), every field


def _block_tokens(shape: RequestShape | None) -> float | None:
    """Prompt tokens per ``prefix_hashes`` block (None: no hashes or size unknown).

    NOTE: a replay synthesises blocks of this many tokens (loadgen's polyinfer
    reader); without it, a reader assumes 512-token blocks (the old schema).
    """
    if shape is None or not shape.prefix_hashes:
        return None
    tokens = shape.prefix_block_tokens
    if not math.isfinite(tokens) or tokens <= 0:
        return None
    return round(tokens, BLOCK_TOKENS_DECIMALS)
