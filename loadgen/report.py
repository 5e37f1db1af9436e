"""Writing a replay's outputs: per-request JSONL, summary JSON, Markdown report, plots."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from loadgen.errors import LoadgenConfigError

if TYPE_CHECKING:
    from loadgen.replay import ReplayResult

logger = logging.getLogger(__name__)

REQUESTS_FILE = "requests.jsonl"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
LAG_WARNING_S = 1e-3  # DESIGN.md: loadgen keeps send lag p99 under 1 ms


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def prepare_output_dir(directory: Path) -> None:
    """Create ``directory`` (checked before a run, so a bad --output loses no results)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LoadgenConfigError(f"--output {directory}: cannot create the directory "
                                 f"({e.strerror or e})") from e
    if not os.access(directory, os.W_OK):
        raise LoadgenConfigError(f"--output {directory}: the directory is not writable")


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[IO[bytes]]:
    """A binary file that replaces ``path`` only once it is complete.

    NOTE: a run killed or failing while writing leaves the previous file (or
    none), never a half-written JSON/JSONL.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as f:
            yield f
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_outputs(directory: Path, result: ReplayResult, plots: bool = True) -> None:
    prepare_output_dir(directory)
    with atomic_writer(directory / REQUESTS_FILE) as f:
        for r in result.results:
            f.write(orjson.dumps(r.to_json()) + b"\n")
    with atomic_writer(directory / SUMMARY_FILE) as f:
        f.write(orjson.dumps(result.summary,
                             option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    images: list[str] = []
    if plots:
        from loadgen.plots import write_plots

        images = write_plots(directory, result.results, result.summary)
    with atomic_writer(directory / REPORT_FILE) as f:
        f.write(markdown(result.summary, images).encode())
    logger.info("wrote %s", directory)


def _latency_table(summary: dict[str, Any]) -> list[str]:
    rows = ["| metric (ms) | mean | p50 | p90 | p99 | max |", "|---|---|---|---|---|---|"]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"),
                      ("e2e_s", "E2E"), ("lag_s", "send lag"), ("queue_s", "slot wait")):
        d = summary[key]
        rows.append(f"| {name} | {ms(d['mean'])} | {ms(d['p50'])} | {ms(d['p90'])} | "
                    f"{ms(d['p99'])} | {ms(d['max'])} |")
    return rows


def _group_table(title: str, groups: dict[str, dict[str, Any]]) -> list[str]:
    rows = [f"### {title}", "",
            "| group | requests | ok | goodput req/s | out tok/s | TTFT p50 | TTFT p99 | "
            "TPOT p50 | TPOT p99 |", "|---|---|---|---|---|---|---|---|---|"]
    for name, g in groups.items():
        rows.append(f"| {name} | {g['num_requests']} | {g['num_ok']} | {g['goodput']:.2f} | "
                    f"{g['output_throughput']:.1f} | {ms(g['ttft_s']['p50'])} | "
                    f"{ms(g['ttft_s']['p99'])} | {ms(g['tpot_s']['p50'])} | "
                    f"{ms(g['tpot_s']['p99'])} |")
    return rows + [""]


def markdown(summary: dict[str, Any], images: list[str]) -> str:
    s = summary
    slo = ", ".join(f"{k[:-2]} <= {v * 1e3:g} ms" for k, v in s["slo"].items() if v) or "none"
    lines = [
        f"# loadgen report{': ' + s['label'] if s.get('label') else ''}", "",
        f"- target: `{s['target']}`, model `{s['model']}`, endpoint {s['endpoint']}, "
        f"stream {s['stream']}",
        f"- trace: `{s['trace']['path']}` ({s['trace']['format']}); "
        f"{s['trace']['num_bad_lines']} bad lines skipped",
        f"- arrivals: {_arrival_text(s['arrival'])}",
        f"- lengths: {s['lengths']['description']}",
        f"- prompts: {s['prompts']['num_synthesized']} synthesized, "
        f"{s['prompts']['num_from_trace']} from the trace; token counts "
        f"{'exact' if s['prompts']['exact'] else 'ESTIMATED'} ({s['prompts']['tokenizer']}); "
        f"{s['num_prompt_token_mismatch']} requests whose reported prompt_tokens differed",
        "",
        "## Results", "",
        f"- duration {s['duration_s']:.2f} s; {s['num_requests']} sent, {s['num_ok']} ok, "
        f"{s['num_errors']} errors, {s['num_not_sent']} not sent (duration limit)",
        f"- throughput {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} "
        f"output tok/s, {s['total_token_throughput']:.1f} total tok/s",
        f"- goodput {s['goodput']:.2f} req/s ({s['num_good']} requests met {slo})",
        "",
        *_latency_table(s), "",
        f"loadgen itself: {s['loadgen_cpu_s_per_request'] * 1e6:.0f} us of CPU per request; "
        f"send lag p99 {ms(s['lag_s']['p99'])} ms.",
        *([f"**Warning: send lag p99 is over {LAG_WARNING_S * 1e3:g} ms: the client fell "
           "behind its schedule (a loaded machine, or too high a rate), so offered load "
           "was lower than intended.**"]
          if (s["lag_s"]["p99"] or 0) > LAG_WARNING_S else []),
        "",
    ]
    if s["errors"]:
        lines += ["### Errors", "", *(f"- {k}: {v}" for k, v in s["errors"].items()), ""]
    lines += _group_table("Per domain", s["by_domain"])
    lines += _group_table("Per worker", s["by_worker"])
    lines += [f"![{Path(i).stem}]({i})" for i in images]
    return "\n".join(lines) + "\n"


def _arrival_text(a: dict[str, Any]) -> str:
    parts = [a["mode"]]
    if a["mode"] == "trace":
        parts.append(f"time-scale {a['time_scale']:g}, window {a['window_s']}")
    elif a["mode"] == "concurrency":
        parts.append(f"{a['concurrency']} in flight")
    else:
        parts.append(f"{a['rate']:g} req/s, burstiness {a['burstiness']:g}")
    for key in ("max_requests", "duration_s", "max_concurrency"):
        if a[key] is not None:
            parts.append(f"{key} {a[key]:g}")
    return ", ".join(parts)
