"""The compiled config: one per worker, the contract between engine, proxy and optimizer.

A compiled config names a backend and the knobs that backend understands. It is
read from YAML or JSON (a file, an HTTP body, a board entry), validated once in
``__post_init__``, and never mutated: the optimizer makes new ones with
``dataclasses.replace`` / :meth:`CompiledConfig.with_engine`.

Example (YAML)::

    backend: engine
    model: models/tiny-target
    engine:
      max_num_seqs: 16
      max_num_batched_tokens: 1024
      kv_cache_tokens: 16384
      spec_method: ngram
      spec_max_depth: 4
      enable_prefix_caching: true   # vLLM's default: reuse K/V of shared prompt prefixes
    fit:
      domains: [code, extraction]
      prompt_tokens: [0, 512]
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

DOMAINS = ("code", "math", "chat", "qa", "summarization", "translation", "rag", "extraction")
BACKENDS = ("engine", "vllm", "external")
SPEC_METHODS = ("none", "ngram", "draft")
NGRAM_CAPS = ("auto", "cpu", "none")
DTYPES = ("float32", "bfloat16", "float16")
EXECUTIONS = ("eager", "compiled", "cuda_graph")
ATTENTIONS = ("sdpa", "naive", "triton")

# NOTE: the bundled tiny pair: models/ in a checkout (polyinfer/models links to it), inside
# the package in a wheel (package data), so an installed proxy finds its default model
MODELS_DIR = (Path(__file__).resolve().parent / "models").resolve()
TINY_TARGET = MODELS_DIR / "tiny-target"
TINY_DRAFT = MODELS_DIR / "tiny-draft"


class ConfigError(ValueError):
    """A config value is missing, of the wrong type or out of range; the message names the key."""


def _check(cond: bool, key: str, expected: str, got: Any) -> None:
    if not cond:
        raise ConfigError(f"{key}: expected {expected}, got {got!r}")


@dataclass(frozen=True)
class ForwardConfig:
    """Forward-pass variants: fused Triton kernels in place of runs of small torch ops.

    Hot-reloadable. Whenever an engine builds with one, it checks each kernel against
    the torch reference at the model's shapes on fresh random inputs and refuses the
    config if one falls outside its bound (``engine.fused``). They need a CUDA device
    (or ``TRITON_INTERPRET=1``, Triton's slow CPU interpreter) and not execution
    'compiled', which fuses its own.
    """

    fused_norm: bool = False  # residual add + RMSNorm in one kernel
    fused_rope_kv: bool = False  # RoPE on q and k + the K/V-cache write in one kernel
    fused_silu: bool = False  # silu(gate) * up in one kernel
    # projections of <= 16 rows (small-batch decode) as one stream over the weight, the
    # launch tuned per shape on the device, cuBLAS kept where it is faster
    skinny_gemm: bool = False
    # captured decode attention split over 256-token slices of the context, then merged
    # (flash-decoding): more programs for long contexts at small batch, one kernel more
    split_attention: bool = False
    # in decode steps whose every row is its own sequence (CUDA graphs of their own), RoPE
    # and the K/V-cache write inside the attention kernel: one kernel fewer a layer
    fused_rope_attention: bool = False
    # captured steps of many rows (prompt chunks) attend by tiles of one sequence's rows,
    # each K/V tile read once a tile of rows instead of once a row
    prefill_attention: bool = False
    # the Triton kernels launched with programmatic dependent launch (Hopper and later):
    # each one's programs start while the kernel before drains, and wait for its results
    pdl: bool = False
    # each layer's projection weights asked into L2 on a side stream while the kernels
    # before them (attention, the norms) leave the memory idle (Hopper and later)
    l2_prefetch: bool = False

    @property
    def enabled(self) -> tuple[str, ...]:
        """The names of the variants switched on."""
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name))


FUSED_FORWARD = ForwardConfig(fused_norm=True, fused_rope_kv=True, fused_silu=True)
# the fused kernels and the skinny projections: the fastest small-batch GPU decode
GPU_FORWARD = ForwardConfig(fused_norm=True, fused_rope_kv=True, fused_silu=True,
                            skinny_gemm=True)


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the built-in engine; all hot-reloadable except :data:`RESTART_FIELDS`."""

    max_num_seqs: int = 32  # sequences in one batch
    max_num_batched_tokens: int = 1024  # tokens per step (chunked-prefill budget)
    kv_cache_tokens: int = 32768  # KV-cache capacity, in tokens, summed over sequences
    block_size: int = 16  # tokens per KV-cache block
    max_model_len: int = 2048  # prompt + output, per sequence
    spec_method: Literal["none", "ngram", "draft"] = "none"
    spec_max_depth: int = 4  # cap on speculative_depth per request
    spec_default_depth: int = 0  # used when the request names none (capped by spec_max_depth)
    ngram_min: int = 1  # shortest n-gram the prompt-lookup proposer matches
    ngram_max: int = 4  # longest n-gram the prompt-lookup proposer matches
    # The n-gram proposer's caps on a proposal by its match length (specdec.ngram NOTE):
    # "cpu" keeps them (a draft token is kept where it is accepted often enough to pay for
    # its verify row, ~0.1 of a step on the CPU), "none" lifts them, "auto" is "none" under
    # execution "cuda_graph" (a verify row replays for ~0.3% of a batch-1 step there, and the
    # caps cost qa/chat ~12-16% of their tokens per step: bench/RESULTS.md, top-m replay)
    # and "cpu" otherwise.
    ngram_caps: Literal["auto", "cpu", "none"] = "auto"
    draft_model: str = ""  # path of the draft checkpoint when spec_method == "draft"
    # the draft stops proposing at a token it gives less than this probability (0 = never)
    draft_min_confidence: float = 0.2
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    execution: Literal["eager", "compiled", "cuda_graph"] = "eager"
    attention: Literal["sdpa", "naive", "triton"] = "sdpa"
    device: str = "cpu"
    # CPU threads for the step loop; 0 = auto = half the cores, at least 1. On the CPU, 2+
    # threads run big decode steps as two lanes of num_threads // 2 intra-op threads each
    # when that measures faster than one lane (engine.lanes).
    num_threads: int = 0
    # 0 = the step loop runs on a thread of the HTTP process; N >= 1 = N engine-core
    # processes (engine.dp), each with its own weights, KV cache (kv_cache_tokens each) and
    # step loop, one intra-op thread each when num_threads is 0. Not hot-reloadable.
    data_parallel_size: int = 0
    # Automatic prefix caching (engine.kv_cache), on by default as in vLLM V1: a request
    # reuses the cached K/V of the full 16-token blocks its prompt shares with earlier
    # requests (its own history after preemption, a previous turn's prompt and answer).
    # Hot-reloadable; every reload starts with an empty cache.
    enable_prefix_caching: bool = True
    forward: ForwardConfig = field(default_factory=ForwardConfig)
    # Row counts captured as CUDA graphs (execution "cuda_graph"); () = the default ladder
    # (engine.cuda_graph.graph_buckets). A step runs in the smallest one that holds its
    # rows, and eager above the largest. Chosen from the traffic's rows per step
    # (optimizer.space.graph_sizes_for): fewer graphs capture faster (a reload) and hold
    # less memory.
    graph_sizes: tuple[int, ...] = ()
    # NOTE: measurement only. Loading only the first N layers makes a fast,
    # wrong model whose step times track the full one; never serve it.
    measure_num_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens", "block_size",
                     "max_model_len"):
            value = getattr(self, name)
            _check(value > 0, f"engine.{name}", "a positive integer", value)
        _check(self.spec_method in SPEC_METHODS, "engine.spec_method", f"one of {SPEC_METHODS}",
               self.spec_method)
        _check(0 <= self.spec_max_depth <= 16, "engine.spec_max_depth", "0..16", self.spec_max_depth)
        _check(0 <= self.spec_default_depth <= self.spec_max_depth, "engine.spec_default_depth",
               f"0..spec_max_depth ({self.spec_max_depth})", self.spec_default_depth)
        _check(self.ngram_caps in NGRAM_CAPS, "engine.ngram_caps", f"one of {NGRAM_CAPS}",
               self.ngram_caps)
        _check(1 <= self.ngram_min <= self.ngram_max, "engine.ngram_min",
               f"1..ngram_max ({self.ngram_max})", self.ngram_min)
        _check(self.dtype in DTYPES, "engine.dtype", f"one of {DTYPES}", self.dtype)
        _check(self.execution in EXECUTIONS, "engine.execution", f"one of {EXECUTIONS}",
               self.execution)
        _check(self.attention in ATTENTIONS, "engine.attention", f"one of {ATTENTIONS}",
               self.attention)
        _check(self.execution != "cuda_graph" or self.device.startswith("cuda"),
               "engine.execution", f"'eager' or 'compiled' on engine.device {self.device!r} "
               "('cuda_graph' needs a CUDA device)", self.execution)
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "engine.max_num_batched_tokens",
               f">= max_num_seqs ({self.max_num_seqs})", self.max_num_batched_tokens)
        _check(self.kv_cache_tokens >= self.block_size, "engine.kv_cache_tokens",
               f">= block_size ({self.block_size})", self.kv_cache_tokens)
        _check(self.spec_method != "draft" or bool(self.draft_model), "engine.draft_model",
               "a path when spec_method is 'draft'", self.draft_model)
        _check(0.0 <= self.draft_min_confidence < 1.0, "engine.draft_min_confidence",
               "a value in [0, 1)", self.draft_min_confidence)
        _check(self.num_threads >= 0, "engine.num_threads", "0 (auto) or a positive integer",
               self.num_threads)
        _check(0 <= self.data_parallel_size <= 64, "engine.data_parallel_size",
               "0 (in-process) or 1..64 engine-core processes", self.data_parallel_size)
        _check(self.data_parallel_size == 0 or self.execution != "cuda_graph",
               "engine.data_parallel_size", "0 with execution 'cuda_graph'",
               self.data_parallel_size)
        _check(isinstance(self.enable_prefix_caching, bool), "engine.enable_prefix_caching",
               "true or false", self.enable_prefix_caching)
        _check(not self.forward.enabled or self.execution != "compiled", "engine.forward",
               "no fused kernels with execution 'compiled' (torch.compile fuses its own)",
               self.forward.enabled)
        _check(all(0 < n <= 1 << 16 for n in self.graph_sizes), "engine.graph_sizes",
               "row counts in 1..65536 (empty: the default ladder)", self.graph_sizes)
        _check(self.measure_num_layers is None or self.measure_num_layers > 0,
               "engine.measure_num_layers", "a positive integer or null", self.measure_num_layers)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size

    @property
    def ngram_capped(self) -> bool:
        """Whether the n-gram proposer caps proposals by match length (see ngram_caps)."""
        if self.ngram_caps == "auto":
            return self.execution != "cuda_graph"
        return self.ngram_caps == "cpu"

    @property
    def usable_model_len(self) -> int:
        """Tokens one sequence can hold: ``max_model_len``, capped by the whole KV cache."""
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)


