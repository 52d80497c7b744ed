"""The stage functions that tasks/ wraps, one module per stage: profile, extract, plan, search, experience (between
search rounds), accept, evaluate, kernelbench; common holds what they share. Each takes and returns paths, ids and
small dicts, never tensors or modules, so Prefect can hash, cache and retry them; what a stage reads and writes goes
through the repository it is handed (a Protocol in its module; storage.store.Store on DuckDB)."""
