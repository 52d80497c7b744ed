"""Call boundaries: a module call as a function of named tensors.

    fn(inputs, weights, state, static) -> {"out", "out.1", ..., "state_out.<name>"}

- inputs: the call's tensor arguments, positional ones named by the forward's signature; tuples/lists flatten to
  `name.0`, `name.1`, dicts to `name.<key>`. None arguments are absent from `inputs` (the recipe keeps their place).
  An optional tensor node (merge_recipes) stands for an argument some calls pass as None: absent, it is None.
- static: JSON values: the call's non-tensor arguments (by argument name) and the module's scalar attributes
  (`variance_epsilon`, `head_dim`, `q_norm.variance_epsilon`, `attn_implementation`, `act_fn.__class__`, ...).
- weights: the module's parameters and buffers by qualified name.
- state: what the call reads and writes beyond its arguments (this layer's KV cache, SSM conv/ssm state), by name.
  The HF Cache object is never an input: a StateAdapter reads this layer's tensors out of it before the call
  (cloned: Mamba updates its conv/ssm state in place) and after it, and builds a one-layer cache back from them.
  An empty `state` means a fresh layer (nothing cached yet, e.g. the first prefill).
- outputs: a bare tensor is `out`; a tuple's element 0 is `out`, element i is `out.i` (nested: `out.i.j`).

`recipe` (JSON) rebuilds the original (args, kwargs) from those names and says which adapter owns the state.
"""
from __future__ import annotations

import copy
import inspect
import json
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

OUT = "out"
STATE_OUT = "state_out."
# Module attributes that identify an instance rather than its computation: excluded when grouping instances.
INSTANCE_KEYS = ("layer_idx",)
_JSON_SCALARS = (bool, int, float, str, type(None))


class UnsupportedBoundary(Exception):
    """A module call that cannot be expressed over named tensors (a non-JSON argument, state without an adapter)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class BoundaryCall:
    inputs: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]  # state-in, read before the call
    static: dict[str, Any]
    recipe: dict[str, Any]
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    state_out: dict[str, torch.Tensor] = field(default_factory=dict)  # state after the call, without the prefix

    def reference(self) -> dict[str, torch.Tensor]:
        """The outputs as call_reference returns them: outputs plus `state_out.<name>`."""
        return {**self.outputs, **{STATE_OUT + k: v for k, v in self.state_out.items()}}

    def structure_key(self, drop_instance_keys: bool = False) -> str:
        """Argument structure (names, tensor vs None vs static, state names) and static values, as one string."""
        static = {k: v for k, v in self.static.items() if not (drop_instance_keys and _is_instance_key(k))}
        payload = {"recipe": structural_recipe(self.recipe, bool(self.state)), "static": static,
                   "state": sorted(self.state)}
        return json.dumps(payload, sort_keys=True, default=str)

    def shape_key(self) -> str:
        """Every input and state tensor's dtype and shape (the CaseSig key)."""
        return shape_key(self.inputs, self.state)

    def cloned(self, to: str | torch.device | None = None) -> BoundaryCall:
        """A copy of every tensor (on `to`, e.g. "cpu", where given: the extraction keeps its cases in host memory,
        so the captures of a serving regime's corners do not fill the GPU the workload runs on)."""
        return BoundaryCall(_clone_all(self.inputs, to), _clone_all(self.state, to), copy.deepcopy(self.static),
                            copy.deepcopy(self.recipe), _clone_all(self.outputs, to), _clone_all(self.state_out, to))


