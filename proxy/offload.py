"""A request's CPU work of unbounded size, off the event loop.

Parsing, checking and estimating the shape of a request (the chat template rendered over
every message) cost time in proportion to its body: four bodies of 100k messages held the
loop for 1.25 s, and every other request waited behind them. A body larger than
``limits.offload_body_bytes`` has that work done in :class:`CpuLane`'s thread instead:

    handler (event loop)                     CpuLane (one thread, its own event loop)
      await lane.call(read_request, raw)  ->   parse, check, count characters
      pool checks (cheap)
      await lane.run(estimator.estimate)  ->   render, classify, count tokens
      route, forward

NOTE: one thread, so large bodies are served one at a time there, bounding what they can
take together; the loop's thread still shares the GIL with it, but takes it back within
the interpreter's switch interval (5 ms) instead of waiting for a whole body.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from proxy.validate import check_body, parse_body, prompt_chars

T = TypeVar("T")


def read_request(raw: bytes, endpoint: str) -> tuple[dict[str, Any], int]:
    """The parsed, checked body and its prompt's length in characters (proxy.validate)."""
    body = parse_body(raw)
    check_body(body, endpoint)
    return body, prompt_chars(body, endpoint)


class CpuLane:
    """One worker thread running its own event loop; coroutines and calls run there."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="polyinfer-cpu",
                                        daemon=True)
        self._thread.start()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``'s result, run on the lane's loop; cancelled with the caller."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        async def call() -> T:
            return fn(*args)
        return await self.run(call())

    def close(self) -> None:
        """Stop the thread (what runs there is cancelled with its callers first)."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
