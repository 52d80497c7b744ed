"""Task extraction: from a profile's hotspots to phase-aware, deployable task artifacts.

1. Candidates: profiled (module, phase) records of a kernel-target family with hotspot_score >= min_score.
2. Capture run: the workload runs once more (`run_fn()`) under a PhaseTracker with hooks on the candidates. Every
   call is named (kernels_runtime.boundary); per (instance, phase) the first call of each distinct shape signature is
   kept, up to `max_cases`, and every signature is counted.
3. Deployability, each failure with its reason: the state is adaptable and every argument nameable; the call
   writes no tensor attribute on the module that no state adapter owns (hidden state); the call boundary is
   stable (one argument structure and the same static values over all calls of a phase, where structures that
   differ only by an argument passed as None or as a tensor count as one: `merge_optional_inputs`); the captured
   calls are
   reproducible (call_reference run twice on the captured inputs matches the captured outputs and state, bitwise
   or within the dtype's tolerance). The fallback is always the original forward.
4. Grouping: instances of one class, family and phase with the same argument structure, static values (apart from
   `layer_idx`), weight shapes and shape signatures become one task; its cases come from the first instance (weights
   are inputs), `instances` lists all, hotspot_score sums theirs. Non-deployable instances group by (class, family,
   phase, kind of reason).
5. Dispatch: a task names the deployable tasks of the same module class in the other phase as siblings.

Deployable tasks are written with taskspec.write_task (module.pt = the first instance, on the CPU). Non-deployable
ones are only returned (deployable=False, reason, no cases, the observed signatures), never written: there is
nothing to search against.
"""
from __future__ import annotations

import copy
import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from kernels_runtime.boundary import (MODULE_ADAPTERS, BoundaryCall, UnsupportedBoundary, call_reference,
                                      capture_boundary, find_cache, hidden_state_writes, merge_recipes,
                                      recipe_inputs, record_outputs, tensor_attributes, weights_of)
from kernels_runtime.phase import CURRENT_PHASE, PHASES, PhaseTracker
from kernels_runtime.tolerances import TOLERANCES, compare, tolerance_for
from llm4llm import progress
from llm4llm.records import ModuleRecord, ProfileResult
from llm4llm.taskspec import Case, CaseSig, DispatchTemplate, TaskSpec, TensorSig, write_task

TARGET_FAMILIES = ("norm", "mlp", "attention", "ssm_mixer", "ssm_block", "recurrent_block", "rotary", "conv",
                   "decoder_layer", "lm_head")
# Families extracted in some phases only: a whole decoder layer is a decode task (one candidate fuses across its
# modules, where launches and weight passes per token are what a step costs), beside its finer tasks
FAMILY_PHASES = {"decoder_layer": ("decode",)}
PREDICATES = {"prefill": "prefill: new positions > 1", "decode": "decode: new positions == 1 with a cache"}


@dataclass
class _Observed:
    """All calls of one instance in one phase."""

    structures: Counter = field(default_factory=Counter)  # structure key -> calls
    sigs: dict[str, CaseSig] = field(default_factory=dict)  # shape key -> signature and count, first-seen order
    calls: list[BoundaryCall] = field(default_factory=list)  # captured, one per kept signature
    call_structures: list[str] = field(default_factory=list)  # the structure key of each captured call
    error: str = ""


