"""How fast can loadgen send? Highest request rate it sustains on one core, with send lag.

DESIGN.md target: loadgen is never the bottleneck — 2,000 req/s against a fast
upstream on one core with send-time lag p99 under 1 ms.

The upstream is ``RawFastUpstream``, a benchmark fixture: a bare asyncio
protocol (no HTTP framework) in a separate process pinned to the other core,
answering every POST at once with a canned SSE stream of ``--chunks`` token
chunks + usage + [DONE], so that it costs far less per request than the
client under test. Loadgen runs in this process, pinned to core 0, through its
public API (``loadgen.replay``) with Poisson arrivals, once per event loop
(uvloop, stdlib asyncio) and offered rate, side by side.

    python bench/loadgen_capacity.py [--rates 500,1000,2000,3000] [--seconds 4]

Besides the open-loop rates, a closed-loop run (16 in flight, as fast as the
client goes) gives the client's CPU time per request, a number that contention
from other processes on a shared machine distorts far less than lag does. Each
row also counts the garbage collections during the send loop (full ones in
brackets) and the longest: full collections were the lag tail until the send
loop held them off (bench/RESULTS.md, Loadgen).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import subprocess
import sys
import time
from typing import Any

import orjson

TARGET_RATE = 2000.0  # req/s (DESIGN.md)
TARGET_LAG_P99_S = 1e-3


# ---------------------------------------------------------------- the fixture upstream
def _canned_response(num_chunks: int) -> bytes:
    events = [b"data: " + orjson.dumps({"choices": [{"index": 0, "text": f" t{i}"}]}) + b"\n\n"
              for i in range(num_chunks)]
    events.append(b"data: " + orjson.dumps({"choices": [], "usage": {
        "prompt_tokens": 8, "completion_tokens": num_chunks}}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    body = b"".join(events)
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    return head + body


MODELS = orjson.dumps({"object": "list", "data": [{"id": "raw-fast"}]})


class RawFastUpstream(asyncio.Protocol):
    """FIXTURE: minimal HTTP/1.1 keep-alive server; every request gets the canned answer."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            length = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0
                              else len(head)]) if i >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            assert self.transport is not None
            if head.startswith(b"get /v1/models"):
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: " + str(len(MODELS)).encode()
                                     + b"\r\n\r\n" + MODELS)
            else:
                self.transport.write(self.answer)


def serve(num_chunks: int) -> None:
    import uvloop

    async def main() -> None:
        answer = _canned_response(num_chunks)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: RawFastUpstream(answer), "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await server.serve_forever()

    uvloop.run(main())


# ---------------------------------------------------------------- the measurement
def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})


