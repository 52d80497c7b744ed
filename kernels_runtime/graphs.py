"""CUDA-graph replay of a model's one-token decode step (and, for Mamba / Mamba2 caches, of its prompt's forward).

A decode step of a small or state-space model is host-bound: every launch costs the host more than the GPU spends
on it (a Triton call's host time is tens of µs, a small layer's GPU work a few µs).
Replacing kernels cannot remove that cost; replaying the whole step as one CUDA graph does. This module wraps
the top-level model's `forward` (an instance attribute, as patch.py does for modules) so that a decode call

  * input_ids [B, 1] (no inputs_embeds), every other tensor argument of a fixed shape,
  * a cache whose every layer keeps its state at static addresses (see STATIC_LAYERS: Mamba / Mamba2's
    LinearAttentionLayer, transformers' StaticLayer and StaticSlidingWindowLayer from
    `generate(..., cache_implementation="static")`; a DynamicLayer KV cache grows each token and is not graphed),
    with any host-side counter (HOST_COUNTERS) advanced by the wrapper after each replay, and positions the model
    would derive from such a counter passed in as `position_ids`,
  * state kept on modules outside the cache (RecurrentGemma's recurrent blocks assign a new `conv1d_state` and
    `rg_lru.recurrent_states` each step) of a fixed shape: adopted into buffers the graph owns, the captured step
    ending with a copy of the new values there; state that grows is refused,

is captured once per call signature and then replayed: the arguments are copied into static buffers, the graph runs,
and the outputs are returned as fresh tensors (clones: a caller may keep them across steps). The step that triggers a
capture runs eagerly (it is also the warm-up: Triton JIT, cuBLAS workspaces); then the graph is captured from the
state before that step and replayed twice, and its logits and state must match two eager steps with the same
arguments (kernels_runtime.tolerances; the second catches values the host froze at capture) or the signature is
refused for good and runs eagerly. Every refusal has a reason in
`stats()`.

The cache tensors move into buffers the graph owns: on a decode call with a new cache (each `generate` makes one),
its state is copied in once and its layers are pointed at the graph's buffers (the layers' contract is in-place
updates at static addresses, which is what `LinearAttentionLayer` does itself). A cache bound before is first
given back copies of its state, so two live caches never share storage.

A prompt's forward (input_ids [B, L], L > 1) on a fresh cache whose every layer is a LinearAttentionLayer (Mamba,
Mamba2: the prefill allocates the state and writes it whole) is graphed per prompt signature too, from the
signature's second call (`_prefill_call`): on a small model it is host-bound (its kernels take a fraction of its
wall time). The graph records the prefill on a private fresh copy of the cache, so
its state tensors come from the graph's pool; a replay hands them to the caller's cache with the bookkeeping the eager
prefill left there (flags, kernel sizes), and a cache still holding them from an earlier replay gets copies first.
A prefill that assigns state kept on modules is refused. `enable_decode_graphs(prefill=False)` leaves prefill eager.

Patched modules (patch.py) are captured with the rest: guard checks, phase predicate and dispatch run on the host at
capture time only, so their counters count the capture, not the replays.

Tests on the CPU use `backend="emulate"`: the same binding, static buffers, validation and refusals, with the
"graph" being the ATen ops the captured step dispatched, replayed with their Python arguments as recorded, so a
host value freezes at capture as in a CUDA graph (and a host read during capture fails). Triton kernels under the
interpreter are not ATen ops: steps with them use `backend="rerun"`, which calls the captured closure again (host
values recomputed). Only a GPU shows the gain.
"""
from __future__ import annotations

import copy
import functools
import inspect
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from kernels_runtime.tolerances import FLOOR_MAX_REL_L2, compare, rel_l2

_ATTR = "_llm4llm_decode_graphs"  # on the top-level model: the DecodeGraphs that wraps its forward

# Cache layer classes (exact names) whose state lives at static addresses, and where: a per-layer dict of tensors
# (LinearAttentionLayer: Mamba, Mamba2) or a tensor attribute (StaticLayer: transformers' static KV cache, whose
# write position `cumulative_length` is a device tensor advanced in place; StaticSlidingWindowLayer: the same while
# its window is not full).
STATIC_LAYERS: dict[str, tuple[str, ...]] = {
    "LinearAttentionLayer": ("conv_states", "recurrent_states"),
    "StaticLayer": ("keys", "values", "cumulative_length"),
    "StaticSlidingWindowLayer": ("keys", "values", "cumulative_length"),
}
# Host-side bookkeeping a layer's update does besides its tensors: a Python int counter advanced by the tokens
# written. A replay runs no Python, so the wrapper advances it after each replay. StaticSlidingWindowLayer also
# branches on it (filling, then rolling the window): a step is graphed only while the write stays inside the window,
# the branch every replay then takes (transformers 5.17, cache_utils.StaticSlidingWindowLayer.update).
HOST_COUNTERS: dict[str, str] = {"StaticSlidingWindowLayer": "cumulative_length_int"}
_CACHE_KWARGS = ("cache_params", "past_key_values")
# Prefill graphs: a prompt's forward on a fresh cache whose every layer is one of these (its state allocated by the
# prefill itself and written whole: nothing of an earlier state is read).
PREFILL_LAYERS = ("LinearAttentionLayer",)
PREFILL_STATES = ("conv_states", "recurrent_states")  # the tensor dicts of such a layer; the rest is host bookkeeping


class NotGraphable(Exception):
    """This call cannot be replayed from a graph (the reason is counted; the call runs eagerly)."""


@dataclass
class _Slot:
    layer: Any
    attr: str
    index: Any  # a key of the dict `layer.<attr>`, or None: the tensor is `layer.<attr>` itself

    def get(self) -> torch.Tensor:
        holder = getattr(self.layer, self.attr)
        return holder if self.index is None else holder[self.index]

    def set(self, t: torch.Tensor) -> None:
        if self.index is None:
            setattr(self.layer, self.attr, t)
        else:
            getattr(self.layer, self.attr)[self.index] = t


def _find_cache(kwargs: dict) -> tuple[str, Any]:
    for name in _CACHE_KWARGS:
        cache = kwargs.get(name)
        if cache is not None:
            return name, cache
    raise NotGraphable("no cache argument (cache_params / past_key_values)")


