"""The trace record: one JSON object per request, written by the proxy, read by the rest.

The proxy appends one record per finished request (``proxy.traces``); the
optimizer builds its traffic profile from them and loadgen replays them (its
``polyinfer`` format). All three use this module: :class:`TraceRecord` is the
schema (DESIGN.md), :meth:`TraceRecord.to_dict` the writer and
:func:`parse_record` the reader, so a field is named in one place.

Example::

    line = orjson.dumps(TraceRecord(ts=1.7e9, domain="code", prompt_tokens=12).to_dict())
    record = parse_record(orjson.loads(line))
    assert record.prompt_tokens == 12
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_CANCELLED = "cancelled"
DEFAULT_OUTPUT_TOKENS = 16  # an output length for a record that says nothing of it

# NOTE: the proxy hashes blocks of 16..65536 bytes, i.e. a few to ~16k tokens; a block
# under one token or beyond this is a broken record, not a size to replay.
MIN_BLOCK_TOKENS = 1.0
MAX_BLOCK_TOKENS = 65536.0


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request as the proxy saw it (DESIGN.md's trace record)."""

    ts: float  # unix seconds, arrival
    domain: str = ""  # "" when the request ended before its shape was known
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    completion_tokens: int | None = None
    request_id: str = ""
    model: str = ""
    endpoint: str = ""  # "chat/completions" | "completions"
    stream: bool = False
    worker: str = ""
    spec_depth: int | None = None  # speculative_depth sent (None = worker default)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    queue_s: float = 0.0  # waited in the proxy for room under the workers' caps
    num_attempts: int = 0  # workers the request was sent to (> 1: failed over; 0: none)
    status: str = STATUS_OK
    error: str | None = None
    # chained hashes of the prompt's leading blocks (never the text)
    prefix_hashes: tuple[int, ...] = ()
    prefix_block_tokens: float | None = None  # tokens per prefix_hashes block (None: 512)
    prompt_text: str | None = field(default=None, repr=False)  # only when the operator enables it

    @property
    def output_tokens(self) -> int:
        """Observed output length, else the requested cap, else a small default."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.max_tokens if self.max_tokens is not None else DEFAULT_OUTPUT_TOKENS

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to the trace file (``prompt_text`` only when recorded)."""
        out: dict[str, Any] = {
            "ts": self.ts,
            "request_id": self.request_id,
            "model": self.model,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "domain": self.domain,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "completion_tokens": self.completion_tokens,
            "worker": self.worker,
            "spec_depth": self.spec_depth,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "queue_s": self.queue_s,
            "num_attempts": self.num_attempts,
            "status": self.status,
            "error": self.error,
            "prefix_hashes": list(self.prefix_hashes),
            "prefix_block_tokens": self.prefix_block_tokens,
        }
        if self.prompt_text is not None:
            out["prompt_text"] = self.prompt_text
        return out


def parse_record(obj: Any) -> TraceRecord:
    """One decoded JSON value -> a record; raises ValueError naming the bad field.

    Only ``ts`` is required. Fields a reader cannot do without (the optimizer
    needs ``domain`` and ``prompt_tokens``) are that reader's to check.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    domain = obj.get("domain")
    if domain is not None and not isinstance(domain, str):
        raise ValueError(f"domain: expected a string, got {domain!r}")
    prompt_text = obj.get("prompt_text")
    if prompt_text is not None and not isinstance(prompt_text, str):
        raise ValueError("prompt_text: expected a string")
    error = obj.get("error")
    return TraceRecord(
        ts=_finite_number(obj.get("ts"), "ts"),
        domain=domain or "",
        prompt_tokens=_optional_count(obj, "prompt_tokens"),
        max_tokens=_optional_count(obj, "max_tokens"),
        completion_tokens=_optional_count(obj, "completion_tokens"),
        request_id=str(obj.get("request_id") or ""),
        model=str(obj.get("model") or ""),
        endpoint=str(obj.get("endpoint") or ""),
        stream=bool(obj.get("stream", False)),
        worker=str(obj.get("worker") or ""),
        spec_depth=_optional_count(obj, "spec_depth"),
        spec_draft_tokens=_count_or_zero(obj.get("spec_draft_tokens")),
        spec_accepted_tokens=_count_or_zero(obj.get("spec_accepted_tokens")),
        ttft_s=_seconds_or_none(obj.get("ttft_s")),
        tpot_s=_seconds_or_none(obj.get("tpot_s")),
        e2e_s=_seconds_or_none(obj.get("e2e_s")),
        queue_s=_seconds_or_none(obj.get("queue_s")) or 0.0,
        num_attempts=_count_or_zero(obj.get("num_attempts")),
        status=str(obj.get("status", STATUS_OK)),
        error=error if isinstance(error, str) else None,
        prefix_hashes=block_ids(obj.get("prefix_hashes"), "prefix_hashes"),
        prefix_block_tokens=_block_tokens(obj.get("prefix_block_tokens")),
        prompt_text=prompt_text,
    )


def block_ids(value: object, key: str) -> tuple[int, ...]:
    """Prefix-block ids from a JSON list: ints as they are, strings (hex digests) hashed
    stably, so traces from other tools that name blocks by digest share blocks too."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{key}: expected a list, got {type(value).__name__}")
    return tuple(_block_id(v, key) for v in value)


def _block_id(value: object, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value:
        return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big")
    raise ValueError(f"{key}: expected integers or strings, got {value!r}")


def _finite_number(value: object, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a number, got {value!r}")
    return float(value)


def _optional_count(obj: Mapping[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key}: expected a non-negative integer, got {obj.get(key)!r}")
    return value


def _count_or_zero(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _seconds_or_none(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _block_tokens(value: object) -> float | None:
    key = "prefix_block_tokens"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}: expected a number of tokens, got {value!r}")
    number = _finite_number(value, key)
    if not MIN_BLOCK_TOKENS <= number <= MAX_BLOCK_TOKENS:
        raise ValueError(f"{key}: expected {MIN_BLOCK_TOKENS}..{MAX_BLOCK_TOKENS} tokens, "
                         f"got {value!r}")
    return number
