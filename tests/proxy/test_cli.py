"""The `polyinfer` CLI as a new user meets it: --version, help texts, start-up errors."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import pytest

from polyinfer.config import CompiledConfig
from proxy.cli import build_parser, main
from proxy.config import LaunchSpec, RoutingConfig, WorkerSpec, default_config
from proxy.routing import POLICIES
from proxy.serve_cli import build_config
from proxy.supervisor import SupervisedWorker, WorkerStartError, log_tail, vllm_command


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"polyinfer {version('polyinfer')}"


def test_serve_help_lists_every_routing_policy_and_the_default(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(_help(capsys, "serve").split())  # argparse wraps the lines
    for name in POLICIES:
        assert name in text
    assert f"(default: {RoutingConfig().policy})" in text


@pytest.mark.parametrize("command", ["engine", "optimize"])
def test_engine_and_optimize_help_describe_the_command_with_examples(
        capsys: pytest.CaptureFixture[str], command: str) -> None:
    text = _help(capsys, command)
    description = text.split("\n\n", 2)[1]  # after the usage block
    assert description.startswith(f"``polyinfer {command}``")
    examples = text.split("Examples::", 1)[1].split("options:", 1)[0]
    assert f"    polyinfer {command} --" in examples


def test_a_config_without_workers_starts_the_embedded_default_ones(tmp_path: Path) -> None:
    path = tmp_path / "polyinfer.yaml"
    path.write_text("server: {port: 8123}\nrouting: {policy: least_outstanding}\n")
    args = argparse.Namespace(config=str(path), worker=[], host=None, port=None, policy=None)
    config = build_config(args)
    assert config.workers == default_config().workers
    assert config.server.port == 8123 and config.routing.policy == "least_outstanding"
    args.worker = ["http://127.0.0.1:9001"]  # --worker still replaces them
    assert [w.url for w in build_config(args).workers] == ["http://127.0.0.1:9001"]


def test_a_busy_port_fails_before_any_worker_starts(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = tmp_path / "polyinfer.yaml"
        path.write_text(f"server: {{port: {port}}}\nrun_dir: {tmp_path / 'run'}\n"
                        "traces: {dir: " + str(tmp_path / "traces") + "}\n")
        start = time.monotonic()
        assert main(["serve", "--config", str(path)]) == 1  # the two default engine workers
        elapsed = time.monotonic() - start
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text
    assert "started (pid" not in caplog.text and not (tmp_path / "run" / "logs").exists()
    assert elapsed < 5.0  # a worker start alone takes ~10 s


async def test_a_bad_model_path_shows_the_workers_own_error(tmp_path: Path) -> None:
    spec = WorkerSpec(name="bad", launch=LaunchSpec(startup_timeout_s=120),
                      config=CompiledConfig(backend="engine", model=str(tmp_path / "nowhere")))
    worker = SupervisedWorker(spec, tmp_path)
    try:
        with pytest.raises(WorkerStartError) as e:
            await worker.start()
    finally:
        await worker.stop()
    message = str(e.value)
    assert message.startswith("bad: exited during start-up (code ")
    assert f"{tmp_path / 'nowhere'} does not exist" in message  # the worker's own last lines
    assert " start: " not in message  # the log's own start line is not repeated


def test_log_tail_keeps_the_last_run_only(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("\n=== t0 start: a\nold error\n\n=== t1 start: b\n"
                   + "".join(f"line {i}\n" for i in range(20)))
    assert log_tail(log, num_lines=3) == "line 17\nline 18\nline 19"
    assert "old error" not in log_tail(log, num_lines=50)
    assert log_tail(tmp_path / "missing.log") == ""


def test_vllm_is_launched_under_the_name_the_proxy_routes_by(tmp_path: Path) -> None:
    config = CompiledConfig(backend="vllm", model="models/tiny-target")
    spec = WorkerSpec(name="v", launch=LaunchSpec(), config=config)
    cmd = vllm_command(spec, "127.0.0.1", 8001, tmp_path / "c.yaml")
    assert cmd[cmd.index("--served-model-name") + 1] == config.model_name == "tiny-target"
    own = WorkerSpec(name="v", launch=LaunchSpec(args=("--served-model-name", "mine")),
                     config=config)
    cmd = vllm_command(own, "127.0.0.1", 8001, tmp_path / "c.yaml")
    assert cmd.count("--served-model-name") == 1 and cmd[-1] == "mine"