def shape_key(inputs: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str:
    parts = [f"{k}:{_dtype_name(v.dtype)}{list(v.shape)}" for k, v in sorted({**inputs, **state}.items())]
    return "|".join(parts)


def _is_instance_key(key: str) -> bool:
    return key.rpartition(".")[2] in INSTANCE_KEYS


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _clone_all(tensors: dict[str, torch.Tensor], to: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    if to is not None:
        return {k: v.detach().to(to, copy=True) for k, v in tensors.items()}
    return {k: v.detach().clone() for k, v in tensors.items()}


# ----------------------------------------------------------------------------------------------- state adapters

class StateAdapter:
    """Reads one module's state out of whatever holds it, and builds that holder back from named tensors.

    `describe` returns the JSON the recipe keeps (`recipe["state"]`; the layer index is read from the module's
    `layer_idx` at call time, so one recipe serves every layer of a group); `build` returns the object to pass where the
    call had its cache (None for state that lives on the module) and a function that undoes what it changed.

    An adapter that can also put a kernel's state back defines `write_state(module, cache, state_out, spec,
    inputs=None)`, the mirror of `read_out`: afterwards the user's cache (or module) holds what the original forward
    would have left there, bookkeeping included, so the next call's phase, masks and positions are unchanged. It
    checks everything before it changes anything (a ValueError leaves the cache untouched). patch.py falls back for
    an adapter without it."""

    name: str = ""
    state_names: tuple[str, ...] = ()
    owned_attributes: tuple[str, ...] = ()  # tensor attributes of the module that this adapter reads and writes

    def describe(self, module: torch.nn.Module, cache: Any) -> dict[str, Any]:
        return {"adapter": self.name}

    def extract(self, module: torch.nn.Module, cache: Any, spec: dict[str, Any]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def build(self, module: torch.nn.Module, state: dict[str, torch.Tensor],
              spec: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
        raise NotImplementedError

    def clear(self, module: torch.nn.Module) -> None:
        """Drop state held on the module itself (before it is saved as a task's reference)."""


def layer_index(module: torch.nn.Module) -> int | None:
    """The module's index into the cache's layers, None where it has none."""
    idx = getattr(module, "layer_idx", None)
    if idx is None:  # a decoder layer: its cache layer is its attention's (HF keeps layer_idx on self_attn)
        idx = next((c.layer_idx for c in module.children() if isinstance(getattr(c, "layer_idx", None), int)), None)
    return idx if isinstance(idx, int) else None


def _layer_idx(module: torch.nn.Module) -> int:
    idx = layer_index(module)
    if idx is None:
        raise UnsupportedBoundary(f"{type(module).__name__} takes a cache but has no integer layer_idx")
    return idx


def _cache_layer(cache: Any, idx: int) -> Any:
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        raise UnsupportedBoundary(f"cache {type(cache).__name__}: expected a Cache with per-layer `layers`")
    return layers[idx] if idx < len(layers) else None


def _writable_layer(cache: Any, idx: int) -> Any:
    """The cache's layer `idx`, created as `Cache.update` would (a DynamicCache() without config grows lazily)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        raise ValueError(f"write_state: expected a Cache with per-layer `layers`, got {type(cache).__name__}")
    if idx >= len(layers):
        replicate = getattr(cache, "layer_class_to_replicate", None)
        if replicate is None:
            raise ValueError(f"write_state: cache has {len(layers)} layers and no layer class to create layer {idx}")
        while len(layers) <= idx:
            layers.append(replicate())
    return layers[idx]


def _check_like(name: str, got: torch.Tensor, like: torch.Tensor | None, dims: int, fixed: tuple[int, ...]) -> None:
    """A state tensor for write-back: a tensor of `dims` dims whose dims `fixed` match `like` (the state before)."""
    if not isinstance(got, torch.Tensor) or got.dim() != dims:
        raise ValueError(f"state_out.{name}: expected a {dims}-d tensor, got "
                         f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
    if like is not None and (got.dtype != like.dtype or got.device != like.device
                             or any(got.shape[d] != like.shape[d] for d in fixed)):
        raise ValueError(f"state_out.{name}: expected {like.dtype} on {like.device} with dims {list(fixed)} of "
                         f"{tuple(like.shape)}, got {got.dtype} on {got.device} {tuple(got.shape)}")


def _new_positions(inputs: dict[str, torch.Tensor] | None) -> int | None:
    """Number of new positions of an attention call ([B, S, H] hidden states), None when unknown."""
    if not inputs:
        return None
    x = inputs.get("hidden_states")
    if x is None:
        x = next((t for t in inputs.values() if t.dim() == 3), None)
    return None if x is None or x.dim() < 2 else int(x.shape[-2])


def _one_layer_cache(layer: Any, idx: int, placeholder: Callable[[], Any]) -> Any:
    """A DynamicCache holding `layer` at index `idx` (empty placeholders below it)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = None
    cache.layers = [placeholder() for _ in range(idx)] + [layer]
    return cache


class KVLayerAdapter(StateAdapter):
    """DynamicLayer / DynamicSlidingWindowLayer: `key_cache`, `value_cache` [B, Hkv, S_past, D]."""

    state_names = ("key_cache", "value_cache")

    def __init__(self, name: str):
        self.name = name

    def describe(self, module, cache):
        spec = {"adapter": self.name}
        if getattr(cache, "offloading", False):
            raise UnsupportedBoundary(f"{self.name}: an offloading cache (prefetch/offload around update) "
                                      f"is not adapted")
        layer = _cache_layer(cache, _layer_idx(module))
        if layer is not None and getattr(layer, "record_past", False):
            raise UnsupportedBoundary(f"{self.name}: past recording (speculative rollback) is not adapted")
        if self.name == "DynamicSlidingWindowLayer":
            window = getattr(layer, "sliding_window", None)
            if window is None:  # layer not created yet: DynamicCache(config) always creates it, so this is unexpected
                raise UnsupportedBoundary("DynamicSlidingWindowLayer: sliding_window unknown before the first call")
            spec["sliding_window"] = int(window)
        return spec

    def extract(self, module, cache, spec):
        layer = _cache_layer(cache, _layer_idx(module))
        if layer is None or not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            return {}
        return {"key_cache": layer.keys, "value_cache": layer.values}

    def _new_layer(self, spec):
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        if self.name == "DynamicSlidingWindowLayer":
            return DynamicSlidingWindowLayer(sliding_window=spec["sliding_window"])
        return DynamicLayer()

    def build(self, module, state, spec):
        from transformers.cache_utils import DynamicLayer

        layer = self._new_layer(spec)
        if state:
            keys, values = state["key_cache"].clone(), state["value_cache"].clone()
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = keys.shape[-2]  # read only by mask construction, outside the module
        return _one_layer_cache(layer, _layer_idx(module), DynamicLayer), lambda: None

    def read_out(self, module, cache, spec):
        layer = _cache_layer(cache, _layer_idx(module))
        if layer is None or not layer.is_initialized:
            return {}
        return {"key_cache": layer.keys, "value_cache": layer.values}

    def write_state(self, module, cache, state_out, spec, inputs=None):
        """The layer's keys/values after the call (what `read_out` reads) = `state_out.key_cache/value_cache`
        [B, Hkv, S, D]: the past (state-in) followed by the call's new positions, as `DynamicLayer.update` leaves them.
        A fresh layer gets `lazy_initialization` (dtype, device, is_initialized; the sliding-window tensor's device).
        DynamicSlidingWindowLayer: keeps the last `sliding_window - 1` positions (the cut `update` makes; a kernel
        may return them cut or uncut) and advances `cumulative_length` (its `get_seq_length` and mask sizes) by the
        call's new positions (`inputs["hidden_states"]` length; without inputs, by the growth of the keys)."""
        idx = _layer_idx(module)
        layer = _cache_layer(cache, idx)
        keys, values = state_out["key_cache"], state_out["value_cache"]
        old = layer.keys if layer is not None and layer.is_initialized and layer.keys is not None \
            and layer.keys.numel() else None
        _check_like("key_cache", keys, old, 4, (0, 1, 3))
        _check_like("value_cache", values, layer.values if old is not None else None, 4, (0, 1, 3))
        if keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype or keys.device != values.device:
            raise ValueError(f"state_out: expected key_cache and value_cache alike in [B, Hkv, S], got "
                             f"{tuple(keys.shape)} {keys.dtype}, {tuple(values.shape)} {values.dtype}")
        sliding = self.name == "DynamicSlidingWindowLayer"
        if sliding:
            window = int(spec.get("sliding_window") or getattr(layer, "sliding_window", 0))
            if window < 1:
                raise ValueError("write_state: DynamicSlidingWindowLayer without a sliding_window")
            past = old.shape[-2] if old is not None else 0
            new = _new_positions(inputs)
            if new is None:  # uncut keys grow by the new positions; cut ones are exact below the window
                new = keys.shape[-2] - past
            if new < 0 or (keys.shape[-2] != min(past + new, window - 1) and keys.shape[-2] != past + new):
                raise ValueError(f"state_out.key_cache: expected {past} past + {new} new positions "
                                 f"(or the last {window - 1}), got {keys.shape[-2]}")
            keys, values = keys[:, :, -window + 1:, :], values[:, :, -window + 1:, :]
        layer = _writable_layer(cache, idx)  # checks done: from here on the cache changes
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if sliding:
            layer.cumulative_length += new


class StaticLayerAdapter(StateAdapter):
    """StaticLayer / StaticSlidingWindowLayer (transformers' static KV cache, `generate(cache_implementation=
    "static")`): `key_cache`, `value_cache` = the preallocated `keys`/`values` [B, Hkv, S_max, D] whole (zeros past
    the length), `cache_len` = `cumulative_length`, a 0-d int64 device tensor: the positions written so far, the
    next write position. No host read anywhere (the dispatch runs inside a captured decode graph): a kernel reads the
    position from `cache_len`, writes k/v there in place and advances it, as `StaticLayer.update` does.

    StaticSlidingWindowLayer is adapted while its window is not full (its update then takes the same
    write-at-length branch; once full it rolls the window, a branch decided by the host counter
    `cumulative_length_int`, and the call falls back to the original forward, as kernels_runtime.graphs does)."""

    state_names = ("key_cache", "value_cache", "cache_len")

    def __init__(self, name: str):
        self.name = name

    def describe(self, module, cache):
        if getattr(cache, "offloading", False):
            raise UnsupportedBoundary(f"{self.name}: an offloading cache (prefetch/offload around update) "
                                      f"is not adapted")
        layer = _cache_layer(cache, _layer_idx(module))
        if layer is None:
            raise UnsupportedBoundary(f"{self.name}: the static cache has no layer {_layer_idx(module)}")
        spec = {"adapter": self.name, "max_cache_len": int(layer.max_cache_len)}
        if self.name == "StaticSlidingWindowLayer":
            if layer.cumulative_length_int >= layer.max_cache_len:
                raise UnsupportedBoundary("StaticSlidingWindowLayer: the window is full (the update rolls it)")
            spec["window_filling"] = True
        return spec

    def extract(self, module, cache, spec):
        layer = _cache_layer(cache, _layer_idx(module))
        if layer is None or not layer.is_initialized:
            return {}
        return {"key_cache": layer.keys, "value_cache": layer.values, "cache_len": layer.cumulative_length}

    read_out = extract

    def _new_layer(self, spec):
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

        if self.name == "StaticSlidingWindowLayer":  # its max_cache_len is min(window, the cache's): no roll below it
            return StaticSlidingWindowLayer(max_cache_len=spec["max_cache_len"],
                                            sliding_window=spec["max_cache_len"])
        return StaticLayer(max_cache_len=spec["max_cache_len"])

    def build(self, module, state, spec):
        if state:  # the cache's size is the state's (SIZED_BY_STATE: one task's cases may differ in it)
            spec = {**spec, "max_cache_len": int(state["key_cache"].shape[-2])}
        layer = self._new_layer(spec)
        if state:
            keys, values, n = state["key_cache"], state["value_cache"], state["cache_len"]
            layer.lazy_initialization(keys, values)
            layer.keys.copy_(keys)
            layer.values.copy_(values)
            layer.cumulative_length = n.detach().clone().to(device=keys.device, dtype=torch.int64).reshape(())
            if hasattr(layer, "cumulative_length_int"):
                layer.cumulative_length_int = int(n)  # host bookkeeping of the sliding layer, outside any graph
        return _one_layer_cache(layer, _layer_idx(module), lambda: self._new_layer(spec)), lambda: None

    def write_state(self, module, cache, state_out, spec, inputs=None):
        """The layer's `keys`/`values` = `state_out.key_cache/value_cache` [B, Hkv, S_max, D] (nothing to do where
        the kernel wrote the layer's own tensors in place; copied in otherwise: the addresses stay static for CUDA
        graphs), `cumulative_length` = `state_out.cache_len` (in place). A fresh layer (a prefill) is lazily
        initialized first. The sliding layer's host counter advances by the call's new positions."""
        idx = _layer_idx(module)
        layer = _cache_layer(cache, idx)
        if layer is None:
            raise ValueError(f"write_state: the static cache has no layer {idx}")
        keys, values, n = state_out["key_cache"], state_out["value_cache"], state_out["cache_len"]
        like = layer.keys if layer.is_initialized else None
        for name, t in (("key_cache", keys), ("value_cache", values)):
            _check_like(name, t, like, 4, (0, 1, 2, 3))
            if t.shape[-2] != layer.max_cache_len:
                raise ValueError(f"state_out.{name}: expected {layer.max_cache_len} positions (the static cache's "
                                 f"size), got {tuple(t.shape)}")
        if not isinstance(n, torch.Tensor) or n.numel() != 1 or n.is_floating_point():
            raise ValueError(f"state_out.cache_len: expected a one-element integer tensor, got {n!r}")
        new = _new_positions(inputs)
        if hasattr(layer, "cumulative_length_int"):
            if new is None or layer.cumulative_length_int + new > layer.max_cache_len:
                raise ValueError(f"write_state: {self.name} past its window ({layer.cumulative_length_int} + {new} "
                                 f"of {layer.max_cache_len}) rolls it: not adapted")
        if not layer.is_initialized:  # checks done: from here on the cache changes
            layer.lazy_initialization(keys, values)
        for dst, src in ((layer.keys, keys), (layer.values, values)):
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        if n.data_ptr() != layer.cumulative_length.data_ptr():
            layer.cumulative_length.copy_(n.reshape(()))
        if hasattr(layer, "cumulative_length_int"):
            layer.cumulative_length_int += new


class LinearAttentionLayerAdapter(StateAdapter):
    """LinearAttentionLayer (Mamba, Mamba2): `conv_state` [B, C, K], `ssm_state` (Mamba [B, D, N], Mamba2
    [B, H, P, N]). Only a layer with previous state has state-in; the module reads nothing from a fresh one."""

    name = "LinearAttentionLayer"
    state_names = ("conv_state", "ssm_state")

    def describe(self, module, cache):
        spec = {"adapter": self.name}
        if getattr(cache, "offloading", False):
            raise UnsupportedBoundary(f"{self.name}: an offloading cache is not adapted")
        layer = _cache_layer(cache, _layer_idx(module))
        if layer is not None:
            if layer.number_of_states != 1:
                raise UnsupportedBoundary(f"LinearAttentionLayer with {layer.number_of_states} states is not adapted")
            if layer.record_past:
                raise UnsupportedBoundary("LinearAttentionLayer: past recording (speculative rollback) is not adapted")
        return spec

    def extract(self, module, cache, spec):
        layer = _cache_layer(cache, _layer_idx(module))
        if layer is None or not layer.has_previous_state[0]:
            return {}
        return self._read(layer)

    @staticmethod
    def _read(layer) -> dict[str, torch.Tensor]:
        state = {}
        if layer.is_conv_states_initialized[0]:
            state["conv_state"] = layer.conv_states[0]
        if layer.is_recurrent_states_initialized[0]:
            state["ssm_state"] = layer.recurrent_states[0]
        return state

    def build(self, module, state, spec):
        from transformers.cache_utils import LinearAttentionLayer

        layer = LinearAttentionLayer()
        if "conv_state" in state:
            conv = state["conv_state"]
            layer.lazy_initialization(conv_states=conv, conv_kernel_size=conv.shape[-1])
            layer.conv_states[0].copy_(conv)
        if "ssm_state" in state:
            layer.lazy_initialization(recurrent_states=state["ssm_state"])
            layer.recurrent_states[0].copy_(state["ssm_state"])
        layer.has_previous_state[0] = bool(state)
        return _one_layer_cache(layer, _layer_idx(module), LinearAttentionLayer), lambda: None

    def read_out(self, module, cache, spec):
        layer = _cache_layer(cache, _layer_idx(module))
        return {} if layer is None else self._read(layer)

    def write_state(self, module, cache, state_out, spec, inputs=None):
        """`conv_states[0]` = `state_out.conv_state` [B, C, K], `recurrent_states[0]` = `state_out.ssm_state`, both
        copied in place (the layer keeps static addresses for CUDA graphs, as `update_conv_state` /
        `update_recurrent_state` do); a fresh layer is lazily initialized from them (dtype, device, conv_kernel_size,
        is_*_initialized). `has_previous_state[0]` becomes True, as after any call that had a cache: the next call
        takes the one-token decode path (and `Cache.has_previous_state` answers as after the original)."""
        idx = _layer_idx(module)
        layer = _cache_layer(cache, idx)
        conv, ssm = state_out["conv_state"], state_out["ssm_state"]
        old_conv = layer.conv_states[0] if layer is not None and layer.is_conv_states_initialized[0] else None
        old_ssm = layer.recurrent_states[0] if layer is not None and layer.is_recurrent_states_initialized[0] else None
        _check_like("conv_state", conv, old_conv, 3, (0, 1, 2))
        width = getattr(module, "conv_kernel_size", None)
        if isinstance(width, int) and conv.shape[-1] != width:
            raise ValueError(f"state_out.conv_state: expected the last {width} inputs (conv_kernel_size), "
                             f"got {conv.shape[-1]}")
        if not isinstance(ssm, torch.Tensor) or ssm.dim() < 3 or ssm.shape[0] != conv.shape[0]:
            raise ValueError(f"state_out.ssm_state: expected [B={conv.shape[0]}, ...] (3-d or more), got "
                             f"{tuple(ssm.shape) if isinstance(ssm, torch.Tensor) else type(ssm).__name__}")
        if old_ssm is not None and (ssm.shape != old_ssm.shape or ssm.device != old_ssm.device):
            raise ValueError(f"state_out.ssm_state: expected {tuple(old_ssm.shape)} on {old_ssm.device}, "
                             f"got {tuple(ssm.shape)} on {ssm.device}")
        if layer is not None and (layer.number_of_states != 1 or layer.record_past):
            raise ValueError("write_state: LinearAttentionLayer with several states or past recording is not adapted")
        layer = _writable_layer(cache, idx)  # checks done: from here on the cache changes
        if not layer.is_conv_states_initialized[0]:
            layer.lazy_initialization(conv_states=conv, conv_kernel_size=conv.shape[-1])
        if conv.data_ptr() != layer.conv_states[0].data_ptr():
            layer.conv_states[0].copy_(conv)
        if not layer.is_recurrent_states_initialized[0]:
            layer.lazy_initialization(recurrent_states=ssm)
        if ssm.data_ptr() != layer.recurrent_states[0].data_ptr():
            layer.recurrent_states[0].copy_(ssm)
        layer.has_previous_state[0] = True


class RecurrentGemmaBlockAdapter(StateAdapter):
    """RecurrentGemmaRecurrentBlock keeps its state on itself (transformers 5.17): `conv_state` = `conv1d_state`
    [B, W, K-1], `rg_lru_state` = `rg_lru.recurrent_states` [B, W] (fp32). The cache it is handed is unused by its
    forward in 5.17 and is passed back as None."""

    name = "RecurrentGemmaRecurrentBlock"
    state_names = ("conv_state", "rg_lru_state")
    owned_attributes = ("conv1d_state", "rg_lru.recurrent_states")

    def extract(self, module, cache, spec):
        return self.read_out(module, None, spec)

    def read_out(self, module, cache, spec):
        state = {}
        if module.conv1d_state is not None:
            state["conv_state"] = module.conv1d_state
        if module.rg_lru.recurrent_states is not None:
            state["rg_lru_state"] = module.rg_lru.recurrent_states
        return state

    def build(self, module, state, spec):
        saved = (module.conv1d_state, module.rg_lru.recurrent_states)
        conv, lru = state.get("conv_state"), state.get("rg_lru_state")
        module.conv1d_state = None if conv is None else conv.clone()
        module.rg_lru.recurrent_states = None if lru is None else lru.clone()

        def restore():
            module.conv1d_state, module.rg_lru.recurrent_states = saved

        return None, restore

    def clear(self, module):
        module.conv1d_state = None
        module.rg_lru.recurrent_states = None

    def write_state(self, module, cache, state_out, spec, inputs=None):
        """`module.conv1d_state` = `state_out.conv_state` [B, W, K-1], `module.rg_lru.recurrent_states` =
        `state_out.rg_lru_state` [B, W] (fp32), assigned as the forward assigns them (new tensors, no copy). The HF
        cache object is untouched (the forward never writes to it); its attention layers keep the bookkeeping."""
        conv, lru = state_out["conv_state"], state_out["rg_lru_state"]
        k = module.conv1d_width - 1
        if not isinstance(conv, torch.Tensor) or conv.dim() != 3 or conv.shape[1:] != (module.hidden_size, k):
            raise ValueError(f"state_out.conv_state: expected [B, {module.hidden_size}, {k}], got "
                             f"{tuple(conv.shape) if isinstance(conv, torch.Tensor) else type(conv).__name__}")
        if not isinstance(lru, torch.Tensor) or tuple(lru.shape) != (conv.shape[0], module.lru_width):
            raise ValueError(f"state_out.rg_lru_state: expected [{conv.shape[0]}, {module.lru_width}], got "
                             f"{tuple(lru.shape) if isinstance(lru, torch.Tensor) else type(lru).__name__}")
        if lru.dtype != torch.float32:
            raise ValueError(f"state_out.rg_lru_state: expected float32 (HF keeps the RG-LRU state in fp32), "
                             f"got {lru.dtype}")
        module.conv1d_state = conv
        module.rg_lru.recurrent_states = lru


# Keyed by the cache layer's class name (state in an HF Cache) or the module's class name (state on the module).
# Exact names: a subclass (QuantizedLayer, ...) stores its state differently and is not adapted.
CACHE_LAYER_ADAPTERS: dict[str, StateAdapter] = {
    "DynamicLayer": KVLayerAdapter("DynamicLayer"),
    "DynamicSlidingWindowLayer": KVLayerAdapter("DynamicSlidingWindowLayer"),
    "LinearAttentionLayer": LinearAttentionLayerAdapter(),
    "StaticLayer": StaticLayerAdapter("StaticLayer"),
    "StaticSlidingWindowLayer": StaticLayerAdapter("StaticSlidingWindowLayer"),
}
MODULE_ADAPTERS: dict[str, StateAdapter] = {
    "RecurrentGemmaRecurrentBlock": RecurrentGemmaBlockAdapter(),
}


def register_state_adapter(key: str, adapter: StateAdapter, *, on_module: bool = False) -> None:
    (MODULE_ADAPTERS if on_module else CACHE_LAYER_ADAPTERS)[key] = adapter


def clear_module_state(model: torch.nn.Module) -> list[str]:
    """Drop the per-step state that modules with a module adapter keep on themselves (RecurrentGemma's recurrent
    blocks); the next prefill builds it afresh. Returns the cleared modules' names. Needed after a run whose
    tensors cannot be read any more (a torch.compile CUDA-graph run that failed leaves graph outputs there)."""
    cleared = []
    for name, module in model.named_modules():
        adapter = MODULE_ADAPTERS.get(type(module).__name__)
        if adapter is not None:
            adapter.clear(module)
            cleared.append(name)
    return cleared


def adapter_by_name(name: str) -> StateAdapter:
    for registry in (CACHE_LAYER_ADAPTERS, MODULE_ADAPTERS):
        for adapter in registry.values():
            if adapter.name == name:
                return adapter
    raise UnsupportedBoundary(f"state adapter: expected one of {sorted({**CACHE_LAYER_ADAPTERS, **MODULE_ADAPTERS})}, "
                              f"got {name!r}")


def state_adapter_for(module: torch.nn.Module, cache: Any, idx: int | None = None) -> StateAdapter | None:
    """The adapter owning `module`'s state, None for a stateless call; UnsupportedBoundary when state is there but
    no adapter knows it. idx: the module's layer index where the caller already knows it."""
    own = MODULE_ADAPTERS.get(type(module).__name__)
    if own is not None:
        return own
    if cache is None:
        return None
    layer = _cache_layer(cache, _layer_idx(module) if idx is None else idx)
    layer_cls = type(layer) if layer is not None else getattr(cache, "layer_class_to_replicate", None)
    name = getattr(layer_cls, "__name__", type(cache).__name__)
    adapter = CACHE_LAYER_ADAPTERS.get(name)
    if adapter is None:
        raise UnsupportedBoundary(f"no state adapter for cache layer {name} (cache {type(cache).__name__}); "
                                  f"adapted: {sorted(CACHE_LAYER_ADAPTERS)}")
    return adapter


# ---------------------------------------------------------------------------------------------------- capture

_CACHE_CLASS: Any = None  # transformers.cache_utils.Cache, imported on first use (transformers stays lazy)


def _is_cache(value: Any) -> bool:
    global _CACHE_CLASS
    if _CACHE_CLASS is None:
        try:
            from transformers.cache_utils import Cache
        except ImportError:  # transformers absent: nothing can be an HF cache
            return False
        _CACHE_CLASS = Cache
    return isinstance(value, _CACHE_CLASS)


_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward function -> (names, var name)


def _signature_names(fn: Callable) -> tuple[tuple[str, ...], str]:
    """The positional parameter names of a (bound) forward and the name of its *args."""
    names, var = [], "args"
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            var = p.name
    return tuple(names), var


def _cached_signature_names(module: torch.nn.Module) -> tuple[tuple[str, ...], str]:
    fn = module.forward
    func = getattr(fn, "__func__", None)  # a bound method: one signature per function, whatever the instance
    if func is None or getattr(fn, "__self__", None) is not module:
        return _signature_names(fn)
    names = _SIGNATURES.get(func)
    if names is None:
        names = _SIGNATURES[func] = _signature_names(fn)
    return names


def _name_positionals(names: tuple[str, ...], var: str, n: int) -> list[str]:
    return [names[i] if i < len(names) else f"{var}.{i - len(names)}" for i in range(n)]


def _positional_names(module: torch.nn.Module, n: int) -> list[str]:
    return _name_positionals(*_cached_signature_names(module), n)


class _Flattener:
    """Walks (args, kwargs) into named tensors + static values, recording the recipe nodes that rebuild them."""

    def __init__(self):
        self.inputs: dict[str, torch.Tensor] = {}
        self.static: dict[str, Any] = {}
        self.cache: Any = None

    def node(self, value: Any, name: str) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            self.inputs[name] = value
            return {"kind": "tensor", "name": name}
        if value is None:
            return {"kind": "none"}
        if _is_cache(value):
            if self.cache is not None and self.cache is not value:
                raise UnsupportedBoundary(f"argument {name}: a second cache object in one call")
            self.cache = value
            return {"kind": "cache"}
        if isinstance(value, (tuple, list)):
            items = [self.node(v, f"{name}.{i}") for i, v in enumerate(value)]
            return {"kind": type(value).__name__ if type(value) in (tuple, list) else "tuple", "items": items}
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {"kind": "dict", "items": {k: self.node(v, f"{name}.{k}") for k, v in value.items()}}
        if isinstance(value, _JSON_SCALARS):
            self.static[name] = value
            return {"kind": "static", "name": name}
        raise UnsupportedBoundary(f"argument {name}: expected a tensor, None, a JSON value or an HF cache, "
                                  f"got {type(value).__name__}")


def _json_value(value: Any) -> tuple[bool, Any]:
    if isinstance(value, _JSON_SCALARS):
        return True, value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _JSON_SCALARS) for v in value):
        return True, list(value)
    return False, None


def module_static(module: torch.nn.Module) -> dict[str, Any]:
    """The module's (and its submodules') scalar attributes, the class of parameterless submodules (activations),
    and the attention implementation from its config."""
    static: dict[str, Any] = {}
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        for attr, value in vars(sub).items():
            if attr.startswith("_") or attr == "training":
                continue
            ok, value = _json_value(value)
            if ok:
                static[dot + attr] = value
        if prefix and not any(True for _ in sub.parameters()) and not any(True for _ in sub.buffers()):
            static[dot + "__class__"] = type(sub).__name__
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if isinstance(impl, str):
        static["attn_implementation"] = impl
    return static


def tensor_attributes(module: torch.nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Tensors held as plain attributes of the module or its submodules (not parameters or buffers), by qualified
    name, with their identity and shape. A call that changes them keeps state that the boundary must adapt."""
    adapter = MODULE_ADAPTERS.get(type(module).__name__)
    owned = set(adapter.owned_attributes) if adapter is not None else set()
    found = {}
    for prefix, sub in module.named_modules():
        for attr, value in vars(sub).items():
            name = f"{prefix}.{attr}" if prefix else attr
            if isinstance(value, torch.Tensor) and name not in owned:
                found[name] = (id(value), tuple(value.shape))
    return found


def hidden_state_writes(before: dict, after: dict) -> list[str]:
    """Names of tensor attributes that a call created, replaced or dropped (see tensor_attributes)."""
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


def capture_boundary(module: torch.nn.Module, args: tuple, kwargs: dict, outputs: Any = None, *,
                     clone: bool = True) -> BoundaryCall:
    """Name a call's tensors. Call it BEFORE the module runs (it reads the state-in); then `record_outputs` after.
    With `outputs` given in the same call the module must be stateless (its state-in would already be overwritten).
    `clone=False` keeps references (cheap, for signatures only); `.cloned()` copies later, still before the call."""
    flat = _Flattener()
    arg_nodes = [flat.node(a, n) for a, n in zip(args, _positional_names(module, len(args)))]
    kw_nodes = {k: flat.node(v, k) for k, v in kwargs.items()}
    adapter = state_adapter_for(module, flat.cache)
    state_spec = adapter.describe(module, flat.cache) if adapter is not None else None
    state = adapter.extract(module, flat.cache, state_spec) if adapter is not None else {}
    static = dict(flat.static)
    for key, value in module_static(module).items():
        static[key if key not in static else f"module.{key}"] = value
    recipe = {"args": arg_nodes, "kwargs": kw_nodes, "state": state_spec}
    call = BoundaryCall(inputs=dict(flat.inputs), state=dict(state), static=static, recipe=recipe)
    if clone:
        call.inputs, call.state = _clone_all(call.inputs), _clone_all(call.state)
    if outputs is not None:
        if state_spec is not None:
            raise ValueError(f"capture_boundary: expected no outputs for stateful {type(module).__name__} "
                             f"(call it before the module runs, then record_outputs), got outputs")
        record_outputs(call, module, outputs, cache=None, clone=clone)
    return call


# Argument kinds in a call's structure key (CallBinder): what the recipe node of an argument depends on.
_K_TENSOR, _K_NONE, _K_STATIC, _K_CACHE = "t", "n", "s", "c"


class CallBinder:
    """capture_boundary(module, args, kwargs, clone=False) for one module instance, called on every call (the patched
    dispatch): what does not change between calls is computed once. Cached: the forward's positional argument names
    (from `forward`, captured at construction), the module's static attributes (`module_static`, on the first call;
    attributes changed later are not seen), and per argument structure (the kinds and names of the arguments, tuple
    lengths, dict keys: a `structure key`) the recipe and the static names. A call with another structure builds and
    caches its own recipe; the state (adapter, spec, state-in) is read from the cache object on every call."""

    def __init__(self, module: torch.nn.Module, forward: Callable | None = None):
        self.names, self.var = _signature_names(forward if forward is not None else module.forward)
        self._module_static: dict[str, Any] | None = None
        self._plans: dict[Any, tuple[dict[str, Any], dict[str, Any]]] = {}  # structure key -> (recipe, module static)
        # positional-only calls of tensors to a module without state (the common case: a norm, an MLP, a mixer
        # called outside a cache): argument count -> (names, recipe with "state": None, module static)
        self._fast: dict[int, tuple[tuple[str, ...], dict[str, Any], dict[str, Any]]] = {}

    def _walk(self, value: Any, name: str, inputs: dict, static: dict, found: list) -> Any:
        """Name one argument's tensors and static values; returns its structure key (raises like _Flattener)."""
        if isinstance(value, torch.Tensor):
            inputs[name] = value
            return _K_TENSOR
        if value is None:
            return _K_NONE
        if isinstance(value, (tuple, list)):
            kind = type(value).__name__ if type(value) in (tuple, list) else "tuple"
            return kind, tuple(self._walk(v, f"{name}.{i}", inputs, static, found) for i, v in enumerate(value))
        if isinstance(value, _JSON_SCALARS):
            static[name] = value
            return _K_STATIC
        if _is_cache(value):
            if found and found[0] is not value:
                raise UnsupportedBoundary(f"argument {name}: a second cache object in one call")
            found[:] = [value]
            return _K_CACHE
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return "dict", tuple((k, self._walk(v, f"{name}.{k}", inputs, static, found)) for k, v in value.items())
        raise UnsupportedBoundary(f"argument {name}: expected a tensor, None, a JSON value or an HF cache, "
                                  f"got {type(value).__name__}")

    def _plan(self, module: torch.nn.Module, key: Any, args: tuple, kwargs: dict,
              call_static: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        flat = _Flattener()
        arg_nodes = [flat.node(a, n) for a, n in zip(args, _name_positionals(self.names, self.var, len(args)))]
        recipe = {"args": arg_nodes, "kwargs": {k: flat.node(v, k) for k, v in kwargs.items()}}
        if self._module_static is None:
            self._module_static = module_static(module)
        own = {(k if k not in call_static else f"module.{k}"): v for k, v in self._module_static.items()}
        plan = self._plans[key] = (recipe, own)
        return plan

    def bind(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> BoundaryCall:
        """The call's BoundaryCall over references (no clones): inputs, state-in, static, recipe. The recipe is
        shared between calls of one structure: read it, do not change it (capture_boundary builds its own)."""
        if not kwargs:
            fast = self._fast.get(len(args))
            if fast is not None:
                for a in args:
                    if not isinstance(a, torch.Tensor):
                        break
                else:
                    names, recipe, own = fast
                    return BoundaryCall(dict(zip(names, args)), {}, dict(own), recipe)
        inputs: dict[str, torch.Tensor] = {}
        call_static: dict[str, Any] = {}
        found: list = []
        names, n_names, walk, tensor = self.names, len(self.names), self._walk, torch.Tensor
        keys = []
        for i, a in enumerate(args):
            name = names[i] if i < n_names else f"{self.var}.{i - n_names}"
            if isinstance(a, tensor):  # the common case, inline
                inputs[name] = a
                keys.append(_K_TENSOR)
            else:
                keys.append(walk(a, name, inputs, call_static, found))
        for k, v in kwargs.items():
            if isinstance(v, tensor):
                inputs[k] = v
                keys.append((k, _K_TENSOR))
            else:
                keys.append((k, walk(v, k, inputs, call_static, found)))
        key = (len(args), *keys)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(module, key, args, kwargs, call_static)
        recipe, own = plan
        if found:
            cache = found[0]
            adapter = state_adapter_for(module, cache)
        else:
            cache = None
            adapter = MODULE_ADAPTERS.get(type(module).__name__) if MODULE_ADAPTERS else None
        if adapter is None:
            state: dict[str, torch.Tensor] = {}
            recipe = {**recipe, "state": None}
            if not kwargs and not call_static and all(k == _K_TENSOR for k in keys):
                self._fast[len(args)] = (tuple(inputs), recipe, own)
        else:
            spec = adapter.describe(module, cache)
            recipe = {**recipe, "state": spec}
            state = dict(adapter.extract(module, cache, spec))
        return BoundaryCall(inputs, state, {**call_static, **own} if call_static else dict(own), recipe)


def record_outputs(call: BoundaryCall, module: torch.nn.Module, outputs: Any, cache: Any = None, *,
                   clone: bool = True, to: str | torch.device | None = None) -> BoundaryCall:
    """Fill `call.outputs` and `call.state_out` after the module ran; `cache` is the cache object of the call.
    clone: copies (on `to` where given, as `BoundaryCall.cloned`)."""
    named, node = flatten_outputs(outputs)
    call.recipe["outputs"] = node
    state_spec = call.recipe.get("state")
    state_out = {}
    if state_spec is not None:
        state_out = adapter_by_name(state_spec["adapter"]).read_out(module, cache, state_spec)
    call.outputs = _clone_all(named, to) if clone else named
    call.state_out = _clone_all(state_out, to) if clone else dict(state_out)
    return call


def capture_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> BoundaryCall:
    """Capture, run the module, record its outputs and state-out: one observed call."""
    call = capture_boundary(module, args, kwargs)
    with torch.inference_mode():
        outputs = module(*args, **kwargs)
    return record_outputs(call, module, outputs, cache=find_cache(args, kwargs))


def find_cache(args: tuple, kwargs: dict) -> Any:
    for value in (*args, *kwargs.values()):
        if _is_cache(value):
            return value
    return None


def _out_name(path: tuple[int, ...]) -> str:
    if path in ((), (0,)):
        return OUT
    return OUT + "." + ".".join(map(str, path))


def flatten_outputs(outputs: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Outputs by boundary name, plus the recipe node that rebuilds the structure (`rebuild_outputs`)."""
    named: dict[str, torch.Tensor] = {}

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            name = _out_name(path)
            named[name] = value
            return {"kind": "tensor", "name": name}
        if value is None:
            return {"kind": "none"}
        if isinstance(value, (tuple, list)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {"kind": kind, "items": [walk(v, (*path, i)) for i, v in enumerate(value)]}
        raise UnsupportedBoundary(f"output {_out_name(path)}: expected tensors, tuples or None, "
                                  f"got {type(value).__name__}")

    return named, walk(outputs, ())


def rebuild_outputs(node: dict[str, Any], result: dict[str, torch.Tensor]) -> Any:
    """The forward's return value from a boundary result (the inverse of flatten_outputs)."""
    return _rebuild(node, result, {}, None)


# ---------------------------------------------------------------------------------------------------- reference

def weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by qualified name, detached (they share storage with the module)."""
    named = {k: v.detach() for k, v in module.named_parameters()}
    named.update({k: v.detach() for k, v in module.named_buffers()})
    return named


def boundary_names(module: torch.nn.Module, call: BoundaryCall | None = None) -> dict[str, list[str]]:
    """Boundary names of a module: weights always; inputs, state and outputs when a captured call is given (they
    depend on how the module is called)."""
    names = {"weights": list(weights_of(module))}
    if call is not None:
        names.update(inputs=list(call.inputs), state=list(call.state), outputs=list(call.reference()))
    return names


def _rebuild(node: dict[str, Any], inputs: dict[str, torch.Tensor], static: dict[str, Any], cache: Any) -> Any:
    kind = node["kind"]
    if kind == "tensor":
        if node.get("optional") and node["name"] not in inputs:
            return None
        if node["name"] not in inputs:
            raise KeyError(f"boundary: expected tensor {node['name']!r}, got names {sorted(inputs)}")
        return inputs[node["name"]]
    if kind == "none":
        return None
    if kind == "cache":
        return cache
    if kind == "static":
        return static[node["name"]]
    if kind in ("tuple", "list"):
        items = [_rebuild(n, inputs, static, cache) for n in node["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _rebuild(n, inputs, static, cache) for k, n in node["items"].items()}
    raise ValueError(f"boundary recipe: expected a known node kind, got {kind!r}")


# State-spec values that calls carrying state read from the state's own tensors (a static cache's size is its
# key_cache's positions): calls on caches of different sizes (a serving regime's prompt lengths) are one boundary
SIZED_BY_STATE = ("max_cache_len",)


def structural_recipe(recipe: dict[str, Any], has_state: bool) -> dict[str, Any]:
    """The recipe as a boundary's identity: without the state-spec values SIZED_BY_STATE where the call has state."""
    if not has_state or not recipe.get("state"):
        return recipe
    return {**recipe, "state": {k: v for k, v in recipe["state"].items() if k not in SIZED_BY_STATE}}


def merge_recipes(a: dict[str, Any], b: dict[str, Any], has_state: bool = False) -> dict[str, Any] | None:
    """One recipe rebuilding the calls of both `a` and `b`, or None where they differ other than by an argument that
    is None in one and a tensor in the other (HF passes no attention mask for an unpadded batch and a bool one for a
    padded batch): that argument becomes an optional tensor node, rebuilt as None for inputs without it. Everything
    else (state, outputs, static nodes, nesting) must be equal, but for calls with state (`has_state`) the values
    their state's tensors carry (SIZED_BY_STATE: `a`'s are kept)."""
    sa, sb = structural_recipe(a, has_state), structural_recipe(b, has_state)
    if {k: v for k, v in sa.items() if k not in ("args", "kwargs")} != \
            {k: v for k, v in sb.items() if k not in ("args", "kwargs")}:
        return None
    if len(a["args"]) != len(b["args"]) or set(a["kwargs"]) != set(b["kwargs"]):
        return None
    args = [_merge_node(x, y) for x, y in zip(a["args"], b["args"])]
    kwargs = {k: _merge_node(v, b["kwargs"][k]) for k, v in a["kwargs"].items()}
    if any(n is None for n in (*args, *kwargs.values())):
        return None
    return {**a, "args": args, "kwargs": kwargs}


def _merge_node(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    if a == b:
        return a
    kinds = {a["kind"], b["kind"]}
    if kinds == {"tensor", "none"}:
        return {**(a if a["kind"] == "tensor" else b), "optional": True}
    if kinds == {"tensor"}:  # one side optional already
        return {**a, "optional": True} if a["name"] == b["name"] else None
    if len(kinds) != 1 or a["kind"] not in ("tuple", "list", "dict") or len(a["items"]) != len(b["items"]):
        return None
    if a["kind"] == "dict":
        if set(a["items"]) != set(b["items"]):
            return None
        items: Any = {k: _merge_node(v, b["items"][k]) for k, v in a["items"].items()}
        ok = all(n is not None for n in items.values())
    else:
        items = [_merge_node(x, y) for x, y in zip(a["items"], b["items"])]
        ok = all(n is not None for n in items)
    return {**a, "items": items} if ok else None


def recipe_inputs(recipe: dict[str, Any]) -> list[str]:
    """The input names a recipe reads, in argument order (its optional ones included)."""
    names: list[str] = []

    def walk(node):
        if node["kind"] == "tensor":
            names.append(node["name"])
        elif node["kind"] in ("tuple", "list"):
            for n in node["items"]:
                walk(n)
        elif node["kind"] == "dict":
            for n in node["items"].values():
                walk(n)

    for node in (*recipe.get("args", ()), *recipe.get("kwargs", {}).values()):
        walk(node)
    return names


def rebuild_call(recipe: dict[str, Any], inputs: dict[str, torch.Tensor], static: dict[str, Any],
                 cache: Any = None) -> tuple[tuple, dict]:
    """The original (args, kwargs) from named tensors, static values and a cache object."""
    args = tuple(_rebuild(n, inputs, static, cache) for n in recipe["args"])
    kwargs = {k: _rebuild(n, inputs, static, cache) for k, n in recipe["kwargs"].items()}
    return args, kwargs


_CPU_ALIGNMENT = 64  # bytes; what the CPU allocator guarantees and the vectorised CPU GEMM paths assume


def _aligned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors copied to fresh (aligned) memory where they are not: tensors read from a safetensors file can sit at
    any offset, and oneDNN/MKL take a different summation order for unaligned operands, which breaks bitwise
    reproduction of the captured outputs."""
    return {k: v.clone() if v.device.type == "cpu" and v.data_ptr() % _CPU_ALIGNMENT else v
            for k, v in tensors.items()}


def call_reference(module: torch.nn.Module, weights: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor],
                   state: dict[str, torch.Tensor], static: dict[str, Any],
                   recipe: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Run the original forward over named tensors: a fresh cache holding `state` for the module's layer,
    `torch.func.functional_call(module, weights, args, kwargs)`; returns outputs and `state_out.<name>`.
    Neither `state` nor the module's own state is modified."""
    weights, inputs, state = _aligned(weights), _aligned(inputs), _aligned(state)
    state_spec = recipe.get("state")
    adapter = adapter_by_name(state_spec["adapter"]) if state_spec else None
    cache, restore = adapter.build(module, state, state_spec) if adapter else (None, lambda: None)
    try:
        args, kwargs = rebuild_call(recipe, inputs, static, cache)
        with torch.inference_mode():
            outputs = torch.func.functional_call(module, weights, args, kwargs)
            named, _ = flatten_outputs(outputs)
            result = dict(named)
            if adapter is not None:
                state_out = adapter.read_out(module, cache, state_spec)
                result.update({STATE_OUT + k: v.clone() for k, v in state_out.items()})
    finally:
        restore()
    return result
