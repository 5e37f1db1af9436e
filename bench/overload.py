"""Overload: polyinfer at 3x its capacity, on its own core, in front of an instant upstream.

DESIGN's target: past capacity the proxy sheds load (429/503 with Retry-After) instead of
collapsing: at 3x capacity goodput >= 0.9x of capacity, accepted requests keep a bounded
p99, and the proxy's own load never marks its healthy worker down.

Capacity is measured first: offered rates rise by ``--step`` from ``--start`` until the
proxy no longer keeps up (goodput under 95% of the offered rate, or any refusal), and
``--past-saturation`` points more (the door starts refusing a little before the loop's
plateau); the highest goodput seen is the capacity (streaming chat, bench/proxy_overhead.py's open-loop
load processes, FakeFastUpstream processes). Then the load is held at ``--factor`` x that
for ``--overload-duration`` seconds and the run prints goodput / capacity, the p50 / p99 of
the accepted (200) requests beside the capacity point's, the answers by status, the load
processes' send lag (they must not be the bottleneck), and what the proxy's /stats says
about shedding, its in-flight limit, connections and its worker (probe, breaker, healthy).

    python bench/overload.py                          # 2000 req/s x1.25 until saturated, then 3x
    python bench/overload.py --sweep 2000 2500 3000 --duration 10 --prompts unique
    python bench/overload.py --door-cost             # loop CPU per served / refused request
    python bench/overload.py --step-load --step-source /tmp/a /tmp/b /tmp/a /tmp/b
    python bench/overload.py --cpu-quota 0.25 --start 300   # the proxy in a 1/4-core cgroup

``--client-connections N`` gives each load process a pool of N connections, a request
waiting for one when all are busy (its wait counted), as pooled clients do, the pool opened
by the load's warm-up (N requests at once, not counted) so that a point measures clients
whose connections are open, not their opening storm (``--step-load`` is that); by default a
process opens a connection whenever none is idle, so past capacity the clients' connection
storm, the kernel's listen drops and their connect retries are part of what is measured.

``--cpu-quota F`` runs the proxy in a cgroup of its own whose CPU quota is F of one core
(cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``; needs root): a container's CPU limit, and
on a 2-core machine the way to offer 3x the proxy's capacity from the other core.

``--step-load`` answers what the onset of overload does: the proxy (from each
``--step-source`` tree in turn, one fresh proxy each) sits idle with ``--step-conns``
keep-alive connections open from a raw-socket client process (cheaper per request than the
load processes, so the load side is not what saturates first); then every connection sends
at once and goes on for ``--step-duration`` seconds, the next request as soon as a 200
ends, or Retry-After seconds after a refusal. It prints goodput, the 200s' p50 / p99 / max
and the p99 of those sent in the first second, the answers by status, and /stats every
0.2 s (in flight, the limit, lag, busy, /stats' own latency).

``--door-cost`` answers what the goodput past capacity rests on: past capacity the proxy's
core serves S requests and refuses the rest, S x cost + refused x cost_refused <= 1 s, so at
3x capacity goodput is (1 - 3r) / (1 - r) of capacity, r = cost_refused / cost (0.9x needs
r <= 0.048). It runs the proxy in this process (uvloop) in front of one FakeFastUpstream
process, and a raw-socket client process keeps ``--conns`` keep-alive connections busy, one
request at a time each; blocks of ``--block`` requests alternate served (the in-flight limit
out of reach), refused (limit 0: every request a door 429), a bare protocol answering the
same 429 with no proxy logic (the floor: one read, one write), and refused on a new
connection each (``--block`` / 4 of them, 8 at a time, closed after the answer: what a
client whose pool has no idle connection costs); each block's cost is the loop thread's
CPU time (user + system) over its requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po  # noqa: E402  (a bench sibling, not a package)


def summary(parts: list[dict], rate: float, duration: float) -> dict:
    """One load's answers: goodput is the 200s over the schedule's ``duration`` (the
    streams still running when it ends finish after it: dividing by the wall time instead
    undercounts a rate by a stream's length, 15% for 0.7 s streams at 4 s a point)."""
    samples = [s for p in parts for s in p["samples"]]
    wall = max(p["wall_s"] for p in parts)
    ok_e2e = np.array([e for _, e, st in samples if st == 200 and e is not None])
    ok_ttft = np.array([t for t, _, st in samples if st == 200 and t is not None])
    by_status: dict[str, int] = {}
    for _, _, st in samples:
        by_status[str(st)] = by_status.get(str(st), 0) + 1

    def pct(a: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(a, q)), 2) if len(a) else None
    lags = np.array([x for p in parts for x in p["lag_ms"]])
    refused = np.array([e for _, e, st in samples if st in (429, 503) and e is not None])
    return {"offered_rps": rate, "goodput_rps": round(len(ok_e2e) / duration, 1),
            "by_status": by_status, "e2e_p50_ms": pct(ok_e2e, 50),
            "e2e_p99_ms": pct(ok_e2e, 99), "ttft_p99_ms": pct(ok_ttft, 99),
            "e2e_max_ms": pct(ok_e2e, 100), "refused_p50_ms": pct(refused, 50),
            "refused_p99_ms": pct(refused, 99), "refused_max_ms": pct(refused, 100),
            "wall_s": round(wall, 2), "send_lag_p99_ms": pct(lags, 99)}


