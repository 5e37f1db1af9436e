"""``polyinfer loadgen compare A.json B.json ...``: summaries side by side."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from loadgen.errors import LoadgenError

logger = logging.getLogger(__name__)

Getter = Callable[[dict[str, Any]], float | None]

# The settings that make two runs comparable: the same traffic (trace, arrivals, lengths,
# prompts) measured the same way (model, endpoint, stream, SLOs). The target and the label
# are what a comparison varies.
SETTINGS: tuple[tuple[str, ...], ...] = (
    ("trace", "path"), ("trace", "format"), ("model",), ("endpoint",), ("stream",),
    *(("arrival", k) for k in ("mode", "rate", "burstiness", "concurrency", "time_scale",
                               "window_s", "max_requests", "duration_s", "max_concurrency",
                               "seed")),
    ("lengths", "policy"), ("prompts", "tokenizer"), ("prompts", "exact"), ("slo",),
)


def _dist(key: str, pct: str) -> Getter:
    return lambda s: s[key][pct]


ROWS: tuple[tuple[str, Getter, float, bool], ...] = (
    # label, getter, display scale, higher is better
    ("requests ok", lambda s: s["num_ok"], 1, True),
    ("errors", lambda s: s["num_errors"], 1, False),
    ("throughput (req/s)", lambda s: s["request_throughput"], 1, True),
    ("output (tok/s)", lambda s: s["output_throughput"], 1, True),
    ("goodput (req/s)", lambda s: s["goodput"], 1, True),
    *((f"{name} {p} (ms)", _dist(key, p), 1e3, False)
      for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"))
      for p in ("p50", "p90", "p99")),
    ("send lag p99 (ms)", _dist("lag_s", "p99"), 1e3, False),
)


def load_summary(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    try:
        summary = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise LoadgenError(f"cannot read summary {path}: {e}") from e
    if not isinstance(summary, dict) or "ttft_s" not in summary:
        raise LoadgenError(f"{path} is not a loadgen summary.json")
    return summary


def _cell(value: float | None, scale: float) -> str:
    if value is None:
        return "-"
    v = value * scale
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _ratio(base: float | None, other: float | None) -> str:
    if not base or other is None:
        return "-"
    return f"{other / base:.3g}x"


def compare_table(summaries: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """A Markdown table: one column per run, then each run's ratio to the first."""
    head = ["metric", *names, *(f"{n} / {names[0]}" for n in names[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, get, scale, _ in ROWS:
        values = [get(s) for s in summaries]
        cells = [_cell(v, scale) for v in values]
        ratios = [_ratio(values[0], v) for v in values[1:]]
        lines.append("| " + " | ".join([label, *cells, *ratios]) + " |")
    return "\n".join(lines)


def _setting(summary: dict[str, Any], key: tuple[str, ...]) -> Any:
    value: Any = summary
    for part in key:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def setting_differences(summaries: Sequence[dict[str, Any]], names: Sequence[str]
                        ) -> list[str]:
    """One line per setting in :data:`SETTINGS` on which a run differs from the first."""
    out = []
    for key in SETTINGS:
        first = _setting(summaries[0], key)
        for s, name in zip(summaries[1:], names[1:], strict=True):
            value = _setting(s, key)
            if value != first:
                out.append(f"{'.'.join(key)}: {first!r} ({names[0]}) vs {value!r} ({name})")
    return out


def compare_files(paths: Sequence[str]) -> str:
    summaries = [load_summary(p) for p in paths]
    names = [s.get("label") or Path(p).stem for s, p in zip(summaries, paths, strict=True)]
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    for line in setting_differences(summaries, names):
        logger.warning("the runs were not made with the same settings: %s", line)
    return compare_table(summaries, names)
