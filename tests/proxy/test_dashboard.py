"""The dashboard in a real browser: headless Chromium loads the page from a real proxy over
real engine workers with traffic, and every chart must have drawn data points.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it); without a binary these
tests are skipped. The page's DOM is read after its scripts ran (``--dump-dom`` after a
virtual-time budget), and a screenshot is saved under the test's temporary folder.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from optimizer.board import Board
from tests.proxy.servers import ProxyThread, external_config

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))
                 if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install chromium; "
                             ".ci/run installs it when run as root)")

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars")
TIME_CHARTS = ("requests", "errors", "refused", "load", "ttft_worker", "ttft_domain",
               "tpot_worker", "tpot_domain", "depth", "acceptance", "prediction_error")
PROMPTS = [  # a few domains for the classifier, repetitive enough for n-gram drafts
    ("completions", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul("),
    ("completions", "Solve for x: 3x + 7 = 22. Then compute 12 * 13 and 144 / 12. Answer:"),
    ("chat", "Hi! How are you today? Tell me something nice about the weather."),
    ("chat", "Summarize the following text in one sentence: The cat sat on the mat. The cat "
             "sat on the mat again. Then the cat slept on the mat all afternoon."),
    ("chat", "Translate to French: good morning, good evening, good night, thank you."),
]


def dump_dom(url: str, tmp: Path) -> str:
    """The page's DOM after its scripts ran for a few seconds of virtual time."""
    return chromium(url, tmp, "--dump-dom")


def chromium(url: str, tmp: Path, *args: str, budget_ms: int = 6000) -> str:
    """Run headless Chromium on ``url`` with a fresh profile; its stdout."""
    assert CHROMIUM is not None
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp)
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
           f"--virtual-time-budget={budget_ms}", *args, url]
    done = subprocess.run(cmd, capture_output=True, timeout=180, check=False)
    log = done.stderr.decode(errors="replace")
    assert done.returncode == 0, log[-2000:]
    console = [line for line in log.splitlines() if "CONSOLE" in line]
    assert not console, "the page logged to its console:\n" + "\n".join(console)
    return done.stdout.decode()


