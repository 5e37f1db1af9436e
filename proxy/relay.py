"""The request path: admit, validate, shape, route, forward, relay, record.

For each OpenAI request::

    admit (draining? auth? in-flight limit?) -> read + check body -> shape
    -> for each attempt: policy.choose (worker and depth, router.speculation) -> send
         failure before any byte reached the client: breaker + next worker
    -> relay (JSON as one body; SSE event by event as it arrives) -> record

Streams are relayed as they arrive, cut only at SSE event boundaries so that
the usage event can be read (and dropped when the proxy, not the client, asked
for it). A client that goes away cancels the handler, which closes the
upstream connection, which aborts the request on the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from polyinfer.capabilities import OPTIONS, requested_options
from polyinfer.errors import error_body, error_codes, error_field, sse_error_event
from polyinfer.trace import STATUS_CANCELLED, STATUS_ERROR
from proxy.admission import RECHECK_S, AdmissionQueue, InFlightLimit, cpu_quota, quota_lag_s
from proxy.config import ProxyConfig
from proxy.errors import (
    BodyTooLarge,
    ModelNotFound,
    NoHealthyWorker,
    Overloaded,
    ProxyError,
    ShuttingDown,
    Unauthorized,
    UnsupportedOption,
    UpstreamError,
)
from proxy.exchange import ClientExchange
from proxy.offload import CpuLane, read_request
from proxy.pool import Worker, WorkerPool
from proxy.record import RequestRecord
from proxy.shape import ShapeEstimator, prompt_text
from proxy.stats import Stats
from proxy.traces import TraceWriter
from proxy.upstream import UpstreamClient, UpstreamResponse
from proxy.validate import (
    CHAT,
    check_content_type,
    check_fits,
    encode_body,
    wants_usage,
)
from router.base import RequestShape, RouteDecision, RoutingPolicy, WorkerView
from router.speculation import DepthChooser
from specdec.policy import DepthPolicy

logger = logging.getLogger(__name__)

UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
# a request answered with a server error by this many workers is not sent to another
MAX_REFUSALS = 2
# A stream cut at the drain deadline gets this long to take its error event and end.
CUT_WRITE_TIMEOUT_S = 1.0
# A client's own x-request-id is kept when it is an id: else the proxy makes one
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_JSON_HEADERS = {"Content-Type": "application/json"}


class _Retryable(Exception):
    """The worker failed before any byte reached the client."""


class _Refused(_Retryable):
    """The worker answered with a server error (5xx) before any byte reached the client."""


class _NotServed(_Retryable):
    """The worker answered 404: it does not serve the request's model under that name."""

    def __init__(self, message: str, raw: bytes) -> None:
        super().__init__(message)
        self.raw = raw


class _Unsupported(_Retryable):
    """A worker refused an option (400 ``unsupported_option``): learned, then retried."""


class _ClientGone(Exception):
    pass


# OpenAI's error types; a worker's error of another type (vLLM's "NotFoundError") gets the
# one its HTTP status has at OpenAI.
_OPENAI_ERROR_TYPES = frozenset({"invalid_request_error", "authentication_error",
                                 "permission_error", "not_found_error", "rate_limit_error",
                                 "server_error", "api_error"})
_STATUS_ERROR_TYPES = {401: "authentication_error", 403: "permission_error",
                       429: "rate_limit_error"}


def openai_error(status: int, raw: bytes, worker: str) -> dict[str, object]:
    """A worker's error body in OpenAI's shape, with the worker's own message (and param,
    and code when it is a string): what the openai SDK and other clients parse."""
    err = error_field(raw)
    fields = err if isinstance(err, dict) else {}
    message = fields.get("message")
    if not isinstance(message, str) or not message:
        message = err if isinstance(err, str) and err else \
            raw[:1000].decode(errors="replace").strip()
    if not message:
        message = f"worker {worker} answered HTTP {status}"
    error_type = fields.get("type")
    if error_type not in _OPENAI_ERROR_TYPES:
        error_type = _STATUS_ERROR_TYPES.get(status, "server_error" if status >= 500
                                             else "invalid_request_error")
    param = fields.get("param") if isinstance(fields.get("param"), str) else None
    code = fields.get("code") if isinstance(fields.get("code"), str) else None
    if status == 404 and code is None:
        code, param = "model_not_found", param or "model"
    return error_body(message, str(error_type), param, code)


def proxy_headers(rec: RequestRecord) -> dict[str, str]:
    return {
        "x-request-id": rec.request_id,
        "x-polyinfer-worker": rec.worker or "none",
        "x-polyinfer-domain": rec.domain or "none",
        "x-polyinfer-spec-depth": "default" if rec.spec_depth is None else str(rec.spec_depth),
    }


