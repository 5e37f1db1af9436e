"""polyinfer's ground floor: what every part shares, importing none of them.

- :mod:`polyinfer.config` — the compiled config (one per worker), domains, config errors
- :mod:`polyinfer.trace` — the trace record: schema, writer and reader
- :mod:`polyinfer.errors` — the OpenAI error shape
- :mod:`polyinfer.heap` — garbage-collector settling for long-running processes

Everything else (proxy, router, specdec, engine, optimizer, loadgen) may import
these; they import only the standard library and third-party packages.
"""