class Page(HTMLParser):
    """What the dumped DOM shows: per card, its svg's attributes and what it drew."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.html = html
        self.cards: dict[str, dict[str, Any]] = {}
        self.body: dict[str, str] = {}
        self.tables: dict[str, str] = {}
        self.meta = ""  # the page's status line
        self._meta = False
        self._card: str | None = None
        self.feed(html)

    def handle_data(self, data: str) -> None:
        if self._meta:
            self.meta += data

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        elif tag == "section" and "data-chart" in a:
            self._card = a["data-chart"]
            self.cards[self._card] = {"vertices": 0, "dots": 0, "cells": 0, "events": [],
                                      "bars": 0, "states": 0, "markers": 0}
        elif a.get("id") == "meta":
            self._meta = True
        elif tag == "table" and "id" in a:
            self.tables[a["id"]] = a.get("data-rows", "")
        card = self.cards.get(self._card or "")
        if card is None:
            return
        if tag == "svg":
            card["points"] = int(a.get("data-points", "-1"))
        elif tag == "path" and "series" in a.get("class", ""):
            card["vertices"] += len(re.findall(r"[ML]", a.get("d", "")))
        elif tag == "circle":
            card["dots"] += 1
        elif tag == "rect":
            kind = a.get("class", "")
            if kind == "cell" and int(a.get("data-count", "0")) > 0:
                card["cells"] += 1
            elif kind in ("bar", "state"):
                card[kind + "s"] += 1
        elif tag == "line" and "marker" in a.get("class", ""):
            card["markers"] += 1
        elif tag == "text" and "event" in a.get("class", ""):
            card["events"].append(a["class"].split()[-1])

    def handle_endtag(self, tag: str) -> None:
        self._meta = self._meta and tag != "div"
        if tag == "section":
            self._card = None


class CampaignOnBoard:
    """A campaign's steps as the optimizer writes them to its board, through its own
    :class:`Board`, from this process (as a ``polyinfer optimize join`` process would):
    a live campaign takes minutes on this machine, its records take milliseconds."""

    CAMPAIGN = "20260101T000000-dashtest"
    CANDIDATES = (("incumbent", {"max_num_seqs": 8, "spec_method": "ngram"}, 40.0),
                  ("bayes", {"max_num_seqs": 16, "spec_method": "ngram"}, 52.0),
                  ("evolution", {"max_num_seqs": 32, "spec_method": "none"}, 31.0),
                  ("costmodel", {"max_num_seqs": 4, "spec_method": "ngram"}, None))

    def __init__(self, path: Path) -> None:
        self.board = Board(path)
        self.ids: dict[str, int] = {}

    def screen(self) -> None:
        """The campaign starts; agents post candidates; three are measured in the fast tier."""
        cid, board = self.CAMPAIGN, self.board
        board.note(cid, "service", "incumbent", {"key": "{}"})
        for agent, knobs, value in self.CANDIDATES:
            pid = board.post(cid, _key(knobs), {"engine": knobs}, agent, predicted=45.0)
            assert pid is not None
            self.ids[agent] = pid
            if value is not None:
                board.add_result(pid, "fast", value, 2.0)
                board.set_status(pid, "measured")

    def promote(self) -> None:
        """The best is confirmed in the slow tier and promoted."""
        self.board.add_result(self.ids["bayes"], "slow", 50.5, 6.0)
        self.board.add_promotion(self.CAMPAIGN, "http://127.0.0.1:1",
                                 _key(self.CANDIDATES[1][1]), "promoted", 0.21, {"reason": ""})

    def roll_back(self) -> None:
        """The live watch saw TPOT regress: rolled back, and the campaign ends."""
        self.board.add_promotion(self.CAMPAIGN, "http://127.0.0.1:1",
                                 _key(self.CANDIDATES[1][1]), "rolled_back", 0.21,
                                 {"reason": "live TPOT 0.0500s vs 0.0300s before"})
        self.board.note(self.CAMPAIGN, "service", "campaign_done",
                        {"status": "rolled_back", "gain": 0.21})


def _key(knobs: dict[str, Any]) -> str:
    return json.dumps(knobs, sort_keys=True)  # as optimizer.space keys candidates


def send_traffic(url: str, headers: dict[str, str], seconds: float) -> dict[str, int]:
    """Requests over several domains, streamed and not, one at a time for ``seconds``."""
    num_ok = 0
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or num_ok < len(PROMPTS):
            endpoint, text = PROMPTS[num_ok % len(PROMPTS)]
            body: dict[str, Any] = {"model": "tiny-target", "max_tokens": 12, "temperature": 0,
                                    "stream": num_ok % 2 == 0}
            if num_ok % 3 == 0:
                # NOTE: the depth policy may find that speculation does not pay on this CPU
                # (its step-time model is fed by the shared engines' earlier steps), and the
                # acceptance chart needs drafted tokens: a client's depth always wins
                body["speculative_depth"] = 4
            if endpoint == "chat":
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            r = client.post(f"/v1/{endpoint.replace('chat', 'chat/completions')}", json=body)
            r.read()
            assert r.status_code == 200, r.text
            num_ok += 1
    return {"ok": num_ok, "shed": 0, "error": 0}


def send_burst_and_error(url: str) -> dict[str, int]:
    """A burst over ``limits.max_in_flight`` (shed with 429), and a prompt the worker
    refuses (a token id out of its vocabulary: an error on that worker)."""
    with httpx.Client(base_url=url, timeout=120) as client:
        def one(_: int) -> int:
            return client.post("/v1/completions", json={
                "model": "tiny-target", "prompt": "def f(x):", "max_tokens": 16}).status_code

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            statuses = list(pool.map(one, range(12)))
        r = client.post("/v1/completions", json={"model": "tiny-target", "prompt": [10 ** 9],
                                                 "max_tokens": 4})
    return {"ok": statuses.count(200), "shed": statuses.count(429),
            "error": int(r.status_code >= 400)}


def wait_for_history(url: str, headers: dict[str, str], counts: dict[str, int],
                     num_events: int = 0) -> dict[str, Any]:
    """The history once the sampler has closed the seconds that hold the traffic sent (and
    the optimizer's board has been read since its last ``num_events`` events).

    NOTE: served requests are counted in the routing matrix (whole counts); the rate series
    divide by the seconds a point's slots cover, which a late sampler tick stretches, so
    their sum times the step undercounts a loaded run (203 of 232 in one CI run): refusals
    are only required to show. 90 s: on a loaded 2-core box the board's read (an executor
    job, at most every 5 s) and the sampler's ticks fell past a 30 s wait once."""
    deadline = time.monotonic() + 90
    while True:
        doc = httpx.get(url + "/stats/history?window=300", headers=headers, timeout=10).json()
        series = doc["series"]
        routed = sum(n for row in doc["routing"]["matrix"].values() for n in row.values())
        refused = _total(series["refused_per_s"], doc["step_s"])
        events = doc["optimizer"].get("events", ())
        if (routed >= counts["ok"] + counts["error"] and (refused > 0 or not counts["shed"])
                and len(events) >= num_events):
            return doc
        assert time.monotonic() < deadline, (routed, refused, events, counts, doc)
        time.sleep(0.5)


