"""Pure cores of the proxy on tiny inputs: config, breaker, metrics parsing, SSE usage
scanning, shapes, stats, trace rotation, the CLI config builder."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import orjson
import pytest

from polyinfer.config import ConfigError
from proxy.breaker import CircuitBreaker
from proxy.config import ProxyConfig, default_config
from proxy.pool import parse_metrics
from proxy.record import RequestRecord
from proxy.relay import _scan_usage_events
from proxy.routing import build_policy
from proxy.serve_cli import build_config
from proxy.shape import HeuristicShapeEstimator, prefix_hashes
from proxy.stats import LatencySeries, Stats
from proxy.traces import RotatingJsonl
from router.base import RequestShape


def test_default_config_has_two_differently_compiled_engine_workers() -> None:
    config = default_config()
    assert [w.name for w in config.workers] == ["latency", "throughput"]
    lat, thr = (w.config for w in config.workers)
    assert all(w.launch is not None and w.backend == "engine" for w in config.workers)
    assert lat.engine.spec_method == "ngram" and thr.engine.spec_method == "none"
    assert thr.engine.max_num_seqs > lat.engine.max_num_seqs
    assert config.server.host == "127.0.0.1" and config.server.port == 8000


def test_yaml_config_loads_with_config_file(tmp_path: Path) -> None:
    (tmp_path / "big.yaml").write_text("backend: engine\nengine: {max_num_seqs: 64}\n")
    (tmp_path / "polyinfer.yaml").write_text("""
workers:
  - {name: a, url: "http://127.0.0.1:9000", config_file: big.yaml}
  - {name: b, launch: {port: 9100}, config: {backend: engine, fit: {domains: [code]}}}
routing: {policy: least_outstanding}
traces: {record_prompt_text: true}
auth: {api_keys: [k1], admin_key: adm}
""")
    config = ProxyConfig.load(tmp_path / "polyinfer.yaml")
    assert config.workers[0].config.engine.max_num_seqs == 64
    assert config.workers[1].launch is not None and config.workers[1].launch.port == 9100
    assert config.workers[1].config.fit.domains == ("code",)
    assert config.routing.policy == "least_outstanding" and config.traces.record_prompt_text
    assert config.auth.api_keys == ("k1",)


@pytest.mark.parametrize("data, key", [
    ({"routing": {"policy": "fastest"}}, "routing.policy"),
    ({"routing": {"polcy": "random"}}, "routing"),
    ({"limits": {"max_in_flight": "many"}}, "limits.max_in_flight"),
    ({"limits": {"max_in_flight": 0}}, "limits.max_in_flight"),
    ({"limits": {"busy_loop_lag_s": -0.01}}, "limits.busy_loop_lag_s"),
    ({"limits": {"max_loop_busy": 0}}, "limits.max_loop_busy"),
    ({"limits": {"max_loop_busy": 1.5}}, "limits.max_loop_busy"),
    ({"workers": [{"name": "a"}]}, "url"),
    ({"workers": [{"name": "a", "url": "http://x", "launch": {}}]}, "url"),
    ({"workers": [{"name": "a", "url": "x"}]}, "url"),
    ({"workers": [{"name": "a", "url": "http://x", "config": {"engine": {"max_num_seqs": -1}}}]},
     "engine.max_num_seqs"),
    ({"workers": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]},
     "unique names"),
    ({"workers": [{"name": "a", "launch": {}, "config": {"backend": "external"}}]}, "launch"),
    ({"speculation": {"mode": "sometimes"}}, "speculation.mode"),
    ({"traces": {"max_files": 0}}, "traces.max_files"),
    ({"server": {"port": 70000}}, "server.port"),
    ({"routing": {"slo_ttft_s": {"poetry": 1.0}}}, "routing.slo_ttft_s.poetry"),
    ({"routing": {"slo_tpot_s": {"*": -0.1}}}, r"routing.slo_tpot_s.\*"),
    ({"routing": {"slo_tpot_s": {"code": "fast"}}}, "routing.slo_tpot_s.code"),
    ({"routing": {"slo_ttft_s": [1.0]}}, "routing.slo_ttft_s"),
])
def test_config_errors_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        ProxyConfig.from_dict(data)


def test_cli_config_builder() -> None:
    ns = argparse.Namespace(config=None, worker=["http://127.0.0.1:9/"], host=None, port=8123,
                            policy="random")
    config = build_config(ns)
    assert config.workers[0].url == "http://127.0.0.1:9" and config.workers[0].discover
    assert config.server.port == 8123 and config.routing.policy == "random"
    default = build_config(argparse.Namespace(config=None, worker=[], host=None, port=None,
                                              policy=None))
    assert len(default.workers) == 2 and default.server.port == 8000


def test_build_policy_by_name_and_path() -> None:
    assert build_policy("round_robin").name == "round_robin"
    assert build_policy("router.baselines:RandomPolicy", seed=3).name == "random"
    with pytest.raises(ConfigError, match="not available"):
        build_policy("router.nothing:Nope")


def test_breaker_opens_half_opens_and_closes() -> None:
    b = CircuitBreaker(max_failures=2, cooldown_s=10)
    b.record_failure(now=0)
    assert b.allows(now=0) and b.state == "closed"
    b.record_failure(now=1)
    assert not b.allows(now=5)
    assert b.allows(now=11)  # half-open: one more chance
    b.record_failure(now=11)  # failed again in half-open: open at once
    assert not b.allows(now=12) and b.num_opened == 2
    b.record_success()
    assert b.allows(now=12) and b.state == "closed"


def test_parse_metrics_sums_label_sets() -> None:
    text = """# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3.0
