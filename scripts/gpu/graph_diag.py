"""Decode graphs with one decode template patched in, without a search: why a capture is refused, and what it costs.

Profiles and extracts the workload (the decode task's spec gives the guard), renders the named decode templates (the
template's default config, or --config JSON), and times the script's generate for: eager, eager_graphs, and per
template patched and patched_graphs, in this one process, as `llm4llm evaluate` times them (llm4llm.evaluate.measure:
total, prefill, decode per token; the numbers of docs/results/2026-11-30-h200-c come from an earlier version with its
own full-run timer). Prints the graph stats and, for a failed capture, its traceback.

    python scripts/gpu/graph_diag.py examples/workloads/mamba2-2.7b.toml \\
        --template ssm_mixer.mamba2_decode_fused --template ssm_mixer.mamba2_decode --out $OUT/graph_diag.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> int:
    args = _parse_args()
    import kernels_runtime
    from llm4llm.stages.extract import extract_to_temp
    from llm4llm.workload import call_script, load_script, load_workload

    t0 = time.perf_counter()
    tasks = extract_to_temp(args.workload, "graph_diag-")
    print(f"profile + extract {time.perf_counter() - t0:.1f}s", flush=True)
    wl = load_workload(args.workload)
    script = load_script(wl)
    model = call_script(script.build, wl)
    batch = call_script(script.inputs, wl)

    cuda = wl.device.startswith("cuda")
    backend = "rerun" if args.emulate else "cuda"
    timed = functools.partial(_timed, model, wl, batch, script, args.repeats)
    rows = [{"variant": "eager", **timed()}]
    g = kernels_runtime.enable_decode_graphs(model, backend=backend)
    try:
        rows.append({"variant": "eager_graphs", **timed(), "graphs": g.stats()})
    finally:
        kernels_runtime.disable_decode_graphs(model)
    prefill = _prefill_patch(args, tasks, cuda)
    bundle = label = None
    for name in args.template:
        for ci, cfg in enumerate(args.config or [None]):
            bundle, label, config = _bundle(args, tasks, name, ci, cfg, prefill, cuda)
            for graphs in (True,) if args.graphs_only else (False, True):
                rows.append(_variant_row(model, bundle, f"{label}{'+graphs' if graphs else ''}", config, graphs,
                                         cuda, backend, timed))
    with open(args.out, "w") as f:  # the measurements first: a bundle that cannot be written loses none of them
        json.dump({"workload": wl.name, "rows": rows}, f, indent=1, default=str)
    if args.save_bundle:
        from kernels_runtime.bundle import save_bundle

        bundle.decode_graphs = True
        print(f"bundle of {label}: {save_bundle(bundle, args.save_bundle)}")
    _print_rows(rows)
    return 0


def _parse_args() -> argparse.Namespace:
    """The arguments, templates and configs checked: a usage error before anything runs."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload")
    ap.add_argument("--template", action="append", required=True, help="decode template name (repeatable)")
    ap.add_argument("--config", action="append", default=None,
                    help="JSON config (repeatable: each template runs with each; default: the template's default)")
    ap.add_argument("--prefill-template", default=None,
                    help="also patch prefill with this template (its default config) in every bundle")
    ap.add_argument("--graphs-only", action="store_true", help="skip the patched-without-graphs rows")
    ap.add_argument("--family", default=None, help="task family (default: the template's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-bundle", default=None,
                    help="write the last row's bundle (its template, config and prefill template; decode graphs on) "
                         "to this directory, e.g. for scripts/gpu/trace_decode.py --bundle")
    ap.add_argument("--emulate", action="store_true", help="CPU smoke run: the re-running graph backend (Triton under the "
                    "interpreter is not ATen ops), no timing claim")
    args = ap.parse_args()
    from llm4llm.search.templates import TEMPLATES

    known = {t.name for t in TEMPLATES}
    for name in args.template + ([args.prefill_template] if args.prefill_template else []):
        if name not in known:
            ap.error(f"template: expected one of {sorted(known)}, got {name!r}")
    for cfg in args.config or []:
        try:
            if not isinstance(json.loads(cfg), dict):
                raise ValueError("not an object")
        except ValueError as e:
            ap.error(f"--config: expected a JSON object, got {cfg!r} ({e})")
    return args


