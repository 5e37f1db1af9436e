"""polyinfer optimizer: the background loop that re-tunes engine workers from their traffic.

    profile.py      traces (JSONL files or live records) -> TrafficProfile + stratified sample
    sample.py       sample records -> replay requests (synthesised prompts at recorded lengths)
    space.py        the search space of engine compiled configs, constraints, GP encodings
    board.py        the SQLite message board (proposals, claims, results, notes, promotions)
    agents/         proposer agents: costagent (cost model), bayes (GP + EI), evolution, llm
    costmodel.py    measured hardware constants -> roofline -> fitted step times -> tokens/s
    pruner.py       cost-model pruning of clearly-worse candidates, with an audit sample
    measure.py      hot-reload + replay on a persistent engine; fast and slow tiers
    pool.py         engines per restart class (data_parallel_size): restart-only knobs
    campaign.py     one traffic profile's search: screen, then confirm finalists in pairs
    verify.py       greedy-output identity, KV-cache contamination, gain beyond noise
    promote.py      hot reload (engine) or blue-green (vLLM; engine restart-only changes) to
                    the live worker, rollback watch
    service.py      OptimizerService: run() / snapshot() / observe()
    join.py         more agents from another process, through the board file
    cli.py          `polyinfer optimize`
"""
