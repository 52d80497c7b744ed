"""Decode-graph planning from what extraction found: whether a run's decode steps (and prompt forward) replay from
CUDA graphs, and whether its KV-cache decode tasks are captured on transformers' static cache."""
from __future__ import annotations

import json
from pathlib import Path


GRAPH_CHOICES = ("auto", "on", "off")


# A KV cache that grows per token: graphable under transformers' static cache (StaticLayer / StaticSlidingWindowLayer)
KV_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")
# The static cache itself (decode tasks extracted with static_cache=True): it asks for the static cache as well
STATIC_KV_LAYERS = ("StaticLayer", "StaticSlidingWindowLayer")


def extract_on_static_cache(device: str, requested: str | bool) -> bool:
    """Whether a run's extraction captures KV-cache decode tasks on transformers' static cache: wherever decode
    graphs may be on (a CUDA device, graphs not off), since graphs generate on it (decode_graphs_plan)."""
    return device.startswith("cuda") and requested not in (False, "off")


def decode_graphs_plan(index_path: str, device: str, requested: str | bool) -> tuple[bool, bool, str]:
    """(graphs, static_cache, why) for a run. `requested`: auto | on | off (bools: on / off).

    auto is on when the extracted tasks keep decode state only in cache layers with static addresses
    (kernels_runtime.graphs.STATIC_LAYERS: Mamba, Mamba2), in a KV cache, which the run then swaps for transformers'
    static cache (static_cache=True: Llama, Qwen3, RecurrentGemma's sliding-window attention; their attention kernels,
    written for the dynamic cache, fall back there), or on modules with a state adapter (RecurrentGemma's recurrent
    blocks: the graph adopts state a module assigns per step). Acceptance still gates them like a patch
    (accept.decide_graphs: the unpatched model's logits with graphs, then a gain of at least delta)."""
    from kernels_runtime.boundary import MODULE_ADAPTERS
    from kernels_runtime.graphs import STATIC_LAYERS

    choice = {True: "on", False: "off"}.get(requested, requested) if isinstance(requested, bool) else requested
    if choice not in GRAPH_CHOICES:
        raise ValueError(f"decode_graphs: expected one of {GRAPH_CHOICES}, got {requested!r}")
    if choice == "off":
        return False, False, "off"
    if not device.startswith("cuda"):
        return False, False, f"off ({choice}): CUDA graphs need a CUDA device, this run is on {device}"
    adapters = state_adapters(index_path)
    static = bool(adapters & set(KV_LAYERS + STATIC_KV_LAYERS))
    cache_note = "; generate with the static KV cache" if static else ""
    if choice == "on":
        return True, static, f"on (asked for){cache_note}"
    if not adapters:
        return False, False, "off (auto): no extracted module keeps decode state, so nothing says the step is static"
    other = sorted(adapters - set(STATIC_LAYERS) - set(KV_LAYERS) - set(MODULE_ADAPTERS))
    if other:
        return False, False, (f"off (auto): decode state in {other}, which graphs cannot hold (static: "
                              f"{sorted(STATIC_LAYERS)}, {list(KV_LAYERS)} under the static cache, or on modules: "
                              f"{sorted(MODULE_ADAPTERS)})")
    return True, static, f"on (auto): decode state only in {sorted(adapters)}{cache_note}"


def prefill_graphed(index_path: str) -> bool:
    """Whether the run's prompt forward replays from a CUDA graph when its decode graphs are on: kernels_runtime
    graphs a prefill only on a cache whose every layer is one of PREFILL_LAYERS (Mamba, Mamba2), so every extracted
    task that keeps state must keep it there, and one must."""
    from kernels_runtime.graphs import PREFILL_LAYERS

    adapters = state_adapters(index_path)
    return bool(adapters) and adapters <= set(PREFILL_LAYERS)


def state_adapters(index_path: str) -> set[str]:
    """The state adapters (cache layer or module kinds) the run's extracted tasks keep decode state in."""
    return {a for t in json.loads(Path(index_path).read_text())
            if (a := ((t.get("recipe") or {}).get("state") or {}).get("adapter"))}

