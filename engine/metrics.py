"""Prometheus metrics under vLLM's names, so the proxy scrapes engine and vLLM workers alike.

One :class:`EngineMetrics` per app, on its own ``CollectorRegistry`` (no
global registry: tests start several engines in one process). Beside vLLM's
names, ``polyinfer:decode_step_fit_total`` carries the least-squares sums of
the engine's pure decode steps, which the depth policy's step-time model reads
(:mod:`specdec.step_feed`).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from engine.sequence import GenerationParams
from specdec.step_feed import METRIC as STEP_FIT_METRIC
from specdec.step_feed import StepSums

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
                         0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full.")
        self.prompt_tokens = counter("vllm:prompt_tokens",
                                     "Prompt tokens processed (computed or found cached).")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Prompt tokens served from the prefix cache.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens (new requests).")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in tokens (new requests).")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted.")
        self.finished = counter("vllm:request_success", "Finished requests.",
                                ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output chunks.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Mean time per output token, per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency.",
                             LATENCY_BUCKETS)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative proposals.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                         "Speculative tokens proposed.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                            "Speculative tokens accepted.")
        self.spec_accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted speculative tokens by position.",
                                             ("position",))

        self.slo_requests = counter(
            "polyinfer:slo_requests", "Requests that named an SLO, by which (ttft, tpot).",
            ("slo",))
        self.paced_steps = counter(
            "polyinfer:prefill_paced_steps",
            "Steps whose prompt chunks were held to a decode's TPOT SLO (engine.pacing).")

        self.decode_steps = StepSums()  # added to per pure decode step (engine.async_engine)
        r.register(_StepFitCollector(model_name, self.decode_steps))

        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens,
                       self.prompt_tokens_cached, self.prefix_cache_queries,
                       self.prefix_cache_hits,
                       self.generation_tokens, self.preemptions, self.ttft, self.itl, self.tpot,
                       self.e2e, self.spec_drafts, self.spec_draft_tokens,
                       self.spec_accepted_tokens, self.paced_steps):
            metric.labels(model_name=model_name)  # export zeros before the first request

    def count_slos(self, params: GenerationParams) -> None:
        for slo, value in (("ttft", params.slo_ttft_s), ("tpot", params.slo_tpot_s)):
            if value is not None:
                self.slo_requests.labels(model_name=self.model_name, slo=slo).inc()

    def expose(self) -> bytes:
        return generate_latest(self.registry)


class _StepFitCollector(Collector):
    """Exports a :class:`StepSums` at scrape time (nothing to update per step but floats)."""

    def __init__(self, model_name: str, sums: StepSums) -> None:
        self.model_name = model_name
        self.sums = sums

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            STEP_FIT_METRIC, "Weighted least-squares sums over pure decode steps (features "
            "[1, batch, depth sum, depth max, any depth], weight 1/seconds^2); term 'steps' "
            "counts them. See specdec.step_feed.", labels=["model_name", "term"])
        for term, value in self.sums.samples():
            family.add_metric([self.model_name, term], value)
        yield family
