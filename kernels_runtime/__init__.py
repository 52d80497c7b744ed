"""Runtime half of llm4llm: Triton ops, the shared tolerance table, the phase predicate, call-boundary adapters
and patch bundles. Imports without Prefect, DuckDB or litellm."""