def _timed(model, wl, batch, script, repeats: int) -> dict:
    """The script's generate as `llm4llm evaluate` times it (llm4llm.evaluate.measure: one warm-up, then the median
    of --repeats full runs and of --repeats one-token runs): total, prefill and decode per token."""
    from llm4llm.evaluate import measure

    r = measure(model, wl, batch, script.run, repeats=repeats)
    return {"ms": r.total_ms, "prefill_ms": r.prefill_ms, "decode_ms_per_token": r.decode_ms_per_token}


def _prefill_patch(args, tasks, cuda: bool):
    """(patch spec, source) of --prefill-template at its default config, or None."""
    if not args.prefill_template:
        return None
    from llm4llm.patchspec import task_patch_spec
    from llm4llm.search.templates import TEMPLATES

    pt = next(t for t in TEMPLATES if t.name == args.prefill_template)
    ptask = next(k for k in tasks if k.spec.phase == "prefill" and k.spec.family == pt.family)
    psrc = pt.render(ptask.spec, pt.default(ptask.spec))
    return (task_patch_spec(ptask.spec, "prefill", 1.0, "cuda" if cuda else "cpu"), psrc)


def _bundle(args, tasks, name: str, ci: int, cfg: str | None, prefill, cuda: bool):
    """(bundle, row label, config) of decode template `name` at config `cfg` (its default when None), with the
    prefill patch when there is one."""
    from kernels_runtime.bundle import PatchBundle
    from llm4llm.patchspec import task_patch_spec
    from llm4llm.search.templates import TEMPLATES

    t = next(t for t in TEMPLATES if t.name == name)
    fam = args.family or t.family
    task = next(k for k in tasks if k.spec.phase == "decode" and k.spec.family == fam)
    config = {**t.default(task.spec), **json.loads(cfg)} if cfg else t.default(task.spec)
    source = t.render(task.spec, config)
    bundle = PatchBundle(name="graph-diag")
    if prefill is not None:
        bundle.add_patch(prefill[0], source=prefill[1])
    bundle.add_patch(task_patch_spec(task.spec, name, 1.0, "cuda" if cuda else "cpu"), source=source)
    return bundle, f"{name}#{ci}" + ("+prefill" if prefill is not None else ""), config


def _variant_row(model, bundle, variant: str, config: dict, graphs: bool, cuda: bool, backend: str, timed) -> dict:
    """One row: the model timed with `bundle` applied (and decode graphs with `graphs`), then reverted; a failure
    is a row too."""
    import kernels_runtime

    report = kernels_runtime.apply(model, bundle, strict=True, decode_graphs=graphs and cuda)
    if graphs and not cuda:
        kernels_runtime.enable_decode_graphs(model, backend=backend)
    try:
        row = {"variant": variant, **timed(), "calls": report.totals(), "config": config}
        gg = kernels_runtime.decode_graphs_of(model)
        if gg is not None:
            row["graphs"] = gg.stats()
            row["errors"] = list(gg.errors.values())
    except Exception as e:  # one template failing is a row
        row = {"variant": variant, "ms": None, "error": repr(e)[:2000]}
    finally:
        kernels_runtime.disable_decode_graphs(model)
        kernels_runtime.revert(model)
    return row


def _print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "errors"}, default=str)[:600])
        for e in r.get("errors", []):
            print(e[-3000:])
    print(f"{'variant':<40}{'ms':>10}")
    for r in rows:
        print(f"{r['variant']:<40}{r['ms'] if r['ms'] is None else round(r['ms'], 1):>10}")


if __name__ == "__main__":
    sys.exit(main())