class _Recorder:
    """Forward hooks that name every call of the candidate instances, per phase."""

    def __init__(self, modules: dict[str, torch.nn.Module], max_cases: int, phases: tuple[str, ...] = PHASES):
        self.modules = modules
        self.max_cases = max_cases
        self.phases = phases  # the phases whose calls are captured (the static-cache capture needs decode only)
        self.observed: dict[tuple[str, str], _Observed] = defaultdict(_Observed)
        self._pending: dict[str, list] = defaultdict(list)
        self._handles: list = []
        self._kept: set[tuple] = set()  # (class and weights, phase, shapes, structure) one instance already keeps
        self._idents: dict[str, tuple] = {}
        self._held_by: Counter = Counter()  # keys kept per (class and weights, phase): max_cases per task, as before

    def __enter__(self) -> _Recorder:
        for path, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(
                lambda m, a, k, p=path: self._pre(p, m, a, k), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                lambda m, a, k, o, p=path: self._post(p, m, a, k, o), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, path, module, args, kwargs):
        phase = CURRENT_PHASE.get()
        obs = self.observed[(path, phase)] if phase in self.phases else None
        if obs is None or obs.error:
            self._pending[path].append(None)
            return
        try:
            call = capture_boundary(module, args, kwargs, clone=False)
        except Exception as exc:  # never break the user's run: the instance becomes non-deployable with the reason
            obs.error = _reason(exc)
            self._pending[path].append(None)
            return
        skey, structure = call.shape_key(), call.structure_key()
        obs.structures[structure] += 1
        held = self._held_key(path, module, call, skey)
        keep = skey not in obs.sigs and len(obs.calls) < self.max_cases and (
            structure not in obs.call_structures
            or (held not in self._kept and self._held_by[held[:2]] < self.max_cases))
        if skey not in obs.sigs:
            obs.sigs[skey] = CaseSig(inputs=_sigs(call.inputs), state=_sigs(call.state), calls=0)
        obs.sigs[skey].calls += 1
        attrs = tensor_attributes(module)
        # state-in copied now, before the call writes it; kept cases live in host memory (a serving regime's corners,
        # batch 32 x 2048 tokens, captured on every hotspot's module, would not fit beside the model on the GPU)
        kept = call.cloned(to="cpu") if keep else call
        self._pending[path].append((obs, kept, keep, skey, structure, attrs, held))

    def _held_key(self, path, module, call, skey) -> tuple:
        """What makes two instances' calls interchangeable as cases: class and weight shapes, phase, shapes and
        structure. An instance keeps its own first call of each argument structure always (the reproducibility check,
        merge_optional_inputs and the task's grouping read them), any other only if no instance keeps a call of that
        key yet. A task's cases come from its first instance, with other instances' calls only for shapes it never
        saw (_group_calls): copies of one corner on every layer are never read, and at a serving regime's largest
        corner (batch 32 x 2048 tokens, about 4 GB of tensors a layer) they do not fit in host memory."""
        ident = self._idents.get(path)
        if ident is None:
            ident = self._idents[path] = (_class_path(module), _weight_sig(module))
        return ident, CURRENT_PHASE.get(), skey, call.structure_key(drop_instance_keys=True)

    def _post(self, path, module, args, kwargs, output):
        item = self._pending[path].pop() if self._pending[path] else None
        if item is None:
            return
        obs, call, keep, skey, structure, attrs, held = item
        written = hidden_state_writes(attrs, tensor_attributes(module))
        if written:
            obs.error = f"unsupported boundary: the call writes state kept on the module ({', '.join(written)}) " \
                        f"and no state adapter owns it"
            return
        try:
            record_outputs(call, module, output, find_cache(args, kwargs), clone=keep, to="cpu")
        except Exception as exc:
            obs.error = _reason(exc)
            return
        if not obs.sigs[skey].outputs:
            obs.sigs[skey].outputs = _sigs(call.reference())
        if keep:
            obs.calls.append(call)
            obs.call_structures.append(structure)
            if held not in self._kept:
                self._kept.add(held)
                self._held_by[held[:2]] += 1


def _reason(exc: Exception) -> str:
    if isinstance(exc, UnsupportedBoundary):
        return f"unsupported boundary: {exc.reason}"
    return f"capture failed: {type(exc).__name__}: {exc}"


def _sigs(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSig]:
    return {k: TensorSig(shape=list(v.shape), dtype=str(v.dtype).removeprefix("torch.")) for k, v in tensors.items()}


# ------------------------------------------------------------------------------------------------ deployability

def check_stable(obs: _Observed) -> str:
    """"" when every call of the phase had one argument structure and the same static values, else the reason."""
    if len(obs.structures) <= 1:
        return ""
    (first, n1), (second, n2) = obs.structures.most_common(2)
    a, b = json.loads(first), json.loads(second)
    diffs = [f"static {k}: {a['static'].get(k)!r} vs {b['static'].get(k)!r}"
             for k in sorted(set(a["static"]) | set(b["static"])) if a["static"].get(k) != b["static"].get(k)]
    if a["state"] != b["state"]:
        diffs.append(f"state {a['state']} vs {b['state']}")
    for part in ("args", "kwargs"):
        if a["recipe"][part] != b["recipe"][part]:
            diffs.append(f"{part} {json.dumps(a['recipe'][part])} vs {json.dumps(b['recipe'][part])}")
    return (f"unstable call boundary: {len(obs.structures)} argument structures in one phase "
            f"({n1} and {n2} calls of the two most common; {'; '.join(diffs) or 'recipe differs'})")


