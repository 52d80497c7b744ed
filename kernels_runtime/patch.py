"""One generic apply/revert over patch bundles: patches are data, never a function per model.

`apply(model, bundle)` finds the module instances each patch targets and installs, on each instance (an instance
attribute, never a class monkey-patch), a dispatching `forward` that:
  1. decides the phase with the profiler's predicate (CURRENT_PHASE, set by a PhaseTracker hook that apply installs
     on the top-level model; the module's own input length when the module is called on its own),
  2. picks the kernel for that phase (a dispatch template rejoins the prefill and decode kernels of one module class),
  3. checks its guards (guards.py), converts the call to the boundary contract (boundary.py), runs `entry`, rebuilds
     the forward's return value and writes `state_out.*` back into the cache object,
and otherwise calls the original forward, captured once at patch time. Every call is counted, fallbacks by reason.
`revert(model)` restores the exact original attributes and removes the hook.
"""
from __future__ import annotations

import fnmatch
import functools
import inspect
import linecache
import logging
import os
import re
import sys
import time
import types
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kernels_runtime import boundary
from kernels_runtime.buckets import disable_batch_buckets, enable_batch_buckets
from kernels_runtime.bundle import BundleError, PatchBundle, PatchSpec, load_bundle
from kernels_runtime.guards import is_supported, missing_input
from kernels_runtime.phase import CURRENT_PHASE, PhaseTracker

log = logging.getLogger(__name__)

_STATE_ATTR = "_llm4llm_runtime"  # on the top-level model: the tracker and the dispatchers
_GRAPHS_ATTR = "_llm4llm_graphs_by_apply"  # on the top-level model: apply() enabled decode graphs (revert disables)
_DISPATCH_ATTR = "_llm4llm_dispatch"  # on each patched instance: its dispatcher (the print(model) marker reads it)
_KERNEL_MODULES: dict[tuple[str, str], Callable] = {}  # (sha256, entry name) -> entry, loaded once per process


class KernelLoadError(RuntimeError):
    """A kernel that cannot be loaded: source missing, hash mismatch, syntax error, import error, entry missing."""


class PatchError(RuntimeError):
    """A patch the user asked for (strict, or by name) that cannot be applied."""


class BundleMismatchError(PatchError):
    """A bundle verified on another GPU architecture or another model config than the one it is applied to."""


VERSION_CHANGE_ENV = "LLM4LLM_ON_VERSION_CHANGE"  # "fallback" (default) | "apply" | "refuse"


# ----------------------------------------------------------------------------------------------------------------------
# Kernel loading


def _exec_kernel(name: str, filename: str, source: str) -> types.ModuleType:
    """Execute the verified source text (never re-read from disk). Triton's @jit reads its function's source back
    through inspect/linecache, so the same verified lines are registered in linecache under the module's filename."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # mtime None: never reloaded
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    try:
        exec(compile(source, filename, "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_kernel(bundle: PatchBundle, spec: PatchSpec) -> Callable:
    """The patch's entry function; KernelLoadError (what was expected, what was got) when it cannot be loaded."""
    where = f"patch {spec.patch_id}: kernel {spec.kernel[:12]}"
    try:
        source = bundle.source(spec.kernel)  # verified against its sha256 on load; checked before any cache
    except BundleError as e:
        raise KernelLoadError(f"{where}: {e}") from e
    key = (spec.kernel, spec.entry)
    if key in _KERNEL_MODULES:
        return _KERNEL_MODULES[key]
    name = f"llm4llm_kernels.k_{spec.kernel[:16]}"
    module = sys.modules.get(name)
    if module is None:
        where_file = bundle.kernel_path(spec.kernel) or Path("llm4llm-kernels") / f"{spec.kernel}.py"
        try:
            module = _exec_kernel(name, str(where_file), source)
        except SyntaxError as e:
            raise KernelLoadError(f"{where}: expected valid Python, got SyntaxError at line {e.lineno}: {e.msg}") from e
        except Exception as e:
            raise KernelLoadError(f"{where}: expected the source to import, got {type(e).__name__}: {e}") from e
    fn = getattr(module, spec.entry, None)
    if not callable(fn):
        raise KernelLoadError(f"{where}: expected a callable `{spec.entry}`, got {type(fn).__name__}")
    _KERNEL_MODULES[key] = fn
    return fn


# ----------------------------------------------------------------------------------------------------------------------
# The boundary bridge: a module call <-> (inputs, weights, state, static) -> outputs, state_out (boundary.py)


