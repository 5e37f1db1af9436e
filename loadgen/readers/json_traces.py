"""JSON-lines traces with timestamps: polyinfer's own trace records and Mooncake."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from loadgen.errors import TraceLineError
from loadgen.readers.base import BadLines, finite_float, non_negative_int, numbered_lines
from loadgen.request import TraceRequest

# NOTE: the proxy hashes blocks of 16..65536 bytes, i.e. a few to ~16k tokens; a block
# under one token or beyond this is a broken record, not a size to replay.
MIN_BLOCK_TOKENS = 1.0
MAX_BLOCK_TOKENS = 65536.0


def json_objects(path: Path, bad: BadLines) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every line that parses as a JSON object."""
    for line, text in numbered_lines(path):
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            bad.reject(TraceLineError(str(path), line, f"not JSON ({e})"))
            continue
        if not isinstance(obj, dict):
            bad.reject(TraceLineError(str(path), line, "not a JSON object"))
            continue
        yield line, obj


def sniff_json_keys(first_line: str) -> set[str]:
    try:
        obj = orjson.loads(first_line)
    except orjson.JSONDecodeError:
        return set()
    return set(obj) if isinstance(obj, dict) else set()


def optional_int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    return None if value is None else non_negative_int(value, key)


def block_tokens(obj: dict[str, Any], key: str = "prefix_block_tokens") -> float | None:
    """Tokens per prefix block as recorded (None when absent: the replay's default, 512)."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}: expected a number of tokens, got {value!r}")
    number = finite_float(value, key)
    if not MIN_BLOCK_TOKENS <= number <= MAX_BLOCK_TOKENS:
        raise ValueError(f"{key}: expected {MIN_BLOCK_TOKENS}..{MAX_BLOCK_TOKENS} tokens, "
                         f"got {value!r}")
    return number


def block_id(value: object, key: str) -> int:
    """A prefix-block id: ints as they are, strings (hex digests) hashed stably."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value:
        return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big")
    raise ValueError(f"{key}: expected integers or strings, got {value!r}")


def int_tuple(value: object, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{key}: expected a list, got {type(value).__name__}")
    return tuple(block_id(v, key) for v in value)


class MooncakeReader:
    """Mooncake: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

    Each hash id names one 512-token block of the prompt; equal ids in
    different requests are the same text, so replays keep the prefix sharing.
    """

    name = "mooncake"

    def sniff(self, first_line: str) -> bool:
        return {"input_length", "output_length"} <= sniff_json_keys(first_line)

    def read(self, path: Path, bad: BadLines) -> Iterator[TraceRequest]:
        for line, obj in json_objects(path, bad):
            try:
                yield TraceRequest(
                    line=line,
                    timestamp_s=finite_float(obj["timestamp"], "timestamp") / 1000.0,
                    prompt_tokens=non_negative_int(obj["input_length"], "input_length"),
                    output_tokens=non_negative_int(obj["output_length"], "output_length"),
                    hash_ids=int_tuple(obj.get("hash_ids"), "hash_ids"),
                )
            except KeyError as e:
                bad.reject(TraceLineError(str(path), line, f"missing key {e}"))
            except ValueError as e:
                bad.reject(TraceLineError(str(path), line, str(e)))


def messages_of(value: object, key: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{key}: expected a non-empty list of messages")
    out = []
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"{key}: each message needs string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


class PolyinferTraceReader:
    """polyinfer's own trace records (DESIGN.md), one JSON object per request.

    The replayed output length is what the recorded request produced
    (``completion_tokens``), falling back to its ``max_tokens``. Prompt text is
    used when the operator had it recorded (``prompt_text``, sent as a user
    message when ``endpoint`` was chat; or ``prompt`` / ``messages``);
    otherwise a prompt of ``prompt_tokens`` is synthesised, sharing blocks per
    ``prefix_hashes``, each block ``prefix_block_tokens`` tokens (traces that
    do not say: the replay's ``--block-tokens``, 512). A record whose block
    size is not a number in 1..65536 is a bad line.
    """

    name = "polyinfer"

    def sniff(self, first_line: str) -> bool:
        return {"ts", "request_id", "prompt_tokens"} <= sniff_json_keys(first_line)

    def read(self, path: Path, bad: BadLines) -> Iterator[TraceRequest]:
        for line, obj in json_objects(path, bad):
            try:
                yield self._record(line, obj)
            except KeyError as e:
                bad.reject(TraceLineError(str(path), line, f"missing key {e}"))
            except ValueError as e:
                bad.reject(TraceLineError(str(path), line, str(e)))

    @staticmethod
    def _record(line: int, obj: dict[str, Any]) -> TraceRequest:
        completion = optional_int(obj, "completion_tokens")
        output = completion if completion else optional_int(obj, "max_tokens")
        prompt = obj.get("prompt_text", obj.get("prompt"))
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError("prompt_text: expected a string")
        messages = obj.get("messages")
        if prompt is not None and messages is None and "chat" in str(obj.get("endpoint", "")):
            messages, prompt = [{"role": "user", "content": prompt}], None
        domain = obj.get("domain")
        return TraceRequest(
            line=line,
            timestamp_s=finite_float(obj["ts"], "ts"),
            prompt=prompt,
            messages=None if messages is None else messages_of(messages, "messages"),
            prompt_tokens=optional_int(obj, "prompt_tokens"),
            output_tokens=output,
            hash_ids=int_tuple(obj.get("prefix_hashes"), "prefix_hashes"),
            block_tokens=block_tokens(obj),
            domain=domain if isinstance(domain, str) and domain else None,
        )