# Engine fields a running engine cannot take by hot reload: a change needs a new engine
# process (a cold start, or a blue-green replacement of a live worker).
RESTART_FIELDS = ("device", "data_parallel_size")


def needs_restart(running: CompiledConfig, target: CompiledConfig) -> bool:
    """True when ``target`` cannot be hot-reloaded onto an engine serving ``running``.

    A different backend or model, or a different value of any of
    :data:`RESTART_FIELDS`; vLLM and external workers take no hot reload at all.
    """
    if running.backend != target.backend or running.model != target.model:
        return True
    if target.backend != "engine":
        return running != target
    return bool(restart_fields_changed(running.engine, target.engine))


def restart_fields_changed(running: EngineConfig, target: EngineConfig) -> list[str]:
    """The :data:`RESTART_FIELDS` whose values differ: what a hot reload must refuse."""
    return [f for f in RESTART_FIELDS if getattr(running, f) != getattr(target, f)]


@dataclass(frozen=True)
class VllmConfig:
    """Arguments for a `vllm serve` worker; ``speculative_config`` is passed as JSON."""

    args: tuple[str, ...] = ()  # extra command-line arguments, verbatim
    speculative_config: str = ""  # JSON text for --speculative-config, "" for none
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.speculative_config:
            try:
                spec = json.loads(self.speculative_config)
            except ValueError as e:
                raise ConfigError(f"vllm.speculative_config: expected JSON text, got "
                                  f"{self.speculative_config!r}") from e
            _check(isinstance(spec, dict), "vllm.speculative_config", "a JSON object", spec)
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "vllm.gpu_memory_utilization",
               "a fraction in (0, 1]", self.gpu_memory_utilization)

    @property
    def speculative(self) -> dict[str, Any] | None:
        return json.loads(self.speculative_config) if self.speculative_config else None