def _weight_getters(module: torch.nn.Module) -> list[tuple[str, dict, str]]:
    """(qualified name, owner's `_parameters` or `_buffers` dict, attribute) for every parameter and buffer, found once
    at patch time and read per call from the live dicts (a weight assigned later is seen; a submodule or parameter
    added after apply is not). A None entry (a registered but unset bias) is skipped, as named_parameters does."""
    getters = []
    for prefix, owner in module.named_modules():
        for table in (owner._parameters, owner._buffers):
            for attr in table:
                getters.append((f"{prefix}.{attr}" if prefix else attr, table, attr))
    return getters


def _read_weights(getters: list[tuple[str, dict, str]]) -> dict[str, torch.Tensor]:
    weights = {}
    for name, table, attr in getters:
        t = table.get(attr)
        if t is not None:
            weights[name] = t
    return weights


def _pack_outputs(spec: PatchSpec, result: dict) -> Any:
    """Rebuild the forward's return value from the kernel's named outputs."""
    if spec.outputs is not None:
        return boundary.rebuild_outputs(spec.outputs, result)
    if len(result) == 1 and "out" in result:  # a bare tensor, the common case
        return result["out"]
    extra = sorted((k for k in result if k.startswith("out.")), key=lambda k: int(k.split(".", 1)[1]))
    return (result["out"], *(result[k] for k in extra)) if extra else result["out"]


def _state_adapter(call: boundary.BoundaryCall) -> tuple[Any, str]:
    """The adapter that writes this call's state back into the user's cache object (None for a stateless call),
    or why there is none. Its `write_state(module, cache, state_out, spec[, inputs])` mirrors `read_out`; every
    adapter of boundary.py has one, a registered adapter without it makes its calls fall back."""
    spec = call.recipe.get("state")
    if spec is None:
        return None, ""
    adapter = boundary.adapter_by_name(spec["adapter"])
    if getattr(adapter, "write_state", None) is None:
        return None, f"state: expected a write-back for {spec['adapter']} state, got an adapter that only reads it"
    return adapter, ""


_WRITE_TAKES_INPUTS: dict[type, bool] = {}  # adapter class -> its write_state accepts `inputs`


def _write_state(adapter: Any, module: torch.nn.Module, cache: Any, state_out: dict, spec: dict, inputs: dict) -> None:
    """adapter.write_state(module, cache, state_out, spec[, inputs=...]): `inputs` only where the adapter takes it."""
    cls = type(adapter)
    takes = _WRITE_TAKES_INPUTS.get(cls)
    if takes is None:
        try:
            params = inspect.signature(adapter.write_state).parameters
        except (TypeError, ValueError):
            params = {}
        takes = _WRITE_TAKES_INPUTS[cls] = "inputs" in params or any(
            p.kind == p.VAR_KEYWORD for p in params.values())
    if takes:
        adapter.write_state(module, cache, state_out, spec, inputs=inputs)
    else:
        adapter.write_state(module, cache, state_out, spec)


def _state_out(adapter: Any, result: dict) -> dict[str, torch.Tensor]:
    """The kernel's state after the call, every name the adapter owns (a missing one would corrupt the cache)."""
    prefix = boundary.STATE_OUT
    state_out = {k[len(prefix):]: v for k, v in result.items() if k.startswith(prefix)}
    missing = [n for n in adapter.state_names if n not in state_out]
    if missing:
        raise KeyError(f"state_out: expected {[prefix + n for n in adapter.state_names]}, got {sorted(result)}")
    return state_out


# ----------------------------------------------------------------------------------------------------------------------
# Dispatch


@dataclass
class _Kernel:
    spec: PatchSpec
    fn: Callable
    bundle: str  # bundle digest

    def __post_init__(self):
        g = self.spec.guard  # an empty guard accepts every call: dispatch skips the check
        self.guarded = bool(g.dtypes or g.device_types or g.min_capability or g.shapes or g.contiguous
                            or g.batch_buckets)
        # A kernel that writes its state into the cache itself (declared by `STATE_IN_PLACE = True` in its source,
        # or seen returning the state tensors it was given) cannot fall back once it started: the original forward
        # would run on a state the kernel already advanced. Its errors are raised instead.
        self.in_place = bool(getattr(self.fn, "__globals__", {}).get("STATE_IN_PLACE", False))
        self.config = self.spec.config  # read per call
        self.bare_out = self.spec.outputs is None  # a lone "out" is returned as it is (_pack_outputs' common case)
        # guarded inputs that a call may pass as keyword None (HF's attention_mask under the dynamic cache) and that
        # were verified only as tensors: such a call is refused before binding, the costliest step of a fallback,
        # with the reason the guard would give
        self.required_kwargs = tuple(n for n in g.shapes if "." not in n and n not in g.optional)
        self.state_adapter = g.state_adapter