def saturated(row: dict) -> bool:
    """The proxy did not keep up with the offered rate, or refused some of it."""
    num_other = sum(n for st, n in row["by_status"].items() if st != "200")
    return row["goodput_rps"] < 0.95 * row["offered_rps"] or num_other > 0


def proxy_stats(url: str) -> dict:
    with urllib.request.urlopen(url.replace("/v1/chat/completions", "/stats"), timeout=10) as r:
        doc = json.loads(r.read())
    worker = doc["workers"][0] if isinstance(doc.get("workers"), list) else \
        next(iter(doc.get("workers", {}).values()), {})
    return {"shed_at_door": doc.get("shed_at_door"),
            "in_flight_limit": doc.get("in_flight_limit"),
            "connections": doc.get("connections"), "loop_lag_ms": doc.get("loop_lag_ms"),
            "worker": {k: worker.get(k) for k in ("healthy", "probe_ok", "breaker")}}


_BARE_429 = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
             b"Retry-After: 1\r\nContent-Length: 2\r\n\r\n{}")


class BareRefusal(asyncio.Protocol):
    """The least a refusal can cost on this loop: a bare protocol that frames each request
    by its Content-Length and writes a constant 429 (no proxy logic), for --door-cost's
    calibration."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        while (end := buf.find(b"\r\n\r\n")) != -1:
            at = buf.find(b"Content-Length: ", 0, end) + 16
            size = end + 4 + int(buf[at:buf.find(b"\r\n", at)])
            if len(buf) < size:
                break
            buf = buf[size:]
            assert self.transport is not None
            self.transport.write(self.answer)
        self.buf = buf


def door_client_main(port: int, num_conns: int, path: str, stream: bool) -> None:
    """The door-cost client (its own process): per line on stdin (a request count), that
    many requests over ``num_conns`` keep-alive connections, then one line on stdout: the
    count of answers by status."""
    import selectors
    import socket
    body = json.dumps({**po.BODY, "stream": stream}).encode()
    request = (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
    sel = selectors.DefaultSelector()
    conns = []
    for _ in range(num_conns):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(sock)
    for line in sys.stdin:
        if line.startswith("fresh"):
            print(json.dumps(_fresh_connections(port, int(line.split()[1]), request)),
                  flush=True)
            continue
        todo = int(line)
        counts: dict[int, int] = {}
        bufs = {s: b"" for s in conns}
        busy = 0
        for sock in conns:
            if todo:
                sock.sendall(request)
                todo -= 1
                busy += 1
                sel.register(sock, selectors.EVENT_READ, sock)
        while busy:
            for key, _ in sel.select():
                sock = key.data
                data = sock.recv(1 << 16)
                if not data:
                    raise SystemExit("the proxy closed a connection")
                buf = bufs[sock] + data
                end = buf.find(b"\r\n\r\n")
                if end == -1:
                    bufs[sock] = buf
                    continue
                head = buf[:end].lower()
                at = head.find(b"content-length:")
                if at != -1:
                    size = end + 4 + int(head[at + 15:head.find(b"\r\n", at) if
                                              head.find(b"\r\n", at) != -1 else None])
                    done = len(buf) >= size
                else:
                    size = buf.find(b"\r\n0\r\n\r\n", end) + 7
                    done = size >= 7
                if not done:
                    bufs[sock] = buf
                    continue
                status = int(buf[9:12])
                counts[status] = counts.get(status, 0) + 1
                bufs[sock] = buf[size:]
                if todo:
                    sock.sendall(request)
                    todo -= 1
                else:
                    sel.unregister(sock)
                    busy -= 1
        print(json.dumps(counts), flush=True)


def _fresh_connections(port: int, n: int, request: bytes, num_threads: int = 8
                       ) -> dict[int, int]:
    """``n`` requests, each on a new connection that asks to be closed after its answer
    (``num_threads`` at a time): what a client that opens a connection per request (or
    whose pool has none idle) costs the proxy."""
    import socket
    import threading
    request = request.replace(b"\r\nContent-Length", b"\r\nConnection: close\r\nContent-Length", 1)
    counts: dict[int, int] = {}
    lock = threading.Lock()
    todo = [n]

    def work() -> None:
        while True:
            with lock:
                if not todo[0]:
                    return
                todo[0] -= 1
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(request)
                buf = b""
                while chunk := sock.recv(1 << 16):
                    buf += chunk
            status = int(buf[9:12]) if len(buf) >= 12 else 0
            with lock:
                counts[status] = counts.get(status, 0) + 1
    threads = [threading.Thread(target=work) for _ in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


def step_client_main(port: int, num_conns: int, seconds: float, stream: bool) -> None:
    """The ``--step-load`` client (its own process): ``num_conns`` keep-alive connections opened
    idle, then one request sent on every one at once, and for ``seconds`` each connection
    sends its next request as soon as it is answered 200, or Retry-After seconds after a
    429/503 (a client that honours it). One line on stdout: the answers by status, and the
    200s' latencies (ms, send to last byte) with their send times (s after the step)."""
    import heapq
    import selectors
    import socket
    body = json.dumps({**po.BODY, "stream": stream}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
               % (len(body), body))
    sel = selectors.DefaultSelector()
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(num_conns)]
    time.sleep(1.0)  # every connection accepted and idle before the step
    bufs = {s: b"" for s in conns}
    index = {s: i for i, s in enumerate(conns)}
    sent = {s: 0.0 for s in conns}
    counts: dict[int, int] = {}
    served: list[tuple[float, float]] = []
    later: list[tuple[float, int]] = []  # (when, index) of connections waiting out Retry-After
    t0 = time.perf_counter()
    end = t0 + seconds
    for sock in conns:
        sent[sock] = time.perf_counter()
        sock.sendall(request)
        sel.register(sock, selectors.EVENT_READ, sock)
    while True:
        now = time.perf_counter()
        while later and later[0][0] <= now:
            sock = conns[heapq.heappop(later)[1]]
            if now < end:
                sent[sock] = now
                sock.sendall(request)
            else:
                sel.unregister(sock)
        if now >= end and not sel.get_map():
            break
        if now >= end + 30:
            break  # an answer never came: counted as missing
        for key, _ in sel.select(0.01):
            sock = key.data
            data = sock.recv(1 << 16)
            if not data:
                counts[-1] = counts.get(-1, 0) + 1  # closed by the proxy
                sel.unregister(sock)
                continue
            buf = bufs[sock] + data
            h_end = buf.find(b"\r\n\r\n")
            if h_end == -1:
                bufs[sock] = buf
                continue
            head = buf[:h_end].lower()
            at = head.find(b"content-length:")
            if at != -1:
                size = h_end + 4 + int(head[at + 15:head.index(b"\r\n", at)
                                            if b"\r\n" in head[at:] else None])
            else:
                size = buf.find(b"\r\n0\r\n\r\n", h_end) + 7
                size = size if size >= 7 else len(buf) + 1
            if len(buf) < size:
                bufs[sock] = buf
                continue
            bufs[sock] = buf[size:]
            status = int(buf[9:12])
            counts[status] = counts.get(status, 0) + 1
            done = time.perf_counter()
            if status == 200:
                served.append((round(sent[sock] - t0, 4), round((done - sent[sock]) * 1e3, 2)))
            if done >= end:
                sel.unregister(sock)
            elif status == 200:
                sent[sock] = done
                sock.sendall(request)
            else:
                at = head.find(b"retry-after:")
                wait = float(head[at + 12:head.find(b"\r\n", at)]) if at != -1 else 1.0
                heapq.heappush(later, (done + wait, index[sock]))
    print(json.dumps({"by_status": counts, "served": served}), flush=True)