def state_slots(cache: Any) -> list[_Slot]:
    """Every state tensor of `cache`, in layer order; raises NotGraphable unless all of them are static."""
    layers = getattr(cache, "layers", None)
    if not layers:
        raise NotGraphable(f"cache {type(cache).__name__} has no per-layer `layers`")
    slots = []
    for layer in layers:
        attrs = STATIC_LAYERS.get(type(layer).__name__)
        if attrs is None:
            raise NotGraphable(f"cache layer {type(layer).__name__} does not keep static addresses "
                               f"(graphed: {sorted(STATIC_LAYERS)})")
        if getattr(layer, "record_past", False):
            raise NotGraphable("cache layer records its past (conv state grows)")
        for attr in attrs:
            holder = getattr(layer, attr, None)
            if isinstance(holder, torch.Tensor):
                slots.append(_Slot(layer, attr, None))
            elif isinstance(holder, dict):
                slots.extend(_Slot(layer, attr, index) for index, t in holder.items() if t is not None)
            elif holder is not None:
                raise NotGraphable(f"cache layer {type(layer).__name__}.{attr} is a {type(holder).__name__}")
        if not all(getattr(layer, "has_previous_state", {0: True}).values()):
            raise NotGraphable("cache layer without previous state (prefill, not decode)")
        counter = HOST_COUNTERS.get(type(layer).__name__)
        if counter is not None and getattr(layer, "is_initialized", False) and \
                getattr(layer, counter) >= layer.max_cache_len:
            raise NotGraphable("sliding-window cache full (it rolls its window on a host-side branch)")
    if not slots:
        raise NotGraphable("cache holds no state yet")
    return slots


def _host_layers(cache: Any) -> list[tuple[Any, str]]:
    """(layer, counter attribute) of every initialized cache layer with host-side bookkeeping (HOST_COUNTERS)."""
    out = []
    for layer in getattr(cache, "layers", ()):
        counter = HOST_COUNTERS.get(type(layer).__name__)
        if counter is not None and getattr(layer, "is_initialized", False):
            out.append((layer, counter))
    return out


def _window_open(hosts: list[tuple[Any, str]], tokens: int) -> bool:
    """Every host-counted layer can take `tokens` more without leaving the branch the graph was captured on."""
    return all(getattr(layer, c) + tokens <= layer.max_cache_len for layer, c in hosts)


def _module_tensors(model: torch.nn.Module, snapshot: bool = False) -> dict[tuple[int, str], tuple]:
    """Every tensor a module keeps as a plain attribute (not a parameter or buffer), by (id(module), name):
    (module, name, tensor, a clone of it when `snapshot`)."""
    out = {}
    for m in model.modules():
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor):
                out[(id(m), k)] = (m, k, v, v.clone() if snapshot else None)
    return out


def _module_state(before: dict, after: dict) -> tuple[list[_Slot], str]:
    """State a module keeps on itself (RecurrentGemma's recurrent blocks: `conv1d_state`, `rg_lru.recurrent_states`):
    the tensor attributes a step replaced or changed, given clones from before it. Such a slot is adopted: its
    tensor moves into a buffer the graph owns and the captured step ends by copying the module's new value into it
    (forward assigns a new tensor each step; a replay has no Python to do the assignment). Returns (slots, why not):
    an attribute that appears, disappears or changes shape or dtype cannot be held at a static address."""
    if before.keys() != after.keys():
        names = [before[x][1] for x in before.keys() - after.keys()] + [after[x][1] for x in after.keys() - before.keys()]
        return [], f"a module adds or drops tensor attributes per step ({sorted(names)[:4]})"
    slots = []
    for key, (m, k, ref, old) in before.items():
        cur = after[key][2]
        if cur is ref and torch.equal(cur, old):
            continue  # neither replaced nor written: not state
        if cur.shape != old.shape or cur.dtype != old.dtype or cur.device != old.device:
            return [], f"module state {type(m).__name__}.{k} changes shape or dtype per step"
        slots.append(_Slot(m, k, None))
    return slots, ""


def _arg_sig(name: str, v: Any) -> tuple:
    """Signature of one argument: tensors by dtype/shape/device, plain values by value; dicts, lists and tuples of
    those (Qwen3's per-layer-type attention masks come as a dict) element by element."""
    if isinstance(v, torch.Tensor):
        return ("T", str(v.dtype), tuple(v.shape), str(v.device))
    if v is None or isinstance(v, (bool, int, float, str)):
        return ("V", v)
    if isinstance(v, dict):
        return ("D", tuple((k, _arg_sig(name, v[k])) for k in sorted(v, key=str)))
    if isinstance(v, (list, tuple)):
        return ("L", type(v).__name__, tuple(_arg_sig(name, x) for x in v))
    raise NotGraphable(f"argument {name!r} of type {type(v).__name__} (graphed: tensors, numbers, None, "
                       "and dicts/lists/tuples of those)")


def _signature(kwargs: dict, cache_name: str, slots: list[_Slot]) -> tuple:
    parts = []
    for k in sorted(kwargs):
        v = kwargs[k]
        parts.append((k, type(v).__name__) if k == cache_name else (k, _arg_sig(k, v)))
    for s in slots:
        t = s.get()
        parts.append(("state", s.attr, str(t.dtype), tuple(t.shape), str(t.device)))
    return tuple(parts)