def _own_phase(args: tuple, kwargs: dict) -> str:
    """Phase of a module called outside a tracked model forward: its own first tensor's sequence length."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
        value = args[0]
        n = value.shape[-2] if value.dim() >= 3 else value.shape[0]
        return "prefill" if n > 1 else "decode"
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            n = value.shape[-2] if value.dim() >= 3 else value.shape[0]  # [B, S, H] or [tokens, H]
            return "prefill" if n > 1 else "decode"
    return "prefill"


@functools.lru_cache(maxsize=64)
def _wrong_state(expected: str, got: str | None) -> str:
    return f"state: expected a {expected} cache layer (what the kernel was verified on), got {got or 'no cache state'}"


def _state_mismatch(expected: str, module: torch.nn.Module, idx: int | None, args: tuple, kwargs: dict) -> str:
    """The fallback reason when the call's state is not the kind the kernel was verified on, '' when it is (or when
    only binding can tell: the bound call is checked again). idx: the module's layer index, None if not known."""
    try:
        adapter = boundary.state_adapter_for(module, boundary.find_cache(args, kwargs), idx)
    except boundary.UnsupportedBoundary as e:
        return f"boundary: {getattr(e, 'reason', None) or e}"
    got = adapter.name if adapter is not None else None
    return "" if got == expected else _wrong_state(expected, got)


def _autograd_needed(inputs: dict, weights: dict) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(getattr(t, "requires_grad", False) for t in inputs.values()) or any(
        t.requires_grad for t in weights.values())


