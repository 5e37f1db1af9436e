"""polyinfer loadgen: replay request traces against an OpenAI-compatible server.

Python API (used in-process by the routing and optimizer benchmarks)::

    from loadgen import ReplayConfig, TraceConfig, ClientConfig, ArrivalConfig, run_replay
    summary = run_replay(ReplayConfig(
        trace=TraceConfig("data/traces/azure_llm_2023_conv.csv"),
        client=ClientConfig("http://127.0.0.1:8000"),
        arrivals=ArrivalConfig(mode="trace", time_scale=0.1, max_requests=200),
        lengths=LengthConfig(max_model_len=2048),
        tokenizer="models/tiny-target"))
    summary["goodput"], summary["ttft_s"]["p99"], summary["by_worker"]

``await replay(cfg)`` is the same inside a running event loop, and returns the
per-request results too.
"""

from loadgen.config import (
    ArrivalConfig,
    ClientConfig,
    LengthConfig,
    OutputConfig,
    ReplayConfig,
    SloConfig,
    TraceConfig,
)
from loadgen.replay import ReplayResult, replay, run_replay, run_sweep, sweep
from loadgen.request import RequestResult, TraceRequest

__all__ = [
    "ArrivalConfig", "ClientConfig", "LengthConfig", "OutputConfig", "ReplayConfig",
    "ReplayResult", "RequestResult", "SloConfig", "TraceConfig", "TraceRequest", "replay",
    "run_replay", "run_sweep", "sweep",
]
