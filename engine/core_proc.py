"""One engine-core process: the model, KV cache and step loop of :mod:`engine.dp`.

The child runs the same :class:`engine.async_engine.StepLoop` as the in-process
engine. A reader thread turns messages from the parent's pipe into inbox
commands; the step thread sends each step's outputs and stats back as one
pickled message. The child exits when the parent says ``stop`` or its pipe
closes (the parent died), so it never outlives the HTTP process.

Parent -> child: ``("add", request_id, prompt_ids, params)``, ``("abort", request_id)``,
``("reload", token, config)``, ``("reset_prefix_cache", token)``, ``("stop",)``.
Child -> parent: ``("ready", pid)``, ``("out", outputs, stats)``,
``("reloaded", token, seconds, error)``, ``("prefix_cache_reset", token, num_blocks, error)``,
``("failed", message)`` (start-up failed).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from engine.async_engine import Abort, Add, Command, Reload, ResetPrefixCache
from engine.core import RequestOutput, StepStats
from polyinfer.config import CompiledConfig

logger = logging.getLogger(__name__)


def child_config(config: CompiledConfig) -> CompiledConfig:
    """The config a core process runs: one intra-op thread unless num_threads says otherwise."""
    if config.engine.num_threads == 0:
        return config.with_engine(num_threads=1)
    return config


class _Sender:
    """Serialises sends from the step thread and the reader thread onto one pipe."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            try:
                self._conn.send(msg)
            except (BrokenPipeError, OSError):  # the parent is gone; the reader stops us
                pass

    def post(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        self.send(("out", outputs, stats))


def _answer(sender: _Sender, kind: str, token: int, done: concurrent.futures.Future[Any],
            fallback: Any) -> None:
    """When ``done`` resolves, send ``(kind, token, result, error)``: the parent is always
    answered, with ``fallback`` and the error's text when the command failed."""

    def reply(fut: concurrent.futures.Future[Any]) -> None:
        error = fut.exception()
        result = fallback if error is not None else fut.result()
        sender.send((kind, token, result, None if error is None else str(error)))

    done.add_done_callback(reply)


def _reload_command(sender: _Sender, token: int, config: CompiledConfig) -> Reload:
    cmd = Reload(child_config(config))
    _answer(sender, "reloaded", token, cmd.done, 0.0)
    return cmd


def _reset_command(sender: _Sender, token: int) -> ResetPrefixCache:
    cmd = ResetPrefixCache()
    _answer(sender, "prefix_cache_reset", token, cmd.done, 0)
    return cmd


def _read(conn: Connection, inbox: queue.SimpleQueue[Command | None], sender: _Sender) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = ("stop",)
        kind = msg[0]
        if kind == "add":
            inbox.put(Add(msg[1], msg[2], msg[3]))
        elif kind == "abort":
            inbox.put(Abort(msg[1]))
        elif kind == "reload":
            inbox.put(_reload_command(sender, msg[1], msg[2]))
        elif kind == "reset_prefix_cache":
            inbox.put(_reset_command(sender, msg[1]))
        else:
            inbox.put(None)
            return


def main(config: CompiledConfig, conn: Connection, log_level: int) -> None:
    """The child's entry point (spawned): load the core, then step until told to stop."""
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s core[{os.getpid()}] %(levelname)s %(name)s: "
                               "%(message)s")
    from engine.async_engine import StepLoop
    from engine.loader import load_core
    from polyinfer.heap import settle_heap

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (Ctrl-C reaches both)

    sender = _Sender(conn)
    try:
        core = load_core(child_config(config))
    except Exception as e:
        logger.exception("engine core failed to start")
        sender.send(("failed", f"{type(e).__name__}: {e}"))
        return
    inbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
    reader = threading.Thread(target=_read, args=(conn, inbox, sender), name="core-reader",
                              daemon=True)
    reader.start()
    settle_heap()
    sender.send(("ready", os.getpid()))
    StepLoop(core, inbox, sender.post).run()
    logger.info("engine core stopped")