class Dispatch:
    """The forward installed on one patched instance. Holds the original forward and the per-phase kernels."""

    def __init__(self, module: torch.nn.Module, path: str, strict: bool, original: Callable | None = None):
        """original: the forward a fallback calls (default: the instance's forward now, captured once here)."""
        self.path = path
        self.class_name = type(module).__name__
        self.strict = strict
        self.kernels: dict[str, _Kernel] = {}  # "prefill" | "decode" | "any" -> kernel
        self.kernel_calls: Counter[str] = Counter()  # by phase
        self.fallbacks: Counter[str] = Counter()  # by reason
        self._module = weakref.ref(module)
        self._saved = {name: module.__dict__[name] for name in ("forward", "extra_repr") if name in module.__dict__}
        self.original: Callable = original if original is not None else module.forward  # captured once, here
        self.__signature__ = inspect.signature(self.original)  # boundary.py names positional args from it
        self._original_extra_repr: Callable = module.extra_repr
        self._weights = _weight_getters(module)
        self._binder = boundary.CallBinder(module, self.original)  # per-instance capture cache
        self._layer_idx = boundary.layer_index(module)  # read once: the state check runs before every bind

    # installation ------------------------------------------------------------------------------------------------
    def install(self) -> None:
        module = self._module()
        module.__dict__["forward"] = self
        module.__dict__["extra_repr"] = self.extra_repr
        module.__dict__[_DISPATCH_ATTR] = self

    def uninstall(self) -> None:
        module = self._module()
        if module is None:
            return
        for name in ("forward", "extra_repr", _DISPATCH_ATTR):
            module.__dict__.pop(name, None)
        module.__dict__.update(self._saved)

    def kernel_for(self, phase: str) -> _Kernel | None:
        return self.kernels.get(phase) or self.kernels.get("any")

    # the call ----------------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        phase = CURRENT_PHASE.get() or _own_phase(args, kwargs)
        kernels = self.kernels
        kernel = kernels.get(phase) or kernels.get("any")
        if kernel is None:
            return self._fallback(f"phase: no kernel for {phase}", args, kwargs)
        for name in kernel.required_kwargs:
            if name in kwargs and kwargs[name] is None:
                return self._fallback(missing_input(name), args, kwargs)
        module = self._module()
        if kernel.state_adapter is not None:  # the cache layer's kind before binding: under another cache (HF's
            # dynamic one for a static-cache kernel) every call falls back, and binding was most of its cost
            why = _state_mismatch(kernel.state_adapter, module, self._layer_idx, args, kwargs)
            if why:
                return self._fallback(why, args, kwargs)
        try:
            call = self._binder.bind(module, args, kwargs)
            adapter, why = _state_adapter(call) if call.recipe["state"] is not None else (None, "")
        except Exception as e:  # a call the boundary cannot adapt: the original forward takes it
            return self._fallback(f"boundary: {getattr(e, 'reason', None) or f'{type(e).__name__}: {e}'}", args, kwargs)
        if why:
            return self._fallback(why, args, kwargs)
        if kernel.state_adapter is not None:
            got = (call.recipe["state"] or {}).get("adapter")
            if got != kernel.state_adapter:
                return self._fallback(_wrong_state(kernel.state_adapter, got), args, kwargs)
        if kernel.guarded:
            ok, reason = is_supported(kernel.spec.guard, call)
            if not ok:
                return self._fallback(reason, args, kwargs)
        weights = _read_weights(self._weights)
        if torch.is_grad_enabled() and _autograd_needed(call.inputs, weights):
            return self._fallback("autograd: expected no_grad/inference_mode, got grad enabled", args, kwargs)
        static = call.static  # a fresh dict per call (the binder copies its cached part)
        if kernel.config:
            static["config"] = kernel.config
        try:  # an out-of-place kernel writes nothing until it returned complete outputs: the original can still
            # take the call; an in-place one may have written its state already, so its errors are raised
            result = kernel.fn(call.inputs, weights, call.state, static)
            output = result["out"] if kernel.bare_out and len(result) == 1 else _pack_outputs(kernel.spec, result)
            state_out = _state_out(adapter, result) if adapter is not None else None
        except Exception as e:
            if self.strict or kernel.in_place:
                raise
            log.warning("llm4llm: %s kernel %s failed, falling back: %s", self.path, kernel.spec.patch_id, e)
            return self._fallback(f"kernel error: {type(e).__name__}", args, kwargs)
        if state_out is not None:
            if not kernel.in_place and any(isinstance(t, torch.Tensor) and isinstance(call.state.get(n), torch.Tensor)
                                           and t.data_ptr() == call.state[n].data_ptr() for n, t in state_out.items()):
                kernel.in_place = True  # it returned the cache's own tensors: it updates them in place
            try:  # write_state checks before it changes anything: a rejected state leaves the cache as it was
                _write_state(adapter, module, boundary.find_cache(args, kwargs), state_out, call.recipe["state"],
                             call.inputs)
            except Exception as e:
                if self.strict or kernel.in_place:
                    raise
                log.warning("llm4llm: %s kernel %s state rejected, falling back: %s", self.path,
                            kernel.spec.patch_id, e)
                return self._fallback(f"state write-back: {type(e).__name__}", args, kwargs)
        self.kernel_calls[phase] += 1
        return output

    def _fallback(self, reason: str, args, kwargs):
        self.fallbacks[reason] += 1
        return self.original(*args, **kwargs)

    # reporting ---------------------------------------------------------------------------------------------------
    def phases_label(self) -> str:
        return "+".join(p for p in ("prefill", "decode", "any") if p in self.kernels)

    def marker(self) -> str:
        n_kernel, n_fallback = sum(self.kernel_calls.values()), sum(self.fallbacks.values())
        return f"[llm4llm: {self.phases_label()} kernels, {n_kernel} kernel / {n_fallback} fallback]"

    def extra_repr(self) -> str:
        own = self._original_extra_repr()
        return f"{own} {self.marker()}" if own else self.marker()

    def counters(self) -> dict:
        return {"kernel": dict(self.kernel_calls), "fallback": dict(self.fallbacks)}


# ----------------------------------------------------------------------------------------------------------------------
# Report


@dataclass
class AppliedPatch:
    patch_id: str
    phase: str
    template: str
    instances: list[str]
    unchanged: bool = False  # already applied by an earlier apply() of the same bundle


@dataclass
class SkippedPatch:
    patch_id: str
    reason: str