def _light(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (v.shape, v.dtype, v.device)
    if isinstance(v, dict):
        return tuple((k, _light(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return tuple(_light(x) for x in v)
    return v


def _light_key(kwargs: dict, cache_name: str) -> tuple:
    """The arguments' part of a signature (the state's shapes are checked by identity on the fast path)."""
    return tuple((k, type(v).__name__) if k == cache_name else (k, _light(v)) for k, v in kwargs.items())


def _has_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    return isinstance(v, (list, tuple)) and any(_has_tensor(x) for x in v)


def _static_copy(v: Any) -> Any:
    """The graph's own input buffers: every tensor cloned, containers rebuilt around them."""
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _static_copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_static_copy(x) for x in v)
    return v


def _copy_into(buf: Any, v: Any) -> None:
    if isinstance(buf, torch.Tensor):
        buf.copy_(v)
    elif isinstance(buf, dict):
        for k, b in buf.items():
            _copy_into(b, v[k])
    elif isinstance(buf, (list, tuple)):
        for b, x in zip(buf, v):
            _copy_into(b, x)


class CudaGraphBackend:
    """torch.cuda.CUDAGraph: warm-up on a side stream, capture into a shared memory pool, replay. The emulating
    backend below has the same three calls; the verifier's graph timing uses this one (llm4llm/verify/timing.py)."""

    def __init__(self, pool: Any = None):
        self.pool = pool

    def warmup(self, fn: Callable[[], Any]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # on a side stream, as torch.cuda.graphs asks (the caller restores the state after)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def record(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    @staticmethod
    def replay(graph: Any, fn: Callable[[], Any], out: Any) -> None:
        graph.replay()


class _EmulatedBackend(CudaGraphBackend):
    """CPU stand-in with a graph's semantics: `record` runs the step once while recording every ATen op it
    dispatches (arguments as given: tensors by identity, Python values as they were), `replay` re-executes that op
    list: buffers that existed before the capture are read and written in place, intermediates are recomputed, and
    every host value (a position counted in a Python int, a branch taken) stays what it was at capture, as in a CUDA
    graph. The outputs recorded at capture receive the new values. A host read of a tensor during the capture
    (`.item()`, a data-dependent branch) fails as it does under stream capture. Work that is not ATen ops (Triton
    kernels under TRITON_INTERPRET run on NumPy copies) cannot be replayed this way: `_RerunBackend` for those."""

    def warmup(self, fn):
        fn()

    def record(self, fn):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops: list[tuple] = []

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in _HOST_READS:
                    raise RuntimeError(f"{func}: a host read of a device value while capturing (operation not "
                                       "permitted when stream is capturing)")
                out = func(*args, **kwargs)
                ops.append((func, args, kwargs, out))
                return out

        with Recorder():
            out = fn()
        return ops, out

    @staticmethod
    def replay(graph, fn, out):
        from torch.utils._pytree import tree_flatten, tree_map

        live: dict[int, Any] = {}  # id(tensor recorded as an op's output) -> this replay's tensor

        def sub(x):
            return live.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, rec in graph:
            new = func(*tree_map(sub, args), **tree_map(sub, kwargs))
            for r, n in zip(tree_flatten(rec)[0], tree_flatten(new)[0]):
                if isinstance(r, torch.Tensor):
                    live[id(r)] = n
        for t in _flat_tensors(out):
            n = live.get(id(t))
            if n is not None and n is not t:
                t.copy_(n)


_HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)


class _RerunBackend(CudaGraphBackend):
    """CPU stand-in for steps whose work is not all ATen ops (Triton kernels under TRITON_INTERPRET): replay re-runs
    the recorded closure on the static buffers and copies its results into the outputs recorded at capture. Host
    values are recomputed on every replay here, unlike in a graph; `_EmulatedBackend` freezes them."""

    def warmup(self, fn):
        fn()

    def record(self, fn):
        return "rerun", fn()

    @staticmethod
    def replay(graph, fn, out):
        new = fn()
        for a, b in zip(_flat_tensors(out), _flat_tensors(new)):
            a.copy_(b)


def _fresh_outputs(out: Any, cache_keys: tuple, cache: Any) -> Any:
    """The recorded outputs as fresh tensors (clones: a caller may keep them across steps); the cache the graph wrote
    through (fields `cache_keys`) is replaced by the caller's."""
    def fresh(k, v):
        if k in cache_keys:
            return cache
        return v.clone() if isinstance(v, torch.Tensor) else v

    if isinstance(out, torch.Tensor):
        return out.clone()
    if hasattr(out, "keys") and hasattr(out, "values"):
        return type(out)(**{k: fresh(k, v) for k, v in out.items()})
    if isinstance(out, tuple):
        return tuple(fresh(i, v) for i, v in enumerate(out))
    return out


def _give_back_copies(entry: _PrefillEntry, cache: Any) -> None:
    """The cache last given `entry`'s state tensors, if alive, not `cache` and still holding them, gets copies (the
    next replay overwrites them; a decode step's binding has usually moved it off them already)."""
    old = entry.bound() if entry.bound is not None else None
    if old is None or old is cache:
        return
    for (i, attr, ix), t in zip(entry.slot_keys, entry.out[1]):
        holder = getattr(old.layers[i], attr, None) if i < len(getattr(old, "layers", ())) else None
        if isinstance(holder, dict) and holder.get(ix) is t:
            holder[ix] = t.clone()


def _fresh_prefill_layers(cache: Any) -> None:
    """NotGraphable unless every layer of `cache` is one of PREFILL_LAYERS and holds no state yet."""
    layers = getattr(cache, "layers", None)
    if not layers:
        raise NotGraphable(f"cache {type(cache).__name__} has no per-layer `layers`")
    for layer in layers:
        if type(layer).__name__ not in PREFILL_LAYERS:
            raise NotGraphable(f"cache layer {type(layer).__name__} (prefill graphs: {', '.join(PREFILL_LAYERS)})")
        if getattr(layer, "record_past", False):
            raise NotGraphable("cache layer records its past (conv state grows)")
        for attr in PREFILL_STATES:
            holder = getattr(layer, attr, None)
            if not isinstance(holder, dict) or any(t is not None for t in holder.values()):
                raise NotGraphable("the cache holds state already (a prompt continuing a cache is not graphed)")
        if any(getattr(layer, "has_previous_state", {}).values()):
            raise NotGraphable("the cache holds state already (a prompt continuing a cache is not graphed)")


_HOST_TYPES = (bool, int, float, str, type(None), torch.device, torch.dtype)


def _host_value(v: Any) -> bool:
    if isinstance(v, _HOST_TYPES):
        return True
    if isinstance(v, dict):
        return all(_host_value(k) and _host_value(x) for k, x in v.items())
    return isinstance(v, (list, tuple)) and all(_host_value(x) for x in v)


def _host_attrs(obj: Any, skip: tuple[str, ...] = PREFILL_STATES) -> dict[str, Any]:
    """Copies of `obj`'s plain bookkeeping attributes (flags, counters, sizes, device, dtype, containers of them)."""
    return {k: copy.deepcopy(v) for k, v in vars(obj).items() if k not in skip and _host_value(v)}


def _flat_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor in `out`, through nested outputs, dicts, tuples and lists (a prefill graph records (the model's
    outputs, [state tensors]))."""
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else []  # ModelOutput: a dict
    return [t for v in values for t in _flat_tensors(v)]


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if hasattr(out, "values") and hasattr(out, "keys") else out if isinstance(out, (tuple, list)) else []
    return [v for v in values if isinstance(v, torch.Tensor)]


@dataclass
class _Entry:
    graph: Any
    fn: Callable[[], Any]
    out: Any
    static_inputs: dict[str, Any]  # the graph's input buffers: tensors, or containers of them
    states: list[torch.Tensor]  # graph-owned state buffers, in slot order
    cache_keys: tuple  # output fields (names or positions) that are the cache object
    cache_arg: str  # the argument the cache comes in (cache_params / past_key_values)
    bound: Any = None  # weakref to the cache whose layers point at `states`
    replays: int = 0
    module_slots: list = field(default_factory=list)  # state kept on modules (its buffers end `states`)
    positions: bool = False  # position_ids are counted on the host and passed in (see _with_positions)
    private: Any = None  # the cache copy the graph was recorded through


@dataclass
class _PrefillEntry:
    graph: Any
    fn: Callable[[], Any]
    out: Any  # (the model's outputs, [state tensors]) as recorded: a replay leaves the new values there
    static_inputs: dict[str, Any]
    slot_keys: list[tuple[int, str, Any]]  # (layer position, state dict, key) of each state tensor, in out[1]'s order
    host: list[dict]  # per layer: its bookkeeping after the eager prefill (flags, kernel sizes, device, dtype)
    cache_host: dict  # the cache object's own attributes the prefill changed
    cache_keys: tuple  # output fields (names or positions) that are the cache object
    bound: Any = None  # weakref to the last cache given the graph's state tensors
    replays: int = 0


@dataclass
class _EagerSteps:
    """What `_capture` learns from the two eager steps: outputs, and each state's value before, after the first and
    after the second step (cache slots, then module slots)."""

    out: Any  # the first step's result, the one returned to the caller
    logits: list[torch.Tensor]
    second: list[torch.Tensor]  # the second step's output tensors
    before: list[torch.Tensor]
    after: list[torch.Tensor]
    after2: list[torch.Tensor]
    counters: list  # the host layers' counters before the step
    module_slots: list
    why: str  # why module-held state cannot be graphed, or ''


def _graph_step(original: Callable, call: dict, module_slots: list, module_states: list) -> Callable[[], Any]:
    """The function a decode graph records: the forward on the private cache, module-held state kept in its
    buffers."""
    def fn():
        out = original(**call)
        for s, t in zip(module_slots, module_states):  # a module that assigned new state: into the buffer
            cur = s.get()
            if cur is not t:
                t.copy_(cur)
                s.set(t)
        return out
    return fn


def _restore_state(slots: list, states: list, private: Any, counters: list, values: list) -> None:
    """The graph's state buffers back to `values`, each slot pointed at its buffer, the private cache's host
    counters back to the step's start."""
    for s, t, v in zip(slots, states, values):
        t.copy_(v)
        s.set(t)
    for (layer, c), v in zip(_host_layers(private), counters):
        setattr(layer, c, v)


@dataclass
class DecodeGraphs:
    """The wrapper around one model's forward (see the module docstring). `stats()` says what it did."""

    model: torch.nn.Module
    original: Callable
    backend: CudaGraphBackend
    max_graphs: int = 8
    had_instance_forward: bool = False  # `forward` was an instance attribute already: disable puts it back
    # generation_config values replaced by static_cache=True (cache_implementation, disable_compile), put back on disable
    saved_generation: dict | None = None
    entries: dict[tuple, _Entry] = field(default_factory=dict)
    refused: dict[tuple, str] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    errors: dict[tuple, str] = field(default_factory=dict)  # the traceback of each failed capture, for diagnosis
    notes: list[str] = field(default_factory=list)  # checks passed by rel-L2 rather than elementwise (REL_L2_BOUND)
    # (entry, cache weakref, light key, [(state dict, index, graph buffer)]) of the last replay: a decode loop calls
    # with the same signature and cache every step, and the full checks cost host time for every state tensor
    _fast: tuple | None = None
    _takes_positions: bool | None = None
    # Prefill graphs (see _prefill_call): caches of PREFILL_LAYERS only, one graph per prompt signature, captured on
    # its second call (a prompt length seen once is not worth a capture)
    prefill: bool = True
    prefill_entries: dict[tuple, _PrefillEntry] = field(default_factory=dict)
    prefill_seen: set = field(default_factory=set)
    prefill_backend: CudaGraphBackend | None = None  # its own memory pool: prefill outputs outlive decode replays
    # Hand positions counted on the host in as position_ids (see _with_positions). Off only to show what it is for:
    # RecurrentGemma's replays would then keep the capture's position (tests)
    pass_positions: ClassVar[bool] = True
    # When a list: every decode replay appends a (start, end) pair of CUDA events around the graph, so the GPU time
    # of a step can be read apart from the host's (gpu_step_ms); None (the default) records nothing.
    step_events: list | None = None
    # The batch buckets the bundle verified (kernels_runtime.buckets): one graph each. A decode step at another batch
    # (past the largest: `generate` pads the others) still gets its graph while max_graphs allows: inside it the
    # patched modules' guards send that batch to their original forwards (counted at capture), and the capture's own
    # check holds the replay to the eager step, so outside the regime a bundle decodes as fast as eager with graphs.
    buckets: tuple = ()

    @property
    def __signature__(self) -> inspect.Signature:
        # the original forward's: generate reads it to decide whether to pass `position_ids` (per row, from a
        # padded batch's attention mask); behind a bare (*args, **kwargs) the layers would get one row of positions
        return inspect.signature(self.original)

    # ------------------------------------------------------------------------------------------------ call path
    def __call__(self, *args, **kwargs):
        if args:
            self.counts["eager: positional arguments"] += 1
            return self.original(*args, **kwargs)
        ids = kwargs.get("input_ids")
        if self.prefill and isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 1:
            return self._prefill_call(kwargs)
        fast = self._fast
        if fast is not None:  # the same signature and cache as the last replay: skip the full checks
            entry, cache_ref, light, checks, hosts = fast
            cache = kwargs.get(entry.cache_arg)
            if cache is not None and cache is cache_ref():
                try:
                    call = self._with_positions(kwargs, cache) if entry.positions else kwargs
                except NotGraphable:  # the full path below says why
                    call = None
                if (call is not None and _light_key(call, entry.cache_arg) == light and _window_open(hosts, 1)
                        and all((getattr(c, k) if i is None else c[i]) is t for c, k, i, t in checks)):
                    return self._replay(entry, call, cache, hosts)
        try:
            ids = kwargs.get("input_ids")
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
                raise NotGraphable("not a one-token decode call (input_ids [B, 1])")
            if kwargs.get("inputs_embeds") is not None:
                raise NotGraphable("inputs_embeds given")
            cache_name, cache = _find_cache(kwargs)
            slots = state_slots(cache)
            hosts = _host_layers(cache)
            positions = self.pass_positions and bool(hosts) and kwargs.get("position_ids") is None
            call = self._with_positions(kwargs, cache) if positions else kwargs
            key = _signature(call, cache_name, slots)
        except NotGraphable as e:
            return self._eager(str(e), kwargs)
        if key in self.refused:
            return self._eager(self.refused[key], kwargs)
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= self.max_graphs:
                return self._eager(f"{self.max_graphs} graphs already captured", kwargs)
            return self._capture(key, kwargs, call, cache_name, cache, slots, hosts, positions)
        mod_states = entry.states[len(entry.states) - len(entry.module_slots):]
        for ms, t in zip(entry.module_slots, mod_states):
            v = ms.get()
            if not isinstance(v, torch.Tensor) or v.shape != t.shape or v.dtype != t.dtype:
                # a call without a cache cleared it, or a different batch left it reshaped: the module makes anew
                return self._eager(f"module state {type(ms.layer).__name__}.{ms.attr} missing or reshaped", kwargs)
        slots = slots + entry.module_slots
        self._bind(entry, cache, slots)
        self._fast = (entry, weakref.ref(cache), _light_key(call, cache_name),
                      [(s.layer if s.index is None else getattr(s.layer, s.attr), s.attr, s.index, t)
                       for s, t in zip(slots, entry.states)], hosts)
        return self._replay(entry, call, cache, hosts)

    def _with_positions(self, kwargs: dict, cache: Any) -> dict:
        """kwargs plus `position_ids` counted on the host: a model that derives positions from the cache's length
        (RecurrentGemma: `past_key_values.get_seq_length()`, a Python int for a sliding-window layer) would have
        the graph replay the capture's position forever; given as an argument, it is copied in like the token."""
        if self._takes_positions is None:
            try:
                params = inspect.signature(self.original).parameters
                self._takes_positions = "position_ids" in params or any(
                    p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            except (TypeError, ValueError):
                self._takes_positions = False
        if not self._takes_positions:
            raise NotGraphable("positions are counted on the host and forward takes no position_ids")
        past = cache.get_seq_length()
        if not isinstance(past, int):
            raise NotGraphable(f"positions: cache length is a {type(past).__name__}, not a host int")
        n = kwargs["input_ids"].shape[1]
        return {**kwargs, "position_ids": torch.arange(past, past + n, device=kwargs["input_ids"].device)[None]}

    def _replay(self, entry: _Entry, call: dict, cache: Any, hosts: list) -> Any:
        for k, buf in entry.static_inputs.items():
            _copy_into(buf, call[k])
        if hosts and isinstance(self.backend, _RerunBackend):
            # the re-run emulation runs Python on the private cache: it takes the caller's branch (a graph has frozen it)
            for (layer, c), (mine, _) in zip(hosts, _host_layers(entry.private)):
                setattr(mine, c, getattr(layer, c))
        if self.step_events is not None and type(self.backend) is CudaGraphBackend:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.backend.replay(entry.graph, entry.fn, entry.out)
            end.record()
            self.step_events.append((start, end))
        else:
            self.backend.replay(entry.graph, entry.fn, entry.out)
        n = call["input_ids"].shape[1]
        for layer, c in hosts:  # the bookkeeping the layer's update does in Python, which a replay skips
            setattr(layer, c, getattr(layer, c) + n)
        entry.replays += 1
        self.counts["replayed"] += 1
        return self._result(entry, cache)

    def _result(self, entry: _Entry, cache: Any) -> Any:
        return _fresh_outputs(entry.out, entry.cache_keys, cache)

    def _bind(self, entry: _Entry, cache: Any, slots: list[_Slot]) -> None:
        """Point `cache`'s layers (and the modules' own state) at the graph's state buffers, copying the current
        state in, unless they already are. `slots`: the cache's, then entry.module_slots."""
        if (entry.bound is not None and entry.bound() is cache
                and all(s.get().data_ptr() == t.data_ptr() for s, t in zip(slots, entry.states))):
            return
        old = entry.bound() if entry.bound is not None else None
        if old is not None and old is not cache:
            try:
                for s, t in zip(state_slots(old), entry.states):
                    if s.get().data_ptr() == t.data_ptr():
                        s.set(t.clone())  # the old cache keeps its own copy of its state
            except NotGraphable:
                pass
        for s, t in zip(slots, entry.states):
            if s.get().data_ptr() != t.data_ptr():
                t.copy_(s.get())
                s.set(t)
        entry.bound = weakref.ref(cache)
        self.counts["bound a cache"] += 1

    # ------------------------------------------------------------------------------------------------ capture
    def _capture(self, key, kwargs, call_in, cache_name, cache, slots, hosts, positions):
        """Run this step eagerly (the result returned) and, for the check only, once more with the same arguments;
        then capture from the state before the step and replay twice: both replays must match the two eager steps.
        Two, not one: a value the host computed at capture (a position counter kept in a Python int) replays as a
        constant, which only the second step shows. The eager steps run the caller's own arguments (`kwargs`), the
        graph the wrapper's (`call_in`: plus host-counted positions), so the check covers that difference too."""
        steps = self._eager_steps(kwargs, slots, hosts)
        if steps.why:
            return self._refuse(key, steps.why, steps.out)
        module_slots = steps.module_slots
        slots = slots + module_slots
        states = [b.clone() for b in steps.before]
        statics = {k: _static_copy(v) for k, v in call_in.items() if k != cache_name and _has_tensor(v)}
        for s, t in zip(slots, states):
            s.set(t)
        # The graph runs on a private copy of the cache whose layers always point at `states` (the caller's cache
        # is re-pointed at them too, and may be given back its own copies later); tensors are shared, not copied.
        private = copy.deepcopy(cache, memo={id(t): t for t in states})
        for (layer, c), v in zip(_host_layers(private), steps.counters):
            setattr(layer, c, v)  # the private copy starts where the step started
        call = dict(call_in)
        call.update(statics)
        call[cache_name] = private
        fn = _graph_step(self.original, call, module_slots, states[len(states) - len(module_slots):])
        restore = functools.partial(_restore_state, slots, states, private, steps.counters)
        try:
            graph, out, bad, notes = self._record_and_check(fn, restore, steps, states, statics, private, positions,
                                                            kwargs["input_ids"].shape[1])
        except Exception as e:  # a sync inside the step, an unsupported op: this signature runs eagerly
            self.errors[key] = traceback.format_exc()
            restore(steps.after)
            return self._refuse(key, f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                                steps.out)
        restore(steps.after)  # the eager step is the one returned: continue from its state exactly
        if bad:
            return self._refuse(key, f"replay differs from the eager step: {bad}", steps.out)
        items = out.items() if hasattr(out, "keys") else enumerate(out) if isinstance(out, tuple) else ()
        cache_keys = tuple(k for k, v in items if v is private)
        entry = _Entry(graph, fn, out, statics, states, cache_keys, cache_name, weakref.ref(cache),
                       module_slots=module_slots, positions=positions, private=private)
        self.entries[key] = entry
        self.notes.extend(notes)
        self.counts["captured"] += 1
        return steps.out

    def _eager_steps(self, kwargs, slots, hosts) -> _EagerSteps:
        """The caller's step run eagerly, then once more for the check; the cache, its host counters and the
        modules' own state are left as after the first step."""
        n = kwargs["input_ids"].shape[1]
        before = [s.get().clone() for s in slots]
        mods_before = _module_tensors(self.model, snapshot=True)
        counters = [getattr(layer, c) for layer, c in hosts]
        out_eager = self.original(**kwargs)
        logits_eager = [t.clone() for t in _tensors(out_eager)]
        after = [s.get().clone() for s in slots]
        mods_after = _module_tensors(self.model, snapshot=True)
        module_slots, why = _module_state(mods_before, mods_after)
        second = [t.clone() for t in _tensors(self.original(**kwargs))]  # the check's second step
        after2 = [s.get().clone() for s in slots]
        mods_after2 = _module_tensors(self.model)
        for s, a in zip(slots, after):  # back to the state after the real step
            s.get().copy_(a)
        for (layer, c), v in zip(hosts, counters):
            setattr(layer, c, v + n)
        for s in module_slots:
            k = (id(s.layer), s.attr)
            after2.append(mods_after2[k][2].clone())
            after.append(mods_after[k][3])
            before.append(mods_before[k][3])
            s.set(mods_after[k][3].clone())
        return _EagerSteps(out_eager, logits_eager, second, before, after, after2, counters, module_slots, why)

    def _record_and_check(self, fn, restore, steps: _EagerSteps, states, statics, private, positions: bool, n: int):
        """(graph, its outputs, the first difference or '', notes): the step recorded from the state before it,
        then replayed twice against the two eager steps."""
        self.backend.warmup(fn)
        restore(steps.before)
        graph, out = self.backend.record(fn)
        restore(steps.before)
        self.backend.replay(graph, fn, out)
        if type(self.backend) is CudaGraphBackend:
            torch.cuda.synchronize()
        notes: list[str] = []
        bad = (_mismatch(_tensors(out), steps.logits, "output", notes)
               or _mismatch(states, steps.after, "state", notes, base=steps.before))
        if not bad:
            if positions:
                statics["position_ids"].add_(n)
            for (layer, c), v in zip(_host_layers(private), steps.counters):
                setattr(layer, c, v + n)  # what the emulation's Python sees; a graph has frozen its branch
            self.backend.replay(graph, fn, out)
            if type(self.backend) is CudaGraphBackend:
                torch.cuda.synchronize()
            bad = (_mismatch(_tensors(out), steps.second, "second step's output", notes)
                   or _mismatch(states, steps.after2, "second step's state", notes, base=steps.after))
        return graph, out, bad, notes

    # ------------------------------------------------------------------------------------------------ prefill
    def _prefill_call(self, kwargs: dict):
        """A prompt's forward (input_ids [B, L], L > 1) on a fresh cache of PREFILL_LAYERS: on a small model it is
        host-bound (its Triton launches cost the host more than its kernels take the GPU).
        Its first call of a signature runs eagerly; the second captures (the call
        itself runs eagerly, then the graph is recorded from a fresh copy of the cache and replayed once against it);
        later ones replay and hand the caller's cache the graph's state tensors and the bookkeeping the eager prefill
        left (flags, kernel sizes). A cache given them earlier and still holding them gets copies first."""
        try:
            if kwargs.get("inputs_embeds") is not None:
                raise NotGraphable("inputs_embeds given")
            cache_name, cache = _find_cache(kwargs)
            _fresh_prefill_layers(cache)
            key = ("prefill", _signature(kwargs, cache_name, []), len(cache.layers))
        except NotGraphable as e:
            return self._eager(f"prefill: {e}", kwargs)
        if key in self.refused:
            return self._eager(f"prefill: {self.refused[key]}", kwargs)
        entry = self.prefill_entries.get(key)
        if entry is not None:
            return self._replay_prefill(entry, kwargs, cache)
        if key not in self.prefill_seen:
            self.prefill_seen.add(key)
            return self._eager("prefill signature seen once (captured on its second call)", kwargs)
        if len(self.prefill_entries) >= self.max_graphs:
            return self._eager(f"prefill: {self.max_graphs} prefill graphs already captured", kwargs)
        return self._capture_prefill(key, kwargs, cache_name, cache)

    def _capture_prefill(self, key, kwargs, cache_name, cache):
        fresh = copy.deepcopy(cache)  # no tensors yet: cheap; the graph's private cache starts from it every run
        cache_before = _host_attrs(cache, skip=("layers",))
        mods_before = _module_tensors(self.model, snapshot=True)
        out_eager = self.original(**kwargs)  # the call itself, on the caller's cache
        logits_eager = [t.clone() for t in _tensors(out_eager)]
        module_slots, why = _module_state(mods_before, _module_tensors(self.model))
        if why or module_slots:  # a replay would not assign them
            return self._refuse(key, "prefill changes state kept on modules: " + (why or ", ".join(
                f"{type(m.layer).__name__}.{m.attr}" for m in module_slots[:4])), out_eager)
        try:
            slots = state_slots(cache)
        except NotGraphable as e:
            return self._refuse(key, f"prefill left no static state: {e}", out_eager)
        after = [s.get().clone() for s in slots]
        host = [_host_attrs(layer) for layer in cache.layers]
        cache_after = _host_attrs(cache, skip=("layers",))
        cache_host = {k: v for k, v in cache_after.items() if k not in cache_before or cache_before[k] != v}
        index = {id(layer): i for i, layer in enumerate(cache.layers)}
        slot_keys = [(index[id(s.layer)], s.attr, s.index) for s in slots]
        private = copy.deepcopy(fresh)
        statics = {k: _static_copy(v) for k, v in kwargs.items() if k != cache_name and _has_tensor(v)}
        call = dict(kwargs)
        call.update(statics)
        call[cache_name] = private

        def fn():
            # every run starts from a fresh private cache (host bookkeeping only: no device work); the prefill
            # allocates the state (in the graph's pool while recording) and writes it whole
            for mine, clean in zip(private.layers, fresh.layers):
                for k, v in vars(clean).items():
                    setattr(mine, k, copy.deepcopy(v))
            out = self.original(**call)
            return out, [getattr(private.layers[i], attr)[ix] for i, attr, ix in slot_keys]

        if self.prefill_backend is None:
            self.prefill_backend = type(self.backend)()
        backend = self.prefill_backend
        try:
            backend.warmup(fn)
            graph, out = backend.record(fn)
            backend.replay(graph, fn, out)
            if type(backend) is CudaGraphBackend:
                torch.cuda.synchronize()
            notes: list[str] = []
            bad = (_mismatch(_tensors(out[0]), logits_eager, "prefill output", notes)
                   or _mismatch(out[1], after, "prefill state", notes, base=[torch.zeros_like(a) for a in after]))
        except Exception as e:  # noqa: BLE001 - a host read in the prefill, an unsupported op: it runs eagerly
            self.errors[key] = traceback.format_exc()
            return self._refuse(key, f"prefill capture failed: {type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:200] if str(e) else ''}", out_eager)
        if bad:
            return self._refuse(key, f"prefill replay differs from the eager prefill: {bad}", out_eager)
        items = out[0].items() if hasattr(out[0], "keys") else enumerate(out[0]) if isinstance(out[0], tuple) else ()
        cache_keys = tuple(k for k, v in items if v is private)
        self.prefill_entries[key] = _PrefillEntry(graph, fn, out, statics, slot_keys, host, cache_host, cache_keys)
        self.notes.extend(notes)
        self.counts["captured a prefill"] += 1
        return out_eager

    def _replay_prefill(self, entry: _PrefillEntry, kwargs: dict, cache: Any):
        _give_back_copies(entry, cache)
        for k, buf in entry.static_inputs.items():
            _copy_into(buf, kwargs[k])
        self.prefill_backend.replay(entry.graph, entry.fn, entry.out)
        for layer, host in zip(cache.layers, entry.host):
            for k, v in host.items():
                setattr(layer, k, copy.deepcopy(v))
        for k, v in entry.cache_host.items():
            setattr(cache, k, copy.deepcopy(v))
        for (i, attr, ix), t in zip(entry.slot_keys, entry.out[1]):
            getattr(cache.layers[i], attr)[ix] = t
        entry.bound = weakref.ref(cache)
        entry.replays += 1
        self.counts["replayed a prefill"] += 1
        return _fresh_outputs(entry.out[0], entry.cache_keys, cache)

    def _eager(self, reason: str, kwargs: dict):
        self.counts[f"eager: {reason}"] += 1
        return self.original(**kwargs)

    def _refuse(self, key, reason, out):
        self.refused[key] = reason
        self.counts[f"refused: {reason}"] += 1
        return out

    def gpu_step_ms(self) -> float | None:
        """Median GPU time of the decode replays recorded in `step_events` (None without any). In a host-bound decode
        loop the GPU is idle when the start event is reached, so each pair spans the graph's kernels alone."""
        if not self.step_events:
            return None
        self.step_events[-1][1].synchronize()
        import statistics

        return statistics.median(a.elapsed_time(b) for a, b in self.step_events)

    def summary(self) -> str:
        """One line for reports and decisions: graphs, replays and why any signature was refused."""
        st = self.stats()
        return f"{st['graphs']} captured, {st['replays']} replays" + (
            f", prefill: {st['prefill_graphs']} captured, {st['prefill_replays']} replays"
            if st["prefill_graphs"] else "") + (
            f", refused: {'; '.join(st['refused'])[:300]}" if st["refused"] else "") + (
            f", outputs matched by rel-L2: {st['notes'][0][:120]}" if st.get("notes") else "")

    def stats(self) -> dict[str, Any]:
        return {"graphs": len(self.entries), "replays": sum(e.replays for e in self.entries.values()),
                "prefill_graphs": len(self.prefill_entries),
                "prefill_replays": sum(e.replays for e in self.prefill_entries.values()),
                "refused": sorted(set(self.refused.values())),
                "calls": dict(self.counts), **({"notes": list(self.notes)} if self.notes else {})}


# A replay against the eager step: a graph runs the same kernels, yet a deep 16-bit model's results can differ by
# rounding (logits off by less than the model's own bf16-vs-fp32 noise, the acceptance floor; single K/V elements off
# by a few hundredths, so that an elementwise table alone would capture one of two identical runs and refuse the
# other). A tensor passes
# the elementwise table or, failing it, a relative-L2 bound: tolerances.FLOOR_MAX_REL_L2 for 16-bit, the largest
# rounding allowance the acceptance metric grants. For state the bound applies to what the step wrote (the change
# from the state before it), so a write in the wrong place (a KV row at a frozen position: rel-L2 above 1) or a missing
# update fails however small it is against the whole cache; integer state (write positions) must match exactly.
# Acceptance then re-checks the graphed model's teacher-forced logits over the whole generation.
REL_L2_BOUND: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: FLOOR_MAX_REL_L2,
                                          torch.bfloat16: FLOOR_MAX_REL_L2}


def _mismatch(got: list[torch.Tensor], want: list[torch.Tensor], what: str, notes: list[str],
              base: list[torch.Tensor] | None = None) -> str:
    """'' when every tensor matches (see REL_L2_BOUND), else the first difference. `base`: the state before the
    step, for state (the bound then applies to got - base against want - base). Passes by rel-L2 go to `notes`."""
    if len(got) != len(want):
        return f"{what}: {len(got)} tensors vs {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if not g.is_floating_point():
            if g.shape != w.shape or not torch.equal(g, w):
                return f"{what} {i}: values differ"
            continue
        rep = compare(g, w)
        if rep.ok:
            continue
        bound = REL_L2_BOUND.get(w.dtype)
        if bound is None or g.shape != w.shape or g.dtype != w.dtype:
            return f"{what} {i}: {rep.reason}"
        if base is None:
            r, of = rel_l2(g, w), ""
        else:
            r, of = rel_l2(g, w, base=base[i]), " of the step's change"
        if r <= bound:
            notes.append(f"{what} {i}: rel-L2{of} {r:.2e} <= {bound:g} ({rep.reason})")
            continue
        return f"{what} {i}: {rep.reason}, rel-L2{of} {r:.2e} over {bound:g}"
    return ""


OUTSIDE_GRAPHS = 2  # graphs for decode batches past a bundle's buckets (DecodeGraphs.buckets)


def enable_decode_graphs(model: torch.nn.Module, *, backend: str = "cuda", max_graphs: int = 8,
                         static_cache: bool = False, prefill: bool = True, buckets: tuple = ()) -> DecodeGraphs:
    """Replay `model`'s one-token decode steps from CUDA graphs (see the module docstring). Idempotent: a model
    already wrapped returns its wrapper. Without a GPU (tests): backend="emulate" replays the captured step's ATen ops
    with host values frozen, as a graph would; backend="rerun" re-runs the step's Python (for Triton kernels under
    the interpreter, which are not ATen ops).

    static_cache: make `generate` use transformers' static KV cache by default (model.generation_config:
    cache_implementation="static", disable_compile=True so the step stays eager for the graph), without which a
    KV-cache model (Llama, Qwen3) grows its cache every token and no step can be graphed. Mamba/Mamba2 keep their
    LinearAttentionLayer either way. disable_decode_graphs puts the previous values back.

    prefill: also replay a prompt's forward on a fresh cache of PREFILL_LAYERS (Mamba, Mamba2) from a graph per
    prompt signature, captured on its second call (DecodeGraphs._prefill_call).

    buckets: the batch buckets a bundle verified (kernels_runtime.buckets): one graph per bucket, and OUTSIDE_GRAPHS
    more for batches past them (max_graphs grows to hold both)."""
    existing = model.__dict__.get(_ATTR)
    if existing is not None:
        if static_cache and existing.saved_generation is None:
            existing.saved_generation = _static_generation(model)
        if buckets:
            existing.buckets = tuple(buckets)
            existing.max_graphs = max(existing.max_graphs, len(buckets) + OUTSIDE_GRAPHS)
        return existing
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("enable_decode_graphs: CUDA graphs need a CUDA device (backend='emulate' for tests)")
        impl: CudaGraphBackend = CudaGraphBackend()
    elif backend == "emulate":
        impl = _EmulatedBackend()
    elif backend == "rerun":
        impl = _RerunBackend()
    else:
        raise ValueError(f"backend: expected 'cuda', 'emulate' or 'rerun', got {backend!r}")
    had_forward = "forward" in model.__dict__
    graphs = DecodeGraphs(model, model.forward, impl, max(max_graphs, len(buckets) + OUTSIDE_GRAPHS if buckets else 0),
                          had_instance_forward=had_forward,
                          saved_generation=_static_generation(model) if static_cache else None, prefill=prefill,
                          buckets=tuple(buckets))
    model.__dict__[_ATTR] = graphs
    model.forward = graphs
    return graphs


def disable_decode_graphs(model: torch.nn.Module) -> dict[str, Any] | None:
    """Restore the model's forward and free the graphs; returns their last stats (None when none were enabled)."""
    graphs = model.__dict__.pop(_ATTR, None)
    if graphs is None:
        return None
    stats = graphs.stats()
    for entry in graphs.entries.values():
        cache = entry.bound() if entry.bound is not None else None
        if cache is not None:  # the cache outlives the graph: it gets its own copy of its state
            try:
                for s, t in zip(state_slots(cache), entry.states):
                    if s.get().data_ptr() == t.data_ptr():
                        s.set(t.clone())
            except NotGraphable:
                pass
    for entry in graphs.prefill_entries.values():
        _give_back_copies(entry, None)
    graphs.prefill_entries.clear()
    if graphs.saved_generation is not None:
        gc = getattr(model, "generation_config", None)
        for k, v in graphs.saved_generation.items():
            setattr(gc, k, v)
    if graphs.had_instance_forward:
        model.forward = graphs.original
    else:
        model.__dict__.pop("forward", None)
    graphs.entries.clear()
    graphs._fast = None
    return stats


def _static_generation(model: torch.nn.Module) -> dict:
    gc = getattr(model, "generation_config", None)
    if gc is None:
        raise ValueError("static_cache: the model has no generation_config (not a transformers generation model)")
    saved = {k: getattr(gc, k, None) for k in ("cache_implementation", "disable_compile")}
    gc.cache_implementation, gc.disable_compile = "static", True
    return saved


def decode_graphs_of(model: torch.nn.Module) -> DecodeGraphs | None:
    return model.__dict__.get(_ATTR)
