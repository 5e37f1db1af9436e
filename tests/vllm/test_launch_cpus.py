"""launch.cpus: a supervised worker and everything it starts stay on the CPUs it was given.

Why the vLLM fleet needs it is in tests/vllm/fleet.py (vllm_launch). These tests run
without vLLM: the trampoline on a plain Python child, then the supervisor launching the
built-in engine worker (which, like vLLM, imports torch in its own process).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polyinfer.config import TINY_TARGET, CompiledConfig, ConfigError, build_dataclass
from proxy.config import LaunchSpec, WorkerSpec
from proxy.supervisor import SupervisedWorker, WorkerStartError, pinned_command
from tests.vllm.fleet import tree_cpus

pytestmark = pytest.mark.timeout(120)

REPORT = "import os; print(os.getpid(), ','.join(map(str, sorted(os.sched_getaffinity(0)))))"


def one_cpu() -> int:
    """The last CPU this process may use (CPU 0 on a one-CPU host)."""
    return max(os.sched_getaffinity(0))


def test_without_cpus_the_command_is_unchanged():
    cmd = [sys.executable, "-c", "pass"]
    assert pinned_command(cmd, ()) == cmd


def test_the_child_is_confined_before_its_command_runs_in_the_same_process():
    cpu = one_cpu()
    proc = subprocess.Popen(pinned_command([sys.executable, "-c", REPORT], (cpu,)),
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out.split() == [str(proc.pid), str(cpu)]  # exec'd in place: the pid is the worker's


def test_cpus_the_host_cannot_give_fail_with_a_message_naming_them():
    proc = subprocess.run(pinned_command([sys.executable, "-c", "pass"], (4095,)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith("launch.cpus [4095]: ")


@pytest.mark.parametrize("cpus", [[-1], [0, 0], ["0"]])
def test_bad_cpus_are_refused_with_the_key(cpus: list[object]):
    with pytest.raises(ConfigError, match="launch.cpus"):
        build_dataclass(LaunchSpec, {"cpus": cpus}, "launch")


def test_cpus_round_trip_through_the_config():
    spec = build_dataclass(LaunchSpec, {"cpus": [1, 0]}, "launch")
    assert spec.cpus == (1, 0)


async def test_supervised_engine_worker_stays_on_its_cpu(tmp_path: Path):
    cpu = one_cpu()
    spec = WorkerSpec(name="pinned", launch=LaunchSpec(cpus=(cpu,), startup_timeout_s=90.0),
                      config=CompiledConfig(model=str(TINY_TARGET)))
    worker = SupervisedWorker(spec, tmp_path)
    try:
        await worker.start()
        assert worker.pid is not None
        cpus = await asyncio.to_thread(tree_cpus, worker.pid)
        assert len(cpus) > 1 and set(cpus.values()) == {str(cpu)}, cpus
    finally:
        await worker.stop()


async def test_a_start_on_cpus_the_host_cannot_give_names_them_in_the_log(tmp_path: Path):
    spec = WorkerSpec(name="nowhere", launch=LaunchSpec(cpus=(4095,), startup_timeout_s=60.0),
                      config=CompiledConfig(model=str(TINY_TARGET)))
    worker = SupervisedWorker(spec, tmp_path)
    try:
        with pytest.raises(WorkerStartError, match="exited during start-up"):
            await worker.start()
    finally:
        await worker.stop()
    assert "launch.cpus [4095]: " in worker.log_path.read_text()
