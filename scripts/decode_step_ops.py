"""How many kernels one decode step launches, per decoder layer and outside the layers (no GPU needed).

    python scripts/decode_step_ops.py examples/workloads/tiny-mamba.toml --layers-of examples/workloads/mamba-130m.toml
    python scripts/decode_step_ops.py examples/workloads/tiny-mamba.toml --template ssm_mixer.mamba_decode_fused

A replayed decode step (kernels_runtime.graphs) pays per kernel, not per Python op: each node of the CUDA graph is a
launch the GPU serialises (and that the driver walks at each graph launch). This counts, for the second decode step
of the workload's own `generate`, the ATen ops that launch a kernel (views, reshapes, detach and other metadata-only
ops excluded) and the Triton kernel launches, attributed to the decoder layer running them. The count depends on
the architecture and the code path, not on the sizes: a tiny workload of the same architecture gives the per-layer
count of the real one, and `--layers-of REAL.toml` extrapolates the step to the real number of layers.

With `--template NAME` the workload's decode task is patched with that template at its default config (Triton under
the interpreter on the CPU), as `scripts/gpu/graph_diag.py` does. Counts only: no timing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run under the interpreter here (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# ATen ops that only make a new view of existing storage (or nothing): no kernel on the GPU
METADATA_OPS = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "slice", "select",
    "unsqueeze", "squeeze", "detach", "alias", "as_strided", "split", "split_with_sizes", "chunk", "unbind",
    "lift_fresh", "diagonal", "unfold", "narrow", "view_as", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "promote_types", "result_type",
}


# ops that return their input unchanged when there is nothing to do (a cast to the dtype it has)
MAYBE_ALIAS = {"to", "_to_copy", "contiguous", "type_as"}


def _name(func) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


class _Counter(TorchDispatchMode):
    def __init__(self, where):
        super().__init__()
        self.where, self.ops = where, Counter()
        self.in_triton = 0  # inside an interpreted Triton launch: its NumPy marshalling is not the kernel's work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        out = func(*args, **(kwargs or {}))
        if self.in_triton:
            return out
        if name in MAYBE_ALIAS and args and out is args[0]:
            return out  # already that dtype / layout: no copy, no kernel
        if name not in METADATA_OPS:
            self.ops[(self.where(), name)] += 1
        return out


def _layers(model) -> torch.nn.ModuleList:
    for path in ("model.layers", "backbone.layers", "model.decoder.layers", "transformer.h"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise SystemExit("decoder layers: expected model.layers / backbone.layers / transformer.h")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload")
    ap.add_argument("--layers-of", help="a workload TOML whose layer count the step is extrapolated to")
    ap.add_argument("--template", action="append", default=[],
                    help="patch the decode task of this template's family with it, default config (repeatable)")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                    help="override the workload's dtype (the real workloads run bfloat16: casts count)")
    ap.add_argument("--json", help="write the counts here")
    ap.add_argument("--all-tasks", action="store_true",
                    help="patch every decode task a --template applies to, not only the one with the most instances "
                         "(e.g. Mamba's blocks in bf16: the first takes bf16 embeddings, the rest the fp32 residual "
                         "stream, two tasks)")
    args = ap.parse_args()
    if args.template:  # before anything is built
        from llm4llm.search.templates import TEMPLATES

        known = sorted(t.name for t in TEMPLATES)
        for name in args.template:
            if name not in known:
                ap.error(f"template: expected one of {known}, got {name!r}")
    args.real = None
    if args.layers_of:  # read, not loaded (the real workload may want a GPU): its name and model config
        import tomllib

        from transformers import AutoConfig

        with open(args.layers_of, "rb") as f:
            real = tomllib.load(f)
        model_cfg = real.get("model", {})
        if "model_type" not in model_cfg:
            ap.error(f"--layers-of: expected [model] model_type in {args.layers_of}")
        args.real = (real.get("name", args.layers_of),
                     AutoConfig.for_model(model_cfg["model_type"], **(model_cfg.get("config") or {})))
    if args.dtype:  # a copy of the TOML beside it (its script path is relative), with the dtype replaced
        import re

        with open(args.workload) as f:
            text = f.read()
        text, n = re.subn(r'(?m)^dtype\s*=\s*"[^"]*"', f'dtype = "{args.dtype}"', text)
        if n != 1:
            ap.error(f"--dtype: expected one top-level dtype line in {args.workload}")
        fd, args.workload = tempfile.mkstemp(suffix=".toml", prefix=".dtype-", dir=os.path.dirname(args.workload))
        with os.fdopen(fd, "w") as f:
            f.write(text)
    try:
        return _count(ap, args)
    finally:
        if args.dtype:
            os.unlink(args.workload)


def _count(ap, args) -> int:
    import kernels_runtime  # noqa: F401 - imported before the model is built, as when templates are applied
    from llm4llm.workload import call_script, load_script, load_workload

    wl = load_workload(args.workload)
    script = load_script(wl)
    model = call_script(script.build, wl)
    batch = call_script(script.inputs, wl)
    if args.template:
        _apply_templates(model, args)
    layers = _layers(model)
    counter, triton = _count_step(model, layers, script, wl, batch)
    if args.template:
        from kernels_runtime.patch import report_of

        print("  patched calls:", {p: c for p, c in report_of(model).items() if c["fallback"] or c["kernel"]})
    out = _summary(wl, args, layers, counter, triton)
    if args.real:
        name, n_real, est = _extrapolate(args.real, out["per_layer"], out["outside"], layers)
        print(f"  extrapolated to {name} ({n_real} layers): about {est} kernels per decode step")
        out.update(extrapolated_to=name, layers=n_real, estimate=est)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _apply_templates(model, args) -> None:
    """Install each --template's default candidate on the model's decode task(s) it applies to."""
    import kernels_runtime
    from kernels_runtime.bundle import PatchBundle
    from llm4llm.patchspec import task_patch_spec
    from llm4llm.stages.extract import extract_to_temp
    from llm4llm.search.templates import TEMPLATES

    tasks = extract_to_temp(args.workload, "decode_step_ops-")
    bundle = PatchBundle(name="decode-step-ops")
    for name in args.template:
        t = next(t for t in TEMPLATES if t.name == name)
        # the decode task of the family with the most instances (a model's norms: the per-layer ones)
        cands = [k for k in tasks if k.spec.phase == "decode" and t.why_not(k.spec) is None]
        if not cands:
            raise SystemExit(f"no decode task that {name} applies to in {args.workload}")
        for task in cands if args.all_tasks else [max(cands, key=lambda k: len(k.spec.instances))]:
            bundle.add_patch(task_patch_spec(task.spec, name, 1.0, "cpu"),
                             source=t.render(task.spec, t.default(task.spec)))
    report = kernels_runtime.apply(model, bundle, strict=True)
    print(str(report).splitlines()[0])


def _count_step(model, layers, script, wl, batch) -> tuple[_Counter, Counter]:
    """(aten ops, Triton launches) of the run's second one-token decode step, each keyed by (layer index or -1,
    name); the second because every lazy init is behind it."""
    from llm4llm.workload import call_script

    current: list[int] = []
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: current.append(i))
        layer.register_forward_hook(lambda m, a, o: (current.pop(), None)[1])  # returns None: the output stays
    where = lambda: current[-1] if current else -1  # noqa: E731
    counter = _Counter(where)
    triton = Counter()
    decode_calls = {"n": 0}
    forward = model.forward

    def counted(*a, **kw):
        ids = kw.get("input_ids", a[0] if a else None)
        decode = isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1
        if decode:
            decode_calls["n"] += 1
        if decode and decode_calls["n"] == 2:  # the second decode step: every lazy init is behind us
            with counter:
                return forward(*a, **kw)
        return forward(*a, **kw)

    model.forward = counted
    try:
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def counting_run(self, *a, **kw):
            if counter in _active_modes():
                triton[(where(), getattr(self, "__name__", None) or getattr(self.fn, "__name__", "triton"))] += 1
            counter.in_triton += 1
            try:
                return run(self, *a, **kw)
            finally:
                counter.in_triton -= 1

        InterpretedFunction.run = counting_run
    except ImportError:
        run = None
    wl2 = wl.model_copy(update={"decode_len": 3})
    call_script(script.run, model, wl2, batch)
    if run is not None:
        InterpretedFunction.run = run
    if decode_calls["n"] < 2:
        raise SystemExit("the run made fewer than two one-token decode calls")
    return counter, triton


def _summary(wl, args, layers, counter: _Counter, triton: Counter) -> dict:
    """Print and return the step's kernels: in total, per layer kind, outside the layers, layer 0's ops."""
    per_layer: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        n = sum(v for (w, _), v in counter.ops.items() if w == i) + sum(v for (w, _), v in triton.items() if w == i)
        per_layer.setdefault(type(layer).__name__ + _kind(layer), []).append(n)
    outside = sum(v for (w, _), v in counter.ops.items() if w == -1) + sum(v for (w, _), v in triton.items() if w == -1)
    total = sum(counter.ops.values()) + sum(triton.values())
    print(f"{wl.name}{''.join(' + ' + t for t in args.template)}: one decode step = {total} kernels "
          f"({sum(triton.values())} Triton) over {len(layers)} layers; outside the layers {outside}")
    kinds = {}
    for kind, ns in per_layer.items():
        kinds[kind] = ns
        print(f"  {kind:45s} {len(ns)} layer(s): {sorted(set(ns))} kernels each")
    ops = Counter()
    for (w, name), v in counter.ops.items():
        if w == 0:
            ops[name] += v
    print("  layer 0's ops:", ", ".join(f"{k} {v}" for k, v in ops.most_common()))
    return {"workload": wl.name, "template": args.template, "total": total, "outside": outside, "per_layer": kinds,
            "layer0_ops": dict(ops), "triton": sum(triton.values())}


def _extrapolate(real, kinds: dict[str, list[int]], outside: int, layers) -> tuple[str, int, int]:
    """(name, layers, kernels per decode step) of the real model `--real` names."""
    name, real_cfg = real
    n_real = real_cfg.num_hidden_layers
    # the real model repeats the tiny one's layers; where they differ by kind (RecurrentGemma's recurrent and
    # attention blocks), in the real config's proportion
    pattern = getattr(real_cfg, "layers_block_type", None)
    mean_of = {k: sum(ns) / len(ns) for k, ns in kinds.items()}
    if pattern and len(mean_of) > 1:
        by_block = {k.split("[")[1].rstrip("]"): v for k, v in mean_of.items()}
        block_of = {"recurrent": "RecurrentGemmaRecurrentBlock", "attention": "RecurrentGemmaAttention"}
        est = round(outside + sum(by_block[block_of[b]] for b in list(pattern)[:n_real]))
    elif len(kinds) == 1 and len(layers) > 1:  # the first layer once (the bf16 embeddings' casts), the rest after
        ns = next(iter(kinds.values()))
        est = round(outside + ns[0] + sum(ns[1:]) / len(ns[1:]) * (n_real - 1))
    else:
        est = round(outside + sum(sum(ns) for ns in kinds.values()) / len(layers) * n_real)
    return name, n_real, est


def _kind(layer) -> str:
    """RecurrentGemma's decoder layers differ by their temporal block."""
    block = getattr(layer, "temporal_block", None)
    return f"[{type(block).__name__}]" if block is not None else ""


def _active_modes():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


if __name__ == "__main__":
    raise SystemExit(main())
