"""SLO pacing of chunked prefill: how many prompt tokens a step may take beside decodes
that carry a TPOT SLO.

Chunked prefill lets a long prompt share every step with the running decodes, and on the
CPU a prompt chunk dominates the step: one core of the bundled tiny model decodes three
sequences at depth 4 in ~6 ms, and the same step with a 256-token chunk takes 70-145 ms
(more as the chunk's context grows). A 2,000-token prompt adds ~0.8 s to every decode
beside it, more than a tight TPOT SLO allows a whole 200-token answer. Spreading the chunk
thinner does not help a request whose SLO is its mean TPOT (the same prefill seconds land
in its life either way); what helps is letting the prompt take only what the decodes can
spare, and the rest once they end. The request names its SLO (``slo_tpot_s``; the proxy
forwards its routing config's with ``routing.forward_slos``); requests without one are not
protected.

Each decoding sequence with a TPOT SLO has a target ``s = SLO_TARGET x SLO`` (the margin
covers what the engine does not see: the network, the client, the steps to come) and a
*bank*: ``s x (tokens after its first) - (seconds since its first token)``, how far its mean
TPOT is ahead of the target. Its next step may take ``s x g + BANK_SPEND x bank`` seconds,
``g`` its tokens per step so far (more than one under speculation); behind its target the
bank is negative and the allowance shrinks. The step's allowance is the least over those
sequences, minus what its decode rows cost; :class:`StepCostModel`, fitted on this engine's
own steps, turns the rest into prompt tokens. A sequence that cannot get back to its target
even at ``max_tokens`` (with decode-only steps) is not protected: holding prompts back would
save nothing.

A prompt whose request names a TTFT SLO (``slo_ttft_s``) gets at least what it needs to
finish by ``SLO_TARGET`` of it, were every step to come like this one: while the decodes run
it waits, then goes just in time. Any other prompt (no TTFT SLO, or one it cannot meet even
at full speed) shares a floor of ``MIN_CHUNK`` tokens a step: slowed, never starved.

NOTE: no pacing until the cost model has seen ``MIN_FIT_STEPS`` steps with prompt tokens and
as many with decodes: an unfitted model would either starve prompts or protect nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from engine.sequence import Sequence

SLO_TARGET = 0.8  # of the TPOT SLO, the mean TPOT pacing aims at
BANK_SPEND = 0.5  # of a sequence's bank one step may spend
MIN_CHUNK = 16  # prompt tokens a paced step always grants (one KV block at the default size)
MIN_FIT_STEPS = 8  # steps with prompt tokens, and with decodes, before anything is paced
CONTEXT_UNIT = 1024.0  # tokens: the unit of the context terms, to keep the fit well scaled
NUM_TERMS = 6


def step_terms(num_decodes: int, decode_rows: int, decode_context: int,
               prefill_chunks: Iterable[tuple[int, int]]) -> np.ndarray:
    """[1, decoding sequences, decode rows (drafts included), their context / unit, prompt
    tokens, prompt tokens x their mean context / unit], ``prefill_chunks`` as (start, tokens):
    a chunk's attention grows with the context it reads as well as with its tokens."""
    tokens = attention = 0.0
    for start, num in prefill_chunks:
        tokens += num
        attention += num * (start + num / 2) / CONTEXT_UNIT
    return np.array([1.0, num_decodes, decode_rows, decode_context / CONTEXT_UNIT, tokens,
                     attention])


