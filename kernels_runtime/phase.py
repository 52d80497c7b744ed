"""The phase predicate: is a top-level model forward a prefill or a decode step?

Generic over architectures: a call over more than one new position is prefill; a call over one new position with a
cache that already holds something (KV entries, SSM / recurrent state, or `cache_position[0] > 0`) is decode. Every
module call inside a top-level forward inherits its phase through the context variable `CURRENT_PHASE`. The profiler
and the patched dispatch share this code.
"""
from __future__ import annotations

import contextvars
from collections import Counter
from typing import Any, Literal

import torch

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")

CURRENT_PHASE: contextvars.ContextVar[Phase | None] = contextvars.ContextVar("llm4llm_current_phase", default=None)

_CACHE_KWARGS = ("past_key_values", "cache_params", "past_key_value", "cache")


def new_positions(args: tuple, kwargs: dict) -> int | None:
    """The number of new positions in a top-level forward call, or None when it carries no ids or embeddings."""
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if isinstance(ids, torch.Tensor):
        return int(ids.shape[-1])  # [B, S]
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor):
        return int(embeds.shape[-2])  # [B, S, H]
    return None


def phase_of_call(args: tuple, kwargs: dict) -> Phase:
    """"prefill" for a call over several new positions (or one without any cached past), else "decode"."""
    n = new_positions(args, kwargs)
    if n is not None and n > 1:
        return "prefill"
    return "decode" if _has_past(kwargs) else "prefill"


def _has_past(kwargs: dict) -> bool:
    # The cache objects first: reading them costs no device sync (lengths come from shapes, flags are Python
    # values), and in decode they answer. `cache_position` is read only when they do not: on the GPU reading it
    # waits for the device, once per top-level forward (models without a cache argument, e.g. RecurrentGemma).
    if any(_cache_has_content(kwargs.get(name)) for name in _CACHE_KWARGS):
        return True
    position = kwargs.get("cache_position")
    return isinstance(position, torch.Tensor) and position.numel() > 0 and int(position.reshape(-1)[0]) > 0


def _cache_has_content(cache: Any) -> bool:
    if cache is None:
        return False
    if isinstance(cache, torch.Tensor):
        return cache.numel() > 0
    if isinstance(cache, (tuple, list)):  # legacy tuple-of-tuples caches
        return any(_cache_has_content(c) for c in cache)
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple)) and layers:
        return any(_layer_has_content(layer) for layer in layers)
    return _layer_has_content(cache)


def _layer_has_content(layer: Any) -> bool:
    """A cache layer (or a pre-`layers` cache object) that already holds KV entries or recurrent state."""
    previous = getattr(layer, "has_previous_state", None)
    if isinstance(previous, dict) and any(previous.values()):
        return True
    if isinstance(previous, bool) and previous:
        return True
    if int(getattr(layer, "seqlen_offset", 0) or 0) > 0:
        return True
    if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
        # transformers' StaticLayer: initialized by its first update, so it holds a prefix; its length lives on the
        # device and reading it would wait for the GPU every step (a one-token prompt after `reset()` reads as decode)
        return bool(getattr(layer, "is_initialized", False))
    get_seq_length = getattr(layer, "get_seq_length", None)
    if callable(get_seq_length):
        try:
            return int(get_seq_length()) > 0
        except Exception:  # a layer type that cannot answer is treated as empty, never as an error in user code
            return False
    return False


class PhaseTracker:
    """Tags every module call inside `model`'s top-level forward with its phase and counts forwards per phase.

    Use as a context manager; the hooks are removed on exit, also on error. Re-entrant forwards (a model calling
    itself) keep the outer phase.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.forwards: Counter[str] = Counter()
        self._handles: list[Any] = []
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> PhaseTracker:
        self._handles = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, with_kwargs=True, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        while self._tokens:
            CURRENT_PHASE.reset(self._tokens.pop())

    def _pre(self, module, args, kwargs):
        outer = CURRENT_PHASE.get()
        phase = outer if outer is not None else phase_of_call(args, kwargs)
        if outer is None:
            self.forwards[phase] += 1
        self._tokens.append(CURRENT_PHASE.set(phase))

    def _post(self, module, args, kwargs, output):
        if self._tokens:
            CURRENT_PHASE.reset(self._tokens.pop())
