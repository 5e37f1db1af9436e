"""Loadgen configuration: one frozen root (:class:`ReplayConfig`), a slice per stage.

Every value is checked once in ``__post_init__``; the CLI only builds these.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from loadgen.errors import LoadgenConfigError

ARRIVALS = ("trace", "poisson", "gamma", "concurrency")
ENDPOINTS = ("auto", "completions", "chat")
LENGTH_MODES = ("none", "clip", "scale")


def _check(cond: bool, key: str, expected: str, got: object) -> None:
    if not cond:
        raise LoadgenConfigError(f"{key}: expected {expected}, got {got!r}")


def _positive(value: float | None, key: str) -> None:
    # NOTE: finite too: an infinite time scale makes the first arrival 0 * inf = NaN
    # (the send loop never reaches it), and inf lengths or durations overflow int().
    _check(value is not None and math.isfinite(value) and value > 0, key,
           "a positive finite number", value)


def _positive_or_none(value: float | None, key: str) -> None:
    _check(value is None or (math.isfinite(value) and value > 0), key,
           "a positive finite number or None", value)


@dataclass(frozen=True)
class TraceConfig:
    path: str
    format: str = "auto"  # loadgen.readers.FORMATS
    bad_lines: Literal["skip", "fatal"] = "skip"

    def __post_init__(self) -> None:
        from loadgen.readers import FORMATS

        _check(self.format in FORMATS, "format", f"one of {FORMATS}", self.format)
        _check(self.bad_lines in ("skip", "fatal"), "bad_lines", "skip or fatal", self.bad_lines)


@dataclass(frozen=True)
class LengthConfig:
    """How recorded lengths are made to fit the target (the report states it).

    ``scale`` multiplies prompt lengths (and the prefix block size, so block
    sharing keeps its shape) and output lengths; then ``max_*`` clip; then
    ``max_model_len`` clips the prompt so that prompt + output fits.
    """

    prompt_scale: float = 1.0
    output_scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_model_len: int | None = None  # prompt + output limit of the target, e.g. 2048
    min_prompt_tokens: int = 1
    min_output_tokens: int = 1
    default_output_tokens: int = 128  # when the trace records no output length
    block_tokens: int = 512  # prefix block size when the trace does not say (Mooncake: 512)

    def __post_init__(self) -> None:
        for key in ("prompt_scale", "output_scale"):
            _positive(getattr(self, key), key)
        for key in ("max_prompt_tokens", "max_output_tokens", "max_model_len"):
            _positive_or_none(getattr(self, key), key)
        for key in ("min_prompt_tokens", "min_output_tokens", "default_output_tokens",
                    "block_tokens"):
            _check(getattr(self, key) >= 1, key, "an integer >= 1", getattr(self, key))
        if self.max_model_len is not None:
            _check(self.max_model_len > self.min_prompt_tokens + self.min_output_tokens - 1,
                   "max_model_len", "room for the minimum prompt and output", self.max_model_len)

    @property
    def scaled_block_tokens(self) -> int:
        return self.scale_block(self.block_tokens)

    def scale_block(self, block_tokens: float) -> int:
        """A prefix block of ``block_tokens`` trace tokens after ``prompt_scale`` (>= 1)."""
        return max(1, round(block_tokens * self.prompt_scale))

    @property
    def changes_lengths(self) -> bool:
        return (self.prompt_scale != 1.0 or self.output_scale != 1.0
                or self.max_prompt_tokens is not None or self.max_output_tokens is not None
                or self.max_model_len is not None)


@dataclass(frozen=True)
class ArrivalConfig:
    """When requests are sent. ``trace`` uses recorded timestamps; others ignore them."""

    mode: Literal["trace", "poisson", "gamma", "concurrency"] = "trace"
    rate: float | None = None  # req/s for poisson / gamma
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson, < 1 burstier
    concurrency: int | None = None  # closed loop: this many in flight (mode "concurrency")
    time_scale: float = 1.0  # multiplies trace inter-arrival times; 0.1 = ten times faster
    window_start_s: float = 0.0  # trace window, seconds after the first record
    window_end_s: float | None = None
    max_requests: int | None = None
    duration_s: float | None = None  # stop sending after this long
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.mode in ARRIVALS, "arrival", f"one of {ARRIVALS}", self.mode)
        if self.mode in ("poisson", "gamma"):
            _positive(self.rate, "rate")
        if self.mode == "concurrency":
            _check(self.concurrency is not None and self.concurrency >= 1, "concurrency",
                   "an integer >= 1", self.concurrency)
        _positive(self.burstiness, "burstiness")
        _positive(self.time_scale, "time_scale")
        _check(math.isfinite(self.window_start_s) and self.window_start_s >= 0,
               "window start", "a finite number >= 0", self.window_start_s)
        _check(self.window_end_s is None or (math.isfinite(self.window_end_s)
                                             and self.window_end_s > self.window_start_s),
               "window end", f"a finite number > window start ({self.window_start_s})",
               self.window_end_s)
        _check(self.max_requests is None or self.max_requests >= 1, "max_requests",
               "an integer >= 1", self.max_requests)
        _positive_or_none(self.duration_s, "duration_s")


@dataclass(frozen=True)
class ClientConfig:
    target: str  # base URL, e.g. http://127.0.0.1:8000
    endpoint: Literal["auto", "completions", "chat"] = "auto"
    model: str | None = None  # None: the first id from GET /v1/models
    stream: bool = True
    ignore_eos: bool = True  # ask vLLM-compatible servers for exactly max_tokens
    max_concurrency: int | None = None  # cap on requests in flight (None: no cap)
    timeout_s: float = 600.0  # per request, send to last byte
    api_key: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    # keep what a server says in its errors (which can quote the prompt) in the results;
    # off: only the OpenAI error's type and code, or the body's length
    record_error_bodies: bool = False

    def __post_init__(self) -> None:
        _check(bool(re.match(r"^https?://[^/]+", self.target)), "target",
               "an http(s) URL", self.target)
        _check(self.endpoint in ENDPOINTS, "endpoint", f"one of {ENDPOINTS}", self.endpoint)
        _check(self.max_concurrency is None or self.max_concurrency >= 1, "max_concurrency",
               "an integer >= 1 or None", self.max_concurrency)
        _positive(self.timeout_s, "timeout_s")

    @property
    def base_url(self) -> str:
        url = self.target.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


_SLO_UNITS = {"ms": 1e-3, "s": 1.0, "": 1e-3}  # NOTE: bare numbers are ms, as in vLLM


@dataclass(frozen=True)
class SloConfig:
    """Goodput SLOs (seconds); a request counts as good when it meets every one set."""

    ttft_s: float | None = 0.5
    tpot_s: float | None = 0.05
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            _positive_or_none(getattr(self, key), key)

    @classmethod
    def parse(cls, text: str) -> SloConfig:
        """``"ttft:500ms,tpot:50ms,e2e:2s"`` (bare numbers are milliseconds)."""
        values: dict[str, float] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"(ttft|tpot|e2e|e2el):([0-9]+\.?[0-9]*|\.[0-9]+)\s*(ms|s)?", item)
            if m is None:
                raise LoadgenConfigError(f"--slo: cannot read {item!r}; expected e.g. "
                                         "ttft:500ms,tpot:50ms,e2e:2s")
            name = "e2e" if m[1] == "e2el" else m[1]
            values[f"{name}_s"] = float(m[2]) * _SLO_UNITS[m[3] or ""]
        return cls(ttft_s=values.get("ttft_s"), tpot_s=values.get("tpot_s"),
                   e2e_s=values.get("e2e_s"))

    def describe(self) -> str:
        parts = [f"{k}<={v * 1e3:g}ms" for k, v in
                 (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("e2e", self.e2e_s)) if v]
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class OutputConfig:
    directory: str | None = None  # None: nothing written, the summary is only returned
    plots: bool = True
    quiet: bool = False  # no progress bar
    label: str = ""  # names the run in reports and compare tables


@dataclass(frozen=True)
class ReplayConfig:
    """One replay (or a rate sweep: one replay per rate in ``sweep_rates``)."""

    trace: TraceConfig
    client: ClientConfig
    arrivals: ArrivalConfig = field(default_factory=ArrivalConfig)
    lengths: LengthConfig = field(default_factory=LengthConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    tokenizer: str | None = None  # model dir or tokenizer.json; None: estimate lengths
    sweep_rates: tuple[float, ...] = ()  # req/s; needs a poisson or gamma arrival mode

    def __post_init__(self) -> None:
        if self.sweep_rates:
            _check(self.arrivals.mode in ("poisson", "gamma"), "rate sweep",
                   "--arrival poisson or gamma", self.arrivals.mode)
            _check(all(math.isfinite(r) and r > 0 for r in self.sweep_rates), "sweep_rates",
                   "positive finite rates", self.sweep_rates)
            # each rate's results go to rate-{rate:g}/: two rates that print alike would share it
            _check(len({f"{r:g}" for r in self.sweep_rates}) == len(self.sweep_rates),
                   "sweep_rates", "distinct rates (to 6 significant digits)", self.sweep_rates)