def _total(rates: dict[str, list[float | None]], step_s: float) -> float:
    """Requests in a window's series of rates."""
    return sum(v * step_s for values in rates.values() for v in values if v)


def save_screenshot(url: str, tmp: Path, name: str) -> Path:
    shot = tmp / name
    chromium(url, tmp, f"--screenshot={shot}", "--window-size=1400,2150")
    assert shot.exists() and shot.stat().st_size > 20_000, "a blank screenshot"
    keep = os.environ.get("POLYINFER_DASHBOARD_SHOTS")  # a folder to copy screenshots to
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / name)
    return shot


def test_every_chart_draws_live_traffic_and_the_optimizer(engines, tmp_path: Path):
    campaign = CampaignOnBoard(tmp_path / "board.sqlite")
    campaign.screen()
    config = external_config(
        engines, tmp_path, routing={"policy": "adaptive"},
        limits={"max_loop_lag_s": 0, "max_in_flight": 3},
        # min_records above the traffic: the service starts and watches, no campaign
        optimize={"enabled": True, "min_records": 5000,
                  "board_path": str(campaign.board.path)})
    with ProxyThread(config) as proxy:
        counts = send_traffic(proxy.url, {}, seconds=4)
        campaign.promote()
        more = send_traffic(proxy.url, {}, seconds=4)
        campaign.roll_back()
        burst = send_burst_and_error(proxy.url)
        assert burst["shed"] > 0 and burst["error"] == 1, burst
        counts = {k: counts[k] + more[k] + burst[k] for k in counts}
        doc = wait_for_history(proxy.url, {}, counts, num_events=4)
        assert doc["series"]["refused_per_s"]["429"], doc["series"]["refused_per_s"]
        html = dump_dom(proxy.url + "/dashboard?window=300", tmp_path)
        hour = Page(dump_dom(proxy.url + "/?window=3600", tmp_path))
        shot = save_screenshot(proxy.url + "/?window=300", tmp_path, "dashboard.png")
    page = Page(html)
    assert page.body.get("data-updated"), f"the page never drew a history document: {page.meta}"
    for name in TIME_CHARTS:
        card = page.cards[name]
        assert card["points"] > 0, f"{name}: no data points drawn ({card})"
        assert card["vertices"] == card["points"], f"{name}: {card}"
        assert hour.cards[name]["points"] > 0, f"{name}, 1 h window: {hour.cards[name]}"
    assert page.cards["routing"]["cells"] >= 2, page.cards["routing"]
    opt = page.cards["optimizer"]
    assert {"campaign", "promoted", "rolled_back", "campaign_done"} <= set(opt["events"]), opt
    assert opt["bars"] >= 2 and opt["states"] >= 1, opt  # fast, then slow experiments
    assert page.cards["ttft_worker"]["markers"] >= 2  # promotion and rollback on latency
    assert page.tables["candidates"] == "4", page.tables
    assert page.tables["workers"] == "2", page.tables
    assert campaign.CAMPAIGN in html
    print(f"dashboard screenshot: {shot}")


def test_page_asks_for_the_api_key_and_sends_it(engines, tmp_path: Path):
    config = external_config(engines, tmp_path, auth={"api_keys": ["sk-dash"]})
    with ProxyThread(config) as proxy:
        assert httpx.get(proxy.url + "/stats/history").status_code == 401
        assert httpx.get(proxy.url + "/dashboard").status_code == 200  # no data in the page
        headers = {"Authorization": "Bearer sk-dash"}
        counts = send_traffic(proxy.url, headers, seconds=1)
        wait_for_history(proxy.url, headers, counts)
        locked = Page(dump_dom(proxy.url + "/dashboard", tmp_path))
        wrong = Page(dump_dom(proxy.url + "/dashboard?key=sk-wrong", tmp_path))
        opened = dump_dom(proxy.url + "/dashboard?key=sk-dash", tmp_path)
    assert locked.body.get("data-auth") == "wanted" and "data-updated" not in locked.body
    assert wrong.body.get("data-auth") == "wanted" and "that key was refused" in wrong.html
    page = Page(opened)
    assert page.body.get("data-updated") and "data-auth" not in page.body
    assert page.cards["requests"]["points"] > 0
    assert "sk-dash" not in opened  # kept in sessionStorage, not in the DOM
