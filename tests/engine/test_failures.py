"""Failure handling at the engine's boundaries: clients that leave mid-admin-call, reloads
that cannot be applied, prompts the model cannot embed, and bad command-line values."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from engine.async_engine import AsyncEngine
from engine.errors import ContextLengthError, InvalidRequestError
from engine.loader import load_core
from engine.metrics import EngineMetrics
from engine.protocol import RequestParser
from engine.sequence import GenerationParams
from polyinfer.config import CompiledConfig, EngineConfig
from polyinfer.sampling import SamplingParams
from tests.engine.conftest import EngineProcess, save_random_checkpoint, serving

pytestmark = pytest.mark.timeout(300)
WAIT_S = 60.0  # a hung engine fails the test instead of the whole run


def greedy(max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(0.0), ignore_eos=True)


async def tokens_of(engine: AsyncEngine, rid: str, ids: list[int],
                    params: GenerationParams) -> tuple[list[int], str | None]:
    out: list[int] = []
    reason = None
    async for o in engine.generate(rid, ids, params):
        out.extend(o.new_token_ids)
        reason = o.finish_reason
    return out, reason


@pytest.fixture
async def engine(tiny_model_dir: Path):
    cfg = CompiledConfig(model=str(tiny_model_dir), engine=EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=128, kv_cache_tokens=2048, max_model_len=1024))
    eng = AsyncEngine(load_core(cfg), EngineMetrics("tiny"))
    yield eng
    await eng.stop()


# -- a caller that gives up on a reload or a prefix-cache reset ----------------------------


@pytest.mark.parametrize("call", ["reload", "reset_prefix_cache"])
async def test_cancelled_admin_call_leaves_the_step_loop_serving(engine: AsyncEngine,
                                                                 call: str) -> None:
    """The caller's cancellation reaches the command's future before the step thread runs
    it; settling that future used to raise in the step thread and kill it (all hung)."""
    live = engine.config
    ids = engine.tokenizer.encode("Once upon a time")
    if call == "reload":
        task = asyncio.ensure_future(engine.reload(live.with_engine(max_model_len=64)))
    else:
        task = asyncio.ensure_future(engine.reset_prefix_cache())
    await asyncio.sleep(0)  # the command is in the inbox; the step thread is not started yet
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.start()
    tokens, reason = await asyncio.wait_for(tokens_of(engine, "r", ids, greedy(100)), WAIT_S)
    assert reason == "length" and len(tokens) == 100  # 100 > 64: the reload was skipped
    assert engine.config == live and engine.core.config == live


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    config = {"backend": "engine", "model": str(tiny_model_dir), "served_model_name": "tiny",
              "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 128,
                         "kv_cache_tokens": 4096, "max_model_len": 1024}}
    yield from serving(config, tmp_path_factory)


def _post_and_hang_up(server: EngineProcess, path: str, body: dict) -> None:
    """Send a whole request and close the connection without reading the answer."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (path.encode(), len(data)) + data)


async def _completion(s: aiohttp.ClientSession, server: EngineProcess,
                      **body: object) -> tuple[int, dict]:
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, **body}
    async with s.post(server.base_url + "/v1/completions", json=body,
                      timeout=aiohttp.ClientTimeout(total=WAIT_S)) as r:
        return r.status, await r.json()


async def test_client_gone_mid_reload_leaves_config_and_limits_consistent(
        server: EngineProcess) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(server.base_url + "/admin/config") as r:
            live = await r.json()
        small = json.loads(json.dumps(live))
        small["engine"]["max_model_len"] = 128
        for body in (small, live, small):
            _post_and_hang_up(server, "/admin/reload", body)
            _post_and_hang_up(server, "/reset_prefix_cache", {})
        await asyncio.sleep(1.0)  # whatever reload ran has finished by now
        async with s.get(server.base_url + "/admin/config") as r:
            shown = (await r.json())["engine"]["max_model_len"]
        async with s.get(server.base_url + "/v1/models") as r:
            assert (await r.json())["data"][0]["max_model_len"] == shown
        # fits 1024 but not 128: the parser and the engine must agree on which one runs
        status, answer = await _completion(s, server, prompt=list(range(10, 210)), max_tokens=4)
        if shown == 128:
            assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
        else:
            assert status == 200 and answer["usage"]["completion_tokens"] == 4
        async with s.post(server.base_url + "/admin/reload", json=live) as r:
            assert r.status == 200
        status, answer = await _completion(s, server, prompt="Once upon a time", max_tokens=8)
        assert status == 200 and answer["usage"]["completion_tokens"] == 8


