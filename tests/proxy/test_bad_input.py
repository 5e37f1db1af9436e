"""Bad input gets a 4xx OpenAI error body and the proxy keeps serving (hypothesis-generated)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.proxy.servers import EngineProcess, ProxyThread, external_config

MODEL = "tiny-target"
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12)
wrong_types = {
    "messages": json_values.filter(lambda v: not isinstance(v, list) or not v
                                   or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              for m in v)),
    "stream": json_values.filter(lambda v: v is not None and not isinstance(v, bool)),
    "max_tokens": json_values.filter(lambda v: v is not None and not (
        isinstance(v, int) and not isinstance(v, bool) and v >= 1)),
    "temperature": st.text(max_size=5) | st.lists(st.integers(), max_size=2),
    "speculative_depth": st.integers(17, 10**6) | st.integers(-10**6, -1) | st.text(max_size=3),
    "slo_tpot_s": st.floats(max_value=0, allow_infinity=False) | st.booleans() | st.text(max_size=3),
    "slo_ttft_s": st.integers(-10**6, 0) | st.lists(st.floats(0.1, 1), min_size=1, max_size=2),
}


@pytest.fixture(scope="module")
def small_proxy(engines: list[EngineProcess],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyThread]:
    tmp = tmp_path_factory.mktemp("bad-input")
    with ProxyThread(external_config(engines, tmp, limits={"max_body_bytes": 4096})) as p:
        yield p


@pytest.fixture(scope="module")
def http(small_proxy: ProxyThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=small_proxy.url, timeout=30) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int | None = None) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    if status is not None:
        assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert r.headers["x-request-id"]


def still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=json_values)
def test_arbitrary_json_bodies(http: httpx.Client, body: object) -> None:
    assert_openai_error(http.post("/v1/chat/completions", content=orjson.dumps(body),
                                  headers={"Content-Type": "application/json"}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(sorted(wrong_types)), data=st.data())
def test_one_wrong_field(http: httpx.Client, field: str, data: st.DataObject) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            field: data.draw(wrong_types[field])}
    r = http.post("/v1/chat/completions", json=body)
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"].split("[")[0] == field


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_invalid_bytes(http: httpx.Client, raw: bytes) -> None:
    r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    try:
        valid_object = isinstance(orjson.loads(raw), dict)
    except orjson.JSONDecodeError:
        valid_object = False
    assert_openai_error(r, None if valid_object else 400)


def test_specific_bad_requests(http: httpx.Client) -> None:
    assert_openai_error(http.post("/v1/chat/completions", content=b"{not json"), 400)
    assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL}), 400)
    assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}),
                        400)
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL}), 400)
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x"}), 400)
    r = http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert_openai_error(r, 404)
    assert r.json()["error"]["code"] == "model_not_found"
    big = {"model": MODEL, "prompt": "x" * 10_000}
    assert_openai_error(http.post("/v1/completions", json=big), 413)
    # chunked upload with no Content-Length, over the limit
    assert_openai_error(http.post("/v1/completions", content=iter([b'{"prompt": "' + b"x" * 9000,
                                                                  b'"}'])), 413)
    assert_openai_error(http.get("/v1/chat/completions"), 405)
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    still_serving(http)


def test_still_serving_after_all_that(http: httpx.Client, small_proxy: ProxyThread) -> None:
    still_serving(http)
    r = http.get("/stats").json()
    assert r["in_flight"] == 0


def test_api_keys(engines: list[EngineProcess], tmp_path) -> None:  # type: ignore[no-untyped-def]
    import openai
    config = external_config(engines, tmp_path, auth={"api_keys": ["sk-good"]})
    with ProxyThread(config) as p:
        bad = openai.OpenAI(base_url=f"{p.url}/v1", api_key="sk-bad", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model=MODEL, max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        good = openai.OpenAI(base_url=f"{p.url}/v1", api_key="sk-good", max_retries=0)
        assert good.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hi"}]).choices
