"""The worker pool: who the workers are, whether they can take traffic, and how loaded they are.

Health has two sources. Active: a probe loop GETs each worker's ``/health``
every ``health.interval_s``. Passive: the request path reports each
success/failure to the worker's :class:`CircuitBreaker`. A worker is routable
when its probes pass, its breaker allows traffic, and it is not draining.

NOTE: the proxy's own load must not fail a healthy worker's probe. A probe runs in a
thread with a blocking socket, so its timeout is the worker's time to answer, not the
event loop's lateness; a worker is marked down only after ``health.probe_failures``
failed probes in a row, and a failed probe does not count while the worker has
answered real requests within the last probe interval. A scrape loop reads each worker's ``/metrics`` (vLLM metric names)
into its :class:`router.base.WorkerView`.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import orjson

from polyinfer.capabilities import declared_unsupported
from polyinfer.config import CompiledConfig, ConfigError
from proxy.breaker import CircuitBreaker
from proxy.config import HealthConfig, WorkerSpec
from proxy.supervisor import SupervisedWorker
from router.base import WorkerView

logger = logging.getLogger(__name__)

# Scraped gauge/counter names -> Worker attribute; values are summed over label sets.
_SCRAPED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",  # older vLLM name
    "vllm:spec_decode_num_draft_tokens_total": "scraped_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "scraped_accepted_tokens",
}


@dataclass
class Worker:
    spec: WorkerSpec
    url: str
    breaker: CircuitBreaker
    view: WorkerView
    models: set[str] = field(default_factory=set)
    supervisor: SupervisedWorker | None = None
    probe_ok: bool = False
    discovered: bool = False
    num_probe_failures: int = 0
    probe_streak: int = 0  # failed probes in a row
    # tokens one request can hold (prompt + output): /v1/models' max_model_len, else an
    # engine's config; None = not known
    context_tokens: int | None = None
    scraped_draft_tokens: float = 0.0  # worker-lifetime counters from /metrics
    scraped_accepted_tokens: float = 0.0
    # request options it does not serve (polyinfer.capabilities): its backend's declaration,
    # then what it refused with a 400 unsupported_option
    unsupported: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def backend(self) -> str:
        return self.view.backend

    def refresh_health(self, now: float) -> bool:
        self.view.healthy = self.probe_ok and self.breaker.allows(now)
        return self.view.can_route


def probe_health(url: str, timeout_s: float) -> bool:
    """Whether ``url``/health answers 200 within ``timeout_s``. Blocking: run it in a
    thread (the time it measures is then the worker's, not the event loop's)."""
    parts = urlsplit(url)
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else \
        http.client.HTTPConnection
    conn = conn_type(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path.rstrip("/") + "/health")
        response = conn.getresponse()
        response.read(1 << 16)
        return response.status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Sum the samples of the metric names in ``_SCRAPED`` (Prometheus text format)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        attr = _SCRAPED.get(name)
        if attr is None:
            continue
        rest = line.rsplit("}", 1)[-1] if "{" in line else line[len(name):]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        totals[attr] = totals.get(attr, 0.0) + value
    return totals


class WorkerPool:
    """All workers by name; routable views per model; probe and scrape loops."""

    def __init__(self, health: HealthConfig, run_dir: Path) -> None:
        self.health = health
        self.run_dir = run_dir
        self.workers: dict[str, Worker] = {}
        # called after each scrape with the worker and its /metrics text
        self.on_scrape: list[Callable[[Worker, str], None]] = []
        self._session: aiohttp.ClientSession | None = None

    # -- membership ---------------------------------------------------------------------

    async def add(self, spec: WorkerSpec) -> Worker:
        """Add a worker; a supervised one is started and waited for first."""
        if spec.name in self.workers:
            raise ConfigError(f"workers[].name: expected a new name, got {spec.name!r}")
        supervisor = None
        url = spec.url
        if spec.launch is not None:
            supervisor = SupervisedWorker(spec, self.run_dir)
            try:
                await supervisor.start()
            except BaseException:
                await supervisor.stop()
                raise
            url = supervisor.url
        worker = self._make_worker(spec, url, supervisor)
        self.workers[spec.name] = worker
        await self.probe(worker)
        if not worker.probe_ok:
            logger.warning("worker %s at %s does not answer GET /health; it gets no traffic "
                           "until a probe (every %.0f s) passes", spec.name, url,
                           self.health.interval_s)
        return worker

    def _make_worker(self, spec: WorkerSpec, url: str,
                     supervisor: SupervisedWorker | None) -> Worker:
        view = WorkerView(name=spec.name, url=url, backend=spec.backend, config=spec.config,
                          healthy=False, max_outstanding=spec.max_outstanding)
        models = set() if spec.discover else {spec.config.model_name}
        context = spec.config.engine.usable_model_len if spec.backend == "engine" else None
        return Worker(spec=spec, url=url, view=view, models=models, supervisor=supervisor,
                      context_tokens=None if spec.discover else context,
                      unsupported=set(declared_unsupported(spec.backend)),
                      breaker=CircuitBreaker(self.health.breaker_failures,
                                             self.health.breaker_cooldown_s))

    def drain(self, name: str) -> Worker:
        worker = self.workers[name]
        worker.view.draining = True
        return worker

    async def remove(self, name: str, drain_timeout_s: float) -> None:
        """Drain (wait for its in-flight requests), then drop the worker and stop its process."""
        worker = self.drain(name)
        deadline = time.monotonic() + drain_timeout_s
        while worker.view.outstanding_requests > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.workers.pop(name, None)
        if worker.supervisor is not None:
            await worker.supervisor.stop()

    async def close(self) -> None:
        await asyncio.gather(*(w.supervisor.stop() for w in self.workers.values()
                               if w.supervisor is not None), return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # -- routing ------------------------------------------------------------------------

    def routable(self, model: str, exclude: Iterable[str] = (),
                 needs: frozenset[str] = frozenset()) -> list[WorkerView]:
        """Healthy workers of ``model`` not in ``exclude`` that serve every option in
        ``needs``."""
        now = time.monotonic()
        return [w.view for w in self.workers.values()
                if model in w.models and w.name not in exclude
                and not (needs and w.unsupported & needs) and w.refresh_health(now)]

    def unservable(self, model: str, needs: frozenset[str]) -> list[str]:
        """The options of ``needs`` that no worker of ``model`` (healthy or not) serves
        all together with the rest: empty when some worker serves them all."""
        workers = [w for w in self.workers.values() if model in w.models]
        if not needs or not workers or any(not (w.unsupported & needs) for w in workers):
            return []
        refused = [w.unsupported for w in workers]
        return sorted(needs.intersection(*refused)) or sorted(needs & set().union(*refused))

    def num_routable(self) -> int:
        now = time.monotonic()
        return sum(1 for w in self.workers.values() if w.refresh_health(now))

    def serves(self, model: str) -> bool:
        return any(model in w.models for w in self.workers.values())

    def max_context_tokens(self, model: str) -> int | None:
        """The longest request (tokens) some worker of ``model`` can hold; None when a
        worker of it does not say."""
        lengths = [w.context_tokens for w in self.workers.values() if model in w.models]
        if not lengths or any(n is None for n in lengths):
            return None
        return max(n for n in lengths if n is not None)

    def model_names(self) -> list[str]:
        return sorted({m for w in self.workers.values() for m in w.models})

    def model_root(self, model: str) -> str | None:
        """Where ``model``'s checkpoint (and tokenizer) is, as vLLM's ``/v1/models`` says in
        ``root``: the absolute path when a worker serving it names a directory here, else
        the model its config names."""
        configs = [w.view.config for w in self.workers.values()
                   if model in w.models and w.view.config is not None]
        for config in configs:
            if config.model and Path(config.model).is_dir():
                return str(Path(config.model).resolve())
        return next((c.model for c in configs if c.model), None)

    # -- probe and scrape loops ---------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.health.timeout_s),
                connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def probe(self, worker: Worker) -> None:
        ok = await asyncio.to_thread(probe_health, worker.url, self.health.timeout_s)
        if ok and not worker.discovered:
            await self._discover(worker)
        self._set_probe(worker, ok)

    def _set_probe(self, worker: Worker, ok: bool) -> None:
        worker.num_probe_failures += 0 if ok else 1
        worker.probe_streak = 0 if ok else worker.probe_streak + 1
        if not ok and worker.probe_ok and (
                worker.probe_streak < self.health.probe_failures
                or worker.breaker.succeeded_within(self.health.interval_s)):
            return  # not down yet: one slow probe, or it is answering real requests
        if ok and not worker.probe_ok:
            logger.info("worker %s is healthy", worker.name)
            worker.breaker.record_success()  # recovered: give it traffic again at once
        elif not ok and worker.probe_ok:
            logger.warning("worker %s failed %d health probes in a row", worker.name,
                           worker.probe_streak)
        worker.probe_ok = ok
        worker.refresh_health(time.monotonic())

    async def _discover(self, worker: Worker) -> None:
        """Learn served model names (and an engine's live compiled config)."""
        try:
            async with self.session.get(f"{worker.url}/v1/models") as r:
                data = orjson.loads(await r.read()) if r.status == 200 else {}
            models = {m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m}
            lengths = [m.get("max_model_len") for m in data.get("data", []) if isinstance(m, dict)]
            known = [n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 0]
            if known:
                worker.context_tokens = max(known)
            if worker.spec.discover:
                worker.models |= models
            elif models and not worker.models <= models:
                # NOTE: routed by the declared name only; a request the worker 404s is
                # retried elsewhere and the name dropped for it (proxy.relay)
                logger.warning("worker %s lists %s at /v1/models, not the configured %s",
                               worker.name, sorted(models), sorted(worker.models - models))
            if worker.spec.discover:
                await self._discover_engine_config(worker)
            worker.discovered = True
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError, AttributeError, TypeError) as e:
            logger.warning("worker %s: model discovery failed: %s", worker.name, e)

    async def _discover_engine_config(self, worker: Worker) -> None:
        async with self.session.get(f"{worker.url}/admin/config") as r:
            if r.status != 200:
                return
            data = orjson.loads(await r.read())
        try:
            config = CompiledConfig.from_dict(data.get("config", data))
        except ConfigError:
            return
        worker.view.config = config
        worker.view.backend = config.backend

    async def scrape(self, worker: Worker) -> None:
        try:
            async with self.session.get(f"{worker.url}/metrics") as r:
                if r.status != 200:
                    return
                text = await r.text()
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            return
        values = parse_metrics(text)
        view = worker.view
        view.running = int(values.get("running", 0))
        view.waiting = int(values.get("waiting", 0))
        usage = values.get("kv_cache_usage", 0.0)
        view.kv_cache_usage = usage / 100.0 if usage > 1.0 else usage
        worker.scraped_draft_tokens = values.get("scraped_draft_tokens", 0.0)
        worker.scraped_accepted_tokens = values.get("scraped_accepted_tokens", 0.0)
        for hook in self.on_scrape:
            hook(worker, text)

    async def probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health.interval_s)
            await asyncio.gather(*(self.probe(w) for w in list(self.workers.values())))

    async def scrape_loop(self) -> None:
        if self.health.metrics_interval_s <= 0:
            return
        while True:
            await asyncio.gather(*(self.scrape(w) for w in list(self.workers.values())
                                   if w.probe_ok))
            await asyncio.sleep(self.health.metrics_interval_s)

    async def run_loops(self) -> None:
        """Probe and scrape until cancelled."""
        tasks = [asyncio.create_task(self.probe_loop()), asyncio.create_task(self.scrape_loop())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
