"""The draft model runner under the draft proposer, on the bundled tiny-draft: batching, and
KV consistency after rejections."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.cuda_graph import DecodeRow, RowDecoder, graph_buckets
from engine.draft_runner import (
    DraftConfig,
    build_draft_proposer,
    draft_proposer,
    load_draft_proposer,
)
from polyinfer.config import TINY_DRAFT, EngineConfig
from specdec.base import ProposalRequest
from specdec.draft import DraftProposer
from specdec.errors import ProposerConfigError

pytestmark = pytest.mark.skipif(not (TINY_DRAFT / "model.safetensors").exists(),
                                reason="the bundled tiny-draft checkpoint is not trained yet")

CONFIG = DraftConfig(model_dir=str(TINY_DRAFT), kv_cache_tokens=4096, block_size=16,
                     max_model_len=1024)


@pytest.fixture(scope="module")
def proposer_model() -> DraftProposer:
    return load_draft_proposer(CONFIG)


def _fresh(like: DraftProposer) -> DraftProposer:
    """A proposer sharing the weights with an empty cache: recomputes everything from scratch."""
    return draft_proposer(like.model.model, CONFIG)


def _prompts(seed: int, num: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 8192) for _ in range(rng.randrange(5, 60))] for _ in range(num)]


def test_kv_stays_consistent_after_rejections(proposer_model: DraftProposer) -> None:
    """Random accept/reject/skip cycles; every step's draft logits equal a fresh recomputation."""
    kept = _fresh(proposer_model)
    rng = random.Random(1)
    histories = _prompts(0, 3)
    for step in range(10):
        reqs = [ProposalRequest(i, list(h), rng.choice([0, 1, 3, 4, 6]))
                for i, h in enumerate(histories)]
        props, logits = kept.propose_with_logits(reqs)
        fresh_props, fresh_logits = _fresh(proposer_model).propose_with_logits(reqs)
        for r, p, fp, lg, flg in zip(reqs, props, fresh_props, logits, fresh_logits, strict=True):
            assert len(p.tokens) == r.depth and p.probs is None
            assert p.tokens == fp.tokens, (step, r.seq_id)
            torch.testing.assert_close(lg, flg, rtol=1e-4, atol=1e-4)
        for i, p in enumerate(props):
            accepted = rng.randint(0, len(p.tokens))
            bonus = rng.randrange(4, 8192)
            histories[i].extend(p.tokens[:accepted] + [bonus])
            if rng.random() < 0.8:  # sometimes the engine drops a proposal without a commit
                kept.commit(i, accepted)
    assert kept.num_tracked == 3
    for i in range(3):
        kept.release(i)
    assert kept.num_tracked == 0
    assert kept.model.allocator.num_free == kept.model.allocator.num_blocks


def test_greedy_drafts_follow_the_draft_model(proposer_model: DraftProposer) -> None:
    """With every draft accepted, proposals chain: k=4 at once equals 4 steps of k=1."""
    history = _prompts(3, 1)[0]
    deep = _fresh(proposer_model).propose([ProposalRequest(0, history, 4)])[0].tokens
    stepper = _fresh(proposer_model)
    one_by_one: list[int] = []
    h = list(history)
    for _ in range(4):
        tok = stepper.propose([ProposalRequest(0, h, 1)])[0].tokens
        stepper.commit(0, 1)
        one_by_one += tok
        h += tok
    assert deep == one_by_one


def test_reused_seq_id_with_a_new_history(proposer_model: DraftProposer) -> None:
    a, b = _prompts(5, 2)
    p = _fresh(proposer_model)
    p.propose([ProposalRequest(0, a, 3)])
    again = p.propose_with_logits([ProposalRequest(0, b, 3)])
    fresh = _fresh(proposer_model).propose_with_logits([ProposalRequest(0, b, 3)])
    assert again[0][0].tokens == fresh[0][0].tokens
    torch.testing.assert_close(again[1][0], fresh[1][0], rtol=1e-4, atol=1e-4)


