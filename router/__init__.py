"""polyinfer router: request shapes and adaptive, config-fit routing.

Modules, in the order a request meets them:

- ``base``: the routing contract (RequestShape, WorkerView, RouteDecision,
  RequestOutcome, RoutingPolicy).
- ``shape``: ``ShapeEstimator.load(tokenizer_dir)`` at start-up, then
  ``await estimate(body, endpoint) -> RequestShape`` per request (bounded work on the
  loop) and ``observe(outcome)`` to learn output lengths per domain.
- ``tokens``: calibrated and exact prompt token counts, ChatML rendering, prefix-block ids.
- ``features`` + ``classifier``: the hashed n-gram domain classifier and its
  ``.npz`` artefact (``data/domain_classifier.npz``; sources in ``data/SOURCES.md``).
- ``corpus``, ``templates``, ``dataset``, ``training``, ``cli``: the training data,
  its group split and ``polyinfer train-classifier``.
- ``profiles``: per-(worker, shape bucket) TTFT/TPOT models over a config-derived prior.
- ``affinity``: bounded prefix-hash -> worker LRU.
- ``adaptive``: ``AdaptivePolicy``, the cost-based RoutingPolicy (asks
  ``specdec.policy.DepthPolicy`` for k); ``baselines``: round-robin,
  least-outstanding, random.
- ``errors``: the router's exception tree.
"""