vllm:num_requests_running{model_name="b",engine="1"} 2
vllm:num_requests_waiting 4
vllm:kv_cache_usage_perc{model_name="a"} 0.25
vllm:spec_decode_num_draft_tokens_total{model_name="a"} 100 1700000000
vllm:spec_decode_num_accepted_tokens_total{model_name="a"} 60
vllm:time_to_first_token_seconds_bucket{le="0.1"} 9
garbage line
"""
    assert parse_metrics(text) == {"running": 5.0, "waiting": 4.0, "kv_cache_usage": 0.25,
                                   "scraped_draft_tokens": 100.0,
                                   "scraped_accepted_tokens": 60.0}


def _event(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_usage_event_is_read_and_stripped_only_when_asked() -> None:
    chunk = _event({"choices": [{"index": 0, "delta": {"content": "x"}}]})
    usage = _event({"choices": [], "usage": {"completion_tokens": 7, "spec_decode": {
        "num_draft_tokens": 9, "num_accepted_tokens": 4}}})
    done = b"data: [DONE]\n\n"
    rec = RequestRecord(request_id="r", ts=0, t0=0, endpoint="completions")
    assert _scan_usage_events(chunk + usage + done, rec, strip=True) == chunk + done
    assert (rec.completion_tokens, rec.spec_draft_tokens, rec.spec_accepted_tokens) == (7, 9, 4)
    rec2 = RequestRecord(request_id="r", ts=0, t0=0, endpoint="completions")
    assert _scan_usage_events(chunk + usage + done, rec2, strip=False) == chunk + usage + done
    assert rec2.completion_tokens == 7
    assert _scan_usage_events(usage, rec2, strip=True) == b""


def test_usage_scan_with_null_usage_in_every_chunk_and_crlf() -> None:
    # OpenAI-style: "usage": null in every chunk, the usage-only chunk last; CRLF framing.
    chunks = [b"data: " + orjson.dumps({"choices": [{"delta": {"content": c}}], "usage": None})
              + b"\r\n\r\n" for c in "abc"]
    usage = (b'data: {"choices": [], "usage": {"completion_tokens": 3}}\r\n\r\n')
    done = b"data: [DONE]\r\n\r\n"
    rec = RequestRecord(request_id="r", ts=0, t0=0, endpoint="chat/completions")
    out = _scan_usage_events(b"".join(chunks) + usage + done, rec, strip=True)
    assert out == b"".join(chunks) + done and rec.completion_tokens == 3
    # a chunk that has content and usage is kept; a malformed usage event is kept untouched
    both = _event({"choices": [{"delta": {"content": "z"}}], "usage": {"completion_tokens": 5}})
    broken = b'data: {"usage":{ not json\n\n'
    rec2 = RequestRecord(request_id="r", ts=0, t0=0, endpoint="chat/completions")
    assert _scan_usage_events(broken + both + usage.replace(b"\r\n", b"\n"), rec2,
                              strip=True) == broken + both
    assert rec2.completion_tokens == 3  # the last usage read wins


def test_heuristic_shape() -> None:
    est = HeuristicShapeEstimator()
    s = asyncio.run(est.estimate(
        {"messages": [{"role": "user", "content": "def f(x):\n  return x"}],
         "max_tokens": 5, "stream": True, "speculative_depth": 2}, "/v1/chat/completions"))
    assert (s.domain, s.max_tokens, s.stream, s.speculative_depth) == ("code", 5, True, 2)
    ids = asyncio.run(est.estimate({"prompt": [1, 2, 3, 4]}, "/v1/completions"))
    assert ids.prompt_tokens == 4 and ids.predicted_output_tokens == 256


def test_prefix_hashes_chain_full_blocks_only() -> None:
    a, b = "a" * 2048, "b" * 2048
    assert prefix_hashes(a[:-1]) == ()
    ha, hab = prefix_hashes(a), prefix_hashes(a + b + "tail")
    assert len(ha) == 1 and len(hab) == 2 and hab[0] == ha[0]
    assert prefix_hashes(b + a)[1] != hab[1], "a block's hash depends on what precedes it"


def test_latency_series_percentiles_and_buckets() -> None:
    s = LatencySeries()
    for v in range(1, 101):
        s.add(v / 1000)
    p = s.percentiles()
    assert p["count"] == 100 and p["p50"] == pytest.approx(0.0505)
    assert p["p99"] == pytest.approx(0.09901)
    assert sum(s.buckets) == 100


def test_stats_counts_requests_errors_and_spec() -> None:
    stats = Stats()
    shape = RequestShape(domain="code", prompt_tokens=3, max_tokens=4, predicted_output_tokens=4)
    ok = RequestRecord(request_id="a", ts=0, t0=0, endpoint="completions", shape=shape,
                       worker="w", reason="fit", spec_depth=3, completion_tokens=4,
                       spec_draft_tokens=6, spec_accepted_tokens=3, ttft_s=0.1, e2e_s=0.4)
    bad = RequestRecord(request_id="b", ts=0, t0=0, endpoint="completions", status="error",
                        http_status=400, error="invalid_request_error: x")
    stats.record(ok)
    stats.record(bad)
    assert stats.requests[("w", "code", "ok")] == 1 and stats.rejected[400] == 1
    assert stats.spec_depths["3"] == 1 and stats.spec_tokens[("w", "code")] == [6, 3]
    assert stats.latency["tpot"]["w"].percentiles()["p50"] == pytest.approx(0.1)
    assert ok.to_trace()["tpot_s"] == pytest.approx(0.1)


def test_rotating_jsonl_rotates_and_prunes(tmp_path: Path) -> None:
    out = RotatingJsonl(tmp_path, max_bytes=100, max_files=3)
    for i in range(40):
        out.write([b'{"i": %d, "pad": "xxxxxxxxxxxxxxxxxxxx"}\n' % i])
    out.close()
    files = sorted(tmp_path.glob("traces-*.jsonl"))
    assert len(files) == 3
    lines = [orjson.loads(line) for f in files for line in f.read_bytes().splitlines()]
    assert [r["i"] for r in lines] == list(range(40 - len(lines), 40))


def test_launch_command_builders(tmp_path: Path) -> None:
    import sys

    from polyinfer.config import CompiledConfig, VllmConfig
    from proxy.config import LaunchSpec, WorkerSpec
    from proxy.supervisor import LAUNCH_BUILDERS

    engine = WorkerSpec(name="e", launch=LaunchSpec(args=("--x",)), config=CompiledConfig())
    cmd = LAUNCH_BUILDERS["engine"](engine, "127.0.0.1", 9001, tmp_path / "e.yaml")
    assert cmd[:4] == [sys.executable, "-m", "proxy.cli", "engine"]
    assert cmd[cmd.index("--port") + 1] == "9001" and cmd[-1] == "--x"
    assert cmd[cmd.index("--config") + 1] == str(tmp_path / "e.yaml")
    vllm = WorkerSpec(name="v", launch=LaunchSpec(), config=CompiledConfig(
        backend="vllm", model="/m", vllm=VllmConfig(
            speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
            max_num_seqs=8, dtype="float32", args=("--enforce-eager",))))
    cmd = LAUNCH_BUILDERS["vllm"](vllm, "127.0.0.1", 9002, tmp_path / "v.yaml")
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--speculative-config") + 1].startswith('{"method": "ngram"')
    assert cmd[cmd.index("--max-num-seqs") + 1] == "8" and "--enforce-eager" in cmd


def test_example_config_loads() -> None:
    from importlib import resources
    path = resources.files("proxy").joinpath("data/polyinfer.example.yaml")
    config = ProxyConfig.load(str(path))
    assert {w.backend for w in config.workers} == {"engine", "vllm", "external"}
    ttft = config.routing.slo_by_domain("slo_ttft_s")
    assert ttft["code"] == 1.0 and ttft["math"] == 2.0 and len(ttft) == 8


def test_routing_slo_reaches_the_router_shape() -> None:
    """A configured per-domain SLO lands in every RequestShape; a request's own value wins."""
    from polyinfer.config import TINY_TARGET
    from proxy.app import default_estimator
    config = ProxyConfig.from_dict({
        "workers": [{"name": "w", "url": "http://127.0.0.1:1", "config": {"model": str(TINY_TARGET)}}],
        "routing": {"slo_ttft_s": {"*": 2.0, "code": 0.5}, "slo_tpot_s": {"code": 0.05}}})
    estimator = default_estimator(config)
    code = {"messages": [{"role": "user", "content": "def f(x):\n    return x\nFix this function."}]}
    shape = asyncio.run(estimator.estimate(code, "/v1/chat/completions"))
    assert shape.domain == "code" and (shape.slo_ttft_s, shape.slo_tpot_s) == (0.5, 0.05)
    shape = asyncio.run(estimator.estimate({**code, "slo_ttft_s": 0.2}, "/v1/chat/completions"))
    assert shape.slo_ttft_s == 0.2
    assert ProxyConfig.from_dict({}).routing.slo_by_domain("slo_ttft_s") == {}