class GcPauses:
    """The garbage collector's pauses while in a ``with`` block (``gc.callbacks``); the
    summary counts those that began inside a window (the send loop's): how many
    collections, how many of them full (the oldest generation), the longest, ms. Loadgen's
    send-time lag tail was its full collections (bench/RESULTS.md, Loadgen)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, int, float]] = []  # (unix start, generation, ms)
        self._unix0, self._t0 = 0.0, 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._unix0, self._t0 = time.time(), time.perf_counter()
        else:
            self.pauses.append((self._unix0, info["generation"],
                                (time.perf_counter() - self._t0) * 1e3))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self, start_unix_s: float, end_unix_s: float) -> dict[str, float]:
        inside = [(g, ms) for t, g, ms in self.pauses if start_unix_s <= t <= end_unix_s]
        return {"gc_collections": len(inside), "gc_full": sum(1 for g, _ in inside if g == 2),
                "gc_max_ms": max((ms for _, ms in inside), default=0.0)}


def measure(url: str, rate: float | None, seconds: float, use_uvloop: bool) -> dict[str, Any]:
    """One open-loop run at ``rate`` (Poisson), or closed-loop saturation when rate is None."""
    from loadgen import ArrivalConfig, ClientConfig, OutputConfig, ReplayConfig, TraceConfig
    from loadgen.replay import replay
    from loadgen.request import TraceRequest

    num = int((rate or 3000.0) * seconds)
    records = [TraceRequest(line=i + 1, prompt="Count the words in this short prompt please.",
                            output_tokens=16) for i in range(64)]
    cfg = ReplayConfig(
        trace=TraceConfig("<in-memory>"), client=ClientConfig(url, model="raw-fast"),
        arrivals=(ArrivalConfig(mode="poisson", rate=rate, max_requests=num, seed=7) if rate
                  else ArrivalConfig(mode="concurrency", concurrency=16, max_requests=num)),
        output=OutputConfig(quiet=True))
    with GcPauses() as pauses:
        if use_uvloop:
            import uvloop
            result = uvloop.run(replay(cfg, records))
        else:
            result = asyncio.run(replay(cfg, records))
    s = result.summary
    sends = sorted(r.sent_s for r in result.results)
    sched = sorted(r.scheduled_s for r in result.results)
    return {
        "loop": "uvloop" if use_uvloop else "asyncio", "offered": rate, "num": num,
        "closed": rate is None,
        "send_rate": (len(sends) - 1) / (sends[-1] - sends[0]),
        "schedule_rate": ((len(sched) - 1) / (sched[-1] - sched[0]) if rate
                          else s["request_throughput"]),
        "done_rate": s["request_throughput"], "errors": s["num_errors"],
        "lag_p50_ms": s["lag_s"]["p50"] * 1e3, "lag_p99_ms": s["lag_s"]["p99"] * 1e3,
        "ttft_p50_ms": (s["ttft_s"]["p50"] or 0) * 1e3, "ttft_p99_ms": (s["ttft_s"]["p99"] or 0) * 1e3,
        "cpu_us_per_req": s["loadgen_cpu_s_per_request"] * 1e6,  # during the send loop
        # the send loop's: from the first send to the last completion
        **pauses.summary(s["started_unix_s"], s["started_unix_s"] + s["duration_s"]),
    }


def sustained(row: dict[str, Any]) -> bool:
    return (row["errors"] == 0 and row["lag_p99_ms"] < TARGET_LAG_P99_S * 1e3
            and row["send_rate"] >= 0.97 * row["schedule_rate"])


def main() -> int:
    logging.getLogger("loadgen.tokenizer").setLevel(logging.ERROR)  # prompts are fixed text
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="500,1000,2000,3000")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--loops", default="uvloop,asyncio")
    p.add_argument("--no-pin", action="store_true",
                   help="let the OS place both processes (a loaded shared machine)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        if not args.no_pin:
            _pin(1)
        serve(args.chunks)
        return 0
    upstream = subprocess.Popen([sys.executable, __file__, "--serve", "--chunks",
                                 str(args.chunks), *(["--no-pin"] if args.no_pin else [])],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert upstream.stdout is not None
        url = f"http://127.0.0.1:{int(upstream.stdout.readline())}"
        if not args.no_pin:
            _pin(0)
        rows = [measure(url, float(r) if r != "closed" else None, args.seconds,
                        loop == "uvloop")
                for loop in args.loops.split(",") for r in ["closed", *args.rates.split(",")]]
    finally:
        upstream.terminate()
        upstream.wait()
    report(rows)
    return 0


def report(rows: list[dict[str, Any]]) -> None:
    print(f"loadgen capacity, one core, {os.cpu_count()} cores on the machine, load average "
          f"{os.getloadavg()[0]:.1f} at the end; target {TARGET_RATE:.0f} req/s with send lag "
          f"p99 < {TARGET_LAG_P99_S * 1e3:g} ms")
    print("| loop | offered req/s | sent req/s | sent/offered | done req/s | errors | "
          "lag p50 ms | lag p99 ms | lag p99 / 1 ms | TTFT p50 ms | TTFT p99 ms | CPU us/req | "
          "send loop's GC collections (full) | longest GC ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        offered = "closed loop x16" if r["closed"] else f"{r['schedule_rate']:.0f}"
        ratio = "-" if r["closed"] else f"{r['send_rate'] / r['schedule_rate']:.3f}"
        print(f"| {r['loop']} | {offered} | {r['send_rate']:.0f} | {ratio} | {r['done_rate']:.0f} | {r['errors']} | "
              f"{r['lag_p50_ms']:.3f} | {r['lag_p99_ms']:.3f} | {r['lag_p99_ms']:.2f}x | "
              f"{r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} | {r['cpu_us_per_req']:.0f} | "
              f"{r['gc_collections']} ({r['gc_full']}) | {r['gc_max_ms']:.1f} |")
    for loop in dict.fromkeys(r["loop"] for r in rows):
        mine = [r for r in rows if r["loop"] == loop]
        ok = [r["offered"] for r in mine if not r["closed"] and sustained(r)]
        best = max(ok) if ok else 0.0
        closed = next(r for r in mine if r["closed"])
        print(f"{loop}: highest sustained offered rate {best:.0f} req/s "
              f"= {best / TARGET_RATE:.2f}x the {TARGET_RATE:.0f} req/s target; closed-loop "
              f"{closed['done_rate']:.0f} req/s at {closed['cpu_us_per_req']:.0f} us CPU/req "
              f"(one uncontended core: {1e6 / closed['cpu_us_per_req']:.0f} req/s "
              f"= {1e6 / closed['cpu_us_per_req'] / TARGET_RATE:.2f}x target)")


if __name__ == "__main__":
    sys.exit(main())
