"""PNG plots of a replay (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.request import RequestResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(directory: Path, results: Sequence[RequestResult], summary: dict[str, Any]
                ) -> list[str]:
    """Write the plots into ``directory``; returns their file names."""
    plt = _pyplot()
    names = []
    for name, draw in (("latency_cdf.png", _cdfs), ("over_time.png", _over_time),
                       ("per_domain.png", _per_domain)):
        fig = draw(plt, results, summary)
        fig.savefig(directory / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def _cdfs(plt: Any, results: Sequence[RequestResult], summary: dict[str, Any]) -> Any:
    ok = [r for r in results if r.ok]
    series: dict[str, list[float | None]] = {"TTFT": [r.ttft_s for r in ok], "TPOT": [r.tpot_s for r in ok],
              "ITL": [x for r in ok for x in r.itl_s], "E2E": [r.e2e_s for r in ok]}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        xs = np.sort(np.array([v for v in values if v is not None], dtype=np.float64)) * 1e3
        if len(xs):
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction (of requests; of gaps for ITL)")
    return fig


def _over_time(plt: Any, results: Sequence[RequestResult], summary: dict[str, Any]) -> Any:
    ok = [r for r in results if r.ok and r.e2e_s is not None]
    fig, (lat, thr) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    if ok:
        sent = np.array([r.sent_s for r in ok])
        done = sent + np.array([r.e2e_s for r in ok])
        ttft = [r.ttft_s * 1e3 if r.ttft_s is not None else np.nan for r in ok]
        lat.scatter(sent, ttft, s=4, label="TTFT")
        lat.scatter(sent, [r.e2e_s * 1e3 for r in ok], s=4, label="E2E")  # type: ignore[operator]
        bins = np.arange(0.0, max(float(done.max()), 1.0) + 1.0, 1.0)
        tokens = np.array([r.completion_tokens or 0 for r in ok], dtype=float)
        thr.hist(done, bins=bins, weights=tokens, histtype="step", label="output tok/s")
        thr2 = thr.twinx()
        thr2.hist(done, bins=bins, histtype="step", color="C1", label="req/s")
        thr2.set_ylabel("completed req/s")
    lat.set_ylabel("latency (ms)")
    lat.set_yscale("log")
    lat.legend(loc="upper left")
    thr.set_ylabel("output tok/s")
    thr.set_xlabel("seconds since start (latency at send time, throughput at completion)")
    return fig


def _per_domain(plt: Any, results: Sequence[RequestResult], summary: dict[str, Any]) -> Any:
    groups = summary["by_domain"]
    names = list(groups)
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.5))
    panels = (("TTFT p50 / p99 (ms)", "ttft_s"), ("TPOT p50 / p99 (ms)", "tpot_s"))
    x = np.arange(len(names))
    for ax, (title, key) in zip(axes[:2], panels, strict=True):
        p50 = [(groups[n][key]["p50"] or 0) * 1e3 for n in names]
        p99 = [(groups[n][key]["p99"] or 0) * 1e3 for n in names]
        ax.bar(x - 0.2, p50, 0.4, label="p50")
        ax.bar(x + 0.2, p99, 0.4, label="p99")
        ax.set_title(title)
        ax.legend()
    axes[2].bar(x, [groups[n]["goodput"] for n in names])
    axes[2].set_title("goodput (req/s)")
    for ax in axes:
        ax.set_xticks(x, names, rotation=30, ha="right")
    return fig
