"""Start a real server (engine, proxy, vLLM) as a subprocess on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp


async def wait_ready(url: str, proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    """Poll ``GET /v1/models`` until it answers 200; fail early if the process exits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            try:
                async with session.get(f"{url}/v1/models") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"server at {url} not ready after {timeout_s} s")


@contextlib.asynccontextmanager
async def running_server(argv: Sequence[str], port: int, cwd: Path, timeout_s: float = 240.0,
                         env: dict[str, str] | None = None) -> AsyncIterator[str]:
    """Yield the base URL of ``argv`` (which must listen on ``port``); terminate it after."""
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, proc, timeout_s)
        yield url
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
