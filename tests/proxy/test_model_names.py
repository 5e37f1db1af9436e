"""Model names through the proxy, on real engine workers: /v1/models and models.retrieve,
a worker that serves the model under another name (a 404 retried on one that serves it),
workers' errors in OpenAI's shape, token counters in /metrics, start-up warnings."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from polyinfer.config import TINY_TARGET
from proxy import keys
from proxy.config import ProxyConfig
from proxy.relay import openai_error
from proxy.supervisor import engine_command, free_port
from tests.proxy.servers import EngineProcess, ProxyThread, wait_healthy

MODEL = "tiny-target"
MESSAGES = [{"role": "user", "content": "Say hi."}]


def client(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def misnamed(engines: list[EngineProcess],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A real engine worker serving the bundled model as "misnamed", as a vLLM server
    started without --served-model-name serves it under its path."""
    tmp = tmp_path_factory.mktemp("misnamed")
    spec = engines[1].spec
    spec = dataclasses.replace(spec, name="misnamed", config=dataclasses.replace(
        spec.config, served_model_name="misnamed"))
    port = free_port()
    cfg = tmp / "misnamed.yaml"
    cfg.write_text(yaml.safe_dump(spec.config.to_dict()))
    with open(tmp / "misnamed.log", "wb") as log:
        proc = subprocess.Popen(engine_command(spec, "127.0.0.1", port, cfg), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    engine = EngineProcess(spec, f"http://127.0.0.1:{port}", proc)
    try:
        wait_healthy(engine.url, proc=proc)
        yield engine
    finally:
        engine.stop()


def _declared_as_tiny_target(engine: EngineProcess, name: str) -> dict[str, object]:
    config = {**engine.spec.config.to_dict(), "served_model_name": MODEL}
    return {"name": name, "url": engine.url, "config": config}


def _config(tmp: Path, workers: list[dict[str, object]]) -> ProxyConfig:
    return ProxyConfig.from_dict({
        "server": {"host": "127.0.0.1", "port": 0}, "workers": workers,
        "routing": {"policy": "round_robin"},
        "traces": {"dir": str(tmp / "traces"), "flush_interval_s": 0.1},
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.5},
        "limits": {"max_loop_lag_s": 0}, "run_dir": str(tmp / "run")})


def test_models_list_and_retrieve_name_the_tokenizer(proxy: ProxyThread) -> None:
    c = client(proxy)
    card = c.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    listed = c.models.list().data
    assert [m.id for m in listed] == [MODEL]
    root = Path(listed[0].model_dump()["root"])
    assert root.is_absolute() and root == TINY_TARGET.resolve()
    assert (root / "tokenizer.json").is_file()  # what loadgen counts prompt tokens with
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_a_404_from_a_worker_is_retried_on_one_that_serves_the_model(
        engines: list[EngineProcess], misnamed: EngineProcess, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="proxy")
    config = _config(tmp_path, [_declared_as_tiny_target(misnamed, "wrong"),
                                _declared_as_tiny_target(engines[0], "right")])
    with ProxyThread(config) as proxy:
        c = client(proxy)
        assert "lists ['misnamed'] at /v1/models, not the configured ['tiny-target']" in \
            caplog.text
        workers = []
        for _ in range(6):
            raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES,
                                                              max_tokens=4)
            assert raw.http_response.status_code == 200
            workers.append(raw.headers["x-polyinfer-worker"])
        assert set(workers) == {"right"}  # the first one after a 404 from "wrong"
        stats = proxy.app[keys.STATS]
        assert stats.errors[("wrong", "model_not_found")] == 1  # then no more sent there
        assert [m.id for m in c.models.list()] == [MODEL]
        assert "worker wrong answered 404 for model 'tiny-target'" in caplog.text


def test_a_workers_404_reaches_the_client_in_openai_shape_with_its_message(
        misnamed: EngineProcess, tmp_path: Path) -> None:
    config = _config(tmp_path, [_declared_as_tiny_target(misnamed, "wrong")])
    with ProxyThread(config) as proxy:
        with pytest.raises(openai.NotFoundError) as e:
            client(proxy).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    body = e.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert body["type"] == "invalid_request_error"
    assert body["message"] == "The model `tiny-target` does not exist; this engine serves " \
                              "`misnamed`."


def test_vllm_shaped_errors_become_openai_errors_keeping_the_message() -> None:
    # the body vLLM 0.32 answers for an unknown model, and for a bad request
    vllm_404 = orjson.dumps({"error": {"message": "The model `x` does not exist.",
                                       "type": "NotFoundError", "param": "model", "code": 404}})
    assert openai_error(404, vllm_404, "w") == {"error": {
        "message": "The model `x` does not exist.", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}}
    vllm_400 = orjson.dumps({"error": {"message": "max_tokens is too large",
                                       "type": "BadRequestError", "param": None, "code": 400}})
    assert openai_error(400, vllm_400, "w")["error"] == {
        "message": "max_tokens is too large", "type": "invalid_request_error", "param": None,
        "code": None}
    assert openai_error(401, b'{"detail": "no"}', "w")["error"]["type"] == \
        "authentication_error"  # type: ignore[index]
    assert openai_error(400, b"plain text", "w")["error"]["message"] == "plain text"  # type: ignore[index]
    assert openai_error(400, b"", "w")["error"]["message"] == "worker w answered HTTP 400"  # type: ignore[index]


def test_metrics_count_prompt_and_generated_tokens_per_model_and_worker(
        proxy: ProxyThread) -> None:
    c = client(proxy)
    before = _token_counters(proxy)
    usage = [c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5).usage
             for _ in range(4)]
    after = _token_counters(proxy)
    assert usage[0] is not None
    gained = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    prompt = sum(v for (name, _, _), v in gained.items() if name == "polyinfer_prompt_tokens")
    generated = sum(v for (name, _, _), v in gained.items()
                    if name == "polyinfer_generation_tokens")
    assert prompt == sum(u.prompt_tokens for u in usage if u)
    assert generated == sum(u.completion_tokens for u in usage if u)
    assert {(m, w) for (_, m, w) in gained} <= {(MODEL, "latency"), (MODEL, "throughput")}


def test_validation_errors_describe_the_value_without_quoting_it(proxy: ProxyThread) -> None:
    # a bad field's value can be prompt text: the message (and the trace) says what kind of
    # value it was, never the value itself, and never as a bytes literal
    r = httpx.post(f"{proxy.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": "secret 99"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.endswith("got a string of 9 characters")
    assert "secret" not in message and "b'" not in message


def test_an_unreachable_worker_is_logged_at_start(engines: list[EngineProcess], tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="proxy")
    port = free_port()  # nothing listens there
    config = _config(tmp_path, [
        _declared_as_tiny_target(engines[0], "right"),
        {"name": "remote", "url": f"http://127.0.0.1:{port}",
         "config": {"backend": "external", "model": MODEL}}])
    with ProxyThread(config):
        pass
    assert f"worker remote at http://127.0.0.1:{port} does not answer GET /health" in caplog.text


def _token_counters(proxy: ProxyThread) -> dict[tuple[str, str, str], float]:
    text = httpx.get(f"{proxy.url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("polyinfer_prompt_tokens", "polyinfer_generation_tokens"):
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[(family.name, s.labels["model"], s.labels["worker"])] = s.value
    return out
