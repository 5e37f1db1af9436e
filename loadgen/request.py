"""The data passed between loadgen's stages.

reader -> :class:`TraceRequest` -> lengths/synthesis -> :class:`PreparedRequest`
-> client -> :class:`RequestResult` -> metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request as read from a trace, before any length policy or prompt synthesis."""

    line: int  # 1-based line (or record) number in the source file
    timestamp_s: float | None = None  # seconds on the trace's own clock; None when it has none
    prompt: str | None = None  # prompt text, when the trace carries it
    messages: tuple[dict[str, str], ...] | None = None  # chat turns, when the trace carries them
    reference_output: str | None = None  # recorded answer text; its length sets output_tokens
    prompt_tokens: int | None = None  # recorded prompt length, in tokens
    output_tokens: int | None = None  # recorded (or requested) output length, in tokens
    hash_ids: tuple[int, ...] = ()  # prefix blocks; equal ids share the same block text
    block_tokens: float | None = None  # tokens per hash_ids block, when the trace says
    domain: str | None = None  # DOMAINS name when the trace says it


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request ready to send: the body is encoded once, before the run starts."""

    index: int  # position in the replay, 0-based
    line: int  # source line, for error reports
    arrival_s: float  # scheduled send time, seconds since the run started
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: bytes  # JSON body, precomputed so the send loop does no encoding
    prompt_tokens: int | None  # expected prompt length (exact when the tokenizer is known)
    max_tokens: int | None  # max_tokens sent
    domain: str | None  # domain from the trace, if any


@dataclass(slots=True)
class RequestResult:
    """What the client measured for one request. Times are seconds."""

    index: int
    line: int
    scheduled_s: float  # when it should have been sent, since run start
    sent_s: float = 0.0  # when the client started sending it, since run start
    lag_s: float = 0.0  # sent_s - max(scheduled_s, time a concurrency slot freed)
    queue_s: float = 0.0  # waited for a --max-concurrency slot
    ttft_s: float | None = None  # send -> first token
    itl_s: list[float] = field(default_factory=list)  # gaps between token-bearing chunks
    tpot_s: float | None = None  # (e2e - ttft) / (completion_tokens - 1)
    e2e_s: float | None = None  # send -> last byte
    expected_prompt_tokens: int | None = None
    max_tokens: int | None = None
    prompt_tokens: int | None = None  # from usage
    completion_tokens: int | None = None  # from usage, else counted chunks
    http_status: int | None = None
    worker: str | None = None  # x-polyinfer-worker
    domain: str | None = None  # x-polyinfer-domain, else the trace's domain
    spec_depth: str | None = None  # x-polyinfer-spec-depth ("default" or a depth)
    request_id: str | None = None  # x-request-id
    ok: bool = False
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
