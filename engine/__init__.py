"""polyinfer's built-in engine worker: a Llama-family model served over the OpenAI API.

Run it::

    polyinfer engine --model models/tiny-target --port 8100 [--config compiled.yaml]
    python -m engine --model models/tiny-target --port 8100

Modules, in the order a request meets them:

- ``cli`` / ``__main__``: the command line; ``server``: aiohttp routes (completions, chat,
  SSE streaming, models, health, metrics, admin config/reload); ``protocol``: strict
  request parsing and OpenAI response bodies; ``errors``: the error tree.
- ``async_engine``: the step thread and per-request output queues; ``core``: one step =
  propose -> schedule -> execute -> postprocess (stop checks, detokenization, counters).
  With ``engine.data_parallel_size`` N >= 1, ``dp`` runs the same step loop in N
  ``core_proc`` processes (own weights + KV cache each) and routes to the least loaded.
- ``scheduler``: continuous batching, chunked prefill, preemption by recompute;
  ``kv_cache``: the paged KV cache and its block allocator; ``sequence``: request state.
- ``runner``: flat batch -> forward -> sampling or speculative verification (``specdec``);
  ``attention``: paged attention over variable-length query slices; ``model``: the
  decoder; ``checkpoint``: HF config + safetensors; ``tokenizer`` / ``detokenizer``.
- ``proposers``: the speculative proposer a compiled config names; ``metrics``: vLLM's
  Prometheus metric names; ``loader``: builds a core from a compiled config.

The knobs are :class:`polyinfer.config.EngineConfig` (the ``engine`` slice of the compiled
config); ``POST /admin/reload`` applies a new one without re-reading weights.
"""
