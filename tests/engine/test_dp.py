"""Engine-core processes (engine.data_parallel_size): real servers on loopback, real clients."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.engine.conftest import EngineProcess
from tests.engine.prompts import mixed_prompts
from tests.engine.test_server import aclient, client, metrics, wait_idle

pytestmark = pytest.mark.timeout(300)
PROMPTS = mixed_prompts(8)


def engine_config(model_dir: Path, dp: int, **engine: object) -> dict:
    knobs = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "kv_cache_tokens": 8192,
             "max_model_len": 2048, "spec_method": "ngram", "spec_max_depth": 4,
             "num_threads": 0 if dp else 1, "data_parallel_size": dp}
    knobs.update(engine)
    return {"backend": "engine", "model": str(model_dir), "served_model_name": "tiny",
            "engine": knobs}


def start(model_dir: Path, workdir: Path, dp: int, **engine: object) -> EngineProcess:
    proc = EngineProcess(engine_config(model_dir, dp, **engine), workdir)
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    return proc


def core_pids(server: EngineProcess, spawned_only: bool = True) -> list[int]:
    """The server's live child processes: its spawned engine cores, or every child."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == server.proc.pid and fields[0] != "Z" and (
                not spawned_only or b"spawn_main" in cmdline):
            out.append(int(entry.name))
    return sorted(out)


def pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def wait_until(predicate, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The in-process engine and the same config with 1 and 2 core processes."""
    procs = {}
    try:
        for dp in (0, 1, 2):
            procs[dp] = start(tiny_model_dir, tmp_path_factory.mktemp(f"dp{dp}"), dp)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


async def _greedy(server: EngineProcess, **extra: object) -> list[str]:
    c = aclient(server)
    outs = await asyncio.gather(*(c.completions.create(
        model="tiny", prompt=p, max_tokens=24, temperature=0, **extra) for p in PROMPTS))
    return [o.choices[0].text for o in outs]


def test_greedy_outputs_match_in_process(servers: dict[int, EngineProcess]) -> None:
    want = asyncio.run(_greedy(servers[0]))
    assert len(set(want)) > 1
    for dp in (1, 2):
        assert asyncio.run(_greedy(servers[dp])) == want, dp
    assert len(core_pids(servers[2])) == 2 and len(core_pids(servers[1])) == 1


def test_seeded_sampling_is_reproducible(servers: dict[int, EngineProcess]) -> None:
    def sample(server: EngineProcess) -> str:
        return client(server).completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0.9, seed=1234,
            extra_body={"ignore_eos": True}).choices[0].text

    want = sample(servers[0])
    assert [sample(servers[2]) for _ in range(3)] == [want] * 3


def test_stream_usage_and_speculation(servers: dict[int, EngineProcess]) -> None:
    c = client(servers[2])
    prompt = PROMPTS[2] + " " + PROMPTS[2]
    extra = {"speculative_depth": 3, "ignore_eos": True}
    full = c.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                extra_body=extra)
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                       temperature=0, stream=True, extra_body=extra,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    use = chunks[-1].usage
    assert use is not None and use.completion_tokens == full.usage.completion_tokens == 40
    spec = use.model_extra["spec_decode"]
    assert spec == full.usage.model_extra["spec_decode"] and spec["num_draft_tokens"] > 0
    assert full.choices[0].text == client(servers[0]).completions.create(
        model="tiny", prompt=prompt, max_tokens=40, temperature=0,
        extra_body=extra).choices[0].text


def test_metrics_aggregate_over_cores(servers: dict[int, EngineProcess]) -> None:
    server = servers[2]
    before = asyncio.run(wait_idle(server))

    async def run() -> int:
        c = aclient(server)
        outs = await asyncio.gather(*(c.completions.create(
            model="tiny", prompt=p, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True}) for p in PROMPTS))
        return sum(o.usage.completion_tokens + o.usage.prompt_tokens for o in outs)

    total = asyncio.run(run())
    after = asyncio.run(wait_idle(server))
    got = (after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
           + after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"])
    assert got == total
    # NOTE: the per-reason counter appears with the server's first finished request
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0.0) \
        == 8
    assert after["vllm:e2e_request_latency_seconds_count"] - \
        before["vllm:e2e_request_latency_seconds_count"] == 8


def test_abort_on_disconnect_frees_child_cache(servers: dict[int, EngineProcess]) -> None:
    server = servers[2]

    async def run() -> None:
        body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 1500, "stream": True,
                "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(server.base_url + "/v1/completions", json=body) as r:
                for _ in range(3):
                    await r.content.readline()
                m = await metrics(server)
                assert m["vllm:num_requests_running"] == 1 and m["vllm:kv_cache_usage_perc"] > 0
        m = await wait_idle(server)
        assert m["vllm:num_requests_running"] == 0

    asyncio.run(run())


def test_reload_under_load_reaches_every_core(servers: dict[int, EngineProcess]) -> None:
    server = servers[2]

    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.get(server.base_url + "/admin/config") as r:
                config = await r.json()
            c = aclient(server)
            load = [asyncio.ensure_future(c.completions.create(
                model="tiny", prompt=p, max_tokens=48, temperature=0,
                extra_body={"ignore_eos": True})) for p in PROMPTS]
            await asyncio.sleep(0.5)
            config["engine"]["max_num_seqs"] = 2
            async with s.post(server.base_url + "/admin/reload", json=config) as r:
                body = await r.json()
            assert r.status == 200, body
            assert len(body["reload_s_per_core"]) == 2
            assert body["reload_s"] == max(body["reload_s_per_core"])
            outs = await asyncio.gather(*load)
            assert [o.usage.completion_tokens for o in outs] == [48] * 8
            async with s.get(server.base_url + "/admin/config") as r:
                assert (await r.json())["engine"]["max_num_seqs"] == 2
            # Each core now runs 2 sequences: 8 long requests show 4 running, 4 waiting.
            load = [asyncio.ensure_future(c.completions.create(
                model="tiny", prompt=p, max_tokens=400, temperature=0,
                extra_body={"ignore_eos": True})) for p in PROMPTS]
            seen = set()
            while len(seen) < 1 or not all(t.done() for t in load):
                m = await metrics(server)
                seen.add((m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]))
                if (4.0, 4.0) in seen:
                    break
                await asyncio.sleep(0.05)
            for t in load:
                t.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            assert (4.0, 4.0) in seen, seen
            assert max(r for r, _ in seen) <= 4
            config["engine"]["max_num_seqs"] = 16
            async with s.post(server.base_url + "/admin/reload", json=config) as r:
                assert r.status == 200
            config["engine"]["data_parallel_size"] = 1
            async with s.post(server.base_url + "/admin/reload", json=config) as r:
                assert r.status == 400 and "data_parallel_size" in await r.text()
        await wait_idle(server)

    asyncio.run(run())


def test_killed_core_fails_its_requests_others_keep_serving(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start(tiny_model_dir, tmp_path, 2)
    try:
        pids = core_pids(server)
        assert len(pids) == 2

        async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
            try:
                stream = await c.completions.create(
                    model="tiny", prompt=prompt, max_tokens=1500, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})
                async for _ in stream:
                    pass
                return "ok"
            except openai.APIError as e:
                return f"error: {e}"

        async def run() -> list[str]:
            c = aclient(server)
            tasks = [asyncio.ensure_future(one(c, p)) for p in PROMPTS[:4]]
            await asyncio.sleep(1.5)
            os.kill(pids[0], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 240)

        outcomes = asyncio.run(run())
        failed = [o for o in outcomes if o != "ok"]
        assert len(failed) == 2 and all("died" in o for o in failed), outcomes
        c = client(server)
        again = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                     temperature=0)
        assert again.usage.completion_tokens > 0
        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: pid_gone(pids[1]))
        with pytest.raises(openai.InternalServerError) as info:
            for _ in range(50):  # until the server has read the second core's end of pipe
                c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2)
                time.sleep(0.1)
        assert info.value.status_code == 503
    finally:
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_shutdown_leaves_no_core_processes(tiny_model_dir: Path, tmp_path: Path,
                                           sig: signal.Signals) -> None:
    server = start(tiny_model_dir, tmp_path, 2)
    try:
        pids = core_pids(server, spawned_only=False)
        assert len(core_pids(server)) == 2
        assert client(server).completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=4).usage.completion_tokens > 0
        server.proc.send_signal(sig)
        assert server.proc.wait(timeout=30) is not None
        wait_until(lambda: all(pid_gone(p) for p in pids))
    finally:
        server.stop()


@pytest.mark.parametrize("bad", [{"data_parallel_size": -1}, {"data_parallel_size": 65},
                                 {"data_parallel_size": 2, "execution": "cuda_graph",
                                  "device": "cuda"}])
def test_bad_data_parallel_size_is_refused(bad: dict) -> None:
    from polyinfer.config import CompiledConfig, ConfigError

    with pytest.raises(ConfigError, match="data_parallel_size"):
        CompiledConfig.from_dict({"backend": "engine", "engine": bad})