class Relay:
    """Everything the request path needs, built once by the app factory."""

    def __init__(self, config: ProxyConfig, pool: WorkerPool, stats: Stats,
                 estimator: ShapeEstimator, policy: RoutingPolicy,
                 depth_policy: DepthPolicy | None = None) -> None:
        self.config = config
        self.limits = config.limits
        self.pool = pool
        self.stats = stats
        self.estimator = estimator
        self.policy = policy  # swapped at run time by the admin API
        # the depth rules around the policy's decision; its depth policy serves speculation
        # mode "adaptive" under a policy that picks no depth (router.speculation)
        self.speculation = DepthChooser(config.speculation, depth_policy)
        self.traces: TraceWriter | None = None
        self.on_finish: list[Callable[[RequestRecord], None]] = []  # learners, never raising
        self.client: UpstreamClient | None = None  # set by the app's lifetime context
        self.offload: CpuLane | None = None  # for large bodies; set by the app's lifetime context
        self.draining = False
        self.loop_lag_s = 0.0  # smoothed event-loop lag, from measure_loop_lag()
        self.loop_busy = 0.0  # smoothed share of the time the loop's thread was on the CPU
        # the loop is saturated: shed new requests (at the door, proxy.fastpath, for the
        # hot routes); set by measure_loop_lag
        self.shedding = False
        self.num_shed_at_door = 0
        # requests in flight admitted at most (the door refuses the rest); lowered while the
        # loop is saturated, by measure_loop_lag
        self.in_flight_limit = InFlightLimit(config.limits.max_in_flight)
        self._api_keys = frozenset(f"Bearer {k}" for k in config.auth.api_keys)
        self._ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()
        self._slo_tables = {key: config.routing.slo_by_domain(key)
                            for key in ("slo_ttft_s", "slo_tpot_s")}
        self.admission = AdmissionQueue()
        # the requests in progress (id of their record -> their task), for a drain that
        # must cut them; and those of them whose stream has started
        self._running: dict[int, asyncio.Task[Any]] = {}
        self._streaming: set[int] = set()
        self._cut: set[int] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once known

    def new_request_id(self) -> str:
        return f"pi-{self._id_prefix}-{next(self._ids)}"

    def depth_policies(self) -> list[DepthPolicy]:
        """The depth policies in use, the one that picks depths first: the routing policy's
        (an adaptive router gives its decision a depth, which wins), then the relay's."""
        found = (getattr(self.policy, "depth_policy", None), self.depth_policy)
        return list({id(p): p for p in found if isinstance(p, DepthPolicy)}.values())

    @property
    def depth_policy(self) -> DepthPolicy:
        """The depth policy of speculation mode ``adaptive`` under a policy that picks none."""
        return self.speculation.depth_policy

    async def handle(self, ex: ClientExchange, endpoint: str) -> None:
        """Serve one request; a :class:`ProxyError` raised means nothing was sent yet."""
        rid = ex.header("x-request-id")
        if not rid or not _REQUEST_ID.fullmatch(rid):  # what traces and logs may hold
            rid = self.new_request_id()
        rec = RequestRecord(request_id=rid, ts=time.time(), t0=time.perf_counter(),
                            endpoint=endpoint)
        ex.bind(rec)
        try:
            self._admit(ex)
        except ProxyError as e:
            self._fail(rec, e)
            self._finish(rec)
            raise
        self.stats.in_flight += 1
        key = id(rec)
        # NOTE: the loop named: looking it up (asyncio.current_task() without one) costs a
        # getpid() system call per request
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is not None:
            self._running[key] = task
        try:
            await self._handle(ex, rec)
        except ProxyError as e:
            self._fail(rec, e)
            raise
        except asyncio.CancelledError:
            if key in self._cut:
                await self._end_cut(ex, rec)  # a ShuttingDown error unless it streamed
                return
            # NOTE: a client that closes as soon as it has read [DONE] is not a cancellation.
            if not rec.responded:
                rec.status, rec.error = STATUS_CANCELLED, "client_disconnected"
            raise
        except Exception as e:
            rec.status, rec.error, rec.http_status = STATUS_ERROR, f"internal: {e!r}", 500
            raise
        finally:
            self._running.pop(key, None)
            self._streaming.discard(key)
            self._cut.discard(key)
            self.stats.in_flight -= 1
            if rec.e2e_s is None:
                rec.e2e_s = time.perf_counter() - rec.t0
            self._finish(rec)

    def cut_all(self) -> int:
        """End every request in progress (the drain's deadline has come): a stream gets an
        SSE error event and its end, a request not yet answered a 503; their traces say
        so. Returns how many were cut."""
        for key, task in self._running.items():
            self._cut.add(key)
            task.cancel()
        return len(self._running)

    async def _end_cut(self, ex: ClientExchange, rec: RequestRecord) -> None:
        rec.status, rec.http_status = STATUS_ERROR, 503
        rec.error = (f"shutting_down: cut at the drain deadline "
                     f"(limits.drain_timeout_s = {self.limits.drain_timeout_s:g} s)")
        if id(rec) not in self._streaming:
            raise ShuttingDown("the proxy is shutting down and could not finish this request",
                               retry_after_s=self.limits.retry_after_s)
        # NOTE: bounded: a client that does not read would hold this write (and its record,
        # appended after it) past the drain and the trace writer's close
        with contextlib.suppress(TimeoutError, ConnectionError, RuntimeError):
            async with asyncio.timeout(CUT_WRITE_TIMEOUT_S):
                await _write_quietly(ex, sse_error_event(
                    f"the proxy is shutting down; the response is incomplete (request "
                    f"{rec.request_id})", "service_unavailable"))
                await ex.write_eof()

    def _admit(self, ex: ClientExchange) -> None:
        retry = self.limits.retry_after_s
        if self.draining:
            raise ShuttingDown("the proxy is shutting down", retry_after_s=retry)
        if self._api_keys and ex.header("authorization") not in self._api_keys:
            raise Unauthorized("invalid or missing API key (Authorization: Bearer <key>)")
        if self.stats.in_flight >= self.in_flight_limit.value:
            raise Overloaded(f"more than {self.in_flight_limit.value} requests in flight",
                             retry_after_s=retry)
        if self.shedding:
            raise Overloaded(f"proxy saturated (event loop {self.loop_lag_s * 1e3:.0f} ms late, "
                             f"{self.loop_busy:.0%} busy)", retry_after_s=retry)

    def _saturated(self) -> bool:
        """The loop's own work keeps its thread on the CPU and runs it late.

        NOTE: past its capacity the loop still wakes a sleeper within a few tens of ms (each
        iteration serves everything that is ready), while the queue grows where the loop
        does not look: in the kernel, connections and requests not yet accepted or read
        (bench/proxy_overhead.py on a quiet 16-core host: 0 shed, p99 2-6 s at 1.2-2.5x
        capacity). Lag alone sheds nothing there; busy + a small lag lowers the in-flight
        limit (proxy.admission.InFlightLimit), and CPU stolen by another process (the lag
        of a shared core) never counts as busy.
        """
        limits = self.limits
        return bool(limits.busy_loop_lag_s) and self.loop_busy >= limits.max_loop_busy \
            and self.loop_lag_s > limits.busy_loop_lag_s

    async def measure_loop_lag(self, period_s: float = 0.05) -> None:
        """Track how late the event loop wakes a sleeper and how busy its thread is: the
        proxy's own saturation signals."""
        lag = busy = 0.0
        # busy is of what a CPU quota lets the thread use; its lag, over what the quota
        # alone causes (proxy.admission.quota_lag_s)
        share, quota_period = cpu_quota()
        quota_lag, num_samples = quota_lag_s(share, quota_period), 0
        while True:
            t, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(period_s)
            elapsed = time.perf_counter() - t
            # NOTE: smoothed over ~0.1 s so a single scheduling hiccup sheds nothing.
            lag = 0.5 * lag + 0.5 * (elapsed - period_s)
            busy = 0.5 * busy + 0.5 * min(1.0, (time.thread_time() - cpu) / elapsed / share)
            num_samples += 1
            if num_samples % 100 == 0:  # a container's quota may be changed while it runs
                share, quota_period = cpu_quota()
                quota_lag = quota_lag_s(share, quota_period)
            self.loop_lag_s, self.loop_busy = lag, busy
            max_lag = self.limits.max_loop_lag_s
            self.shedding = bool(max_lag) and lag > max_lag
            self.in_flight_limit.update(bool(max_lag) and self._saturated(),
                                        self.stats.in_flight,
                                        lag / ((self.limits.busy_loop_lag_s or 1.0)
                                               + quota_lag))

    @staticmethod
    def _fail(rec: RequestRecord, e: ProxyError) -> None:
        rec.status, rec.http_status = STATUS_ERROR, e.status
        rec.error = f"{e.code or e.error_type}: {e.message}"

    def _finish(self, rec: RequestRecord) -> None:
        self.stats.record(rec)
        outcome = rec.outcome()
        if outcome is not None:
            try:
                self.policy.observe(outcome)
                self.estimator.observe(outcome)
                self.speculation.observe(outcome)
                for hook in self.on_finish:
                    hook(rec)
            except Exception:  # learning must never take the request path down
                logger.exception("observe failed (policy %s)", self.policy.name)
        if self.traces is not None:
            self.traces.append(rec)

    async def _read_body(self, ex: ClientExchange) -> bytes:
        limit = self.limits.max_body_bytes
        if (ex.content_length or 0) > limit:
            raise BodyTooLarge(f"request body over {limit} bytes")
        return await ex.read_body(limit, self.limits.body_timeout_s)

    async def _handle(self, ex: ClientExchange, rec: RequestRecord) -> None:
        check_content_type(ex.header("content-type"))
        raw = await self._read_body(ex)
        # NOTE: a large body's parse, checks and shape estimate (the chat template rendered
        # over every message) run off the loop (proxy.offload)
        lane = self.offload if len(raw) > self.limits.offload_body_bytes else None
        body, num_chars = (read_request(raw, rec.endpoint) if lane is None
                           else await lane.call(read_request, raw, rec.endpoint))
        rec.model = body["model"]
        rec.stream = body.get("stream") is True
        if not self.pool.serves(rec.model):
            raise ModelNotFound(f"the model '{rec.model}' does not exist; see GET /v1/models",
                                param="model")
        needs = requested_options(body, rec.endpoint == CHAT)
        self._check_servable(rec.model, needs)
        # NOTE: refused before the shape is estimated (which tokenizes or renders it)
        context = self.pool.max_context_tokens(rec.model)
        param = "messages" if rec.endpoint == CHAT else "prompt"
        check_fits(num_chars, None, context, param)
        # NOTE: a depth fixed before routing (the client's, speculation mode off / fixed) is
        # in the shape, so the policy prices and records the depth that is sent
        estimate = self.estimator.estimate(body, ex.path)
        rec.shape = self.speculation.pin(await estimate if lane is None
                                         else await lane.run(estimate))
        check_fits(0, rec.shape.prompt_tokens, context, param)
        if self.config.traces.record_prompt_text:
            rec.prompt_text = prompt_text(body)
        strip_usage = rec.stream and not wants_usage(body)
        if strip_usage:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        await self._forward(ex, rec, body, strip_usage, hash(raw), needs)

    def _check_servable(self, model: str, needs: frozenset[str]) -> None:
        """A 400 naming the option when no worker of ``model`` serves the request's options."""
        missing = self.pool.unservable(model, needs)
        if missing:
            raise UnsupportedOption(f"no worker serving '{model}' supports "
                                    f"{', '.join(repr(m) for m in missing)}", param=missing[0])

    async def _forward(self, ex: ClientExchange, rec: RequestRecord, body: dict[str, Any],
                       strip_usage: bool, body_key: int,
                       needs: frozenset[str] = frozenset()) -> None:
        """Try workers until one answers; ``body_key`` (a hash of the client's body) tells
        the breakers one request's failures from a worker's. Only workers that serve every
        option in ``needs`` are tried."""
        assert rec.shape is not None
        tried: list[str] = []
        last_error = ""
        not_served: _NotServed | None = None
        refused: list[Worker] = []  # the workers that answered it with a server error
        for _ in range(self.limits.max_attempts):
            # NOTE: the workers with room found without a coroutine (most requests); the
            # wait for room only when every routable worker is at its cap
            views = self.pool.routable(rec.model, tried, needs)
            room = [v for v in views
                    if not v.max_outstanding or v.outstanding_requests < v.max_outstanding]
            views = room if room or not views else await self._views_with_room(rec, tried, needs)
            if not views:
                break
            decision = self._choose(rec.shape, views)
            worker = self.pool.workers[decision.worker]
            decision = self.speculation.complete(decision, rec.shape, worker.view)
            rec.worker, rec.reason = worker.name, decision.reason
            rec.num_attempts += 1
            rec.spec_depth = decision.spec_depth
            try:
                return await self._attempt(ex, rec, worker, body, strip_usage, body_key)
            except _Refused as e:
                last_error = str(e)
                tried.append(worker.name)
                refused.append(worker)
                if len(refused) >= MAX_REFUSALS:
                    self._own_failure(refused, body_key, last_error)
                self.stats.errors[(worker.name, "retried")] += 1
            except _NotServed as e:
                not_served = e
                tried.append(worker.name)
                self._not_serving(worker, rec.model)
            except _Unsupported:
                tried.append(worker.name)
                self._check_servable(rec.model, needs)  # the last capable one refused
            except _Retryable as e:
                last_error = str(e)
                tried.append(worker.name)
                self.stats.errors[(worker.name, "retried")] += 1
        if not_served is not None and not last_error:  # every worker tried said 404
            error = openai_error(404, not_served.raw, rec.worker)["error"]
            assert isinstance(error, dict)
            raise ModelNotFound(str(error["message"]), param="model")
        retry = self.limits.retry_after_s
        if not tried:
            raise NoHealthyWorker(f"no healthy worker serves '{rec.model}'", retry_after_s=retry)
        raise UpstreamError(f"{len(tried)} worker(s) failed: {last_error}")

    def _own_failure(self, refused: list[Worker], body_key: int, last_error: str) -> None:
        """The request got a server error from ``MAX_REFUSALS`` workers: its own doing (a
        body no worker can serve), not theirs. Their breakers take it back, and it is not
        sent to another worker to fail there too."""
        for worker in refused:
            worker.breaker.forgive(body_key)
        raise UpstreamError(f"the request failed on {len(refused)} workers, so it is not "
                            f"retried on more (last: {last_error})")

    def _not_serving(self, worker: Worker, model: str) -> None:
        """A 404 from ``worker`` for ``model``: no more requests for it go there (the
        request itself is retried on a worker that serves it)."""
        self.stats.errors[(worker.name, "model_not_found")] += 1
        if model in worker.models:
            worker.models.discard(model)
            logger.warning("worker %s answered 404 for model %r: it does not serve it under "
                           "that name (for vLLM, see --served-model-name); no more requests "
                           "for it go there", worker.name, model)

    async def _views_with_room(self, rec: RequestRecord, tried: list[str],
                               needs: frozenset[str] = frozenset()) -> list[WorkerView]:
        """The routable workers with room under their ``max_outstanding`` caps; while every
        routable worker is at its cap, waits for room (:mod:`proxy.admission`), until
        ``limits.max_queue_s`` after arrival, then all the routable workers."""
        queued_at = None
        try:
            while True:
                views = self.pool.routable(rec.model, tried, needs)
                room = [v for v in views
                        if not v.max_outstanding or v.outstanding_requests < v.max_outstanding]
                if room or not views:
                    return room
                now = time.perf_counter()
                give_up = rec.t0 + self.limits.max_queue_s
                if now >= give_up:
                    return views
                if queued_at is None:
                    queued_at = now
                    self.stats.queued += 1
                    self.stats.queue_waiting += 1
                await self.admission.wait(self._ttft_deadline(rec), rec.t0,
                                          min(give_up - now, RECHECK_S))
        finally:
            if queued_at is not None:
                waited = time.perf_counter() - queued_at
                rec.queue_s += waited
                self.stats.queued_s += waited
                self.stats.queue_waiting -= 1

    def _ttft_deadline(self, rec: RequestRecord) -> float:
        """When the request misses its TTFT SLO (its own, else its domain's; without one,
        ``limits.max_queue_s`` after arrival), perf_counter seconds."""
        return rec.t0 + (self._slo_of(rec, "slo_ttft_s") or self.limits.max_queue_s)

    def _slo_of(self, rec: RequestRecord, key: str) -> float | None:
        """The request's ``slo_ttft_s`` or ``slo_tpot_s``: its own, else its domain's."""
        assert rec.shape is not None
        return getattr(rec.shape, key) or self._slo_tables[key].get(rec.shape.domain)

    def _choose(self, shape: RequestShape, views: list[WorkerView]) -> RouteDecision:
        """The policy's decision, or the first routable worker if the policy misbehaves."""
        try:
            decision = self.policy.choose(shape, views)
        except Exception:
            logger.exception("routing policy %s failed in choose", self.policy.name)
            return RouteDecision(worker=views[0].name, reason="policy_error")
        for v in views:  # NOTE: a loop, not any() over a generator: every request
            if v.name == decision.worker:
                return decision
        logger.error("routing policy %s chose %r, not a routable worker", self.policy.name,
                     decision.worker)
        return RouteDecision(worker=views[0].name, spec_depth=decision.spec_depth,
                             reason="policy_error")

    def _slos(self, worker: Worker, rec: RequestRecord, body: dict[str, Any]) -> None:
        """The request's SLOs (its own, else its domain's) for an engine worker, which paces
        prompt chunks by them (engine.pacing); stripped for other backends, as other
        polyinfer-only fields are, and with ``routing.forward_slos`` off."""
        if not (self.config.routing.forward_slos and worker.backend == "engine"):
            body.pop("slo_ttft_s", None)
            body.pop("slo_tpot_s", None)
            return
        for key in ("slo_ttft_s", "slo_tpot_s"):
            value = self._slo_of(rec, key)
            if value is not None:
                body[key] = value
            else:
                body.pop(key, None)

    async def _attempt(self, ex: ClientExchange, rec: RequestRecord, worker: Worker,
                       body: dict[str, Any], strip_usage: bool, body_key: int) -> None:
        if rec.spec_depth is not None:
            body["speculative_depth"] = rec.spec_depth
        else:
            body.pop("speculative_depth", None)
        self._slos(worker, rec, body)
        payload = encode_body(body)
        view = worker.view
        assert rec.shape is not None
        num_tokens = rec.shape.prompt_tokens + rec.shape.predicted_output_tokens
        view.outstanding_requests += 1
        view.outstanding_tokens += num_tokens
        rec.batch_size = view.running
        try:
            upstream = await self._send(worker, payload, rec, body_key)
            try:
                if rec.stream and upstream.status == 200:
                    await self._relay_stream(ex, rec, worker, upstream, strip_usage)
                else:
                    await self._relay_body(ex, rec, worker, upstream)
            finally:
                # NOTE: release() keeps a fully read connection for reuse and closes one
                # with unread body (client gone, worker broken), aborting the upstream.
                upstream.release()
        finally:
            view.outstanding_requests -= 1
            view.outstanding_tokens -= num_tokens
            self.admission.release()

    async def _send(self, worker: Worker, payload: bytes, rec: RequestRecord,
                    body_key: int) -> UpstreamResponse:
        assert self.client is not None
        try:
            upstream = await self.client.post(worker.url, f"/v1/{rec.endpoint}", payload,
                                              rec.request_id)
        except UPSTREAM_ERRORS as e:
            worker.breaker.record_failure()
            raise _Retryable(f"{worker.name}: {type(e).__name__}: {e}") from e
        if upstream.status == 404:  # the route exists: the model is what it does not know
            try:
                raw = (await upstream.read_all())[:4096]
            except UPSTREAM_ERRORS:
                raw = b""
            upstream.release()
            raise _NotServed(f"{worker.name}: HTTP 404 {self._error_detail(raw)}", raw)
        if upstream.status >= 500 or upstream.status == 429:
            try:
                detail = (await upstream.read_all())[:200]
            except UPSTREAM_ERRORS:
                detail = b""
            upstream.release()
            message = f"{worker.name}: HTTP {upstream.status} {self._error_detail(detail)}"
            if upstream.status == 429:
                raise _Retryable(message)
            worker.breaker.record_failure(request_key=body_key)
            raise _Refused(message)
        return upstream

    async def _relay_body(self, ex: ClientExchange, rec: RequestRecord, worker: Worker,
                          upstream: UpstreamResponse) -> None:
        try:
            raw = await upstream.read_all()
        except UPSTREAM_ERRORS as e:
            worker.breaker.record_failure()
            raise _Retryable(f"{worker.name}: {type(e).__name__}: {e}") from e
        if upstream.status == 200 and not self._read_usage(raw, rec):
            # NOTE: an OpenAI 200 is a JSON object; relayed as is, the client would get a
            # 200 it cannot parse and the trace an "ok". Nothing was sent yet: next worker.
            worker.breaker.record_failure()
            raise _Retryable(f"{worker.name}: HTTP 200 with a body that is not a JSON object "
                             f"({len(raw)} bytes)")
        worker.breaker.record_success()
        if upstream.status == 400:
            self._learn_unsupported(worker, raw)
        rec.http_status = upstream.status
        headers = proxy_headers(rec)
        if upstream.status != 200:
            rec.status = STATUS_ERROR
            rec.error = f"upstream_{upstream.status}: {self._error_detail(raw[:200])}"
            raw = orjson.dumps(openai_error(upstream.status, raw, worker.name))
            headers["Content-Type"] = "application/json"
        else:
            headers["Content-Type"] = upstream.content_type or "application/json"
        rec.e2e_s = time.perf_counter() - rec.t0
        ex.send(upstream.status, headers, raw)

    def _learn_unsupported(self, worker: Worker, raw: bytes) -> None:
        """A 400 ``unsupported_option`` naming an option of polyinfer.capabilities: the
        worker gets no more requests that use it, and this one is retried elsewhere."""
        error = error_field(raw)
        if not isinstance(error, dict) or error.get("code") != "unsupported_option":
            return
        option = error.get("param")
        if option not in OPTIONS:
            return
        if option not in worker.unsupported:
            worker.unsupported.add(option)
            logger.warning("worker %s does not support %r: no more requests using it go "
                           "there", worker.name, option)
        self.stats.errors[(worker.name, "unsupported_option")] += 1
        raise _Unsupported(f"{worker.name}: unsupported option {option!r}")

    def _error_detail(self, raw: bytes) -> str:
        """What a trace record and the logs keep of a worker's error body: the body itself
        (200 bytes) only with ``traces.record_prompt_text``, else its OpenAI error type and
        code. NOTE: a server's validation error can quote the request's input (pydantic's
        ``input_value=...``), prompt text included."""
        if self.config.traces.record_prompt_text:
            return repr(raw[:200])
        fields = error_codes(error_field(raw))
        return " ".join(f"{k}={v!r}"[:80] for k, v in fields.items()) or f"({len(raw)} bytes)"

    @staticmethod
    def _read_usage(raw: bytes, rec: RequestRecord) -> bool:
        """Take the usage from a JSON response body; False if the body is not a JSON object."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(body, dict):
            return False
        _take_usage(body.get("usage"), rec)
        return True

    async def _relay_stream(self, ex: ClientExchange, rec: RequestRecord, worker: Worker,
                            upstream: UpstreamResponse, strip_usage: bool) -> None:
        content = upstream
        try:
            first = await content.read_available()
        except UPSTREAM_ERRORS as e:
            worker.breaker.record_failure()
            raise _Retryable(f"{worker.name}: {type(e).__name__}: {e}") from e
        if not first:
            worker.breaker.record_failure()
            raise _Retryable(f"{worker.name}: empty stream")
        if first.lstrip()[:1] in (b"{", b"["):
            # NOTE: a JSON document (or a broken one), not SSE events: relayed, the client's
            # SDK would see a stream with no events and end it as if it were complete.
            worker.breaker.record_failure()
            raise _Retryable(f"{worker.name}: a stream request answered with a JSON body, "
                             f"not SSE events")
        spec_depth = rec.spec_depth
        await ex.start_stream({  # the SSE headers + proxy_headers(rec), built as one dict
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "x-request-id": rec.request_id, "x-polyinfer-worker": rec.worker or "none",
            "x-polyinfer-domain": rec.domain or "none",
            "x-polyinfer-spec-depth": "default" if spec_depth is None else str(spec_depth)})
        self._streaming.add(id(rec))
        try:
            last = await self._pump(content, first, ex, rec, strip_usage)
            if last is None or not await self._unfinished(ex, rec, worker, last):
                worker.breaker.record_success()
        except _ClientGone:
            rec.status, rec.error = STATUS_CANCELLED, "client_disconnected"
            return
        except UPSTREAM_ERRORS as e:
            if rec.responded:  # failed while reading past [DONE]: the client has it all
                return
            worker.breaker.record_failure()
            rec.status, rec.http_status = STATUS_ERROR, 502
            rec.error = f"upstream_broken: {worker.name}: {type(e).__name__}"
            logger.warning("worker %s failed mid-stream (%s): %s", worker.name, rec.request_id, e)
            await _write_quietly(ex, sse_error_event(
                f"worker {worker.name} failed mid-stream ({type(e).__name__}); "
                f"the response is incomplete (request {rec.request_id})"))
        except Exception as e:
            # NOTE: the 200 head is out (or pending): an error response can no longer be
            # sent, and raising would cut the stream (fast path) or write a second response
            # into its body (aiohttp). End it with an error event the client's SDK raises.
            logger.exception("relaying the stream of %s failed", rec.request_id)
            rec.status, rec.http_status = STATUS_ERROR, 500
            rec.error = f"internal: {e!r}"
            await _write_quietly(ex, sse_error_event(
                f"internal proxy error; the response is incomplete (request {rec.request_id})",
                "internal_error"))
        if rec.e2e_s is None:
            rec.e2e_s = time.perf_counter() - rec.t0
        try:
            await ex.write_eof()
            rec.responded = True
        except ConnectionError:
            pass

    async def _unfinished(self, ex: ClientExchange, rec: RequestRecord, worker: Worker,
                          last: bytes) -> bool:
        """A worker's stream that ended without ``[DONE]``, ``last`` its last events: one
        that ended on an error event of the worker's own (a request it refused after the 200
        head) is an error, the event relayed as its last word; one from a backend that always
        ends with ``[DONE]`` (``_DONE_BACKENDS``) was cut short, and the client gets an error
        event saying so. Returns whether the worker is to blame (its breaker counts it)."""
        event = last.rstrip().rpartition(b"\n")[2].removeprefix(b"data:").strip()
        try:
            error = orjson.loads(event).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            error = None
        if error is not None:
            rec.status = STATUS_ERROR
            rec.error = f"upstream_error_event: {worker.name}: {self._error_detail(event)}"
            return False
        if worker.backend not in _DONE_BACKENDS:
            return False
        worker.breaker.record_failure()
        rec.status, rec.http_status = STATUS_ERROR, 502
        rec.error = f"upstream_unfinished: {worker.name}: the stream ended without [DONE]"
        logger.warning("worker %s ended the stream of %s without [DONE]", worker.name,
                       rec.request_id)
        await _write_quietly(ex, sse_error_event(
            f"worker {worker.name} ended the stream early; the response is incomplete "
            f"(request {rec.request_id})"))
        return True

    async def _pump(self, content: UpstreamResponse, chunk: bytes, ex: ClientExchange,
                    rec: RequestRecord, strip_usage: bool) -> bytes | None:
        """Relay the stream to the client; None once ``[DONE]`` came, else (the stream ended
        without it) the last events relayed."""
        tail = last = b""
        done = False
        while chunk:
            buf = tail + chunk if tail else chunk
            cut = _last_event_end(buf)
            if cut > 3:
                out, tail = (buf, b"") if cut == len(buf) else (buf[:cut], buf[cut:])
                pos = _find_usage(out, 0)
                if pos != -1:
                    out = _scan_usage_events(out, rec, strip_usage, pos)
                if rec.ttft_s is None and _carries_output(out):
                    rec.ttft_s = time.perf_counter() - rec.t0
                if not tail and out.endswith(_DONE_EVENTS):
                    # NOTE: the stream's last event: send it with the chunked-encoding
                    # terminator (and, for a one-read stream, the headers) in one write.
                    # (Written here, not through _write_client: one coroutine less.)
                    try:
                        await ex.write_eof(out)
                    except (ConnectionError, RuntimeError) as e:
                        raise _ClientGone() from e
                    rec.responded = True
                    rec.e2e_s = time.perf_counter() - rec.t0
                    # the worker's response read to its end so the connection can be reused
                    while await content.read_chunk():
                        pass
                    return None
                if out:
                    await _write_client(ex, out)
                    last = out
                    done = done or b"data: [DONE]" in out
            else:
                tail = buf
            chunk = await content.read_available()
        if tail:
            await _write_client(ex, tail)
            last = tail
        return None if done else last


_DONE_EVENTS = (b"data: [DONE]\n\n", b"data: [DONE]\r\n\r\n")
# backends whose streams always end with [DONE] when whole (other OpenAI-compatible servers
# may not: for them a stream's end is its end)
_DONE_BACKENDS = ("engine", "vllm")
_USAGE_KEY = b'"usage":'  # followed by "{" or " {": a usage object (not "usage": null)
# Keys whose value, when it is a non-empty string (or list), is generated output: a chat
# delta's text or reasoning, a completion's text, a tool call.
_OUTPUT_KEYS = (b'"content":', b'"text":', b'"reasoning_content":', b'"tool_calls":')


def _carries_output(events: bytes) -> bool:
    """Whether ``events`` (whole SSE events) carry a generated token.

    TTFT is the time to the first token, not to the first event: a chat stream opens
    with a role-only chunk (``"content":""``) sent before prefill, so timing that event
    would hide prefill and queueing from the traces and the router's TTFT model. A key
    inside a JSON string is escaped (``\\"content\\":``), so it cannot match here.
    """
    for key in _OUTPUT_KEYS:
        pos = events.find(key)
        while pos != -1:
            i = pos + len(key)
            while events[i:i + 1] == b" ":
                i += 1
            value = events[i:i + 2]
            if value[:1] == b'"' and value != b'""' or value[:1] == b"[" and value != b"[]":
                return True
            pos = events.find(key, i)
    return False


def _last_event_end(buf: bytes) -> int:
    """The end of the last complete SSE event in ``buf`` (after its blank line); < 4 if none.

    NOTE: the CRLF form is looked for only after the last LF-form end, so a stream in
    one style costs one backward scan that stops near the end, not two full scans.
    """
    lf = buf.rfind(b"\n\n")
    return max(lf + 2, buf.rfind(b"\r\n\r\n", max(lf, 0)) + 4)


async def _write_client(ex: ClientExchange, data: bytes, eof: bool = False) -> None:
    try:
        if eof:
            await ex.write_eof(data)
        else:
            await ex.write(data)
    except (ConnectionError, RuntimeError) as e:
        raise _ClientGone() from e


async def _write_quietly(ex: ClientExchange, data: bytes) -> None:
    try:
        await ex.write(data)
    except (ConnectionError, RuntimeError):
        pass


def _take_usage(usage: Any, rec: RequestRecord) -> None:
    if not isinstance(usage, dict):
        return
    tokens = usage.get("completion_tokens")
    if isinstance(tokens, int):
        rec.completion_tokens = tokens
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0:
        rec.usage_prompt_tokens = prompt
    spec = usage.get("spec_decode")
    if isinstance(spec, dict):
        rec.spec_draft_tokens = _token_count(spec.get("num_draft_tokens"))
        rec.spec_accepted_tokens = _token_count(spec.get("num_accepted_tokens"))
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        rec.cached_tokens = details["cached_tokens"]  # the router learns its cache hits


def _token_count(value: Any) -> int:
    """A worker-reported token count; 0 for anything that is not a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    return int(value) if 0 <= value < float("inf") else 0


