"""polyinfer specdec: speculative decoding with a depth chosen per request.

Modules (one concept each):

- ``base``     the contract: ``ProposalRequest`` / ``Proposal`` and the ``Proposer`` protocol
- ``ngram``    prompt-lookup proposer (vectorised numpy, incremental per-sequence buffers)
- ``draft``    draft-model proposer on the engine's ``LlamaModel`` with its own paged KV cache
- ``sampling`` the one sampler plain and speculative decoding share (``process_logits``, ``sample``)
- ``verify``   batched lossless verification, a different k per sequence
- ``policy``   the depth policy: k per request from learned acceptance, batch size, step time
- ``step_feed`` the engine's per-step timing (least-squares sums on ``/metrics``) into the policy
- ``schedule`` a batch-size -> k schedule for vLLM workers, fitted with the policy's models
- ``triton_accept`` the accept scan of verification as a Triton kernel (CUDA)
- ``errors``   the exceptions, with their tree

The engine's step loop (``engine.core`` / ``engine.runner``) calls
``proposer.propose -> forward(k_i + 1 rows each) -> verify -> proposer.commit``;
the proxy (or any client) calls ``DepthPolicy.decide`` per request and feeds
it the ``usage.spec_decode`` counts that responses report, and the engine's
decode-step sums it scrapes from ``/metrics`` (``StepFeed.on_metrics``).
"""
