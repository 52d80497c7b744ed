"""Prefect deployments of llm4llm: nightly re-optimization, a manual deployment for the UI, and re-profiling when
a workload config changes."""