def step(args: argparse.Namespace) -> None:
    """A step from idle to ``--step-conns`` connections each sending at once (see main's
    ``--step-load``), against the proxy of each ``--source`` in turn (and again, ``--rounds``);
    goodput, the 200s' p50 / p99 / max, refusals, and /stats while it runs."""
    import subprocess
    layout = po.Layout.plan(os.cpu_count() or 1, 1, 1, True)
    workdir = Path(tempfile.mkdtemp(prefix="overload-step-"))
    up_url, upstreams = po.start_upstreams(args, layout)
    rows = []
    try:
        po.wait_http(f"{up_url}/health")
        sources = args.step_source or [po.REPO]
        for rnd in range(args.rounds):
            for src, label in zip(sources, po.source_labels(sources), strict=True):
                target = po.start_polyinfer(up_url, workdir, layout.proxy, args.shape_estimator,
                                            src.resolve(), label)
                port = int(target.url.split(":")[2].split("/")[0])
                try:
                    with StatsPoller(target.url, period_s=0.2) as poller:
                        client = subprocess.run(po.pinned(
                            [po.PY, __file__, "--step-client", str(port), str(args.step_conns),
                             str(args.step_duration), "1"], layout.loadgen[0]),
                            capture_output=True, text=True, timeout=args.step_duration + 120)
                    out = json.loads(client.stdout.strip().splitlines()[-1])
                finally:
                    target.proc.terminate()
                    target.proc.wait(timeout=30)
                lat = np.array([ms for _, ms in out["served"]])
                first = np.array([ms for t, ms in out["served"] if t < 1.0])
                row = {"round": rnd, "source": label or "@" + src.name,
                       "goodput_rps": round(len(lat) / args.step_duration, 1),
                       "by_status": out["by_status"],
                       "e2e_p50_ms": round(float(np.percentile(lat, 50)), 1),
                       "e2e_p99_ms": round(float(np.percentile(lat, 99)), 1),
                       "e2e_max_ms": round(float(lat.max()), 1),
                       "first_s_p99_ms": round(float(np.percentile(first, 99)), 1)
                       if len(first) else None,
                       "door": poller.summary()}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for up in upstreams:
            up.terminate()
            up.wait(timeout=10)
    (workdir / "step.json").write_text(json.dumps(rows))
    print(f"# raw: {workdir / 'step.json'}")


