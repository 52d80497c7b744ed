"""Decode-graph planning for the optimize flow (llm4llm.stages.graphs). Plain functions, not Prefect tasks: the flow
decides with them in its own process, from the extracted task index, as it did before they lived here."""
from __future__ import annotations

from llm4llm.stages import graphs


def extract_on_static_cache(device: str, requested: str | bool) -> bool:
    """Whether extraction captures KV-cache decode tasks on transformers' static cache."""
    return graphs.extract_on_static_cache(device, requested)


def decode_graphs_plan(index_path: str, device: str, requested: str | bool) -> tuple[bool, bool, str]:
    """(graphs, static_cache, why) for a run."""
    return graphs.decode_graphs_plan(index_path, device, requested)


def prefill_graphed(index_path: str) -> bool:
    """Whether the run's prompt forward replays from a CUDA graph when its decode graphs are on."""
    return graphs.prefill_graphed(index_path)
