"""A logger for aiohttp's HTTP server that never writes down what a client sent.

aiohttp logs a request it cannot parse (bare-LF line ends, a bad header byte...) at ERROR
with the parser's exception, whose message quotes the raw bytes: the head with its
``Authorization`` key, and the body with the prompt. Both the proxy and the engine pass
:func:`server_logger` to their ``AppRunner`` (``logger=``)::

    web.AppRunner(app, logger=server_logger())

A client's malformed HTTP then leaves one INFO line with the error's class and status
(the client is answered 400 as before); every other record passes through unchanged.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError


class RedactingServerLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's ``aiohttp.server`` logger, minus the client's bytes."""

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None,
            stack_info: bool = False, stacklevel: int = 1,
            extra: Mapping[str, object] | None = None, **kwargs: object) -> None:
        exc = _exception(exc_info)
        if isinstance(exc, HttpProcessingError):
            # NOTE: the message and the traceback both quote the request; its class and
            # status say what went wrong without it.
            self.logger.log(min(level, logging.INFO), "malformed HTTP request: %s (HTTP %s)",
                            type(exc).__name__, exc.code)
            return
        self.logger.log(level, msg, *args, exc_info=exc_info, stack_info=stack_info,
                        stacklevel=stacklevel, extra=extra)


def _exception(exc_info: Any) -> BaseException | None:
    if exc_info is True:
        return sys.exc_info()[1]
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        return exc_info[1]  # type: ignore[no-any-return]
    return None


def server_logger() -> logging.Logger:
    """What aiohttp's request handler takes as ``logger`` (it calls ``debug``,
    ``exception`` and ``log`` on it, as a :class:`logging.LoggerAdapter` provides)."""
    adapter = RedactingServerLogger(logging.getLogger("aiohttp.server"), {})
    return adapter  # type: ignore[return-value]