@dataclass(frozen=True)
class DeclaredFit:
    """The shapes a worker was tuned for: a prior that measured profiles replace."""

    domains: tuple[str, ...] = ()  # empty = any domain
    prompt_tokens: tuple[int, int] = (0, 1 << 30)  # [lo, hi) prompt-length range

    def __post_init__(self) -> None:
        for d in self.domains:
            _check(d in DOMAINS, "fit.domains", f"domains from {DOMAINS}", d)
        lo, hi = self.prompt_tokens
        _check(0 <= lo < hi, "fit.prompt_tokens", "[lo, hi) with 0 <= lo < hi", self.prompt_tokens)

    def covers(self, domain: str, prompt_tokens: int) -> bool:
        lo, hi = self.prompt_tokens
        return (not self.domains or domain in self.domains) and lo <= prompt_tokens < hi


@dataclass(frozen=True)
class CompiledConfig:
    """One worker's configuration: backend, model and the knobs for that backend."""

    backend: Literal["engine", "vllm", "external"] = "engine"
    model: str = str(TINY_TARGET)  # checkpoint directory (engine, vllm) or served name (external)
    served_model_name: str = ""  # name clients use; defaults to the model directory's name
    engine: EngineConfig = field(default_factory=EngineConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    fit: DeclaredFit = field(default_factory=DeclaredFit)

    def __post_init__(self) -> None:
        _check(self.backend in BACKENDS, "backend", f"one of {BACKENDS}", self.backend)
        _check(bool(self.model), "model", "a model path or name", self.model)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def with_engine(self, **changes: Any) -> CompiledConfig:
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, **changes))

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompiledConfig:
        return build_dataclass(cls, data, "")

    @classmethod
    def load(cls, path: str | Path) -> CompiledConfig:
        return cls.from_dict(load_mapping(path))


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that repeats a key (the last value would win
    silently: a second ``admin_key`` would replace the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"duplicate key(s) {dupes}")
    return dict(pairs)


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file into a mapping; errors name the file and the problem (a key
    given twice in one mapping is one)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file ({e.strerror})") from e
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) if p.suffix not in (".json",) \
            else json.loads(text, object_pairs_hook=_unique_pairs)
    except (yaml.YAMLError, ValueError) as e:
        raise ConfigError(f"{p}: not valid YAML/JSON: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(data).__name__}")
    return data


T = typing.TypeVar("T")


def build_dataclass(cls: type[T], data: Any, path: str) -> T:
    """Build a (nested) frozen dataclass from plain data, checking every field's type.

    Unknown keys and wrong types raise :class:`ConfigError` naming the dotted key,
    so a typo never silently becomes a default.
    """
    where = path or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{path}.{name}" if path else name
        kwargs[name] = _coerce(hints[name], value, key)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    args = get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, key)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: unexpected {value!r}")
    if origin is Literal:
        _check(value in args, key, f"one of {list(args)}", value)
        return value
    if origin is tuple:
        _check(isinstance(value, (list, tuple)), key, "a list", value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        _check(len(value) == len(args), key, f"a list of {len(args)} items", value)
        return tuple(_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=False)))
    if origin is dict or tp is dict:
        _check(isinstance(value, Mapping), key, "a mapping", value)
        return dict(value)
    if tp is bool:
        _check(isinstance(value, bool), key, "true or false", value)
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
        return value
    if tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, "a number",
               value)
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)) and key.endswith("speculative_config"):
            return json.dumps(value)
        _check(isinstance(value, str), key, "a string", value)
        return value
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported field type {tp!r}")
