"""Prometheus export: a collector that reads :class:`Stats` and the pool at scrape time.

Nothing is updated per request for Prometheus; the same counters that feed
``/stats`` are turned into labelled series when ``/metrics`` is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from proxy.connections import ConnectionGate
from proxy.pool import WorkerPool
from proxy.stats import ALL, LATENCY_BUCKETS_S, LatencySeries, Stats


class ProxyCollector(Collector):
    def __init__(self, stats: Stats, pool: WorkerPool, policy_name: Callable[[], str]) -> None:
        self.stats = stats
        self.pool = pool
        self.policy_name = policy_name

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._tokens()
        yield from self._spec()
        yield from self._latency()
        yield from self._workers()

    def _requests(self) -> Iterator[Metric]:
        s = self.stats
        req = CounterMetricFamily("polyinfer_requests", "Finished requests",
                                  labels=["worker", "domain", "status"])
        for (worker, domain, status), n in s.requests.items():
            req.add_metric([worker, domain, status], n)
        yield req
        err = CounterMetricFamily("polyinfer_errors", "Errors by worker and kind",
                                  labels=["worker", "kind"])
        for (worker, kind), n in s.errors.items():
            err.add_metric([worker, kind], n)
        yield err
        rej = CounterMetricFamily("polyinfer_rejected", "Requests refused by the proxy",
                                  labels=["status"])
        for http_status, n in s.rejected.items():
            rej.add_metric([str(http_status)], n)
        yield rej
        reasons = CounterMetricFamily("polyinfer_route_decisions", "Routing decisions by reason",
                                      labels=["reason", "policy"])
        for reason, n in s.reasons.items():
            reasons.add_metric([reason, self.policy_name()], n)
        yield reasons
        yield GaugeMetricFamily("polyinfer_in_flight", "Requests in flight", value=s.in_flight)
        yield GaugeMetricFamily("polyinfer_queue_waiting",
                                "Requests waiting for room under the workers' caps",
                                value=s.queue_waiting)
        yield CounterMetricFamily("polyinfer_queued", "Requests that waited for room",
                                  value=s.queued)
        yield CounterMetricFamily("polyinfer_queued_seconds", "Seconds requests waited for room",
                                  value=s.queued_s)

    def _tokens(self) -> Iterator[Metric]:
        # NOTE: vLLM's vllm:prompt_tokens_total / vllm:generation_tokens_total, per model and
        # worker as a gateway counts them
        prompt = CounterMetricFamily("polyinfer_prompt_tokens", "Prompt tokens of requests sent "
                                     "to workers (usage, else estimated)",
                                     labels=["model", "worker"])
        generated = CounterMetricFamily("polyinfer_generation_tokens",
                                        "Generated tokens (usage)", labels=["model", "worker"])
        for (model, worker), (num_prompt, num_generated) in self.stats.tokens.items():
            prompt.add_metric([model, worker], num_prompt)
            generated.add_metric([model, worker], num_generated)
        yield prompt
        yield generated

    def _spec(self) -> Iterator[Metric]:
        depth = CounterMetricFamily("polyinfer_spec_depth", "Requests by speculative depth sent",
                                    labels=["depth"])
        for d, n in self.stats.spec_depths.items():
            depth.add_metric([d], n)
        yield depth
        draft = CounterMetricFamily("polyinfer_spec_draft_tokens", "Drafted tokens (usage)",
                                    labels=["worker", "domain"])
        acc = CounterMetricFamily("polyinfer_spec_accepted_tokens", "Accepted tokens (usage)",
                                  labels=["worker", "domain"])
        for (worker, domain), (num_draft, num_acc) in self.stats.spec_tokens.items():
            draft.add_metric([worker, domain], num_draft)
            acc.add_metric([worker, domain], num_acc)
        yield draft
        yield acc

    def _latency(self) -> Iterator[Metric]:
        for metric, series in self.stats.latency.items():
            h = HistogramMetricFamily(f"polyinfer_{metric}_seconds", f"{metric} in seconds",
                                      labels=["worker"])
            for worker, s in series.items():
                if worker != ALL:
                    h.add_metric([worker], _buckets(s), s.sum)
            yield h

    def _workers(self) -> Iterator[Metric]:
        names = {
            "healthy": "1 if the worker takes traffic", "draining": "1 while draining",
            "outstanding_requests": "Requests in flight to the worker",
            "running": "Scraped vllm:num_requests_running",
            "waiting": "Scraped vllm:num_requests_waiting",
            "kv_cache_usage": "Scraped KV-cache usage, 0..1",
        }
        for attr, doc in names.items():
            g = GaugeMetricFamily(f"polyinfer_worker_{attr}", doc, labels=["worker", "backend"])
            for w in self.pool.workers.values():
                g.add_metric([w.name, w.backend], float(getattr(w.view, attr)))
            yield g


def _buckets(s: LatencySeries) -> list[tuple[str, float]]:
    out = []
    cumulative = 0
    for bound, n in zip((*map(str, LATENCY_BUCKETS_S), "+Inf"), s.buckets, strict=True):
        cumulative += n
        out.append((bound, float(cumulative)))
    return out


class DoorCollector(Collector):
    """What the door refused and holds: connections (open, refused at accept time) and the
    in-flight limit it refuses requests past (their 429s count in polyinfer_rejected)."""

    def __init__(self, gate: ConnectionGate, in_flight_limit: Callable[[], int]) -> None:
        self.gate = gate
        self.in_flight_limit = in_flight_limit

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("polyinfer_connections_open", "Client connections open",
                                value=self.gate.num_open)
        yield CounterMetricFamily("polyinfer_connections_refused",
                                  "Client connections refused at accept time "
                                  "(limits.max_connections): 503 + Retry-After, then closed",
                                  value=self.gate.num_refused)
        yield GaugeMetricFamily("polyinfer_in_flight_limit",
                                "Requests in flight admitted at most (limits.max_in_flight, "
                                "lowered while the event loop is saturated)",
                                value=self.in_flight_limit())


def make_registry(stats: Stats, pool: WorkerPool, policy_name: Callable[[], str]
                  ) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProxyCollector(stats, pool, policy_name))
    return registry