def door_cost(args: argparse.Namespace) -> None:
    """Loop CPU per served and per refused request, blocks alternating (see the doc)."""
    import subprocess

    import uvloop

    from proxy import keys
    from proxy.admission import InFlightLimit
    from proxy.config import ProxyConfig
    from proxy.server import ProxyServer

    workdir = Path(tempfile.mkdtemp(prefix="door-cost-"))
    port = po.free_port()
    upstream = subprocess.Popen([po.PY, str(po.REPO / "bench" / "fake_upstream.py"), "--port",
                                 str(port), "--chunks", str(args.chunks)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    po.wait_http(f"http://127.0.0.1:{port}/health")

    async def run() -> dict[str, list[tuple[float, float]]]:
        config = ProxyConfig.from_dict({
            "server": {"host": "127.0.0.1", "port": 0},
            "workers": [{"name": "up", "url": f"http://127.0.0.1:{port}",
                         "config": {"backend": "external", "model": "fake-fast"}}],
            "routing": {"policy": "round_robin"},
            "traces": {"dir": str(workdir / "traces")}, "run_dir": str(workdir / "run")})
        server = ProxyServer(config)
        await server.start()
        relay = server.app[keys.RELAY]
        served_limit = relay.in_flight_limit
        loop = asyncio.get_running_loop()
        bare = await loop.create_server(lambda: BareRefusal(_BARE_429), "127.0.0.1", 0)
        clients = {}
        for kind, to in (("proxy", server.port), ("bare", bare.sockets[0].getsockname()[1])):
            clients[kind] = await asyncio.create_subprocess_exec(
                po.PY, __file__, "--door-client", str(to), str(args.conns),
                "/v1/chat/completions", "1" if args.stream else "0",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)

        async def block(client: asyncio.subprocess.Process, n: int, fresh: bool = False
                        ) -> tuple[float, float, float, dict]:
            assert client.stdin is not None and client.stdout is not None
            client.stdin.write(b"fresh %d\n" % n if fresh else b"%d\n" % n)
            t, use = time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD)
            line = await client.stdout.readline()
            end = resource.getrusage(resource.RUSAGE_THREAD)
            user, system = end.ru_utime - use.ru_utime, end.ru_stime - use.ru_stime
            return user / n * 1e6, system / n * 1e6, n / (time.perf_counter() - t), \
                json.loads(line)
        kinds = ("served", "refused", "bare", "refused, new connection")
        out: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
        try:
            for client in clients.values():
                await block(client, 500)  # warm-up: connections, caches
            for i in range(len(kinds) * args.blocks):
                kind = kinds[i % len(kinds)]
                relay.in_flight_limit = served_limit if kind == "served" else InFlightLimit(0)
                relay.in_flight_limit.update(False, 0)
                fresh = kind.endswith("connection")
                user, system, rps, counts = await block(
                    clients["bare" if kind == "bare" else "proxy"],
                    args.block // 4 if fresh else args.block, fresh)
                n = args.block // 4 if fresh else args.block
                want = "200" if kind == "served" else "429"
                if counts.get(want) != n:
                    raise SystemExit(f"{kind} block answered {counts}")
                out[kind].append((user, system))
                print(f"{kind:<8} {user + system:7.1f} us loop CPU / request (user {user:.1f}, "
                      f"system {system:.1f}; {rps:,.0f} req/s)", flush=True)
        finally:
            for client in clients.values():
                assert client.stdin is not None
                client.stdin.close()
                await client.wait()
            relay.in_flight_limit = served_limit
            bare.close()
            await server.stop()
        return out
    try:
        out = uvloop.run(run())
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)
    total = {k: [u + s for u, s in v] for k, v in out.items()}
    med = {k: float(np.median(v)) for k, v in total.items()}
    r = med["refused"] / med["served"]
    print("# median us / request (max/min over blocks): " + ", ".join(
        f"{k} {med[k]:.1f} ({max(v) / min(v):.2f})" for k, v in total.items())
          + f"; r = {r:.3f}; goodput bound at 3x (1 - 3r) / (1 - r) = "
            f"{(1 - 3 * r) / (1 - r):.2f}x")
    print(json.dumps({"door_cost_us": out, "median_us": med, "r": round(r, 4)}))


def quota_cgroup(cores: float, root: Path = Path("/sys/fs/cgroup")) -> Path:
    """A new cgroup whose CPU quota is ``cores`` (v2 when the unified hierarchy is mounted
    at ``root``, else v1's cpu controller); the caller removes it once it is empty."""
    period = 100_000
    quota = max(1000, round(cores * period))
    name = f"polyinfer-overload-{os.getpid()}"
    if (root / "cgroup.controllers").is_file():
        folder = root / name
        folder.mkdir()
        (folder / "cpu.max").write_text(f"{quota} {period}")
    else:
        folder = root / "cpu" / name
        folder.mkdir()
        (folder / "cpu.cfs_period_us").write_text(str(period))
        (folder / "cpu.cfs_quota_us").write_text(str(quota))
    return folder


def accept_queue(port: int) -> int | None:
    """Connections waiting in the kernel for the listener on ``port`` to accept them (its
    LISTEN socket's rx_queue in /proc/net/tcp); None where that is not readable."""
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    want = f":{port:04X}"
    for line in lines:
        fields = line.split()
        if fields[1].endswith(want) and fields[3] == "0A":
            return int(fields[4].split(":")[1], 16)
    return None


def listen_counters() -> dict[str, int]:
    """The kernel's TcpExt ListenOverflows / ListenDrops (connections an accept queue had no
    room for), from /proc/net/netstat."""
    try:
        rows = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()
                if line.startswith("TcpExt:")]
    except OSError:
        return {}
    if len(rows) < 2:
        return {}
    values = dict(zip(rows[0][1:], rows[1][1:], strict=False))
    return {k: int(values[k]) for k in ("ListenOverflows", "ListenDrops") if k in values}