@dataclass
class PatchReport:
    bundle: str
    applied: list[AppliedPatch] = field(default_factory=list)
    skipped: list[SkippedPatch] = field(default_factory=list)
    decode_graphs: str = "off"  # "on", "off", or "skipped: <why>" (kernels_runtime.graphs)
    batch_buckets: Any = None  # the BucketedGenerate padding generate's batches (kernels_runtime.buckets), if any
    _dispatches: dict[str, Dispatch] = field(default_factory=dict, repr=False)

    def counters(self) -> dict[str, dict]:
        """Live per-instance counters: {module path: {"kernel": {phase: n}, "fallback": {reason: n}}}."""
        return {path: d.counters() for path, d in sorted(self._dispatches.items())}

    def calls_of(self, patch_id: str) -> int:
        """Calls one patch's kernel took (eager calls; graph replays are not counted). Read from the per-phase
        counters of the instances it was applied to, each phase credited to the kernel that phase dispatches to
        there, so a patch whose calls another patch takes (a block-level kernel replacing its submodule's forward)
        or whose guard rejects every call reads 0 while the bundle's totals do not."""
        n = 0
        for d in self._dispatches.values():
            for phase, calls in d.kernel_calls.items():
                k = d.kernel_for(phase)
                if k is not None and k.spec.patch_id == patch_id:
                    n += calls
        return n

    def totals(self) -> dict[str, int]:
        c = self.counters().values()
        return {"kernel": sum(sum(v["kernel"].values()) for v in c),
                "fallback": sum(sum(v["fallback"].values()) for v in c)}

    def __str__(self) -> str:
        lines = [f"llm4llm patch report (bundle {self.bundle}): {len(self.applied)} applied, {len(self.skipped)} skipped"]
        for a in self.applied:
            note = " (already applied)" if a.unchanged else ""
            lines.append(f"  applied  {a.patch_id} [{a.phase}] on {len(a.instances)} instance(s){note}: "
                         f"{_summarize(a.instances)}")
        for s in self.skipped:
            lines.append(f"  skipped  {s.patch_id}: {s.reason}")
        lines.append(f"  decode graphs {self.decode_graphs}")
        if self.batch_buckets is not None:
            b = self.batch_buckets
            lines.append(f"  batch buckets {list(b.buckets)}: " + (", ".join(
                f"{n} {what}" for what, n in sorted(b.counts.items())) or "no generate call yet"))
        totals = self.totals()
        lines.append(f"  calls    {totals['kernel']} kernel / {totals['fallback']} fallback"
                     + (" (graph replays not counted)" if self.decode_graphs.startswith("on") else ""))
        reasons: Counter[str] = Counter()
        for v in self.counters().values():
            reasons.update(v["fallback"])
        for reason, n in reasons.most_common():
            lines.append(f"    fallback {n:>6}  {reason}")
        outside = sum(n for reason, n in reasons.items() if reason.startswith("shape "))
        if outside:  # the guards admit what was verified: these calls came from shapes outside it
            lines.append(f"  {outside} call(s) had shapes outside what the bundle was verified for: re-profile "
                         f"(llm4llm optimize) with a [regime] in the workload that covers them")
        return "\n".join(lines)


def _summarize(paths: list[str], limit: int = 3) -> str:
    shown = ", ".join(p or "<root>" for p in paths[:limit])
    return shown + (f", ... (+{len(paths) - limit})" if len(paths) > limit else "")


# ----------------------------------------------------------------------------------------------------------------------
# apply / revert


@dataclass
class _ModelState:
    tracker: PhaseTracker
    dispatches: dict[str, Dispatch] = field(default_factory=dict)