class StepCostModel:
    """Seconds of one engine step from :func:`step_terms`: least squares over this engine's
    steps, older ones forgotten by ``decay`` per step (a reload or a busier host shifts
    costs), a small ridge (relative to each term's own scale) keeping terms the recent steps do
    not vary at their prior of 0."""

    def __init__(self, decay: float = 0.998, ridge: float = 1e-6) -> None:
        self.decay = decay
        self.ridge = ridge
        self._xtx = np.zeros((NUM_TERMS, NUM_TERMS))
        self._xty = np.zeros(NUM_TERMS)
        self._coef: np.ndarray | None = None
        self.num_prefill_steps = 0  # steps seen with prompt tokens
        self.num_decode_steps = 0  # steps seen with decoding sequences

    def observe(self, terms: np.ndarray, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        self._xtx *= self.decay
        self._xty *= self.decay
        self._xtx += np.outer(terms, terms)
        self._xty += terms * seconds
        self._coef = None
        if terms[4] > 0:
            self.num_prefill_steps += 1
        if terms[1] > 0:
            self.num_decode_steps += 1

    @property
    def ready(self) -> bool:
        return min(self.num_prefill_steps, self.num_decode_steps) >= MIN_FIT_STEPS

    @property
    def coef(self) -> np.ndarray:
        if self._coef is None:
            a = self._xtx + np.diag(self.ridge * np.diag(self._xtx) + 1e-9)
            self._coef = np.linalg.solve(a, self._xty)
        return self._coef

    def predict(self, terms: np.ndarray) -> float:
        return float(terms @ self.coef)

    def prefill_cost(self, start: int, num: int) -> float:
        """Seconds ``num`` prompt tokens from position ``start`` add to a step."""
        c = self.coef
        per_token = max(float(c[4]), 0.0)
        per_context = max(float(c[5]), 0.0)
        return num * per_token + per_context * num * (start + num / 2) / CONTEXT_UNIT

    def prefill_tokens(self, start: int, seconds: float) -> int:
        """The most prompt tokens from ``start`` whose cost fits in ``seconds``."""
        if seconds <= 0:
            return 0
        c = self.coef
        a = max(float(c[5]), 0.0) / (2 * CONTEXT_UNIT)  # a x n^2 + b x n = seconds
        b = max(float(c[4]), 0.0) + max(float(c[5]), 0.0) * start / CONTEXT_UNIT
        if a <= 0 and b <= 0:
            return 1 << 30  # prompt tokens cost nothing measurable
        n = seconds / b if a <= 0 else (-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)
        return int(n)


@dataclass
class PrefillBudget:
    """Prompt tokens one step may still take: seconds left, the floor not yet granted."""

    model: StepCostModel
    seconds: float  # what the decodes' SLOs leave for prompt chunks
    base: float  # the step's predicted seconds without them
    now: float
    floor: int = MIN_CHUNK
    paced: bool = False  # some chunk got less than it asked for

    def take(self, seq: Sequence, start: int, want: int) -> int:
        """Grant up to ``want`` tokens of ``seq``'s chunk starting at ``start``."""
        need = self._ttft_need(seq, start)
        n = min(want, self.model.prefill_tokens(start, self.seconds))
        if need is not None:
            n = max(n, min(want, need))
        else:
            n = max(n, min(want, self.floor))
            self.floor = max(self.floor - n, 0)
        self.seconds -= self.model.prefill_cost(start, n)
        if n < want:
            self.paced = True
        return n

    def _ttft_need(self, seq: Sequence, start: int) -> int | None:
        """Tokens a step must give ``seq``'s prompt to finish by its TTFT target, were every
        step to come like this one: ``r x base / c + cost(r) <= seconds left``. None (the
        step's shared floor instead) when it names no TTFT SLO or cannot make it even at full
        speed."""
        slo = seq.params.slo_ttft_s
        left_tokens = seq.num_prompt_tokens - start
        if slo is None or seq.first_token_s is not None or left_tokens <= 0:
            return None
        spare = seq.arrival_s + SLO_TARGET * slo - self.now \
            - self.model.prefill_cost(start, left_tokens)
        if spare <= 0:
            return None
        return math.ceil(left_tokens * max(self.base, 0.0) / spare)


class PrefillPacer:
    """Builds each step's :class:`PrefillBudget` from the decoding sequences' TPOT SLOs."""

    def __init__(self, model: StepCostModel | None = None) -> None:
        self.model = model or StepCostModel()
        # NOTE: set by the first request that names an SLO; until then the engine feeds the
        # cost model nothing (~10 us a step, ~1% of a GPU decode step at batch 1)
        self.engaged = model is not None

    def budget(self, decoding: list[tuple[Sequence, int]], now: float) -> PrefillBudget | None:
        """``decoding``: (sequence, rows this step) of every decoding sequence; None: no limit."""
        if not self.model.ready:
            return None
        num_rows = sum(rows for _, rows in decoding)
        context = sum(seq.num_tokens for seq, _ in decoding)
        base = self.model.predict(step_terms(len(decoding), num_rows, context, ()))
        allowance = min((self._allowance(seq, base, now) for seq, _ in decoding),
                        default=math.inf)
        if allowance == math.inf:
            return None
        return PrefillBudget(self.model, allowance - base, base, now)

    def _allowance(self, seq: Sequence, base: float, now: float) -> float:
        if seq.params.slo_tpot_s is None or seq.first_token_s is None:
            return math.inf
        slo = SLO_TARGET * seq.params.slo_tpot_s
        after_first = seq.num_output_tokens - 1
        per_step = after_first / seq.num_decode_steps if seq.num_decode_steps else 1.0
        per_step = max(per_step, 1.0)
        bank = slo * after_first - (now - seq.first_token_s)
        if bank < 0:
            # Hopeless: even decode-only steps to max_tokens would not bring it back.
            left = seq.params.max_tokens - seq.num_output_tokens
            if bank + left * (slo - base / per_step) < 0:
                return math.inf
        return slo * per_step + BANK_SPEND * bank
