"""A request inside the engine: its parameters, tokens, cache blocks and decoding state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.grammar import GrammarSpec
from polyinfer.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (raw logits, as vLLM's default
    ``logprobs_mode``), with the most likely alternatives when asked for."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class GenerationParams:
    """Everything about a request that is not its prompt; validated by ``engine.protocol``."""

    max_tokens: int  # tokens to generate at most
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings, trimmed from the output
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the request
    ignore_eos: bool = False
    spec_depth: int = 0  # speculative tokens per step, already capped by the config
    include_stop_str_in_output: bool = False
    # the request's TPOT SLO, seconds: prompt chunks beside it are paced to keep it
    # (engine.pacing); None = not protected
    slo_tpot_s: float | None = None
    slo_ttft_s: float | None = None  # its TTFT SLO, seconds: the least pace of its prompt
    logprobs: int | None = None  # None: none; else each token's, and this many alternatives
    grammar: GrammarSpec | None = None  # structured output (engine.grammar); None = free text


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's mutable state; owned by the engine core's thread."""

    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    params: GenerationParams
    arrival_s: float  # time.monotonic() at arrival
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    draft_tokens: list[int] = field(default_factory=list)  # this step's proposal
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_draft_tokens: int = 0  # speculative tokens proposed so far
    num_accepted_tokens: int = 0  # of which accepted
    num_preemptions: int = 0
    # prefix caching (engine.kv_cache): chain hashes of the full blocks of token_ids
    # hashed so far, and how many leading blocks of block_table are in the cache
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None  # prompt tokens found cached at first admission
    first_token_s: float | None = None  # time.monotonic() when its first output token came
    num_decode_steps: int = 0  # steps since then that produced tokens (engine.pacing)
    # the xgrammar matcher of params.grammar, advanced by each appended token (engine.core)
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefilling(self) -> bool:
        """True until every known token (prompt, or history after preemption) is cached."""
        return self.num_computed < self.num_tokens - 1
