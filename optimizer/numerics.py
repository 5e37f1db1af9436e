"""A stated bound on logit error, for candidates that legitimately change floating point.

Another dtype, attention kernel, execution mode or forward-pass variant gives
the same model different rounding, so its text may differ from the
incumbent's where two tokens nearly tie: token-for-token comparison would
reject a correct kernel, and accepting any text would pass a wrong one. Such a
candidate is held to a bound on its log-probabilities instead. Each greedy
request of the verification plan is answered alone by the incumbent and by the
candidate, with the top ``top_k`` log-probabilities of every position; while
their tokens agree (the two saw the same context):

- every token in both top-k lists obeys
  ``|logp_cand - logp_inc| <= atol + rtol * |logp_inc|`` (nats; ``allclose``'s
  form: the error may scale with the value, on top of a floor);
- at the first position where the greedy tokens differ, the divergence is
  allowed only if it could come from errors within that bound: the
  incumbent's top-2 margin there is at most twice its top-2 token's bound
  (each of the two logprobs may move by its bound), and the candidate's token
  is the incumbent's runner-up. Later positions of that request saw different
  contexts and are not compared.

At least ``min_positions`` of the planned positions must have been compared,
or the check did not run and fails. The default bound (0.1 nats + 5%) is set
by what bfloat16 does to the bundled model (max 0.12 nats over its top-5 in
116 positions, one divergence at a 0.01-nat margin; float16 0.03; the naive
attention kernel 1e-5): 'bfloat16 on this model' is the loosest change it
admits.

Example::

    report = await check_logit_bound(engine, incumbent, candidate, plan, LogitBound())
    report.ok, report.max_excess, report.reason
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from optimizer.errors import MeasurementError
from optimizer.measure import EngineClient
from polyinfer.config import CompiledConfig

if TYPE_CHECKING:
    from optimizer.verify import VerifyRequest

# the engine fields whose change legitimately moves floating-point results
NUMERIC_FIELDS = ("dtype", "attention", "execution", "forward")


def changes_numerics(a: CompiledConfig, b: CompiledConfig) -> bool:
    return any(getattr(a.engine, f) != getattr(b.engine, f) for f in NUMERIC_FIELDS)


@dataclass(frozen=True)
class LogitBound:
    atol: float = 0.1  # nats
    rtol: float = 0.05  # of |logp| of the incumbent's token
    top_k: int = 5  # log-probabilities compared per position (the engine allows <= 20)
    max_tokens: int = 16  # positions asked per request
    min_positions: float = 0.5  # share of the planned positions that must be compared

    def __post_init__(self) -> None:
        if not (self.atol >= 0 and self.rtol >= 0 and 2 <= self.top_k <= 20
                and self.max_tokens >= 1 and 0 < self.min_positions <= 1):
            raise ValueError(f"logit bound: inconsistent {self}")

    def tolerance(self, logprob: float) -> float:
        return self.atol + self.rtol * abs(logprob)


@dataclass(frozen=True)
class Position:
    token: str
    top: dict[str, float]  # token -> logprob, the top_k of this position


@dataclass(frozen=True)
class LogitReport:
    ok: bool
    num_positions: int  # compared
    num_planned: int
    max_abs_diff: float  # nats, over every compared logprob
    max_excess: float  # largest |diff| / its tolerance (<= 1 inside the bound)
    num_divergences: int  # requests whose greedy text split (each within the margin rule)
    bad: tuple[int, ...]  # plan indices beyond the bound
    reason: str = ""
    details: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in dataclasses.asdict(self).items() if k != "details"},
                "max_abs_diff": round(self.max_abs_diff, 6),
                "max_excess": round(self.max_excess, 4), "details": self.details}


async def positions(engine: EngineClient, r: VerifyRequest, bound: LogitBound) -> list[Position]:
    """One greedy request alone, with the top-k logprobs of each generated position."""
    body = {**r.body(engine.model), "max_tokens": min(r.max_tokens, bound.max_tokens),
            "logprobs": bound.top_k}
    async with engine.session.post(engine.base_url + "/v1/completions", json=body) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise MeasurementError(f"completion failed (HTTP {resp.status}): {text[:300]}")
    lp = orjson.loads(text)["choices"][0]["logprobs"]
    return [Position(t, {k: float(v) for k, v in top.items()})
            for t, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)]


@dataclass(frozen=True)
class Compared:
    num_positions: int
    max_abs_diff: float  # nats
    max_excess: float  # max |diff| / tolerance
    diverged: bool  # the greedy texts split (within the rule when ``why`` is "")
    why: str = ""  # beyond the bound: where and how


def compare(ref: Sequence[Position], cand: Sequence[Position], bound: LogitBound) -> Compared:
    """One request's positions, incumbent against candidate, up to their first divergence."""
    worst_abs, worst_excess = 0.0, 0.0
    for i, (r, c) in enumerate(zip(ref, cand, strict=False)):
        for tok in set(r.top) & set(c.top):
            diff = abs(c.top[tok] - r.top[tok])
            worst_abs = max(worst_abs, diff)
            worst_excess = max(worst_excess, diff / max(bound.tolerance(r.top[tok]), 1e-12))
        if worst_excess > 1.0:
            return Compared(i + 1, worst_abs, worst_excess, r.token != c.token,
                            f"position {i}: logprob differs by {worst_abs:.4f} nats, "
                            f"{worst_excess:.1f}x the bound")
        if r.token != c.token:
            ranked = sorted(r.top.items(), key=lambda kv: kv[1], reverse=True)
            (_, lp1), (second, lp2) = ranked[0], ranked[1]
            margin = lp1 - lp2
            allowed = 2 * bound.tolerance(lp2)
            if c.token != second or margin > allowed:
                return Compared(
                    i + 1, worst_abs, max(worst_excess, margin / max(allowed, 1e-12)), True,
                    f"position {i}: greedy token {c.token!r} instead of {r.token!r}, where the "
                    f"incumbent's top-2 margin is {margin:.4f} nats (allowed {allowed:.4f}, "
                    f"and only to its runner-up {second!r})")
            return Compared(i + 1, worst_abs, worst_excess, True)
    return Compared(min(len(ref), len(cand)), worst_abs, worst_excess, False)