def merge_optional_inputs(obs: _Observed) -> None:
    """Make the calls of one phase one boundary where their argument structures differ only by an argument passed
    as None by some calls and as a tensor by others (HF's attention mask: None for an unpadded batch, a bool tensor
    for a padded one): every captured call then takes one merged recipe (boundary.merge_recipes: the argument an
    optional input, None for a case without it) and the phase counts one structure. Only where every structure has a
    captured call, so that the verifier judges each kind of call and the guard admits none unjudged, and where the
    static values and state agree; otherwise nothing changes and check_stable names the difference."""
    if len(obs.structures) <= 1 or set(obs.structures) - set(obs.call_structures):
        return
    payloads = [json.loads(k) for k in obs.structures]
    if any(p["static"] != payloads[0]["static"] or p["state"] != payloads[0]["state"] for p in payloads):
        return
    merged = obs.calls[0].recipe
    for call in obs.calls[1:]:
        merged = merge_recipes(merged, call.recipe, has_state=bool(call.state))
        if merged is None:
            return
    for call in obs.calls:
        call.recipe = copy.deepcopy(merged)
    key = json.dumps({"recipe": merged, "static": payloads[0]["static"], "state": payloads[0]["state"]},
                     sort_keys=True, default=str)
    obs.structures = Counter({key: sum(obs.structures.values())})
    obs.call_structures = [key] * len(obs.calls)


def check_reproducible(module: torch.nn.Module, calls: list[BoundaryCall], repeats: int = 2) -> str:
    """"" when call_reference on each captured call's inputs and state-in reproduces its outputs and state-out
    `repeats` times, bitwise or within TOLERANCES of the output's dtype; else "not reproducible: ..."."""
    weights = weights_of(module)
    device = next(iter(weights.values())).device if weights else torch.device("cpu")
    for k, call in enumerate(calls):
        # the kept calls live in host memory (_Recorder), the module where the workload put it: one call's tensors
        # at a time go to the module's device, once (each re-run takes a copy made there: it may write its state in
        # place), and the comparisons run there too (a 7B serving layer's KV cache is a GB a call, 32 layers)
        ref = _moved(call.reference(), device)
        inputs0, state0 = _moved(call.inputs, device), _moved(call.state, device)
        for attempt in range(1, repeats + 1):
            inputs, state = ({n: v.clone() for n, v in d.items()} for d in (inputs0, state0))
            try:
                got = call_reference(module, weights, inputs, state, call.static, call.recipe)
            except Exception as exc:
                return f"not reproducible: the reference call raised {type(exc).__name__}: {exc}"
            if set(got) != set(ref):
                return f"not reproducible: expected outputs {sorted(ref)}, the re-run returned {sorted(got)}"
            for name, expected in ref.items():
                problem = _mismatch(got[name].to(expected.device), expected)
                if problem:
                    return f"not reproducible: {name} of case {k} differs from the captured call on re-run " \
                           f"{attempt} ({problem})"
    return ""


def _moved(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in tensors.items()}


RERUN_ULPS = 2  # how far (in the dtype's ulps) a 16-bit re-run may move an element and still reproduce


def _mismatch(got: torch.Tensor, expected: torch.Tensor) -> str:
    if got.shape == expected.shape and got.dtype == expected.dtype and torch.equal(got, expected):
        return ""
    if expected.dtype not in TOLERANCES:
        return f"{expected.dtype} values differ"
    report = compare(got, expected)
    if report.ok or expected.dtype not in (torch.bfloat16, torch.float16) or got.shape != expected.shape:
        return "" if report.ok else report.reason
    # A 16-bit module's own run-to-run rounding: cuBLAS and SDPA pick kernels by the operands' addresses and sizes,
    # so a re-run may move an element by an ulp or two (Qwen3's decode layer at batch 32 on the GPU: 2 ulps near 2,
    # over the table's rtol). Up to RERUN_ULPS of the dtype's ulps is reproducible, an ulp taken at the element's
    # magnitude or the output's RMS, whichever is larger: a reordered reduction rounds by the size of its terms, not
    # of its result (layer 0 of the same layer, 0.031 on an element below 1, the RMS near 2). The candidate's check
    # is the verifier's (with its fp32 reference), not this one.
    e = expected.double()
    diff = (got.double() - e).abs()
    scale = torch.maximum(e.abs(), e.square().mean().sqrt()) if e.numel() else e.abs()
    limit = RERUN_ULPS * torch.finfo(expected.dtype).eps * scale + tolerance_for(expected.dtype).atol
    return "" if bool(torch.isfinite(got).all()) and bool((diff <= limit).all()) else report.reason


