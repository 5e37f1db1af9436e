"""Test-only fault injection for the built-in engine: planted bugs for the mutation suite.

Run an engine worker with these patches installed (the verifier starts it as
any engine, through ``optimizer.engine_proc.EngineProcess(launcher=...)``)::

    python -m tests.optimizer.faults --log-level WARNING engine --model DIR --port N ...

The patched engine behaves exactly like the real one until a fault is switched
on with ``POST /test/fault {"name": "<fault>"}`` (``"none"`` switches it off);
each fault is a plausible bug in a real code path of the engine, armed only
under the condition named here:

- ``cross_kv``: with ``max_num_seqs >= 16`` and 8 or more sequences in a step,
  the second sequence's new K/V lands in the first one's slot (a slot-mapping
  bug at large batch);
- ``block_table``: a sequence whose context spans more than 8 blocks attends
  its second-to-last block twice instead of its last (an off-by-one in the
  block table handed to attention);
- ``top_p``: the sampler ignores ``top_p`` (samples the whole distribution);
- ``bucket``: attention is wrong (scaled by 0.5) for decode steps of 13-16
  sequences, i.e. one batch bucket;
- ``stale_prefix``: a reload keeps the previous config's prefix-cache index and
  K/V (a "keep the cache when the geometry is unchanged" optimisation that
  forgets the model changed);
- ``logit_noise``: under ``attention: naive`` (standing in for another kernel)
  every logit gets Gaussian noise of ``scale`` (the fault request's ``scale``,
  default 0.5): a kernel whose numerical error is within or beyond a bound,
  as the scale says;
- ``slow_prompts``: on any config but the one the engine ran when the fault was
  switched on, a completion whose prompt is longer than ``min_prompt_chars``
  (default 1,000) waits ``sleep_s`` (default 1 s) before it starts: a candidate
  that serves one shape slower than its measurement said, and only that shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from typing import Any

import torch
from aiohttp import web

FAULTS = ("none", "cross_kv", "block_table", "top_p", "bucket", "stale_prefix")
# faults outside the mutation suite: a numerical one and a served-latency one
OTHER_FAULTS = ("logit_noise", "slow_prompts")


class FaultState:
    def __init__(self) -> None:
        self.active = "none"
        self.max_num_seqs = 0  # of the config the engine was last built with
        self.attention = ""  # likewise
        self.config: Any = None  # the engine config it was last built with
        self.armed_config: Any = None  # the one it ran when the active fault was switched on
        self.scale = 0.5  # logit_noise
        self.min_prompt_chars = 1000  # slow_prompts
        self.sleep_s = 1.0  # slow_prompts
        self.num_triggered = 0  # steps (or reloads) the active fault corrupted


STATE = FaultState()


def _build_metadata(original: Any) -> Any:
    from engine.attention import SeqSlice

    def patched(slices: Any, block_size: int, *args: Any, **kwargs: Any) -> Any:
        if STATE.active == "block_table" and any(len(s.block_table) > 8 for s in slices):
            STATE.num_triggered += 1
            slices = [SeqSlice(s.q_len, s.start, [*s.block_table[:-1], s.block_table[-2]])
                      if len(s.block_table) > 8 else s for s in slices]
        meta = original(slices, block_size, *args, **kwargs)
        if STATE.active == "cross_kv" and STATE.max_num_seqs >= 16 and len(slices) >= 8:
            STATE.num_triggered += 1
            first_end = slices[0].q_len
            second = slice(first_end, first_end + slices[1].q_len)
            meta.slot_mapping[second] = meta.slot_mapping[first_end - 1]
        return meta

    return patched


def _paged_attention(original: Any) -> Any:
    def patched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, scale: float,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(q, k, v, meta, scale, *args, **kwargs)
        num_rows = int(meta.positions.numel())
        decode = all(g.max_q == 1 for g in meta.groups)
        if STATE.active == "bucket" and decode and 13 <= num_rows <= 16:
            STATE.num_triggered += 1
            return out * 0.5
        return out

    return patched


def _sample(original: Any) -> Any:
    def patched(logits: torch.Tensor, params: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if STATE.active == "top_p" and any(p.top_p < 1.0 for p in params):
            STATE.num_triggered += 1
            params = [dataclasses.replace(p, top_p=1.0) for p in params]
        return original(logits, params, *args, **kwargs)

    return patched


def _build(original: Any) -> Any:
    def patched(core: Any, cfg: Any) -> None:
        STATE.max_num_seqs, STATE.attention, STATE.config = cfg.max_num_seqs, cfg.attention, cfg
        original(core, cfg)

    return patched


def _forward(original: Any) -> Any:
    def patched(runner: Any, items: Any, hidden_only: bool = False) -> torch.Tensor:
        out = original(runner, items, hidden_only)
        if STATE.active == "logit_noise" and STATE.attention == "naive" and not hidden_only:
            STATE.num_triggered += 1
            out = out + STATE.scale * torch.randn_like(out)
        return out

    return patched


def _reload(original: Any) -> Any:
    def patched(core: Any, config: Any) -> float:
        old_alloc, old_kv = core.allocator, core.runner.kv
        seconds = original(core, config)
        new_alloc, new_kv = core.allocator, core.runner.kv
        if STATE.active == "stale_prefix" and old_alloc.num_blocks == new_alloc.num_blocks:
            STATE.num_triggered += 1
            for name in ("_hash_of", "_block_of", "_evictable"):
                setattr(new_alloc, name, dict(getattr(old_alloc, name)))
            new_alloc._free = [b for b in new_alloc._free if b not in new_alloc._hash_of]
            layers = min(old_kv.k.shape[0], new_kv.k.shape[0])
            if old_kv.k.shape[1:] == new_kv.k.shape[1:]:
                new_kv.k[:layers].copy_(old_kv.k[:layers])
                new_kv.v[:layers].copy_(old_kv.v[:layers])
        return float(seconds)

    return patched


async def handle_fault(request: web.Request) -> web.Response:
    body = await request.json()
    name = str(body.get("name", "none"))
    if name not in FAULTS + OTHER_FAULTS:
        return web.json_response({"error": f"unknown fault {name!r}; one of "
                                           f"{FAULTS + OTHER_FAULTS}"}, status=400)
    STATE.active, STATE.num_triggered, STATE.armed_config = name, 0, STATE.config
    STATE.scale = float(body.get("scale", 0.5))
    STATE.min_prompt_chars = int(body.get("min_prompt_chars", 1000))
    STATE.sleep_s = float(body.get("sleep_s", 1.0))
    return web.json_response({"active": name})


async def handle_fault_state(request: web.Request) -> web.Response:
    return web.json_response({"active": STATE.active, "num_triggered": STATE.num_triggered})


@web.middleware
async def _slow_prompts(request: web.Request, handler: Any) -> web.StreamResponse:
    if (STATE.active == "slow_prompts" and request.method == "POST"
            and request.path.startswith("/v1/") and STATE.config != STATE.armed_config):
        body = await request.read()  # NOTE: aiohttp keeps it; the handler reads it again
        if len(body) > STATE.min_prompt_chars:
            STATE.num_triggered += 1
            await asyncio.sleep(STATE.sleep_s)
    return await handler(request)


def _create_app(original: Any) -> Any:
    def patched(config: Any) -> web.Application:
        app = original(config)
        app.middlewares.append(_slow_prompts)
        app.router.add_post("/test/fault", handle_fault)
        app.router.add_get("/test/fault", handle_fault_state)
        return app

    return patched


def install() -> None:
    """Patch the engine modules in this process (call before the engine is built)."""
    import engine.core
    import engine.model
    import engine.runner
    import engine.server

    engine.runner.build_metadata = _build_metadata(engine.runner.build_metadata)
    engine.model.paged_attention = _paged_attention(engine.model.paged_attention)
    engine.runner.sample = _sample(engine.runner.sample)
    engine.runner.ModelRunner._forward = _forward(engine.runner.ModelRunner._forward)
    engine.core.EngineCore._build = _build(engine.core.EngineCore._build)
    engine.core.EngineCore.reload = _reload(engine.core.EngineCore.reload)
    engine.server.create_app = _create_app(engine.server.create_app)


LAUNCHER = ("-m", "tests.optimizer.faults")  # EngineProcess(launcher=LAUNCHER)


if __name__ == "__main__":
    install()
    from proxy.cli import main

    sys.exit(main(sys.argv[1:]))
