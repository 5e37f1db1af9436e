"""polyinfer proxy: the OpenAI-compatible sidecar in front of the engine workers.

Run it::

    polyinfer serve                                   # embedded default: 2 supervised engines
    polyinfer serve --config polyinfer.yaml           # see proxy/data/polyinfer.example.yaml
    polyinfer serve --worker http://127.0.0.1:9001    # any running OpenAI-compatible server

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (stream or
not; every OpenAI field passed through; ``speculative_depth`` added for engine
workers), ``GET /v1/models``, ``GET /health``, ``GET /stats`` (JSON),
``GET /metrics`` (Prometheus), ``GET /`` (dashboard; its data: ``GET /stats/history``),
and ``/admin/*`` behind ``auth.admin_key`` (see :mod:`proxy.admin`). Every response carries
``x-request-id``, ``x-polyinfer-worker``, ``x-polyinfer-domain`` and
``x-polyinfer-spec-depth``.

Modules, in request order:

- :mod:`proxy.serve_cli`, :mod:`proxy.server` — CLI, listening, SIGTERM drain
- :mod:`proxy.fastpath` — lean protocol for plain POSTs to the two OpenAI routes;
  every other request (and its connection) is handed to aiohttp on the same port
- :mod:`proxy.exchange` — the client side of one request, for the relay (aiohttp or lean)
- :mod:`proxy.config` — frozen config tree, validated on load
- :mod:`proxy.app`, :mod:`proxy.keys` — app factory, typed app keys, lifetimes
- :mod:`proxy.handlers`, :mod:`proxy.admin` — HTTP handlers, error middleware
- :mod:`proxy.relay` — admit, validate, shape, route, forward, relay, record
- :mod:`proxy.validate`, :mod:`proxy.shape` — body checks, fallback shape estimator
- :mod:`proxy.routing` — policies by name (router.baselines, router.adaptive)
- :mod:`proxy.pool`, :mod:`proxy.breaker`, :mod:`proxy.supervisor` — workers,
  health probes, metric scrapes, circuit breakers, child processes
- :mod:`proxy.stats`, :mod:`proxy.metrics`, :mod:`proxy.record`,
  :mod:`proxy.traces` — counters, Prometheus export, trace records and files
- :mod:`proxy.dashboard`, :mod:`proxy.history` (+ ``history_slot``, ``history_window``),
  :mod:`proxy.timeline` — the dashboard: per-second history rings, the optimizer's activity
- :mod:`proxy.errors` — the error tree and OpenAI error bodies
"""