# ------------------------------------------------------------------------------------------------------ grouping

@dataclass
class _Instance:
    path: str
    module: torch.nn.Module
    record: ModuleRecord
    obs: _Observed
    reason: str


def _group_key(inst: _Instance) -> tuple:
    cls = _class_path(inst.module)
    if inst.reason:
        return (cls, inst.record.family, inst.record.phase, False, inst.reason.split(":", 1)[0])
    weight_sig = _weight_sig(inst.module)
    structure = inst.obs.calls[0].structure_key(drop_instance_keys=True)
    # the observed shapes without their dtypes: instances called with the same shapes in another dtype (Mamba's first
    # residual block takes the bf16 embeddings, the others the fp32 residual stream) are one task whose cases cover
    # both; other shapes stay apart (Qwen3's q_norm and k_norm)
    shapes = tuple(sig.shapes() for sig in inst.obs.sigs.values())
    return (cls, inst.record.family, inst.record.phase, True, structure, shapes, weight_sig)


def _group_calls(group: list[_Instance]) -> list[tuple[_Instance, BoundaryCall]]:
    """The first instance's calls, then each other instance's call of a shape signature not seen yet, with the
    instance that made it (its weights go with the case)."""
    out, seen = [], set()
    for inst in group:
        for c in inst.obs.calls:
            key = c.shape_key()
            if key not in seen:
                seen.add(key)
                out.append((inst, c))
    return out


def _weight_sig(module: torch.nn.Module) -> tuple:
    return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in weights_of(module).items())