def test_a_misbehaving_policy_falls_back_to_a_routable_worker() -> None:
    from polyinfer.config import CompiledConfig
    from proxy.config import ProxyConfig
    from proxy.pool import WorkerPool
    from proxy.relay import Relay
    from proxy.shape import HeuristicShapeEstimator
    from router.base import RouteDecision, WorkerView

    class Broken:
        name = "broken"

        def __init__(self, answer: str | None) -> None:
            self.answer = answer

        def choose(self, shape, workers):  # type: ignore[no-untyped-def]
            if self.answer is None:
                raise ValueError("boom")
            return RouteDecision(worker=self.answer, reason="x")

        def observe(self, outcome) -> None:  # type: ignore[no-untyped-def]
            return None

    config = ProxyConfig()
    views = [WorkerView(name="a", url="http://a", backend="engine", config=CompiledConfig())]
    shape = RequestShape(domain="chat", prompt_tokens=1, max_tokens=1, predicted_output_tokens=1)
    for answer in (None, "ghost"):
        relay = Relay(config, WorkerPool(config.health, Path(".")), Stats(),
                      HeuristicShapeEstimator(), Broken(answer))
        assert relay._choose(shape, views) == RouteDecision(worker="a", reason="policy_error")


async def test_trace_writer_flushes_on_close_and_bounds_pending(tmp_path: Path) -> None:
    from proxy.config import TraceConfig
    from proxy.traces import TraceWriter

    writer = TraceWriter(TraceConfig(batch_size=2, max_pending=3, flush_interval_s=60), tmp_path)
    for i in range(5):
        writer.append(RequestRecord(request_id=f"r{i}", ts=0, t0=0, endpoint="completions"))
    assert writer.num_dropped == 2
    writer.start()
    await writer.close()
    lines = b"".join(f.read_bytes() for f in tmp_path.glob("traces-*.jsonl")).splitlines()
    assert [orjson.loads(line)["request_id"] for line in lines] == ["r0", "r1", "r2"]
    assert writer.num_written == 3