# -- reloads that cannot be applied ----------------------------------------------------------


async def test_reload_that_cannot_allocate_is_a_400_and_the_old_config_serves(
        server: EngineProcess) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(server.base_url + "/admin/config") as r:
            live = await r.json()
        _, before = await _completion(s, server, prompt="The capital of France", max_tokens=12)
        huge = json.loads(json.dumps(live))
        huge["engine"]["kv_cache_tokens"] = 1 << 50  # far past any host's memory: malloc fails
        async with s.post(server.base_url + "/admin/reload", json=huge) as r:
            assert r.status == 400
            err = (await r.json())["error"]
        assert "kv_cache_tokens" in err["message"] and err["code"] == "invalid_config"
        async with s.get(server.base_url + "/admin/config") as r:
            assert await r.json() == live
        status, after = await _completion(s, server, prompt="The capital of France",
                                          max_tokens=12)
        assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]


async def test_request_parsed_before_a_shrinking_reload_is_a_context_error(
        engine: AsyncEngine) -> None:
    """A request parsed under the old limits reaches the core after a reload lowered them:
    it is refused as the parser would (400), not failed as an engine error (500)."""
    await engine.start()
    parser = RequestParser(engine.config, engine.tokenizer, engine.max_model_len,
                           engine.vocab_size)
    parsed = parser.parse({"prompt": list(range(10, 310)), "max_tokens": 8}, chat=False)
    await engine.reload(engine.config.with_engine(max_model_len=256))
    with pytest.raises(ContextLengthError) as e:
        await asyncio.wait_for(tokens_of(engine, "late", parsed.prompt_ids, parsed.params),
                               WAIT_S)
    assert e.value.status == 400 and "256" in e.value.message
    tokens, _ = await asyncio.wait_for(tokens_of(engine, "ok", list(range(10, 50)), greedy(8)),
                                       WAIT_S)
    assert len(tokens) == 8


# -- prompts the model cannot embed ----------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose model embeds 4096 ids while its (bundled) tokenizer knows 8192."""
    return save_random_checkpoint(tmp_path_factory.mktemp("small-vocab"), vocab_size=4096,
                                  num_hidden_layers=2)


async def test_token_ids_past_the_models_embedding_are_refused_alone(
        small_vocab_dir: Path) -> None:
    cfg = CompiledConfig(model=str(small_vocab_dir), engine=EngineConfig(
        max_num_seqs=4, kv_cache_tokens=1024, max_model_len=512))
    engine = AsyncEngine(load_core(cfg), EngineMetrics("small"))
    assert engine.tokenizer.vocab_size > engine.vocab_size == 4096
    parser = RequestParser(cfg, engine.tokenizer, engine.max_model_len, engine.vocab_size)
    with pytest.raises(InvalidRequestError) as e:
        parser.parse({"prompt": [5000, 1, 2]}, chat=False)
    assert e.value.param == "prompt" and "4096" in e.value.message
    await engine.start()
    try:  # the core refuses what a parser let through, without failing its neighbours
        good = asyncio.ensure_future(tokens_of(engine, "good", [5, 6, 7], greedy(40)))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidRequestError):
            await asyncio.wait_for(tokens_of(engine, "bad", [5000, 1, 2], greedy(4)), WAIT_S)
        tokens, reason = await asyncio.wait_for(good, WAIT_S)
        assert reason == "length" and len(tokens) == 40
    finally:
        await engine.stop()


# -- command-line values -------------------------------------------------------------------


@pytest.mark.parametrize("args, names", [
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--log-level", "loud"], "--log-level"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
])
def test_cli_rejects_bad_flag_values_by_name(args: list[str], names: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and names in proc.stderr
    assert "Traceback" not in proc.stderr
