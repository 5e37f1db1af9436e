"""The OpenAI error shape: building error bodies and reading them back.

Every part that speaks the OpenAI API uses this one shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

The proxy and the engine build it (:func:`error_body`, :func:`sse_error_event`);
the proxy's relay and loadgen's client read it back (:func:`error_field`,
:func:`error_codes`). The error trees that decide *which* error a request gets
live with their parts (``proxy.errors``, ``engine.errors``).
"""

from __future__ import annotations

import orjson


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def sse_error_event(message: str, error_type: str = "upstream_error") -> bytes:
    """An SSE event that the openai SDK turns into an APIError for the caller."""
    return b"data: " + orjson.dumps(error_body(message, error_type)) + b"\n\n"


def error_field(raw: bytes) -> object:
    """The ``error`` field of an OpenAI-style JSON error body, or None."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return body.get("error") if isinstance(body, dict) else None


def error_codes(error: object) -> dict[str, str | int]:
    """An OpenAI error's ``type`` and ``code`` where they are strings or integers: what the
    proxy's traces and loadgen's results keep of an error by default, since its message can
    quote the request's input (pydantic's ``input_value=...``), prompt text included."""
    if not isinstance(error, dict):
        return {}
    return {k: v for k in ("type", "code")
            if isinstance(v := error.get(k), (str, int)) and not isinstance(v, bool)}