def test_full_cache_and_too_long_histories_propose_nothing(proposer_model: DraftProposer) -> None:
    tiny = draft_proposer(proposer_model.model.model, DraftConfig(
        str(TINY_DRAFT), kv_cache_tokens=64, block_size=16, max_model_len=100))
    out = tiny.propose([ProposalRequest(0, list(range(4, 54)), 4),  # 4 blocks: fits
                        ProposalRequest(1, list(range(4, 30)), 4),  # no blocks left
                        ProposalRequest(2, list(range(4, 104)), 4)])  # longer than max_model_len
    assert [len(p.tokens) for p in out] == [4, 0, 0]
    tiny.release(0)
    assert len(tiny.propose([ProposalRequest(1, list(range(4, 30)), 2)])[0].tokens) == 2


def test_build_from_engine_config() -> None:
    cfg = EngineConfig(spec_method="draft", draft_model="models/tiny-draft", spec_max_depth=4,
                       kv_cache_tokens=2048, draft_min_confidence=0.0)
    proposer = build_draft_proposer(cfg)
    assert proposer.model.config.max_model_len == cfg.max_model_len + 5
    assert proposer.min_confidence == 0.0
    assert len(proposer.propose([ProposalRequest(0, [5, 6, 7], 2)])[0].tokens) == 2
    cut = build_draft_proposer(dataclasses.replace(cfg, draft_min_confidence=0.35))
    assert cut.min_confidence == 0.35
    assert EngineConfig().draft_min_confidence == 0.2  # on by default (bench/RESULTS.md)


def test_config_and_vocab_checks() -> None:
    with pytest.raises(ProposerConfigError):
        DraftConfig(model_dir="")
    with pytest.raises(ProposerConfigError):
        DraftConfig(model_dir="x", kv_cache_tokens=8, block_size=16)
    with pytest.raises(ProposerConfigError, match="vocab"):
        load_draft_proposer(CONFIG, target_vocab=1000)
    with pytest.raises(ProposerConfigError, match="execution"):
        DraftConfig(model_dir="x", execution="compiled")
    with pytest.raises(ProposerConfigError, match="CUDA"):
        DraftConfig(model_dir="x", execution="cuda_graph", device="cpu")
    with pytest.raises(ProposerConfigError, match="max_batch"):
        DraftConfig(model_dir="x", max_batch=0)


def test_sampled_drafts_return_their_distribution(proposer_model: DraftProposer) -> None:
    from polyinfer.sampling import SamplingParams, process_logits
    from specdec.verify import verify

    histories = _prompts(9, 3)
    params = [SamplingParams.seeded(1, 0.8, top_p=0.9), SamplingParams.seeded(2, 1.0, top_k=1),
              SamplingParams(0.0)]
    reqs = [ProposalRequest(i, h, 4, params[i]) for i, h in enumerate(histories)]
    props, logits = _fresh(proposer_model).propose_with_logits(reqs)
    sampled, top1, greedy = props
    assert greedy.probs is None and greedy.tokens == logits[2].argmax(dim=1).tolist()
    assert top1.probs is not None and top1.tokens == logits[1].argmax(dim=1).tolist()
    assert sampled.probs is not None and sampled.probs.shape == (4, 8192)
    torch.testing.assert_close(sampled.probs, process_logits(logits[0], [params[0]] * 4))
    assert all(sampled.probs[j, t] > 0 for j, t in enumerate(sampled.tokens))
    # A target whose distribution equals the draft's accepts every sampled draft (p = q).
    target = torch.cat([logits[0], torch.zeros(1, 8192)])
    result = verify(target, [sampled], [SamplingParams(0.8, top_p=0.9)])[0]
    assert result.num_accepted == 4 and result.tokens[:4] == sampled.tokens


