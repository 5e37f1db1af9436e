"""End-to-end replays against the scripted loopback upstream: bodies, timing, outputs, CLI."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer

from loadgen import (
    ArrivalConfig,
    ClientConfig,
    LengthConfig,
    OutputConfig,
    ReplayConfig,
    SloConfig,
    TraceConfig,
    replay,
    sweep,
)
from loadgen.cli import build_config, register
from loadgen.compare import compare_files
from loadgen.errors import LoadgenConfigError
from polyinfer.config import TINY_TARGET
from polyinfer.heap import OLDER_THRESHOLD, YOUNG_THRESHOLD
from tests.loadgen.conftest import DATA, REPO
from tests.loadgen.upstream import Script, ScriptedUpstream

TOK = Tokenizer.from_file(str(TINY_TARGET / "tokenizer.json"))


def _mooncake(tmp_path: Path) -> Path:
    rows = [(0, 1500, 5, [1, 2, 3]), (100, 1100, 3, [1, 2, 7]), (250, 600, 4, [9, 2]),
            (300, 40000, 2, list(range(100, 179))), (400, 20, 0, [])]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o,
                                        "hash_ids": h}) + "\n" for t, i, o, h in rows))
    return path


def _cfg(url: str, trace: Path, **kw: object) -> ReplayConfig:
    base: dict[str, object] = dict(
        trace=TraceConfig(str(trace)), client=ClientConfig(url),
        arrivals=ArrivalConfig(mode="trace", time_scale=1.0),
        lengths=LengthConfig(block_tokens=512, max_model_len=2048),
        output=OutputConfig(quiet=True), tokenizer=str(TINY_TARGET))
    base.update(kw)
    return ReplayConfig(**base)  # type: ignore[arg-type]


async def test_mooncake_replay_bodies_timing_and_prefixes(upstream: ScriptedUpstream,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = _cfg(upstream.url, _mooncake(tmp_path), output=OutputConfig(str(out), quiet=True))
    result = await replay(cfg)
    s = result.summary
    assert s["num_requests"] == 5 and s["num_ok"] == 5 and s["num_errors"] == 0
    bodies = sorted(upstream.received, key=lambda r: r.recv_s)
    prompts = [TOK.encode(b.body["prompt"], add_special_tokens=False).ids for b in bodies]
    # exact lengths; the 40k-token prompt is clipped to fit 2048 with its 2 output tokens
    assert [len(p) for p in prompts] == [1500, 1100, 600, 2046, 20]
    assert [b.body["max_tokens"] for b in bodies] == [5, 3, 4, 2, 1]
    assert all(b.body["stream"] and b.body["stream_options"] == {"include_usage": True}
               and b.body["ignore_eos"] and b.body["model"] == "scripted-model" for b in bodies)
    assert prompts[0][:1024] == prompts[1][:1024] and prompts[0][1024] != prompts[1][1024]
    # [9, 2] with 600 tokens: block 9, then the first 88 tokens of block 2, cut by whole words
    assert prompts[0][:512] != prompts[2][:512] and prompts[0][512:580] == prompts[2][512:580]
    # never sent early; the trace's 0.1 s spacing is kept
    sent = {r.index: r for r in result.results}
    assert all(r.sent_s >= r.scheduled_s and r.lag_s >= 0 for r in result.results)
    assert [round(sent[i].scheduled_s, 6) for i in range(5)] == [0.0, 0.1, 0.25, 0.3, 0.4]
    assert s["lengths"]["num_prompt_clipped"] == 1 and s["lengths"]["num_raised_to_min"] == 1
    assert s["prompts"] == {"tokenizer": str(TINY_TARGET / "tokenizer.json"), "exact": True,
                            "num_synthesized": 5, "num_from_trace": 0, "num_truncated_text": 0,
                            "num_recounted": 5, "num_inexact": 0}
    lines = (out / "requests.jsonl").read_bytes().splitlines()
    assert len(lines) == 5 and orjson.loads(lines[0])["ok"] is True
    assert orjson.loads((out / "summary.json").read_bytes())["num_ok"] == 5
    assert 0 < s["loadgen_cpu_s_per_request"] < 1.0
    report = (out / "report.md").read_text()
    assert "us of CPU per request" in report
    assert "2048-token context" in report and "![latency_cdf](latency_cdf.png)" in report
    for png in ("latency_cdf.png", "over_time.png", "per_domain.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


async def test_specbench_goes_to_chat_with_domains(upstream: ScriptedUpstream) -> None:
    cfg = _cfg(upstream.url, DATA / "prompts/spec_bench_questions.jsonl",
               arrivals=ArrivalConfig(mode="poisson", rate=200.0, max_requests=12, seed=1),
               lengths=LengthConfig(default_output_tokens=4))
    result = await replay(cfg)
    assert result.summary["num_ok"] == 12
    assert all(r.path == "/v1/chat/completions" and r.body["max_tokens"] == 4
               for r in upstream.received)
    assert set(result.summary["by_domain"]) <= {"translation", "summarization", "qa", "math",
                                                "rag", "chat", "code", "extraction"}
    assert sum(g["num_requests"] for g in result.summary["by_domain"].values()) == 12


async def test_concurrency_is_closed_loop(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    upstream.script = Script(ttft_s=0.02, itl_s=0.005)
    cfg = _cfg(upstream.url, _mooncake(tmp_path),
               arrivals=ArrivalConfig(mode="concurrency", concurrency=2, max_requests=8),
               lengths=LengthConfig(prompt_scale=0.05, max_output_tokens=3))
    result = await replay(cfg)
    assert result.summary["num_ok"] == 8 and upstream.max_in_flight == 2
    assert result.summary["queue_s"]["max"] > 0  # later requests waited for a slot


async def test_duration_limit_and_errors_are_reported(upstream: ScriptedUpstream,
                                                      tmp_path: Path) -> None:
    upstream.script = lambda body: Script(status=500 if body["max_tokens"] == 3 else 200)
    cfg = _cfg(upstream.url, _mooncake(tmp_path),
               arrivals=ArrivalConfig(mode="trace", duration_s=0.2))
    s = (await replay(cfg)).summary
    assert s["num_requests"] == 2 and s["num_ok"] == 1 and s["errors"] == {"HTTP 500": 1}


async def test_rate_sweep_writes_one_run_per_rate(upstream: ScriptedUpstream,
                                                  tmp_path: Path) -> None:
    cfg = _cfg(upstream.url, DATA / "prompts/gsm8k_train.jsonl",
               arrivals=ArrivalConfig(mode="poisson", rate=1.0, max_requests=4),
               lengths=LengthConfig(max_output_tokens=2), sweep_rates=(50.0, 100.0),
               output=OutputConfig(str(tmp_path), plots=False, quiet=True, label="gsm"))
    results = await sweep(cfg)
    assert [r.summary["arrival"]["rate"] for r in results] == [50.0, 100.0]
    assert [r.summary["label"] for r in results] == ["gsm 50 req/s", "gsm 100 req/s"]
    table = compare_files([str(tmp_path / "rate-50"), str(tmp_path / "rate-100")])
    assert "| goodput (req/s) |" in table and "gsm 100 req/s / gsm 50 req/s" in table
    assert "| 50 req/s | 100 req/s | 100 req/s / 50 req/s |" in (tmp_path / "sweep.md").read_text()


async def test_cli_module_end_to_end(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadgen", "--trace", str(_mooncake(tmp_path)),
        "--target", upstream.url + "/v1", "--tokenizer", str(TINY_TARGET),
        "--time-scale", "0.1", "--max-model-len", "2048", "--output", str(out), "--quiet",
        "--no-plots", "--slo", "ttft:2s,tpot:1s", "--label", "cli",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await proc.communicate()
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert b"cli: 5/5 ok" in stdout
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["arrival"]["time_scale"] == 0.1 and summary["slo"]["ttft_s"] == 2.0


def test_cli_builds_the_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["loadgen", "--trace", "t.csv", "--format", "azure", "--target",
                              "http://h:1", "--rate-sweep", "1,2", "--window", "10:70",
                              "--prompt-scale", "0.1", "--slo", "ttft:1s"])
    cfg = build_config(args)
    assert cfg.arrivals.mode == "poisson" and cfg.sweep_rates == (1.0, 2.0)
    assert (cfg.arrivals.window_start_s, cfg.arrivals.window_end_s) == (10.0, 70.0)
    assert cfg.lengths.prompt_scale == 0.1 and cfg.slo == SloConfig(1.0, None, None)
    # two sweep rates that would share one rate-R/ results folder
    args = parser.parse_args(["loadgen", "--trace", "t.csv", "--target", "http://h:1",
                              "--rate-sweep", "2,2.0000001"])
    with pytest.raises(LoadgenConfigError, match="sweep_rates: expected distinct rates"):
        build_config(args)
    args = parser.parse_args(["loadgen", "compare", "a.json", "b.json"])
    assert args.action == "compare" and args.summaries == ["a.json", "b.json"]


def test_compare_rejects_non_summaries(tmp_path: Path) -> None:
    from loadgen.errors import LoadgenError

    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(LoadgenError, match="not a loadgen summary"):
        compare_files([str(tmp_path / "x.json"), str(tmp_path / "x.json")])


def test_cli_errors_exit_2(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from proxy.cli import main

    assert main(["loadgen", "--trace", str(_mooncake(tmp_path))]) == 2
    assert "--trace and --target are required" in caplog.text
    assert main(["loadgen", "compare", "only-one.json"]) == 2
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "hi"}\n')
    assert main(["loadgen", "--trace", str(bad), "--target", "http://127.0.0.1:9"]) == 2
    assert "has no timestamps: pass --rate R" in caplog.text


async def test_tokenizer_from_the_targets_model_root(upstream: ScriptedUpstream,
                                                     tmp_path: Path) -> None:
    trace = _mooncake(tmp_path)
    base = _cfg(upstream.url, trace, tokenizer=None, lengths=LengthConfig(prompt_scale=0.05),
                arrivals=ArrivalConfig(mode="trace", time_scale=0.1, max_requests=2))
    upstream.model_root = str(TINY_TARGET)
    found = (await replay(base)).summary["prompts"]
    assert found["exact"] and found["tokenizer"] == str(TINY_TARGET / "tokenizer.json")
    upstream.model_root = str(tmp_path / "not-here")
    missing = (await replay(base)).summary["prompts"]
    assert not missing["exact"] and missing["tokenizer"].startswith("estimate")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polyinfer")
    register(parser.add_subparsers())
    return parser


@pytest.mark.parametrize(("flags", "message"), [
    (["--time-scale", "inf"], "argument --time-scale: expected a finite number, got 'inf'"),
    (["--time-scale", "0"], "argument --time-scale: expected a positive number, got '0'"),
    (["--rate", "-2"], "argument --rate: expected a positive number, got '-2'"),
    (["--rate", "0"], "argument --rate: expected a positive number, got '0'"),
    (["--concurrency", "0"], "argument --concurrency: expected an integer >= 1, got '0'"),
    (["--duration", "inf"], "argument --duration: expected a finite number, got 'inf'"),
    (["--prompt-scale", "inf"], "argument --prompt-scale: expected a finite number"),
    (["--timeout", "nan"], "argument --timeout: expected a finite number, got 'nan'"),
    (["--max-requests", "1.5"], "argument --max-requests: expected an integer, got '1.5'"),
    (["--window", "5:2"], "argument --window: expected START:END seconds"),
    (["--rate-sweep", "1,-2"], "argument --rate-sweep: expected a positive number, got '-2'"),
])
def test_cli_bad_values_are_argparse_errors_naming_the_flag(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["loadgen", "--trace", "t.jsonl", "--target", "http://h:1",
                              *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--arrival", "trace", "--rate", "5"], "--rate does not apply to --arrival trace"),
    (["--concurrency", "4", "--rate", "5"], "--rate does not apply to --arrival concurrency"),
    (["--arrival", "poisson", "--rate", "5", "--burstiness", "0.5"],
     "--burstiness does not apply to --arrival poisson"),
    (["--arrival", "trace", "--concurrency", "2"],
     "--concurrency does not apply to --arrival trace"),
])
def test_cli_flags_the_arrival_mode_ignores_are_errors(flags: list[str], message: str) -> None:

    args = _parser().parse_args(["loadgen", "--trace", "t.jsonl", "--format", "mooncake",
                                 "--target", "http://h:1", *flags])
    with pytest.raises(LoadgenConfigError, match=message):
        build_config(args)


def test_cli_trace_only_flags_in_a_rate_mode_are_named(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    args = _parser().parse_args(["loadgen", "--trace", "t.jsonl", "--format", "mooncake",
                                 "--target", "http://h:1", "--rate", "5", "--time-scale", "0.5"])
    assert build_config(args).arrivals.mode == "poisson"
    assert "--time-scale is ignored: it applies to --arrival trace, not poisson" in caplog.text


def test_cli_rate_with_burstiness_defaults_to_gamma() -> None:
    args = _parser().parse_args(["loadgen", "--trace", "t.jsonl", "--format", "prompts",
                                 "--target", "http://h:1", "--rate", "5", "--burstiness", "0.5"])
    cfg = build_config(args)
    assert (cfg.arrivals.mode, cfg.arrivals.rate, cfg.arrivals.burstiness) == ("gamma", 5.0, 0.5)


async def test_nothing_to_replay_is_an_error_naming_the_file(upstream: ScriptedUpstream,
                                                             tmp_path: Path) -> None:
    from loadgen.errors import TraceError

    header_only = tmp_path / "h.csv"
    header_only.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match=rf"^{header_only}: nothing to replay \(0 records read, "
                                         r"0 bad lines skipped\)"):
        await replay(_cfg(upstream.url, header_only))
    outside = _cfg(upstream.url, _mooncake(tmp_path),
                   arrivals=ArrivalConfig(mode="trace", window_start_s=100.0))
    with pytest.raises(TraceError, match=r"nothing to replay \(5 records read, 0 bad lines "
                                         r"skipped, none inside --window 100:\)"):
        await replay(outside)
    assert upstream.received == []  # was: a silent "0/0 ok" run


async def test_missing_timestamp_error_names_the_file(upstream: ScriptedUpstream,
                                                      tmp_path: Path) -> None:
    from loadgen.errors import TraceError

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "timestamp": 1}\n{"prompt": "b"}\n')
    cfg = _cfg(upstream.url, path)  # detected as prompts; --arrival trace needs stamps
    with pytest.raises(TraceError, match=rf"^{path}: line 2 has no timestamp"):
        await replay(cfg)


async def test_unusable_output_dir_fails_before_the_run(upstream: ScriptedUpstream,
                                                        tmp_path: Path) -> None:

    not_a_dir = tmp_path / "taken"
    not_a_dir.write_text("a file")
    cfg = _cfg(upstream.url, _mooncake(tmp_path), output=OutputConfig(str(not_a_dir), quiet=True))
    with pytest.raises(LoadgenConfigError, match=rf"^--output {not_a_dir}: cannot create"):
        await replay(cfg)
    assert upstream.received == []  # was: FileExistsError after the run, its results lost


def test_result_files_are_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    from loadgen.report import atomic_writer

    path = tmp_path / "requests.jsonl"
    path.write_bytes(b'{"index": 0}\n')
    with pytest.raises(RuntimeError), atomic_writer(path) as f:
        f.write(b'{"index": 0}\n{"ind')
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b'{"index": 0}\n' and list(tmp_path.iterdir()) == [path]
    with atomic_writer(path) as f:
        f.write(b'{"index": 1}\n')
    assert path.read_bytes() == b'{"index": 1}\n' and list(tmp_path.iterdir()) == [path]


async def test_the_send_loop_holds_full_collections_off_and_restores_the_collector(
        upstream: ScriptedUpstream, tmp_path: Path) -> None:
    # NOTE: the scripted upstream answers in this process, so it sees the collector as the
    # send loop left it while requests are in flight
    seen: list[tuple[tuple[int, ...], int]] = []

    def script(body: dict[str, Any]) -> Script:
        seen.append((gc.get_threshold(), gc.get_freeze_count()))
        return Script()
    upstream.script = script
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    cfg = _cfg(upstream.url, _mooncake(tmp_path),
               lengths=LengthConfig(prompt_scale=0.05, max_output_tokens=3))
    result = await replay(cfg)
    assert result.summary["num_ok"] == 5 and len(seen) == 5
    assert all(t == (YOUNG_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD) and frozen > 1000
               for t, frozen in seen), seen
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
