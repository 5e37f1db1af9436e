"""Proxy errors, and how each one becomes an OpenAI-style error response.

The tree::

    ProxyError                      (500 internal_error)
    ├── ClientRequestError          (4xx: the client's request is wrong)
    │   ├── InvalidRequest          (400 invalid_request_error; names the bad field)
    │   │   └── UnsupportedOption   (400 unsupported_option: no worker serves the option)
    │   │   └── ContextTooLong      (400 context_length_exceeded: no worker could hold it)
    │   ├── BodyTooLarge            (413 invalid_request_error)
    │   ├── Unauthorized            (401 invalid_api_key)
    │   ├── Forbidden               (403 permission_error)
    │   ├── NotFound                (404 not_found)
    │   │   └── ModelNotFound       (404 model_not_found)
    │   └── Conflict                (409 conflict: e.g. a worker already being replaced)
    ├── Overloaded                  (429 rate_limit_exceeded, Retry-After)
    ├── NoHealthyWorker             (503 service_unavailable, Retry-After)
    ├── ShuttingDown                (503 service_unavailable, Retry-After)
    └── UpstreamError               (502 upstream_error: every worker tried failed
        │                            before a byte reached the client)
        └── UpstreamBroken          (mid-stream: relayed as an SSE error event)

Handlers raise these; one middleware turns them into the OpenAI error shape
(:mod:`polyinfer.errors`) with the status above.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from polyinfer.errors import error_body


class ProxyError(Exception):
    status = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, object]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        """Headers the error's response carries (``Retry-After`` for load and shutdown)."""
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def to_response(self, headers: dict[str, str] | None = None) -> web.Response:
        hdrs = {**(headers or {}), **self.headers()}
        return web.Response(status=self.status, body=orjson.dumps(self.body()),
                            content_type="application/json", headers=hdrs)


class ClientRequestError(ProxyError):
    status = 400
    error_type = "invalid_request_error"


class InvalidRequest(ClientRequestError):
    pass


class UnsupportedOption(InvalidRequest):
    code = "unsupported_option"


class ContextTooLong(InvalidRequest):
    code = "context_length_exceeded"


class BodyTooLarge(ClientRequestError):
    status = 413


class BodyTimeout(ClientRequestError):
    """The request's body did not arrive whole in ``limits.body_timeout_s``."""

    status = 408
    code = "request_timeout"


class Unauthorized(ClientRequestError):
    status = 401
    code = "invalid_api_key"


class Forbidden(ClientRequestError):
    status = 403
    error_type = "permission_error"


class NotFound(ClientRequestError):
    status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(ClientRequestError):
    status = 409
    code = "conflict"


class Overloaded(ProxyError):
    status = 429
    error_type = "rate_limit_exceeded"
    code = "overloaded"


class NoHealthyWorker(ProxyError):
    status = 503
    error_type = "service_unavailable"
    code = "no_healthy_worker"


class ShuttingDown(ProxyError):
    status = 503
    error_type = "service_unavailable"
    code = "shutting_down"


class UpstreamError(ProxyError):
    status = 502
    error_type = "upstream_error"


class UpstreamBroken(UpstreamError):
    """The worker failed after part of the response reached the client."""