class StatsPoller:
    """The proxy's door state every ``period_s`` while the load runs, from its /stats: how
    much is in flight against the limit, and the loop's lag and busy share that set it."""

    KEYS = ("in_flight", "in_flight_limit", "loop_lag_ms", "loop_busy", "shed_at_door")

    def __init__(self, url: str, period_s: float = 0.5) -> None:
        import threading
        self.url = url.replace("/v1/chat/completions", "/stats")
        self.period_s = period_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StatsPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        t0 = time.perf_counter()
        port = int(self.url.split(":")[2].split("/")[0])
        while not self._stop.wait(self.period_s):
            start = time.perf_counter()
            queued = accept_queue(port)
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    doc = json.loads(r.read())
            except OSError:
                self.samples.append({"t": round(start - t0, 2), "error": True,
                                     "accept_queue": queued})
                continue
            row = {"stats_ms": round((time.perf_counter() - start) * 1e3, 1),
                   "accept_queue": queued, **{k: doc.get(k) for k in self.KEYS}}
            row["connections"] = (doc.get("connections") or {}).get("open")
            for k in ("loop_lag_ms", "loop_busy"):
                row[k] = round(row[k], 3) if isinstance(row[k], float) else row[k]
            self.samples.append({"t": round(start - t0, 2), **row})

    def summary(self) -> dict:
        """Median and max of each numeric key over the samples (and how many failed)."""
        out: dict = {"samples": len(self.samples),
                     "failed": sum(1 for s in self.samples if s.get("error"))}
        for k in (*self.KEYS[:4], "connections", "stats_ms", "accept_queue"):
            vals = [s[k] for s in self.samples if isinstance(s.get(k), int | float)]
            if vals:
                out[k] = {"median": round(float(np.median(vals)), 3), "max": max(vals)}
        return out


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--step-client":
        step_client_main(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]),
                         sys.argv[5] == "1")
        return
    if len(sys.argv) == 6 and sys.argv[1] == "--door-client":
        door_client_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1")
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", type=float, nargs="+", default=None,
                   help="offered rates (req/s) whose best goodput is the capacity "
                        "(default: --start, x --step, until saturated)")
    p.add_argument("--start", type=float, default=2000.0)
    p.add_argument("--step", type=float, default=1.25)
    p.add_argument("--max-points", type=int, default=10)
    p.add_argument("--past-saturation", type=int, default=2,
                   help="sweep points past the first saturated one: the door refuses some "
                        "load before the loop's plateau, which is the capacity taken")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per sweep point")
    p.add_argument("--overload-duration", type=float, default=20.0,
                   help="seconds at 3x capacity")
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--token-interval-ms", type=float, default=0.0,
                   help="the upstream paces each stream a chunk this often (0: written whole)")
    p.add_argument("--upstream-procs", type=int, default=4)
    p.add_argument("--loadgen-procs", type=int, default=6)
    p.add_argument("--prompts", choices=po.PROMPT_MODES, default="fixed")
    p.add_argument("--client-connections", type=int, default=0, metavar="N",
                   help="each load process's connection pool: N connections, a request "
                        "waiting (its wait counted) when all are busy, as pooled clients do "
                        "(the OpenAI client's default pool is 1,000); 0 = a new connection "
                        "whenever none is idle")
    p.add_argument("--shape-estimator", default="classifier")
    p.add_argument("--data", type=Path, default=po.DATA)
    p.add_argument("--source", type=Path, default=None,
                   help="run the proxy from another source tree (e.g. an earlier commit)")
    p.add_argument("--door-cost", action="store_true",
                   help="measure the loop CPU per served and per refused request (see above)")
    p.add_argument("--conns", type=int, default=16, help="--door-cost: client connections")
    p.add_argument("--block", type=int, default=2000, help="--door-cost: requests per block")
    p.add_argument("--blocks", type=int, default=5, help="--door-cost: blocks of each kind")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="--door-cost: non-streamed requests")
    p.add_argument("--step-load", dest="step_load", action="store_true",
                   help="a step from idle to --step-conns connections sending at once")
    p.add_argument("--step-conns", type=int, default=2048)
    p.add_argument("--step-duration", type=float, default=8.0)
    p.add_argument("--step-source", type=Path, nargs="+", default=None,
                   help="--step: the source trees to run the proxy from, in turn")
    p.add_argument("--rounds", type=int, default=1, help="--step: times through the sources")
    p.add_argument("--cpu-quota", type=float, default=None,
                   help="the proxy's CPU quota in cores, in a cgroup of its own (root)")
    args = p.parse_args()
    if args.client_connections < 0:
        p.error(f"--client-connections: expected >= 0, got {args.client_connections}")
    if args.cpu_quota is not None and not 0.01 <= args.cpu_quota <= 64:
        p.error(f"--cpu-quota: expected 0.01-64 cores, got {args.cpu_quota}")
    if args.step_load:
        step(args)
        return
    if args.door_cost:
        door_cost(args)
        return
    layout = po.Layout.plan(os.cpu_count() or 1, args.upstream_procs, args.loadgen_procs, True)
    print(f"# cores: proxy {layout.proxy}, upstream {list(layout.upstream)}, "
          f"load {list(layout.loadgen)} (of {os.cpu_count()})", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="overload-"))
    up_url, upstreams = po.start_upstreams(args, layout)
    target = cgroup = None
    rows = []
    try:
        cgroup = quota_cgroup(args.cpu_quota) if args.cpu_quota else None
        po.wait_http(f"{up_url}/health")
        # NOTE: the tree always named: the proxy runs in workdir, where a relative
        # PYTHONPATH entry (".") no longer finds it unless the project is installed
        target = po.start_polyinfer(up_url, workdir, layout.proxy, args.shape_estimator,
                                    (args.source or po.REPO).resolve(), cgroup=cgroup)
        rates = args.sweep or [args.start * args.step ** i for i in range(args.max_points)]
        num_past = 0
        for rate in rates:
            row = summary(po.load_parts(target.url, round(rate), args.duration, args.prompts,
                                        args.data, layout.loadgen, args.client_connections),
                          round(rate),
                          args.duration)
            rows.append(row)
            print(json.dumps(row), flush=True)
            time.sleep(1)
            if args.sweep is None and saturated(row):
                num_past += 1
                if num_past > args.past_saturation:
                    break
        best = max(rows, key=lambda r: r["goodput_rps"])
        capacity = best["goodput_rps"]
        rate = args.factor * capacity
        print(f"# capacity {capacity:.0f} req/s; holding {rate:.0f} req/s for "
              f"{args.overload_duration:.0f} s", flush=True)
        before = listen_counters()
        with StatsPoller(target.url) as poller:
            parts = po.load_parts(target.url, rate, args.overload_duration, args.prompts,
                                  args.data, layout.loadgen, args.client_connections)
        over = summary(parts, rate, args.overload_duration)
        over["door"] = poller.summary()
        over["kernel"] = {k: v - before.get(k, 0) for k, v in listen_counters().items()}
        over["goodput_over_capacity"] = round(over["goodput_rps"] / max(capacity, 1e-9), 3)
        over["capacity_point"] = {k: best[k] for k in ("offered_rps", "goodput_rps",
                                                        "e2e_p50_ms", "e2e_p99_ms")}
        over["p99_over_capacity_p99"] = round(over["e2e_p99_ms"] / best["e2e_p99_ms"], 1) \
            if over["e2e_p99_ms"] and best["e2e_p99_ms"] else None
        over["proxy"] = proxy_stats(target.url)
        print(json.dumps(over), flush=True)
        (workdir / "overload.json").write_text(json.dumps({"sweep": rows, "overload": over,
                                                           "door_samples": poller.samples}))
        print(f"# raw: {workdir / 'overload.json'}; proxy log {workdir}/polyinfer-*.log")
    finally:
        if target is not None and target.proc is not None:
            target.proc.terminate()
            target.proc.wait(timeout=30)
        for up in upstreams:
            up.terminate()
            up.wait(timeout=10)
        if cgroup is not None:
            cgroup.rmdir()


if __name__ == "__main__":
    main()
