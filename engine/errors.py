"""Errors raised by the built-in engine, and how each maps to an HTTP answer.

::

    EngineError                      base of everything the engine raises
    ├── CheckpointError              a model directory cannot be loaded (bad config.json, missing
    │                                weights, unsupported architecture or RoPE scaling)
    ├── RequestError                 the client's request is wrong; answered with ``status``
    │   ├── InvalidRequestError      400: not JSON, missing or mistyped field, value out of range
    │   ├── UnsupportedOptionError   400: a valid OpenAI option this engine does not implement
    │   ├── ContextLengthError       400: prompt (+ max_tokens) longer than max_model_len
    │   ├── ModelNotFoundError       404: the request names a model this engine does not serve
    │   └── EngineUnavailableError   503: no engine-core process left, or the one running the
    │                                request died (engine.dp)
    ├── UnsupportedConfigError       a compiled config value this engine/device cannot run
    │                                (e.g. cuda_graph on a CPU); 400 when it comes by reload
    └── ReloadError                  400: a compiled config cannot be applied to this engine

Each ``RequestError`` carries the OpenAI error body fields (``type``, ``param``,
``code``); the server turns it into ``{"error": {...}}`` with its status.
Internal invariants use ``assert``.
"""

from __future__ import annotations

from typing import Any

from polyinfer.errors import error_body


class EngineError(Exception):
    """Base of every error raised by the engine."""


class CheckpointError(EngineError):
    """A checkpoint directory cannot be loaded; the message names the file and the problem."""


class RequestError(EngineError):
    """A client request that the engine refuses; becomes an OpenAI error body."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequestError(RequestError):
    """Malformed body: not JSON, a missing or mistyped field, a value out of range."""


class UnsupportedOptionError(RequestError):
    """An OpenAI option this engine does not implement (n > 1, best_of, logprobs, ...)."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"'{param}' is not supported by this engine: {detail}", param,
                         "unsupported_option")


class ContextLengthError(RequestError):
    """Prompt tokens (+ max_tokens) exceed the engine's max_model_len."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message, param, "context_length_exceeded")


class ModelNotFoundError(RequestError):
    status = 404
    error_type = "NotFoundError"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"The model `{model}` does not exist; this engine serves `{served}`.",
                         "model", "model_not_found")


class EngineUnavailableError(RequestError):
    """The engine-core process for this request is gone (data-parallel mode)."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, None, "engine_unavailable")


class UnsupportedConfigError(EngineError):
    """A compiled-config value this engine or device cannot run; the message says which."""


class ReloadError(EngineError):
    """A compiled config that cannot be applied by hot reload (e.g. a different model)."""