@pytest.mark.parametrize(("data", "key"), [
    # accepted before, then failing at start-up (or never probing healthy) naming no key
    ({"health": {"timeout_s": float("inf")}}, "health.timeout_s"),
    ({"workers": [{"name": "a", "url": "http://127.0.0.1:99999"}]}, r"workers\[a\]\.url"),
    ({"workers": [{"name": "a", "url": "http://:abc"}]}, r"workers\[a\]\.url"),
    ({"workers": [{"name": "a", "url": "http://"}]}, r"workers\[a\]\.url"),
    ({"workers": [{"name": "a", "url": "http://host name:8000"}]}, r"workers\[a\]\.url"),
    ({"workers": [{"name": "a", "launch": {"env": {"OMP_NUM_THREADS": 1}}}]},
     "launch.env.OMP_NUM_THREADS"),
])
def test_config_values_that_only_failed_later_are_named(data: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        ProxyConfig.from_dict(data)


def test_worker_urls_that_work_are_accepted() -> None:
    for url in ("http://127.0.0.1:8000", "https://gpu-7.internal", "http://[::1]:9000/tenant-a"):
        assert ProxyConfig.from_dict({"workers": [{"name": "a", "url": url}]}).workers[0].url == url
    env = {"OMP_NUM_THREADS": "1"}
    config = ProxyConfig.from_dict({"workers": [{"name": "a", "launch": {"env": env}}]})
    assert config.workers[0].launch is not None and config.workers[0].launch.env == env


def test_latency_add_pair_equals_two_adds() -> None:
    from proxy.stats import WINDOW, LatencySeries
    pair, single = (LatencySeries(), LatencySeries()), (LatencySeries(), LatencySeries())
    values = [1e-5 * (i % 997) ** 1.5 for i in range(WINDOW + 300)]  # past a full ring
    for v in values:
        pair[0].add_pair(pair[1], v)
        single[0].add(v)
        single[1].add(v)
    for a, b in zip(pair, single, strict=True):
        assert (a.count, a.sum, a.buckets, a.recent()) == (
            b.count, b.sum, b.buckets, b.recent())
    assert pair[0].recent() == values[-WINDOW:]
    assert pair[0].count == len(values) and pair[0].sum == pytest.approx(sum(values))