def _scan_usage_events(out: bytes, rec: RequestRecord, strip: bool,
                       pos: int | None = None) -> bytes:
    """Read usage from the events in ``out`` (whole events; ``pos``: where the first usage
    object is, when the caller has found it); drop the usage-only event when ``strip``.

    NOTE: only the events that carry a usage object are located and parsed (OpenAI-style
    streams put ``"usage": null`` in every chunk; splitting and re-joining every event of
    every read cost more than the rest of the pump).
    """
    sep = b"\r\n\r\n" if out.endswith(b"\r\n\r\n") else b"\n\n"
    if pos is None:
        pos = _find_usage(out, 0)
    while pos != -1:
        begin = out.rfind(sep, 0, pos)
        begin = 0 if begin == -1 else begin + len(sep)
        end = out.find(sep, pos)
        end = len(out) if end == -1 else end + len(sep)
        obj = _event_json(out[begin:end])
        if obj is not None:
            _take_usage(obj.get("usage"), rec)
            if strip and obj.get("choices") == []:
                out = out[:begin] + out[end:]
                end = begin
        pos = _find_usage(out, end)
    return out


def _find_usage(out: bytes, start: int) -> int:
    """Position of the first usage object at or after ``start``; -1 when none.

    NOTE: bytes.find, not a regex: 2.0 vs 3.4 us over a read of 16 events + usage.
    """
    find = out.find
    i = find(_USAGE_KEY, start)
    while i != -1:
        value = i + len(_USAGE_KEY)
        if out.startswith(b"{", value) or out.startswith(b" {", value):
            return i
        i = find(_USAGE_KEY, value)
    return -1


def _event_json(event: bytes) -> dict[str, Any] | None:
    for line in event.splitlines():
        if line.startswith(b"data:"):
            try:
                obj = orjson.loads(line[5:].strip())
            except orjson.JSONDecodeError:
                return None
            return obj if isinstance(obj, dict) else None
    return None