def test_min_confidence_cuts_proposals_at_the_first_unsure_token(
        proposer_model: DraftProposer) -> None:
    """Kept drafts are a prefix of the uncut ones; the cut falls at the first token whose
    draft probability is below the threshold, and the cache stays consistent afterwards."""
    threshold = 0.3
    cut = draft_proposer(proposer_model.model.model,
                         dataclasses.replace(CONFIG, min_confidence=threshold))
    histories = _prompts(11, 6)
    num_cut = 0
    for step in range(4):
        reqs = [ProposalRequest(i, list(h), 6) for i, h in enumerate(histories)]
        full, full_logits = _fresh(proposer_model).propose_with_logits(reqs)
        props = cut.propose(reqs)
        for p, f, lg in zip(props, full, full_logits, strict=True):
            n = len(p.tokens)
            assert p.tokens == f.tokens[:n], step
            conf = torch.softmax(lg, dim=-1).gather(1, torch.tensor(f.tokens).unsqueeze(1))
            assert all(float(c) >= threshold for c in conf[:n])
            if n < len(f.tokens):
                num_cut += 1
                assert float(conf[n]) < threshold
        for i, p in enumerate(props):
            histories[i].extend(p.tokens + [7 + step])  # all accepted, then a bonus token
            cut.commit(i, len(p.tokens))
    assert num_cut > 0  # the threshold did cut some proposals on these prompts
    with pytest.raises(ProposerConfigError, match="min_confidence"):
        DraftConfig(model_dir="x", min_confidence=1.0)


# -- rounds through the row decoder (the forward the CUDA graphs capture) -------------------

ROW_BUCKET_TOKENS = 40  # catch-up rounds above this many rows run eager


class CountingRows(RowDecoder):
    """The graphs' forward run uncaptured, counting the rounds it served."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.rounds = 0

    def run(self, rows: list[DecodeRow]) -> torch.Tensor:  # type: ignore[override]
        self.rounds += 1
        return super().run(rows)


def check_rows_draft_equals_eager() -> None:
    """Run under Triton's interpreter: the same proposals, draft logits and sampled drafts'
    distributions through the row decoder as eager, over accept/reject/skip cycles with
    mixed depths, a greedy, a sampled and a long-prompt sequence (its first catch-up is
    too many rows for a bucket and runs eager)."""
    from polyinfer.sampling import SamplingParams

    model = load_draft_proposer(CONFIG).model.model
    decoder = CountingRows(model, model.new_kv_cache(1, CONFIG.block_size), [1], 16)

    def build(m: object, kv: object) -> RowDecoder:
        nonlocal decoder
        decoder = CountingRows(m, kv, graph_buckets(4, max_tokens=ROW_BUCKET_TOKENS),
                               CONFIG.max_model_len)
        return decoder

    rows = draft_proposer(model, CONFIG, decoder=build)
    eager = draft_proposer(model, CONFIG)
    rng = random.Random(4)
    histories = _prompts(21, 2) + [[rng.randrange(4, 8192) for _ in range(70)]]

    def sampling(i: int, step: int) -> SamplingParams:
        # a fresh generator per call and proposer: both draw the same stream
        return SamplingParams.seeded(100 + step, 0.9, top_p=0.95) if i == 1 else SamplingParams()

    for step in range(6):
        depths = [rng.choice([1, 2, 4]) if step else 3 for _ in histories]
        got, got_logits = rows.propose_with_logits(
            [ProposalRequest(i, list(h), depths[i], sampling(i, step))
             for i, h in enumerate(histories)])
        want, want_logits = eager.propose_with_logits(
            [ProposalRequest(i, list(h), depths[i], sampling(i, step))
             for i, h in enumerate(histories)])
        for g, w, gl, wl in zip(got, want, got_logits, want_logits, strict=True):
            assert g.tokens == w.tokens, (step, g.seq_id)
            torch.testing.assert_close(gl, wl, rtol=1e-3, atol=1e-3)
            assert (g.probs is None) == (w.probs is None) == (g.seq_id != 1)
            if g.probs is not None and w.probs is not None:
                torch.testing.assert_close(g.probs, w.probs, rtol=1e-3, atol=1e-3)
        for i, p in enumerate(got):
            accepted = rng.randint(0, len(p.tokens))
            histories[i].extend(p.tokens[:accepted] + [rng.randrange(4, 8192)])
            if rng.random() < 0.8:
                rows.commit(i, accepted)
                eager.commit(i, accepted)
    assert decoder.rounds >= 6 * 2  # the rounds after the first catch-up ran as rows


def test_rows_draft_equals_eager_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    from tests.engine.drive import run_interpreted

    done = run_interpreted("from tests.engine.test_draft_runner import "
                           "check_rows_draft_equals_eager; "
                           "check_rows_draft_equals_eager()", timeout_s=170)
    assert done.returncode == 0, done.stderr[-3000:]