def _qualname(module: torch.nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(spec: PatchSpec, path: str, module: torch.nn.Module) -> bool:
    return _qualname(module) == spec.module_class and any(fnmatch.fnmatchcase(path, g) for g in spec.instances)


# ----------------------------------------------------------------------------------------------------------------------
# What a bundle was verified on


def _device_capability(model: torch.nn.Module) -> str:
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return ""
    major, minor = torch.cuda.get_device_capability(param.device)
    return f"{major}.{minor}"


def _model_fingerprint(model: torch.nn.Module) -> str:
    from kernels_runtime.bundle import config_fingerprint

    config = getattr(model, "config", None)
    return config_fingerprint(config) if config is not None and hasattr(config, "to_dict") else ""


def verified_on(model: torch.nn.Module) -> dict[str, str]:
    """The PatchBundle fields that record where its patches were verified: the capability of the device the model is
    on ("" off CUDA) and the model config's fingerprint ("" for a model without a config)."""
    return {"capability": _device_capability(model), "model_fingerprint": _model_fingerprint(model)}


def _release(version: str) -> str:
    """major.minor of a version string ("2.13.0+cu128" -> "2.13"): a patch release does not count as a change."""
    return ".".join(re.findall(r"\d+", version.split("+")[0])[:2])


def version_changes(bundle: PatchBundle) -> list[str]:
    """The torch / Triton releases that differ from those the bundle recorded, as 'torch 2.12 -> 2.13'."""
    from kernels_runtime.bundle import library_versions

    now = library_versions()
    return [f"{lib} {_release(was)} -> {_release(now[lib])}" for lib in ("torch", "triton")
            if (was := bundle.library_versions.get(lib)) and lib in now and _release(was) != _release(now[lib])]


def check_environment(model: torch.nn.Module, bundle: PatchBundle) -> None:
    """Raise BundleMismatchError (one line) when the model is on a GPU architecture or has a config other than the
    bundle recorded; a field the bundle did not record is not checked, and a model off CUDA has no architecture."""
    where = f"bundle {bundle.name or bundle.digest()}"
    cap = _device_capability(model) if bundle.capability else ""
    if cap and cap != bundle.capability:
        raise BundleMismatchError(f"{where}: verified on compute capability {bundle.capability}, got {cap}: its "
                                  "kernels and timings do not carry over; run llm4llm optimize on this GPU")
    fp = _model_fingerprint(model) if bundle.model_fingerprint else ""
    if fp and fp != bundle.model_fingerprint:
        raise BundleMismatchError(f"{where}: verified on model config {bundle.model_fingerprint}, got {fp} (another "
                                  "model or config): run llm4llm optimize for this model")


def _version_policy(strict: bool) -> str:
    if strict:
        return "refuse"
    policy = os.environ.get(VERSION_CHANGE_ENV, "fallback")
    if policy not in ("fallback", "apply", "refuse"):
        raise PatchError(f"{VERSION_CHANGE_ENV}: expected fallback, apply or refuse, got {policy!r}")
    return policy


def apply(
    model: torch.nn.Module,
    bundle: PatchBundle | str | os.PathLike,
    *,
    strict: bool = False,
    patches: list[str] | None = None,
    decode_graphs: bool | None = None,
    static_cache: bool | None = None,
) -> PatchReport:
    """Patch `model` in place with the bundle's kernels; returns a PatchReport (live counters).

    Where the bundle was verified is checked first (check_environment): a model on another GPU architecture (compute
    capability) or with another config than the bundle recorded is refused with BundleMismatchError, one line, and
    nothing is installed: kernels and timings tuned for one chip or one model's shapes are not evidence for another.
    A torch or Triton release other than the recorded one (major.minor) makes the bundle unverified rather than
    wrong: by default nothing is installed, the model keeps its original forward, one warning says why and the report
    lists every patch as skipped. $LLM4LLM_ON_VERSION_CHANGE chooses: `fallback` (the default), `apply` (install
    anyway, after the warning: the guards still check every call) or `refuse` (raise, as strict=True does).

    Automatic choices fall back quietly and say so in the report; explicit requests fail loudly: with strict=True, or
    for the patch ids named in `patches` (which also restricts the bundle to them), a kernel that cannot load or a
    patch that matches no instance raises PatchError. Applying the same bundle again changes nothing.

    decode_graphs (default: the bundle's `decode_graphs`, set when acceptance measured it that way): replay the
    model's one-token decode steps from CUDA graphs (kernels_runtime.graphs). Asked for explicitly on a model that is
    not on a CUDA device it raises PatchError; from the bundle it is skipped and the report says why.
    static_cache (default: the bundle's): with decode graphs, generate with transformers' static KV cache (see
    kernels_runtime.graphs.enable_decode_graphs).
    """
    if not isinstance(bundle, PatchBundle):
        bundle = load_bundle(bundle, strict=strict)
    check_environment(model, bundle)
    specs = bundle.patches
    unverified = _on_version_change(bundle, strict)
    if unverified is not None:
        return unverified
    if patches is not None:
        known = {p.patch_id for p in specs}
        unknown = sorted(set(patches) - known)
        if unknown:
            raise PatchError(f"apply: expected patch ids from {sorted(known)}, got unknown {unknown}")
        specs = [p for p in specs if p.patch_id in set(patches)]
    state = _model_state(model)
    report = PatchReport(bundle=bundle.name or bundle.digest(), _dispatches=state.dispatches)
    loud = strict or patches is not None
    try:
        plan = _plan(model, bundle, specs, state, report, loud)  # raises before anything is installed
    except PatchError:
        if not state.dispatches:
            model.__dict__.pop(_STATE_ATTR, None)
        raise
    for spec, kernel, new, paths in plan:
        for path, module in new:
            dispatch = state.dispatches.get(path)
            if dispatch is None:
                dispatch = state.dispatches[path] = Dispatch(module, path, strict)
                dispatch.install()
            dispatch.kernels[spec.phase] = kernel
        report.applied.append(AppliedPatch(spec.patch_id, spec.phase, spec.template, paths, not new))
    if not state.dispatches:
        model.__dict__.pop(_STATE_ATTR, None)  # nothing installed: leave the model as it was
    elif not state.tracker._handles:
        state.tracker.__enter__()
    if bundle.batch_buckets:  # a batch pads to its verified bucket (kernels_runtime.buckets)
        report.batch_buckets = enable_batch_buckets(model, bundle.batch_buckets)
    want = bundle.decode_graphs if decode_graphs is None else decode_graphs
    if want:
        static = bundle.static_cache if static_cache is None else static_cache
        report.decode_graphs = _enable_graphs(model, explicit=decode_graphs is True, static_cache=static,
                                              buckets=tuple(bundle.batch_buckets))
    return report


def _on_version_change(bundle: PatchBundle, strict: bool) -> PatchReport | None:
    """apply()'s answer to a torch / Triton release other than the bundle's: None to go on installing, a report of
    every patch skipped (the fallback policy), or BundleMismatchError (refuse)."""
    changes = version_changes(bundle)
    if not changes:
        return None
    policy = _version_policy(strict)
    what = f"bundle {bundle.name or bundle.digest()}: verified with {', '.join(changes)}"
    if policy == "refuse":
        raise BundleMismatchError(f"{what}; set {VERSION_CHANGE_ENV}=apply to install it anyway")
    if policy == "fallback":
        log.warning("llm4llm: %s; not applied, the model keeps its original forward (%s=apply installs it)",
                    what, VERSION_CHANGE_ENV)
        report = PatchReport(bundle=bundle.name or bundle.digest(), _dispatches={})
        report.skipped.extend(SkippedPatch(p.patch_id, f"versions: {', '.join(changes)}") for p in bundle.patches)
        return report
    log.warning("llm4llm: %s; applied anyway (%s=apply)", what, VERSION_CHANGE_ENV)
    return None


def layer_dispatch(module: torch.nn.Module, bundle: PatchBundle, patch_ids: list[str], path: str = "") -> Dispatch:
    """A Dispatch over `module` with the named patches' kernels, its fallback the forward of the module's class: what
    a layer class shipped through Hugging Face `kernels` (kernels_runtime.hub_layers) runs per instance, where
    kernelize has already replaced the instance's forward. Phases, guards and fallbacks are apply()'s own. A kernel
    that does not load raises KernelLoadError (the package was exported from a bundle that loaded)."""
    specs = {p.patch_id: p for p in bundle.patches}
    original = types.MethodType(type(module).forward, module)
    dispatch = Dispatch(module, path or type(module).__name__, strict=False, original=original)
    digest = bundle.digest()
    for patch_id in patch_ids:
        spec = specs[patch_id]
        dispatch.kernels[spec.phase] = _Kernel(spec, load_kernel(bundle, spec), digest)
    return dispatch


def _enable_graphs(model: torch.nn.Module, explicit: bool, static_cache: bool = False, buckets: tuple = ()) -> str:
    from kernels_runtime.graphs import enable_decode_graphs

    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda" or not torch.cuda.is_available():
        reason = f"skipped: the model is on {param.device if param is not None else 'no device'}, graphs need CUDA"
        if explicit:
            raise PatchError(f"decode_graphs: {reason}")
        return reason
    enable_decode_graphs(model, static_cache=static_cache, buckets=buckets)
    model.__dict__[_GRAPHS_ATTR] = True
    return "on (static KV cache)" if static_cache else "on"


def _plan(model, bundle, specs, state, report, loud) -> list[tuple[PatchSpec, _Kernel, list, list[str]]]:
    """For each patch: its kernel, the instances to patch now, and all its instances' paths (in model order). Load failures,
    patches without instances and conflicts (another kernel for the same instance and phase) are skipped, or raise
    when loud."""
    digest, plan, planned = bundle.digest(), [], {}
    modules = list(model.named_modules())
    for spec in specs:
        try:
            kernel = _Kernel(spec, load_kernel(bundle, spec), digest)
        except KernelLoadError as e:
            _skip(report, spec, str(e), loud)
            continue
        targets = [(p, m) for p, m in modules if _matches(spec, p, m)]
        if not targets:
            _skip(report, spec, f"instances: expected a {spec.class_name} matching {spec.instances}, got none", loud)
            continue
        new, conflicts = [], []
        for path, module in targets:
            dispatch = state.dispatches.get(path)
            have = planned.get((path, spec.phase)) or (dispatch.kernels[spec.phase].spec
                                                        if dispatch and spec.phase in dispatch.kernels else None)
            if have == spec:
                continue  # already carries this very patch
            if have is not None:
                conflicts.append(f"{path} [{spec.phase}] already patched by {have.patch_id}")
                continue
            new.append((path, module))
            planned[(path, spec.phase)] = spec
        if conflicts:
            _skip(report, spec, "conflict: " + "; ".join(conflicts[:3]) + " (revert first)", loud)
            for path, _ in new:
                planned.pop((path, spec.phase))
            continue
        plan.append((spec, kernel, new, [p for p, _ in targets]))
    return plan


def _skip(report: PatchReport, spec: PatchSpec, reason: str, loud: bool) -> None:
    if loud:
        raise PatchError(f"patch {spec.patch_id}: {reason}")
    report.skipped.append(SkippedPatch(spec.patch_id, reason))


def _model_state(model: torch.nn.Module) -> _ModelState:
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        state = model.__dict__[_STATE_ATTR] = _ModelState(tracker=PhaseTracker(model))
    return state


def revert(model: torch.nn.Module) -> int:
    """Restore every patched instance's original forward (and repr) and remove the phase hook. Returns how many
    instances were restored; reverting an unpatched model does nothing."""
    if model.__dict__.pop(_GRAPHS_ATTR, False):
        from kernels_runtime.graphs import disable_decode_graphs

        disable_decode_graphs(model)
    disable_batch_buckets(model)
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return 0
    for dispatch in state.dispatches.values():
        dispatch.uninstall()
    if state.tracker._handles:
        state.tracker.__exit__(None, None, None)
    return len(state.dispatches)


def report_of(model: torch.nn.Module) -> dict[str, dict]:
    """Live counters of a patched model (empty when it is not patched)."""
    state = model.__dict__.get(_STATE_ATTR)
    return {} if state is None else {p: d.counters() for p, d in sorted(state.dispatches.items())}


# ----------------------------------------------------------------------------------------------------------------------
# Dispatch overhead

_IDENTITY_KERNEL = '''"""Identity kernel: returns its first input; measures what dispatch costs around a kernel."""


def entry(inputs, weights, state, static):
    return {"out": next(iter(inputs.values()))}
'''


@dataclass
class DispatchOverhead:
    original_us: float  # the module's own forward, per call (back to back: its host or its GPU time, the larger)
    patched_identity_us: float  # the module patched with a kernel that does nothing, per call
    module_call_us: float  # a module whose forward returns its input: what any module call costs, per call
    calls: int  # calls per timed sample

    @property
    def overhead_us(self) -> float:
        """Host time the dispatch adds to a call (phase decision, boundary, guards, weights, output packing,
        counters) over the module call itself."""
        return max(self.patched_identity_us - self.module_call_us, 0.0)


class _PassThrough(torch.nn.Module):
    def forward(self, x, *args, **kwargs):
        return x


def _time_us(fn: Callable, args: tuple, kwargs: dict, calls: int, warmup: int, samples: int = 5) -> float:
    """Per-call time of `fn(*args, **kwargs)` called back to back, as a decode step issues its modules: `calls`
    calls per sample, one synchronize before and after each sample on CUDA, median over `samples`. The identity
    kernel issues no GPU work, so its time is the host's alone (a synchronize per call would add its own latency,
    several µs, to what is measured)."""
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
    for _ in range(warmup):
        fn(*args, **kwargs)
    times = []
    for _ in range(samples):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    times.sort()
    return times[len(times) // 2]


def dispatch_overhead_us(
    module: torch.nn.Module, example_args: tuple, example_kwargs: dict | None = None, *, repeats: int = 200,
    warmup: int = 20,
) -> DispatchOverhead:
    """Per-call time of `module`'s original forward, of the same module patched with an identity kernel (phase
    decision, boundary capture, guards, output packing, counters: everything a real kernel call adds), and of a
    pass-through module (the module call itself); `overhead_us` is the dispatch's share. `repeats` calls back to
    back per sample, median of 5 samples.

    The module is patched as a submodule of a throwaway container, as it sits in a model: the phase hook goes on
    the container (it runs once per model forward, not per module call) and the module decides its phase from its
    own input, the dearer of the two ways. The module itself is left as it was."""
    kwargs = example_kwargs or {}
    with torch.no_grad():
        original = _time_us(module, example_args, kwargs, repeats, warmup)
        bare = _time_us(_PassThrough(), example_args, kwargs, repeats, warmup)
        bundle = PatchBundle(name="identity")
        bundle.add_patch(PatchSpec(patch_id="identity", module_class=_qualname(module), instances=["m"], kernel=""),
                         source=_IDENTITY_KERNEL)
        holder = torch.nn.Module()
        holder._modules["m"] = module  # not add_module: nothing on the module changes
        apply(holder, bundle, strict=True)
        try:
            patched = _time_us(module, example_args, kwargs, repeats, warmup)
        finally:
            revert(holder)
    return DispatchOverhead(original_us=original, patched_identity_us=patched, module_call_us=bare, calls=repeats)


__all__ = [
    "AppliedPatch", "Dispatch", "DispatchOverhead", "KernelLoadError", "PatchError", "PatchReport", "SkippedPatch",
    "apply", "dispatch_overhead_us", "load_kernel", "report_of", "revert",
]
