"""Pure cores: block allocator, scheduler, detokenizer with stop strings, request parsing."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedOptionError,
)
from engine.kv_cache import BlockAllocator
from engine.protocol import RequestParser
from engine.scheduler import Scheduler
from engine.sequence import GenerationParams, Sequence, Status
from engine.tokenizer import TextTokenizer
from polyinfer.config import CompiledConfig, EngineConfig
from specdec.base import Proposal


def seq(i: int, n: int, max_tokens: int = 8) -> Sequence:
    return Sequence(i, f"r{i}", list(range(1, n + 1)), n, GenerationParams(max_tokens), 0.0)


def test_allocator_hands_out_and_takes_back() -> None:
    a = BlockAllocator(4)
    assert a.allocate(3) == [0, 1, 2]
    assert not a.can_allocate(2)
    a.free([1, 2])
    assert a.num_free == 3
    assert a.usage == pytest.approx(0.25)


def test_chunked_prefill_respects_token_budget() -> None:
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=10, kv_cache_tokens=64,
                       block_size=4)
    s = Scheduler(cfg, BlockAllocator(cfg.num_kv_blocks))
    a, b = seq(0, 7), seq(1, 9)
    s.add(a)
    s.add(b)
    out = s.schedule({})
    assert [(x.seq.seq_id, x.num_new) for x in out.scheduled] == [(0, 7), (1, 3)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    a.num_computed, b.num_computed = 7, 3
    a.token_ids.append(99)  # a sampled a token; b still prefills
    out = s.schedule({0: Proposal(0, [5, 6])})
    assert [(x.seq.seq_id, x.num_new, x.drafts) for x in out.scheduled] == [(0, 1, [5, 6]),
                                                                             (1, 6, [])]


def test_max_num_seqs_limits_admission() -> None:
    cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=100, kv_cache_tokens=256)
    s = Scheduler(cfg, BlockAllocator(cfg.num_kv_blocks))
    for i in range(3):
        s.add(seq(i, 5))
    out = s.schedule({})
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_full_cache_preempts_newest_and_requeues_it_first() -> None:
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_tokens=16,
                       block_size=4, enable_prefix_caching=False)  # 4 blocks, full recompute
    s = Scheduler(cfg, BlockAllocator(cfg.num_kv_blocks))
    a, b = seq(0, 8), seq(1, 8)
    s.add(a)
    s.add(b)
    s.schedule({})  # both prefill: 2 blocks each, cache full
    for x in (a, b):
        x.num_computed = 8
        x.token_ids.append(7)
    out = s.schedule({})  # a needs a 3rd block: b is preempted
    assert [x.seq.seq_id for x in out.scheduled] == [0]
    assert out.preempted == [b] and b.status is Status.WAITING and b.num_computed == 0
    assert list(s.waiting) == [b] and b.block_table == []
    s.finish(a)
    out = s.schedule({})
    assert [(x.seq.seq_id, x.num_new) for x in out.scheduled] == [(1, 9)]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    from polyinfer.config import TINY_TARGET

    return TextTokenizer(TINY_TARGET)


def run_detok(tok: TextTokenizer, text: str, stop: tuple[str, ...]) -> tuple[list[str], str | None]:
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode("Q:"), stop)
    pieces, hit = [], None
    for t in ids:
        delta = d.push([t])
        pieces.append(delta.text)
        if delta.stop_string:
            hit = delta.stop_string
            break
    if hit is None:
        pieces.append(d.finish())
    return pieces, hit


def test_detokenizer_reassembles_text(tokenizer: TextTokenizer) -> None:
    text = " The café costs 3€ — déjà vu, naïve 日本語 code: x = y + 1\n"
    pieces, hit = run_detok(tokenizer, text, ())
    assert hit is None and "".join(pieces) == text


def test_stop_string_across_tokens_is_trimmed_and_never_streamed(tokenizer: TextTokenizer) -> None:
    text = " alpha beta gamma delta epsilon"
    pieces, hit = run_detok(tokenizer, text, ("ma del",))
    assert hit == "ma del"
    assert "".join(pieces) == " alpha beta gam"


def parser(tokenizer: TextTokenizer, **engine: object) -> RequestParser:
    cfg = CompiledConfig(served_model_name="tiny", engine=EngineConfig(**engine))  # type: ignore
    return RequestParser(cfg, tokenizer, 64)


@pytest.mark.parametrize("body, error", [
    ([1, 2], InvalidRequestError),
    ({}, InvalidRequestError),
    ({"prompt": "hi", "max_tokens": -1}, InvalidRequestError),
    ({"prompt": "hi", "max_tokens": "3"}, InvalidRequestError),
    ({"prompt": "hi", "max_tokens": 10_000}, ContextLengthError),
    ({"prompt": "hi " * 100}, ContextLengthError),
    ({"prompt": "hi", "model": "gpt-4"}, ModelNotFoundError),
    ({"prompt": "hi", "n": 0}, InvalidRequestError),
    ({"prompt": "hi", "best_of": 3}, UnsupportedOptionError),
    ({"prompt": "hi", "logprobs": 21}, InvalidRequestError),
    ({"prompt": "hi", "response_format": {"type": "yaml"}}, InvalidRequestError),
    ({"prompt": "hi", "structured_outputs": {"structural_tag": "{}"}}, UnsupportedOptionError),
    ({"prompt": "hi", "structured_outputs": {"regex": "a+(("}}, InvalidRequestError),
    ({"prompt": "hi", "structured_outputs": {"choice": "a"}}, InvalidRequestError),
    ({"prompt": "hi", "structured_outputs": {"grammar": "root ::= nothing"}},
     InvalidRequestError),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, InvalidRequestError),
    ({"prompt": "hi", "guided_json": {"type": "object"}}, UnsupportedOptionError),
    ({"prompt": "hi", "temperature": -0.5}, InvalidRequestError),
    ({"prompt": "hi", "temperature": 2.5}, InvalidRequestError),
    ({"prompt": "hi", "presence_penalty": 3}, InvalidRequestError),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, InvalidRequestError),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, InvalidRequestError),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, InvalidRequestError),
    ({"prompt": "hi", "top_p": 0}, InvalidRequestError),
    ({"prompt": "hi", "stop": 3}, InvalidRequestError),
    ({"prompt": [1, 99999]}, InvalidRequestError),
    ({"prompt": ["a", "b"]}, UnsupportedOptionError),
    ({"prompt": ""}, InvalidRequestError),
    ({"prompt": "hi", "speculative_depth": -1}, InvalidRequestError),
    ({"prompt": "hi", "stream": "yes"}, InvalidRequestError),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, InvalidRequestError),
    ({"prompt": "hi", "slo_tpot_s": 0}, InvalidRequestError),
    ({"prompt": "hi", "slo_tpot_s": -0.01}, InvalidRequestError),
    ({"prompt": "hi", "slo_tpot_s": "0.05"}, InvalidRequestError),
    ({"prompt": "hi", "slo_tpot_s": True}, InvalidRequestError),
    ({"prompt": "hi", "slo_ttft_s": float("inf")}, InvalidRequestError),
    ({"prompt": "hi", "slo_ttft_s": [1]}, InvalidRequestError),
])
def test_bad_completion_requests(tokenizer: TextTokenizer, body: object,
                                 error: type[Exception]) -> None:
    with pytest.raises(error):
        parser(tokenizer).parse(body, chat=False)


@pytest.mark.parametrize("body", [{"messages": []}, {"messages": [{"content": "x"}]},
                                  {"messages": "hi"}, {"messages": [{"role": "user",
                                                                     "content": 5}]}])
def test_bad_chat_requests(tokenizer: TextTokenizer, body: object) -> None:
    with pytest.raises(InvalidRequestError):
        parser(tokenizer).parse(body, chat=True)


def test_parse_caps_speculative_depth_and_defaults(tokenizer: TextTokenizer) -> None:
    p = parser(tokenizer, spec_method="ngram", spec_max_depth=3, spec_default_depth=2)
    assert p.parse({"prompt": "hi", "speculative_depth": 9}, False).params.spec_depth == 3
    assert p.parse({"prompt": "hi"}, False).params.spec_depth == 2
    chat = p.parse({"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                    "stop": "x", "seed": 3}, True)
    assert chat.params.max_tokens == 64 - len(chat.prompt_ids)
    assert chat.params.sampling.greedy and chat.params.stop == ("x",)
    assert parser(tokenizer).parse({"prompt": "hi", "speculative_depth": 4},
                                   False).params.spec_depth == 0


def test_parse_reads_the_slo_fields(tokenizer: TextTokenizer) -> None:
    params = parser(tokenizer).parse({"prompt": "hi", "slo_tpot_s": 0.05, "slo_ttft_s": 2},
                                     False).params
    assert (params.slo_tpot_s, params.slo_ttft_s) == (0.05, 2.0)
    params = parser(tokenizer).parse({"prompt": "hi", "slo_tpot_s": None}, False).params
    assert (params.slo_tpot_s, params.slo_ttft_s) == (None, None)


def test_decode_group_splits_only_when_padding_dominates() -> None:
    from engine.attention import SeqSlice, _split_by_context, build_metadata

    short = [SeqSlice(1, 15, [i]) for i in range(7)]
    mixed = [*short, SeqSlice(1, 159, list(range(10, 20)))]
    assert _split_by_context(mixed, 0, 8, 16) == [(0, 7), (7, 8)]
    assert _split_by_context([*short, SeqSlice(1, 15, [9])], 0, 8, 16) == [(0, 8)]
    assert _split_by_context(mixed[1:], 0, 7, 16) == [(0, 7)]  # too few to pay for a split
    meta = build_metadata(mixed, 16, 2, 5)
    assert [g.rows for g in meta.groups] == [(0, 7), (7, 8)]
    assert [g.block_tables.shape[1] for g in meta.groups] == [1, 10]


def test_ngram_caps_follow_the_execution_unless_named() -> None:
    from engine.checkpoint import ModelSpec
    from engine.proposers import build_proposer
    from polyinfer.config import ConfigError
    from specdec.ngram import NgramProposer

    def config_of(**engine: object) -> object:
        proposer = build_proposer(EngineConfig(spec_method="ngram", **engine),  # type: ignore
                                  ModelSpec.__new__(ModelSpec), {})
        assert isinstance(proposer, NgramProposer)
        c = proposer.config
        return c.weak_match_depth, c.context_depth_caps, c.pool_depth_caps

    capped, uncapped = (4, (2, 3), (0, 1, 1, 3)), (None, (), ())
    assert config_of() == capped  # eager on the CPU: "auto" keeps the caps
    assert config_of(device="cuda", execution="cuda_graph") == uncapped
    assert config_of(device="cuda", execution="cuda_graph", ngram_caps="cpu") == capped
    assert config_of(ngram_caps="none") == uncapped
    with pytest.raises(ConfigError, match="engine.ngram_caps"):
        EngineConfig(ngram_caps="off")  # type: ignore[arg-type]