async def check_logit_bound(engine: EngineClient, incumbent: CompiledConfig,
                            candidate: CompiledConfig, plan: Sequence[VerifyRequest],
                            bound: LogitBound = LogitBound()) -> LogitReport:
    """The plan's greedy requests alone on the incumbent, then on the candidate, compared.

    Leaves ``engine`` serving the candidate.
    """
    greedy = [(i, r) for i, r in enumerate(plan) if r.seed is None and r.temperature == 0]
    await engine.reload(incumbent.with_engine(measure_num_layers=None))
    refs = [await positions(engine, r, bound) for _, r in greedy]
    await engine.reload(candidate.with_engine(measure_num_layers=None))
    cands = [await positions(engine, r, bound) for _, r in greedy]
    planned = sum(len(p) for p in refs)
    compared, worst_abs, worst_excess, divergences = 0, 0.0, 0.0, 0
    bad: list[int] = []
    details: dict[str, str] = {}
    for (i, _), ref, cand in zip(greedy, refs, cands, strict=True):
        c = compare(ref, cand, bound)
        compared += c.num_positions
        worst_abs, worst_excess = max(worst_abs, c.max_abs_diff), max(worst_excess, c.max_excess)
        divergences += c.diverged and not c.why
        if c.why:
            bad.append(i)
            if len(details) < 3:
                details[str(i)] = c.why
    reason = ""
    if bad:
        reason = (f"logits: {len(bad)} request(s) beyond the bound (|dlogp| <= {bound.atol} + "
                  f"{bound.rtol}|logp|; max {worst_abs:.4f} nats, {worst_excess:.1f}x)")
    elif planned == 0 or compared < bound.min_positions * planned:
        reason = (f"logits: {compared} of {planned} positions compared (the greedy texts split "
                  "too early): the check did not run")
    return LogitReport(not reason, compared, planned, worst_abs, worst_excess, divergences,
                       tuple(bad), reason, details)
