"""Decode attention over transformers' static KV cache on the GPU, in one process:

1. bench: attention_decode_static (q/k norms + rotary + cache write + split-KV attention + length advance, one
   kernel pair) against HF's path for the same step (Qwen3RMSNorm x2, apply_rotary_pos_emb, StaticLayer.update,
   sdpa_attention_forward with repeat_kv over the whole static cache, as transformers 5.17 runs it), qwen3-4b shapes
   (32 q heads, 8 kv heads, head_dim 128, bf16, batch 1), each captured as GRAPH_CALLS steps in one CUDA graph,
   replays alternating A B A B; GB/s = the K/V bytes attended / time, beside the measured copy bandwidth.
2. verify: a 2-layer qwen3-4b (same attention shapes, prompt 512, decode 8) extracted on the static cache and on
   the dynamic one; the verifier (graph timing, as `optimize --decode-graphs` runs it) over the static template's
   configs and the dynamic template (the case that faults when a graph capture frees the dynamic cache's tensors).
3. in-model: the static candidate applied to that model, generate on the static cache with decode graphs: kernel
   and fallback counts, teacher-forced logits rel-L2 against the unpatched model.

    python scripts/gpu/decode_attn_static.py --out $OUT/decode_attn.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from llm4llm.evaluate import copy_bandwidth_gbps  # noqa: E402

GRAPH_CALLS = 20
ROUNDS = 30


def _graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            fn()
    return g


def bench(S: int) -> list[dict]:
    from transformers.cache_utils import StaticLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from kernels_runtime.ops.attention_decode_static import attention_decode_static

    dev, dt = torch.device("cuda"), torch.bfloat16
    B, Hq, Hkv, D = 1, 32, 8, 128
    pos = S - 1 - GRAPH_CALLS  # the graph's steps write the last positions; the length is reset before each replay
    q, k, v = (torch.randn(B, h, 1, D, device=dev, dtype=dt) for h in (Hq, Hkv, Hkv))
    ang = torch.randn(B, 1, D // 2, device=dev)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)
    qn, kn = Qwen3RMSNorm(D, 1e-6).to(dev, dt), Qwen3RMSNorm(D, 1e-6).to(dev, dt)
    layer = StaticLayer(max_cache_len=S)
    layer.lazy_initialization(k, v)
    layer.keys.normal_()
    layer.values.normal_()
    layer.cumulative_length.fill_(pos)
    mask = torch.zeros(B, 1, 1, S, device=dev, dtype=torch.bool)
    mask[..., : pos + GRAPH_CALLS] = True  # attended: the valid positions (HF builds it from the positions)
    mod = torch.nn.Module()
    mod.num_key_value_groups, mod.is_causal, mod.training = Hq // Hkv, True, False
    ours_len = layer.cumulative_length.clone()

    def ours():
        attention_decode_static(q, k, v, layer.keys, layer.values, ours_len, cos, sin, D ** -0.5,
                                q_norm_weight=qn.weight, k_norm_weight=kn.weight, eps=1e-6)

    def hf():
        qq, kk = apply_rotary_pos_emb(qn(q), kn(k), cos, sin)
        keys, values = layer.update(kk, v)
        sdpa_attention_forward(mod, qq, keys, values, mask, scaling=D ** -0.5, dropout=0.0)

    rows = []
    graphs = {"ours": _graph(ours), "hf_sdpa": _graph(hf)}
    lens = {"ours": ours_len, "hf_sdpa": layer.cumulative_length}
    times = {n: [] for n in graphs}
    for _ in range(ROUNDS):
        for name, g in graphs.items():
            lens[name].fill_(pos)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            times[name].append(s.elapsed_time(e) * 1e3 / GRAPH_CALLS)
    kv_bytes = 2 * B * Hkv * (pos + GRAPH_CALLS // 2) * D * 2  # K and V attended, mean length over the steps
    full_bytes = 2 * B * Hkv * S * D * 2  # HF's SDPA reads the whole cache (repeated to 32 heads)
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        p20, p50, p80 = (float(x) for x in torch.quantile(t, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)))
        rows.append({"op": "decode_attention_step", "provider": name, "cache_len": S, "p20_us": p20, "p50_us": p50,
                     "p80_us": p80, "kv_gb_per_s": kv_bytes / (p50 * 1e-6) / 1e9, "kv_bytes": kv_bytes,
                     "cache_bytes": full_bytes, "rounds": ROUNDS, "calls_per_replay": GRAPH_CALLS})
    return rows


def reduced_workload(tmp: Path) -> Path:
    src = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "qwen3-4b.toml"
    text = src.read_text().replace("num_hidden_layers = 36", "num_hidden_layers = 2") \
        .replace("decode_len = 64", "decode_len = 8").replace('name = "qwen3-4b"', 'name = "qwen3-4b-2l"') \
        .replace('script = "../scripts/hf_generate.py"', f'script = "{src.parent.parent / "scripts" / "hf_generate.py"}"')
    out = tmp / "qwen3-4b-2l.toml"
    out.write_text(text)
    return out


def extract(wl: Path, static_cache: bool):
    from llm4llm.stages.extract import run_extract
    from llm4llm.stages.profile import run_profile
    from llm4llm.taskspec import load_task

    data = tempfile.mkdtemp(prefix="decode-attn-")
    run_extract(str(wl), run_profile(str(wl), data), data, static_cache=static_cache)
    for d in sorted((Path(data) / "tasks").iterdir()):
        t = load_task(d, with_cases=False)
        if t.spec.family == "attention" and t.spec.phase == "decode":
            return d, t
    raise RuntimeError("no decode attention task")


def verify(task_dir, task, template, configs) -> list[dict]:
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.verify.worker import VerifierPool

    t = next(x for x in TEMPLATES if x.name == template)
    rows = []
    with VerifierPool("cuda", 300.0, decode_timing="graph") as pool:
        for over in configs:
            config = {**t.default(task.spec), **over}
            v = pool.verify(task_dir, t.render(task.spec, config))
            ic = next((g.detail for g in v.gates if g.name == "timing_in_context"), "")
            rows.append({"template": template, "config": over, "passed": v.passed,
                         "failure_class": v.failure_class, "speedup_in_context": v.speedup_in_context,
                         "speedup_cold": v.speedup_cold, "timing_in_context": ic,
                         "failed_gate": next((f"{g.name}: {g.detail[:400]}" for g in v.gates if not g.passed), "")})
            print(json.dumps(rows[-1], default=str), flush=True)
    return rows


def in_model(wl: Path, task_dir, task) -> dict:
    import kernels_runtime
    from kernels_runtime.bundle import PatchBundle
    from kernels_runtime.graphs import disable_decode_graphs, enable_decode_graphs
    from kernels_runtime.patch import report_of
    from kernels_runtime.tolerances import rel_l2
    from llm4llm.accept import teacher_forced_logits
    from llm4llm.patchspec import task_patch_spec
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.workload import call_script, load_script, load_workload

    w = load_workload(str(wl))
    script = load_script(w)
    model, batch = call_script(script.build, w), call_script(script.inputs, w)
    steps = w.decode_len
    model.generation_config.cache_implementation, model.generation_config.disable_compile = "static", True
    with torch.inference_mode():
        tokens = model.generate(**batch, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                pad_token_id=0)[:, batch["input_ids"].shape[1]:]
    ref = teacher_forced_logits(model, batch, tokens, steps)
    t = next(x for x in TEMPLATES if x.name == "attention.decode_static")
    bundle = PatchBundle(name="static-attention")
    bundle.add_patch(task_patch_spec(task.spec, "c", 1.0, "cuda"), source=t.render(task.spec, t.default(task.spec)))
    report = kernels_runtime.apply(model, bundle, strict=True)
    eager = teacher_forced_logits(model, batch, tokens, steps)
    eager_counts = report_of(model)
    graphs = enable_decode_graphs(model, static_cache=True)
    graphed = teacher_forced_logits(model, batch, tokens, steps)
    stats = disable_decode_graphs(model)
    out = {"kernel_calls_eager": report.calls_of(bundle.patches[0].patch_id), "counters_eager": eager_counts,
           "graph_stats": {k: v for k, v in stats.items() if k in ("graphs", "replays", "refused")},
           "rel_l2_eager_max": max(rel_l2(g, r) for g, r in zip(eager, ref)),
           "rel_l2_graphed_max": max(rel_l2(g, r) for g, r in zip(graphed, ref))}
    kernels_runtime.revert(model)
    del graphs
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: bench,verify,model")
    args = ap.parse_args()
    skip = set(args.skip.split(",")) - {""}
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    import transformers
    result.update(triton=triton.__version__, transformers=transformers.__version__)

    def save():
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    if "bench" not in skip:
        result["copy_gb_per_s"] = copy_bandwidth_gbps()
        result["bench"] = [r for S in (576, 4096, 32768) for r in bench(S)]
        save()
        print(f"copy bandwidth {result['copy_gb_per_s']:.0f} GB/s")
        for r in result["bench"]:
            print(f"S={r['cache_len']:>6} {r['provider']:>8} p50 {r['p50_us']:7.2f} us (p20 {r['p20_us']:.2f} "
                  f"p80 {r['p80_us']:.2f})  K/V {r['kv_gb_per_s']:7.0f} GB/s", flush=True)
    if "verify" not in skip or "model" not in skip:
        tmp = Path(tempfile.mkdtemp())
        wl = reduced_workload(tmp)
        t0 = time.time()
        sdir, stask = extract(wl, static_cache=True)
        result["extract_static_s"] = time.time() - t0
        result["static_task"] = {"id": stask.spec.task_id, "state": stask.spec.recipe.get("state"),
                                 "state_names": stask.spec.state_names}
        print("static task", result["static_task"], flush=True)
        if "verify" not in skip:
            result["verify_static"] = verify(sdir, stask, "attention.decode_static", [
                {}, {"attn_num_splits": 16, "attn_BLOCK_N": 32}])
            save()
            ddir, dtask = extract(wl, static_cache=False)
            result["verify_dynamic"] = verify(ddir, dtask, "attention.decode_splitkv", [{}])
            save()
        if "model" not in skip:
            result["in_model"] = in_model(wl, sdir, stask)
            print("in model", json.dumps(result["in_model"], default=str), flush=True)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