def _class_path(module: torch.nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _spec_for(group: list[_Instance], hardware: dict, workload_name: str, run_id: str) -> TaskSpec:
    rep = group[0]
    calls = [c for _, c in _group_calls(group)]
    observed, by_key = [], {}
    for inst in group:
        for skey, sig in inst.obs.sigs.items():
            if skey not in by_key:
                total = sum(i.obs.sigs[skey].calls for i in group if skey in i.obs.sigs)
                by_key[skey] = sig.model_copy(update={"calls": total}, deep=True)
                observed.append(by_key[skey])
    first = calls[0] if calls else None
    reason = rep.reason if len(group) == 1 else f"{rep.path}: {rep.reason}" if rep.reason else ""
    return TaskSpec(
        workload=workload_name,
        run_id=run_id,
        family=rep.record.family,
        module_class=_class_path(rep.module),
        instances=[inst.path for inst in group],
        phase=rep.record.phase,
        input_names=recipe_inputs(first.recipe) if first else [],  # an optional input too, wherever it came first
        weight_names=list(weights_of(rep.module)),
        state_names=_union(list(c.state) for c in calls),
        output_names=_union(list(c.reference()) for c in calls),
        static={k: v for k, v in first.static.items() if k.rpartition(".")[2] != "layer_idx"} if first else {},
        cases=[by_key[c.shape_key()] for c in calls] if not rep.reason else [],
        observed=observed,
        dtype=_dtype_of(first, rep),
        hardware=dict(hardware or {}),
        hotspot_score=sum(inst.record.hotspot_score for inst in group),
        time_ms=sum(inst.record.time_ms for inst in group),
        deployable=not rep.reason,
        reason=reason,
        recipe=copy.deepcopy(first.recipe) if first else {},
    )


def _union(lists: Iterable[list[str]]) -> list[str]:
    out: list[str] = []
    for names in lists:
        out.extend(n for n in names if n not in out)
    return out


def _dtype_of(call: BoundaryCall | None, inst: _Instance) -> str:
    """The task's compute dtype: its first floating input's, else its weights'. A residual block (ssm_block) takes
    the residual stream, fp32 past the first block with residual_in_fp32, and computes in its weights' dtype: its
    weights come first (the dtype sets the tolerances its candidates are judged by)."""
    tensors = list(call.inputs.values()) if call else []
    if inst.record.family == "ssm_block":
        tensors = [t for t in weights_of(inst.module).values() if t.is_floating_point()][:1] + tensors
    tensors += list(weights_of(inst.module).values())
    for t in tensors:
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "unknown"


def _cases(group: list[_Instance]) -> list[Case]:
    weights: dict[int, dict] = {}
    cases = []
    for inst, c in _group_calls(group):
        if id(inst) not in weights:
            weights[id(inst)] = {k: v.detach().cpu().clone() for k, v in weights_of(inst.module).items()}
        cases.append(Case(inputs=c.inputs, weights=weights[id(inst)], state=c.state, ref=c.reference()))
    return cases


def _reference_module(module: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(module).cpu()
    adapter = MODULE_ADAPTERS.get(type(module).__name__)
    if adapter is not None:
        adapter.clear(ref)
    return ref


# ---------------------------------------------------------------------------------------------------- extraction

def candidate_records(model: torch.nn.Module, profile: ProfileResult, min_score: float,
                      families: Iterable[str] | None) -> list[ModuleRecord]:
    wanted = set(TARGET_FAMILIES) & set(families if families is not None else TARGET_FAMILIES)
    paths = {name for name, _ in model.named_modules()}
    return [r for r in profile.records
            if r.family in wanted and r.phase in FAMILY_PHASES.get(r.family, PHASES) and r.module_path in paths
            and r.hotspot_score >= min_score]


BELOW_SHARE = "below delta"  # the reason's head (it groups the instances of a class and phase into one spec)


def below_share(records: list[ModuleRecord], min_share: float) -> dict[tuple[str, str], str]:
    """(module path, phase) of the records whose module class's whole share of the workload in that phase (the
    hotspot scores of all its instances, the plan's end-to-end bound) is below `min_share`, each with its reason.
    No kernel for them, however fast, could bring the end-to-end gain acceptance asks for, and a serving regime's
    prefill corners are GBs of tensors a task to capture and write: they are not captured."""
    if min_share <= 0:
        return {}
    total: Counter = Counter()
    for r in records:
        total[(r.class_name, r.phase)] += r.hotspot_score
    return {(r.module_path, r.phase): f"{BELOW_SHARE}: the whole {r.phase} share of {r.class_name} "
                                      f"({total[(r.class_name, r.phase)]:.2%}) is below the acceptance's minimum "
                                      f"end-to-end gain ({min_share:.0%}); not captured"
            for r in records if total[(r.class_name, r.phase)] < min_share}


# Cache layers of a KV cache that grows per token; under `static_cache` their decode calls are captured again on
# transformers' static cache (StaticLayer), which decode graphs run on
DYNAMIC_KV_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


def _host_note(observed: dict[tuple[str, str], _Observed]) -> str:
    """The cases kept in host memory and the process's peak resident memory: a serving regime's extraction once
    rose to 109 of a host's 128 GB, and this line says how much of that its cases are."""
    import resource

    calls = [c for obs in observed.values() for c in obs.calls]
    kept = sum(t.numel() * t.element_size() for c in calls
               for d in (c.inputs, c.state, c.outputs, c.state_out) for t in d.values() if isinstance(t, torch.Tensor))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux
    return f"{len(calls)} cases kept, {kept / 2 ** 30:.2f} GiB of tensors; process peak {peak:.1f} GiB resident"


def _kv_decode_paths(observed: dict[tuple[str, str], _Observed]) -> list[str]:
    return [path for (path, phase), obs in observed.items()
            if phase == "decode" and obs.calls
            and ((obs.calls[0].recipe.get("state") or {}).get("adapter")) in DYNAMIC_KV_LAYERS]


def _capture_static(model: torch.nn.Module, run_fn: Callable[[], Any], modules: dict[str, torch.nn.Module],
                    max_cases: int) -> dict[tuple[str, str], _Observed]:
    """The decode calls of `modules` in a run of the workload on transformers' static KV cache: the model's
    generation config asks for it (cache_implementation="static", as kernels_runtime.graphs does for decode graphs),
    restored after the run."""
    from kernels_runtime.graphs import _static_generation

    saved = _static_generation(model)
    try:
        # decode calls only: a prompt's calls on the static cache carry the whole cache in and out (state at the
        # regime's largest corner, every layer), and nothing reads them
        with PhaseTracker(model), _Recorder(modules, max_cases, phases=("decode",)) as recorder:
            run_fn()
    finally:
        for k, v in saved.items():
            setattr(model.generation_config, k, v)
    return dict(recorder.observed)


def extract_tasks(model: torch.nn.Module, run_fn: Callable[[], Any], profile: ProfileResult, out_root: Path, *,
                  workload_name: str = "", run_id: str = "", hardware: dict | None = None, min_score: float = 0.0,
                  families: Iterable[str] | None = None, max_cases: int = 4,
                  static_cache: bool = False, accuracy_budget: dict | None = None,
                  regime: bool = False, min_share: float = 0.0) -> list[TaskSpec]:
    """Capture the candidates' calls in one more run of the workload and turn them into tasks; deployable ones are
    written under `out_root/<task_id>/`. Returns every task, deployable or not, by descending hotspot score.

    static_cache (a run whose decode graphs generate with transformers' static KV cache): the decode calls of
    modules that keep a growing KV cache (DynamicLayer) are captured once more, on the static cache, and their
    decode tasks come from that run (StaticLayer state: the preallocated keys/values and the device-side length),
    so a kernel is searched for the cache it will meet; prefill and every other task stay as captured first.
    `accuracy_budget` (the workload's lossy opt-in, Workload.lossy_budget()) goes into every spec; `regime`: the
    workload declared a serving regime whose corners the captured cases include (TaskSpec.regime); `min_share` (the
    acceptance's delta): a module class whose whole share in a phase is below it is not captured (`below_share`)."""
    records = candidate_records(model, profile, min_score, families)
    cold = below_share(records, min_share)
    named = dict(model.named_modules())
    order = {name: i for i, name in enumerate(named)}
    modules = {r.module_path: named[r.module_path] for r in records}
    t0 = time.perf_counter()

    laps: list[str] = []

    def took(step: str = "") -> str:  # each step's end: where a serving regime's extraction spends its time
        s = f"{time.perf_counter() - t0:.1f} s"
        if step:
            laps.append(f"{step} {s}")
        return s

    with PhaseTracker(model), _Recorder(modules, max_cases) as recorder:
        for key, reason in cold.items():
            recorder.observed[key].error = reason
        run_fn()
    print(f"extract: {_host_note(recorder.observed)} after the capture, at {took('capture')}")
    kv_paths = _kv_decode_paths(recorder.observed) if static_cache else []
    if kv_paths:
        static_obs = _capture_static(model, run_fn, {p: modules[p] for p in kv_paths}, max_cases)
        print(f"extract: {_host_note(static_obs)} after the static-cache capture, at {took('static-cache capture')}")
        for path in kv_paths:
            recorder.observed[(path, "decode")] = static_obs.get((path, "decode"), _Observed())

    instances = []
    for rec in sorted(records, key=lambda r: (r.phase, order[r.module_path])):
        obs = recorder.observed.get((rec.module_path, rec.phase), _Observed())
        module = modules[rec.module_path]
        merge_optional_inputs(obs)
        reason = obs.error or ("" if obs.calls else "no call captured in this phase")
        reason = reason or check_stable(obs) or check_reproducible(module, obs.calls)
        instances.append(_Instance(rec.module_path, module, rec, obs, reason))

    print(f"extract: {len(instances)} instances checked for reproducibility, at {took('reproducibility')}")
    groups: dict[tuple, list[_Instance]] = defaultdict(list)
    for inst in instances:
        groups[_group_key(inst)].append(inst)

    specs = [(_spec_for(g, hardware or profile.hardware, workload_name, run_id), g) for g in groups.values()]
    for spec, _ in specs:
        spec.accuracy_budget = dict(accuracy_budget) if accuracy_budget else None
        spec.regime = regime
    seen: Counter = Counter()
    for spec, _ in specs:
        base = spec.content_id()
        seen[base] += 1
        spec.task_id = base if seen[base] == 1 else f"{base}-{seen[base]}"
    for spec, _ in specs:
        siblings = [s.task_id for s, _ in specs
                    if s.deployable and s.module_class == spec.module_class and s.phase != spec.phase]
        spec.dispatch = DispatchTemplate(phase=spec.phase, predicate=PREDICATES.get(spec.phase, spec.phase),
                                         sibling_tasks=siblings)
    for spec, group in specs:
        if spec.deployable:
            write_task(Path(out_root), spec, _reference_module(group[0].module), _cases(group))
    print(f"extract: {sum(s.deployable for s, _ in specs)} tasks written, at {took('written')}")
    progress.note(f"extract: steps ended at {', '.join(laps)} ({_host_note(recorder.observed)})")
    return sorted((s for s, _ in specs), key=lambda s: s.hotspot_score, reverse=True)
