"""The stage functions that tasks/ wraps, one module per stage: profile, extract, graphs (decode-graph planning),
search, experience (between search rounds), accept, evaluate; common holds what they share. Each takes and returns
paths, ids and small dicts, never tensors or modules, so Prefect can hash, cache and retry them."""
