"""The declared-fit routing policy (router.fit) on hand-made worker views."""

from __future__ import annotations

from polyinfer.config import CompiledConfig, DeclaredFit
from proxy.routing import build_policy
from router.base import RequestShape, WorkerView
from router.fit import DeclaredFitPolicy, fit_rank


def _view(name: str, domains: tuple[str, ...] = (), prompt_tokens: tuple[int, int] = (0, 1 << 30),
          outstanding: int = 0) -> WorkerView:
    config = CompiledConfig(backend="vllm", fit=DeclaredFit(domains, prompt_tokens))
    return WorkerView(name=name, url=f"http://{name}", backend="vllm", config=config,
                      outstanding_requests=outstanding)


def _shape(domain: str, prompt_tokens: int = 100) -> RequestShape:
    return RequestShape(domain=domain, prompt_tokens=prompt_tokens, max_tokens=16,
                        predicted_output_tokens=16)


def test_rank():
    assert fit_rank(_shape("code"), _view("a", ("code",))) == 2
    assert fit_rank(_shape("code"), _view("a")) == 1
    assert fit_rank(_shape("chat"), _view("a", ("code",))) == 0
    assert fit_rank(_shape("code", 5000), _view("a", ("code",), (0, 4096))) == 0


def test_domain_goes_to_its_declared_worker_even_when_busier():
    views = [_view("plain", ("chat", "qa"), outstanding=0), _view("ngram", ("code",), outstanding=5)]
    policy = DeclaredFitPolicy()
    assert policy.choose(_shape("code"), views).worker == "ngram"
    assert policy.choose(_shape("qa"), views).worker == "plain"
    decision = policy.choose(_shape("code"), views)
    assert decision.reason == "fit" and decision.spec_depth is None


def test_explicit_domain_beats_catch_all_and_no_fit_falls_back_to_least_loaded():
    views = [_view("any"), _view("ngram", ("code",), outstanding=3)]
    policy = DeclaredFitPolicy()
    assert policy.choose(_shape("code"), views).worker == "ngram"
    assert policy.choose(_shape("chat"), views).worker == "any"
    only_code = [_view("a", ("code",), outstanding=2), _view("b", ("extraction",), outstanding=1)]
    decision = policy.choose(_shape("chat"), only_code)
    assert (decision.worker, decision.reason) == ("b", "fallback")


def test_equal_workers_share_the_load():
    views = [_view("a", ("code",)), _view("b", ("code",))]
    policy = DeclaredFitPolicy()
    picks = {policy.choose(_shape("code"), views).worker for _ in range(4)}
    assert picks == {"a", "b"}


def test_registered_by_name():
    assert build_policy("declared_fit").name == "declared_fit"
