"""``polyinfer loadgen`` (also ``python -m loadgen``): replay a trace, or compare runs.

    polyinfer loadgen --trace FILE --target URL [--format auto] [--time-scale X]
                      [--max-requests N] [--output DIR] ...
    polyinfer loadgen compare A.json B.json
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path
from typing import Any

from loadgen.config import (
    ARRIVALS,
    ENDPOINTS,
    ArrivalConfig,
    ClientConfig,
    LengthConfig,
    OutputConfig,
    ReplayConfig,
    SloConfig,
    TraceConfig,
)
from loadgen.errors import LoadgenConfigError, LoadgenError

logger = logging.getLogger(__name__)

TIMED_FORMATS = ("azure", "burstgpt", "mooncake", "polyinfer")  # formats with timestamps
# The Azure 2023 conversation trace in the repository's data/ (a checkout; an installed
# package has none, and --trace is then required)
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "azure_llm_2023_conv.csv"


# NOTE: numeric flags are checked by argparse, so that a bad value is an argparse
# error naming the flag (exit 2) before anything runs; ReplayConfig checks them again
# for Python callers.


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _window(text: str) -> tuple[float, float | None]:
    start_text, _, end_text = text.partition(":")
    start = _number(start_text, float) if start_text else 0.0
    end = _number(end_text, float) if end_text else None
    if start < 0 or (end is not None and end <= start):
        raise argparse.ArgumentTypeError(f"expected START:END seconds with 0 <= START < END, "
                                         f"got {text!r}")
    return start, end


def _rates(text: str) -> tuple[float, ...]:
    return tuple(_positive_float(x) for x in text.split(",") if x.strip())


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    from loadgen.readers import FORMATS

    t = p.add_argument_group("trace")
    t.add_argument("--trace", default=str(DEFAULT_TRACE) if DEFAULT_TRACE.is_file() else None,
                   help="trace or prompt file (default: %(default)s)")
    t.add_argument("--format", default="auto", choices=FORMATS)
    t.add_argument("--bad-lines", default="skip", choices=("skip", "fatal"))
    t.add_argument("--tokenizer", help="model dir or tokenizer.json of the target "
                   "(without it prompt lengths are estimates)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--arrival", default=None, choices=ARRIVALS,
                   help="default: trace when the file has timestamps, else poisson")
    a.add_argument("--rate", type=_positive_float, help="req/s for poisson/gamma")
    a.add_argument("--burstiness", type=_positive_float, default=1.0, help="gamma shape (1 = Poisson)")
    a.add_argument("--concurrency", type=_positive_int, help="closed loop with this many in flight")
    a.add_argument("--rate-sweep", type=_rates, default=(), metavar="R1,R2,...")
    a.add_argument("--time-scale", type=_positive_float, default=1.0,
                   help="multiplies trace inter-arrival times (0.1 = 10x faster)")
    a.add_argument("--window", type=_window, default=(0.0, None), metavar="START:END",
                   help="trace seconds after the first record to replay")
    a.add_argument("--max-requests", type=_positive_int)
    a.add_argument("--duration", type=_positive_float, help="seconds; stop sending after this")
    a.add_argument("--seed", type=int, default=0)
    n = p.add_argument_group("lengths (scaling / clipping to fit a small model)")
    n.add_argument("--prompt-scale", type=_positive_float, default=1.0)
    n.add_argument("--output-scale", type=_positive_float, default=1.0)
    n.add_argument("--max-prompt-tokens", type=_positive_int)
    n.add_argument("--max-output-tokens", type=_positive_int)
    n.add_argument("--max-model-len", type=_positive_int, help="clip prompt + output to this context")
    n.add_argument("--default-output-tokens", type=_positive_int, default=128)
    n.add_argument("--block-tokens", type=_positive_int, default=512, help="prefix block size (tokens) for traces that do not record one")
    c = p.add_argument_group("target")
    c.add_argument("--target", help="base URL of an OpenAI-compatible server")
    c.add_argument("--model", help="model name (default: first of GET /v1/models)")
    c.add_argument("--endpoint", default="auto", choices=ENDPOINTS)
    c.add_argument("--no-stream", action="store_true")
    c.add_argument("--no-ignore-eos", action="store_true")
    c.add_argument("--max-concurrency", type=_positive_int)
    c.add_argument("--timeout", type=_positive_float, default=600.0)
    c.add_argument("--api-key")
    c.add_argument("--record-error-bodies", action="store_true",
                   help="keep what the target says in its errors (it can quote the prompt) "
                        "in requests.jsonl; default: only the error's type and code")
    o = p.add_argument_group("outputs")
    o.add_argument("--output", help="directory for requests.jsonl, summary.json, report.md, PNGs")
    o.add_argument("--slo", default="ttft:500ms,tpot:50ms", help="goodput SLOs")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument("--label", default="")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("loadgen", help="replay request traces against a server",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", nargs="?", choices=("run", "compare"), default="run",
                   help="run a replay (default) or compare summary.json files")
    p.add_argument("summaries", nargs="*", help="for compare: summary.json files or run dirs")
    add_run_arguments(p)
    p.set_defaults(func=main)


def _default_arrival(args: argparse.Namespace) -> Any:
    if args.arrival:
        return str(args.arrival)
    if args.concurrency is not None:
        return "concurrency"
    if args.rate is not None or args.rate_sweep:
        return "poisson" if args.burstiness == 1.0 else "gamma"
    from loadgen.readers import detect_format

    fmt = detect_format(args.trace) if args.format == "auto" else args.format
    if fmt in TIMED_FORMATS:
        return "trace"
    raise LoadgenError(f"{args.trace} ({fmt}) has no timestamps: pass --rate R (Poisson), "
                       "--arrival gamma --rate R --burstiness B, or --concurrency N")


def _check_flags_fit(args: argparse.Namespace, mode: str) -> None:
    """A flag the chosen arrival mode would ignore is never silently dropped.

    Rate and concurrency flags contradict another mode: an error. The trace's
    time scale and window only say how to read timestamps the mode does not
    use: a warning (``--rate-sweep`` runs reuse a trace run's flags).
    """
    used_by = (
        ("--rate", args.rate is not None, ("poisson", "gamma")),
        ("--rate-sweep", bool(args.rate_sweep), ("poisson", "gamma")),
        ("--burstiness", args.burstiness != 1.0, ("gamma",)),
        ("--concurrency", args.concurrency is not None, ("concurrency",)),
    )
    for flag, given, modes in used_by:
        if given and mode not in modes:
            raise LoadgenConfigError(f"{flag} does not apply to --arrival {mode}; it is for "
                                     f"--arrival {' or '.join(modes)}")
    for flag, given in (("--time-scale", args.time_scale != 1.0),
                        ("--window", tuple(args.window) != (0.0, None))):
        if given and mode != "trace":
            logger.warning("%s is ignored: it applies to --arrival trace, not %s", flag, mode)


def build_config(args: argparse.Namespace) -> ReplayConfig:
    if not args.trace or not args.target:
        raise LoadgenError("--trace and --target are required")
    mode = _default_arrival(args)
    _check_flags_fit(args, mode)
    rate = args.rate if args.rate is not None else (args.rate_sweep[0] if args.rate_sweep
                                                    else None)
    return ReplayConfig(
        trace=TraceConfig(args.trace, args.format, args.bad_lines),
        client=ClientConfig(args.target, args.endpoint, args.model, not args.no_stream,
                            not args.no_ignore_eos, args.max_concurrency, args.timeout,
                            args.api_key, record_error_bodies=args.record_error_bodies),
        arrivals=ArrivalConfig(mode, rate, args.burstiness, args.concurrency, args.time_scale,
                               args.window[0], args.window[1], args.max_requests,
                               args.duration, args.seed),
        lengths=LengthConfig(args.prompt_scale, args.output_scale, args.max_prompt_tokens,
                             args.max_output_tokens, args.max_model_len,
                             default_output_tokens=args.default_output_tokens,
                             block_tokens=args.block_tokens),
        slo=SloConfig.parse(args.slo),
        output=OutputConfig(args.output, not args.no_plots, args.quiet, args.label),
        tokenizer=args.tokenizer,
        sweep_rates=tuple(args.rate_sweep),
    )


def _print_summary(summary: dict[str, Any]) -> None:
    from loadgen.report import ms

    s = summary
    print(f"{s['label'] or 'run'}: {s['num_ok']}/{s['num_requests']} ok in "
          f"{s['duration_s']:.2f} s | {s['request_throughput']:.2f} req/s, "
          f"{s['output_throughput']:.1f} out tok/s, goodput {s['goodput']:.2f} req/s | "
          f"TTFT p50/p99 {ms(s['ttft_s']['p50'])}/{ms(s['ttft_s']['p99'])} ms, "
          f"TPOT p50/p99 {ms(s['tpot_s']['p50'])}/{ms(s['tpot_s']['p99'])} ms, "
          f"lag p99 {ms(s['lag_s']['p99'])} ms")


def main(args: argparse.Namespace) -> int:
    from loadgen.compare import compare_files
    from loadgen.replay import run_replay, run_sweep

    try:
        if args.action == "compare":
            if len(args.summaries) < 2:
                raise LoadgenError("compare needs at least two summary.json files")
            print(compare_files(args.summaries))
            return 0
        if args.summaries:
            raise LoadgenError(f"unexpected arguments {args.summaries}")
        if args.trace and not Path(args.trace).is_file():
            raise LoadgenError(f"--trace {args.trace}: no such file"
                               + (f" (the repository's traces are in {DEFAULT_TRACE.parent})"
                                  if DEFAULT_TRACE.parent.is_dir() else ""))
        cfg = build_config(args)
        summaries = run_sweep(cfg) if cfg.sweep_rates else [run_replay(cfg)]
    except (LoadgenError, ValueError, OSError) as e:
        logger.error("%s", e)
        return 2
    for s in summaries:
        _print_summary(s)
    return 0 if all(s["num_ok"] for s in summaries) else 1
