"""The search space: engine compiled configs, their constraints, and vector encodings.

A point is one value per knob; every knob is an ordered, finite list of
values, so the space is a grid and the GP works on the unit cube (index /
(len - 1)). ``build`` turns a point into a valid :class:`CompiledConfig` (or
raises SpaceError naming the broken constraint); ``canonical`` folds knobs
that do not matter (no speculation -> depths 0 and default n-gram window)
so that two points meaning the same config share one key on the board.

Constraints beyond what EngineConfig checks itself:
  - the KV cache fits the memory budget (bytes per token from the model shape; one
    cache per engine-core process with data_parallel_size >= 1);
  - the KV cache holds at least one full sequence (max_model_len tokens);
  - one decode step of every sequence with full speculation fits the batch
    budget: max_num_batched_tokens >= max_num_seqs * (1 + spec_max_depth);
  - spec_default_depth <= spec_max_depth, and speculation needs depth >= 1.

Example::

    space = SearchSpace.default(base_config, memory_budget_bytes=2 << 30)
    cfg = space.sample(random.Random(0))
    x = space.encode(cfg)          # np.ndarray in [0, 1]^d
    assert space.key(space.decode(x)) == space.key(cfg)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.errors import SpaceError
from polyinfer.config import (
    FUSED_FORWARD,
    GPU_FORWARD,
    CompiledConfig,
    ConfigError,
    EngineConfig,
    ForwardConfig,
)
from polyinfer.trace import STATUS_OK, TraceRecord

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the constraints and the cost model need to know about a checkpoint."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool = True

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SpaceError(f"{path}: cannot read the model's config.json ({e})") from e
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden,
                   intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
                   num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   vocab_size=int(cfg["vocab_size"]),
                   tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    def params_per_layer(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return attn + mlp

    def num_params(self, num_layers: int | None = None) -> int:
        layers = self.num_layers if num_layers is None else num_layers
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return layers * self.params_per_layer() + emb

    def kv_bytes_per_token(self, dtype: str, num_layers: int | None = None) -> int:
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * layers * self.num_kv_heads * self.head_dim * _DTYPE_BYTES.get(dtype, 4)


@dataclass(frozen=True)
class Knob:
    name: str  # an EngineConfig field
    values: tuple[Any, ...]  # ordered: neighbours are adjacent

    def __post_init__(self) -> None:
        if self.name not in {f.name for f in dataclasses.fields(EngineConfig)}:
            raise SpaceError(f"knob {self.name!r} is not an EngineConfig field")
        if not self.values:
            raise SpaceError(f"knob {self.name!r} has no values")


def thread_counts(num_cpus: int | None = None) -> tuple[int, ...]:
    """0 (the engine's auto choice) then powers of two up to the machine's cores."""
    cpus = max(1, num_cpus or os.cpu_count() or 1)
    return (0, *(1 << i for i in range(cpus.bit_length()) if 1 << i <= cpus))


def resolved_threads(e: EngineConfig, num_cpus: int | None = None) -> int:
    """The step-loop threads the engine runs with: ``num_threads`` 0 (auto) resolved.

    NOTE: auto is half the cores (at least 1) in the HTTP process, 1 per engine-core
    process with data_parallel_size >= 1 (engine.core, engine.core_proc): on a 2-core
    box 0 and 1 are one engine, measured once.
    """
    if e.num_threads:
        return e.num_threads
    if e.data_parallel_size >= 1:
        return 1
    cpus = num_cpus or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                        else os.cpu_count() or 2)
    return max(1, cpus // 2)


def dp_sizes(num_cpus: int | None = None) -> tuple[int, ...]:
    """0 (the step loop in the HTTP process) then 2, 4, ... engine-core processes up to the cores."""
    cpus = max(1, num_cpus or os.cpu_count() or 1)
    return (0, *(1 << i for i in range(1, cpus.bit_length()) if 1 << i <= cpus))


DEFAULT_KNOBS: tuple[Knob, ...] = (
    Knob("max_num_seqs", (1, 2, 4, 8, 16, 32)),
    Knob("max_num_batched_tokens", (64, 128, 256, 512, 1024, 2048)),
    Knob("kv_cache_tokens", (4096, 8192, 16384, 32768)),
    Knob("spec_method", ("none", "ngram", "draft")),
    Knob("spec_max_depth", (0, 1, 2, 3, 4, 6, 8)),
    Knob("spec_default_depth", (0, 1, 2, 3, 4, 6, 8)),
    Knob("ngram_max", (2, 3, 4, 5)),
    # NOTE: at low load one request's step is too small to keep many threads
    # busy, at high load batches are; which wins depends on the machine.
    Knob("num_threads", thread_counts()),
    # NOTE: restart-only (polyinfer.config.RESTART_FIELDS): measured on an engine of its
    # own (optimizer.pool), the cold start priced into the search budget, promoted by
    # blue-green; dropped from the space when the measurement engine is not ours.
    Knob("data_parallel_size", dp_sizes()),
)
# NOTE: `execution` and `attention` are left out: the CPU engine runs one path
# whatever they say, so searching them would only spend measurements on noise.
# Add them (Knob("execution", ("eager", "compiled", "cuda_graph"))) on a GPU engine.

# A GPU engine (execution "cuda_graph") also searches its code: the forward-pass variants
# (engine.forward, each checked against the torch reference before it serves), ordered
# from the torch ops to every fused kernel and the skinny projections.
# Then the same kernels launched dependently (engine.forward.pdl) with RoPE and the K/V
# write inside decode attention (.fused_rope_attention), then also with decode attention
# split over each row's context (.split_attention: 1.49x at batch 1 over a 1,500-token
# context on the H200, a merge kernel more at short ones), then split without the RoPE
# inside; then that set with each layer's o weight asked into L2 while attention runs
# (.l2_prefetch: ~1% of a batch-1 step on the H200); last, that one with prompt chunks
# attending by tiles of rows (.prefill_attention; not yet measured on a device).
FORWARD_KNOB = Knob("forward", (ForwardConfig(), FUSED_FORWARD, GPU_FORWARD,
                                dataclasses.replace(GPU_FORWARD, pdl=True,
                                                    fused_rope_attention=True),
                                dataclasses.replace(GPU_FORWARD, pdl=True,
                                                    fused_rope_attention=True,
                                                    split_attention=True),
                                dataclasses.replace(GPU_FORWARD, pdl=True,
                                                    split_attention=True),
                                dataclasses.replace(GPU_FORWARD, pdl=True,
                                                    fused_rope_attention=True,
                                                    split_attention=True, l2_prefetch=True),
                                dataclasses.replace(GPU_FORWARD, pdl=True,
                                                    fused_rope_attention=True,
                                                    split_attention=True, l2_prefetch=True,
                                                    prefill_attention=True)))


def decode_rows_share(records: Sequence[TraceRecord], max_num_seqs: int) -> dict[int, float]:
    """The share of time ``n`` requests decoded together (``n`` capped at ``max_num_seqs``),
    from each served request's decode interval ``[ts + ttft_s, ts + e2e_s]``: the rows of a
    decode step, and how often a step has them, at the traffic's load."""
    events: list[tuple[float, int]] = []
    for r in records:
        if r.status != STATUS_OK or r.e2e_s is None:
            continue
        start, end = r.ts + (r.ttft_s or 0.0), r.ts + r.e2e_s
        if end > start:
            events += [(start, 1), (end, -1)]
    events.sort()
    spent: dict[int, float] = {}
    running, last = 0, 0.0
    for t, change in events:
        if running > 0 and t > last:
            n = min(running, max_num_seqs)
            spent[n] = spent.get(n, 0.0) + t - last
        running, last = running + change, t
    total = sum(spent.values())
    return {n: s / total for n, s in sorted(spent.items())} if total > 0 else {}


def graph_ladder(top: int) -> list[int]:
    """Row counts a graph may be captured at: 1, 2, 4, then multiples of 8, then ``top``
    (the engine's default ladder, engine.cuda_graph.decode_buckets)."""
    sizes = [b for b in (1, 2, 4) if b < top] + list(range(8, top, 8))
    return sizes + [top]


def graph_sizes_for(rows_share: Mapping[int, float], top: int,
                    min_share: float = 0.01) -> tuple[int, ...]:
    """``engine.graph_sizes`` for a traffic whose decode steps have ``n`` rows a share
    ``rows_share[n]`` of the time: the ladder's sizes (:func:`graph_ladder` up to ``top``)
    that at least ``min_share`` of the steps would run in, and the one holding the most
    rows seen, so that no decode step runs eager; () (the default ladder) without data.

    NOTE: a step runs in the smallest graph that holds it, padded; at decode batch sizes
    a replay costs about the same for a few rows more (the weights dominate), so a size
    the traffic rarely needs is a capture (time, memory) that buys little.
    """
    if not rows_share:
        return ()
    ladder = graph_ladder(max(top, max(rows_share)))
    used: dict[int, float] = {}
    for n, share in rows_share.items():
        size = next(b for b in ladder if b >= n)
        used[size] = used.get(size, 0.0) + share
    largest = next(b for b in ladder if b >= max(rows_share))
    return tuple(sorted({b for b, share in used.items() if share >= min_share} | {largest}))


def graph_sizes_knob(records: Sequence[TraceRecord], max_num_seqs: int,
                     min_shares: Sequence[float] = (0.05, 0.01)) -> Knob:
    """``engine.graph_sizes`` values for the search, from the traces' decode batch sizes:
    the fewest graphs first (sizes for ``min_shares`` in turn), then the default ladder."""
    return graph_sizes_knob_for(decode_rows_share(records, max_num_seqs), max_num_seqs,
                                min_shares)


def graph_sizes_knob_for(share: Mapping[int, float], max_num_seqs: int,
                         min_shares: Sequence[float] = (0.05, 0.01)) -> Knob:
    """:func:`graph_sizes_knob` from a share of decode steps per row count (measured, e.g.,
    on an engine's own steps rather than read from traces)."""
    values = [graph_sizes_for(share, max_num_seqs, m) for m in min_shares]
    return Knob("graph_sizes", (*dict.fromkeys(v for v in values if v), ()))


@dataclass(frozen=True)
class SearchSpace:
    base: CompiledConfig  # knobs not in the space keep the base's values
    knobs: tuple[Knob, ...]
    shape: ModelShape
    memory_budget_bytes: int  # for the KV cache
    draft_model: str = ""  # path used when spec_method == "draft"

    def __post_init__(self) -> None:
        names = [k.name for k in self.knobs]
        if len(set(names)) != len(names):
            raise SpaceError(f"duplicate knobs in {names}")
        if self.memory_budget_bytes <= 0:
            raise SpaceError(f"memory_budget_bytes: expected > 0, got {self.memory_budget_bytes}")

    @classmethod
    def default(cls, base: CompiledConfig, memory_budget_bytes: int = 1 << 30,
                knobs: Sequence[Knob] = DEFAULT_KNOBS, draft_model: str = "") -> SearchSpace:
        if not draft_model:
            knobs = tuple(Knob(k.name, tuple(v for v in k.values if v != "draft"))
                          if k.name == "spec_method" else k for k in knobs)
        return cls(base, tuple(knobs), ModelShape.from_model_dir(base.model), memory_budget_bytes,
                   draft_model)

    @property
    def dim(self) -> int:
        return len(self.knobs)

    def point_of(self, config: CompiledConfig) -> dict[str, Any]:
        return {k.name: getattr(config.engine, k.name) for k in self.knobs}

    def build(self, point: Mapping[str, Any]) -> CompiledConfig:
        """A point (values for some or all knobs) -> a valid, canonical config."""
        changes = dict(point)
        if changes.get("spec_method", self.base.engine.spec_method) == "draft":
            changes.setdefault("draft_model", self.draft_model)
        try:
            cfg = self.base.with_engine(**changes)
        except ConfigError as e:
            raise SpaceError(str(e)) from e
        except TypeError as e:
            raise SpaceError(f"unknown knob in {sorted(changes)}") from e
        cfg = self.canonical(cfg)
        self.check(cfg)
        return cfg

    def canonical(self, cfg: CompiledConfig) -> CompiledConfig:
        cfg = cfg.with_engine(num_threads=resolved_threads(cfg.engine))
        e = cfg.engine
        if e.spec_method == "none":
            base = self.base.engine
            return cfg.with_engine(spec_max_depth=0, spec_default_depth=0, ngram_min=base.ngram_min,
                                   ngram_max=max(base.ngram_min, base.ngram_max), draft_model="")
        if e.spec_method == "draft":
            return cfg.with_engine(ngram_min=self.base.engine.ngram_min,
                                   ngram_max=max(self.base.engine.ngram_min,
                                                 self.base.engine.ngram_max))
        return cfg.with_engine(draft_model="")

    def violations(self, cfg: CompiledConfig) -> list[str]:
        e = cfg.engine
        out = []
        # NOTE: each engine-core process (data_parallel_size) holds a KV cache of its own
        kv_bytes = (max(1, e.data_parallel_size) * e.kv_cache_tokens
                    * self.shape.kv_bytes_per_token(e.dtype))
        if kv_bytes > self.memory_budget_bytes:
            out.append(f"KV cache {kv_bytes} B exceeds the memory budget "
                       f"{self.memory_budget_bytes} B")
        if e.kv_cache_tokens < e.max_model_len:
            out.append(f"KV cache {e.kv_cache_tokens} tokens < max_model_len {e.max_model_len}")
        if e.max_num_batched_tokens < e.max_num_seqs * (1 + e.spec_max_depth):
            out.append(f"max_num_batched_tokens {e.max_num_batched_tokens} < max_num_seqs x "
                       f"(1 + spec_max_depth) = {e.max_num_seqs * (1 + e.spec_max_depth)}")
        if e.spec_method != "none" and e.spec_max_depth < 1:
            out.append(f"spec_method {e.spec_method!r} needs spec_max_depth >= 1")
        if e.spec_method != "none" and e.spec_default_depth < 1:
            out.append(f"spec_method {e.spec_method!r} needs spec_default_depth >= 1")
        if e.ngram_max < e.ngram_min:
            out.append(f"ngram_max {e.ngram_max} < ngram_min {e.ngram_min}")
        return out

    def check(self, cfg: CompiledConfig) -> None:
        problems = self.violations(cfg)
        if problems:
            raise SpaceError("; ".join(problems))

    def is_valid(self, cfg: CompiledConfig) -> bool:
        return not self.violations(cfg)

    def key(self, cfg: CompiledConfig) -> str:
        """Canonical JSON of the knob values: equal keys = the same candidate."""
        return json.dumps(self.point_of(self.canonical(cfg)), sort_keys=True,
                          default=dataclasses.asdict)

    def from_key(self, key: str) -> CompiledConfig:
        point = json.loads(key)
        if isinstance(point.get("forward"), dict):  # a ForwardConfig, written as its fields
            point["forward"] = ForwardConfig(**point["forward"])
        if isinstance(point.get("graph_sizes"), list):  # JSON has no tuples
            point["graph_sizes"] = tuple(point["graph_sizes"])
        return self.build(point)

    # -- encodings ----------------------------------------------------------

    def encode(self, cfg: CompiledConfig) -> np.ndarray:
        point = self.point_of(cfg)
        return np.array([_index(k, point[k.name]) / max(1, len(k.values) - 1) for k in self.knobs],
                        dtype=np.float64)

    def decode(self, x: Sequence[float] | np.ndarray) -> CompiledConfig:
        """Nearest grid point; raises SpaceError when it breaks a constraint."""
        if len(x) != self.dim:
            raise SpaceError(f"expected a vector of {self.dim}, got {len(x)}")
        point = {}
        for k, v in zip(self.knobs, x, strict=True):
            i = int(round(float(np.clip(v, 0.0, 1.0)) * (len(k.values) - 1)))
            point[k.name] = k.values[i]
        return self.build(point)

    # -- enumeration --------------------------------------------------------

    def grid(self) -> Iterator[CompiledConfig]:
        """Every valid config once (canonical duplicates dropped)."""
        seen: set[str] = set()
        tried: set[tuple[Any, ...]] = set()
        names = [k.name for k in self.knobs]
        for values in itertools.product(*(k.values for k in self.knobs)):
            point = self._fold(dict(zip(names, values, strict=True)))
            if point is None or (sig := tuple(point.values())) in tried:
                continue
            tried.add(sig)
            cfg = self.try_build(point)
            if cfg is not None and (key := self.key(cfg)) not in seen:
                seen.add(key)
                yield cfg

    def _fold(self, point: dict[str, Any]) -> dict[str, Any] | None:
        """Cheap pre-canonicalisation for enumeration; None when obviously invalid."""
        method = point.get("spec_method", self.base.engine.spec_method)
        if method == "none":
            for name in ("spec_max_depth", "spec_default_depth"):
                if name in point:
                    point[name] = 0
            if "ngram_max" in point:
                point["ngram_max"] = self.base.engine.ngram_max
            return point
        if point.get("spec_default_depth", 1) > point.get("spec_max_depth", 16):
            return None
        if method == "draft" and "ngram_max" in point:
            point["ngram_max"] = self.base.engine.ngram_max
        return point

    def try_build(self, point: Mapping[str, Any]) -> CompiledConfig | None:
        try:
            return self.build(point)
        except SpaceError:
            return None

    def sample(self, rng: random.Random, max_tries: int = 1000) -> CompiledConfig:
        for _ in range(max_tries):
            cfg = self.try_build({k.name: rng.choice(k.values) for k in self.knobs})
            if cfg is not None:
                return cfg
        raise SpaceError(f"no valid config in {max_tries} random draws; is the space empty?")

    def neighbors(self, cfg: CompiledConfig) -> list[CompiledConfig]:
        """Valid configs one step away on one knob (two knobs for coupled depth moves)."""
        point = self.point_of(cfg)
        out: dict[str, CompiledConfig] = {}
        for k in self.knobs:
            i = _index(k, point[k.name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(k.values):
                    moved = {**point, k.name: k.values[j]}
                    for cand in (moved, _fix_depths(moved)):
                        built = self.try_build(cand)
                        if built is not None:
                            out.setdefault(self.key(built), built)
        out.pop(self.key(cfg), None)
        return list(out.values())

    def repair(self, point: Mapping[str, Any]) -> CompiledConfig | None:
        """Make a point valid by the smallest obvious fixes (depths, batch budget), or None."""
        fixed = _fix_depths(dict(point))
        cfg = self.try_build(fixed)
        if cfg is not None:
            return cfg
        tokens = next((k for k in self.knobs if k.name == "max_num_batched_tokens"), None)
        if tokens is None:
            return None
        for v in tokens.values:
            cfg = self.try_build({**fixed, "max_num_batched_tokens": v})
            if cfg is not None and v >= fixed.get("max_num_batched_tokens", 0):
                return cfg
        return None


def _fix_depths(point: dict[str, Any]) -> dict[str, Any]:
    out = dict(point)
    if out.get("spec_method", "none") != "none":
        if "spec_max_depth" in out:
            out["spec_max_depth"] = max(1, out["spec_max_depth"])
        if "spec_default_depth" in out:
            out["spec_default_depth"] = max(1, min(out["spec_default_depth"],
                                                   out.get("spec_max_depth", 16)))
    return out


def _index(knob: Knob, value: Any) -> int:
    try:
        return knob.values.index(value)
    except ValueError:
        # NOTE: a value off the grid (e.g. a hand-written incumbent) maps to the nearest one.
        if isinstance(value, (int, float)) and all(isinstance(v, (int, float)) for v in knob.values):
            return int(np.argmin([abs(float(v) - float(value)) for v in knob.values]))
        raise SpaceError(f"{knob.name}={value!r} is not one of {knob.values}") from None
