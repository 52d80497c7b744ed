"""Host cost of the fused decode kernels on the GPU: Triton's JIT launch vs the cached launcher, and a patched
module (kernels_runtime dispatch) vs HF's eager module, at qwen3-4b sizes, batch 1.

    python scripts/gpu/decode_dispatch.py --out dispatch.jsonl

Back to back, N calls, one synchronize at the end (how a decode step issues them), 5 interleaved rounds, medians:
1. ops: gate_up_swiglu + gemv (the MLP's 4 launches) with the cached launcher on and off (same outputs checked);
2. Qwen3MLP: HF eager, the rendered mlp.decode_gemv entry called directly, the module patched with it (cached on/off);
3. Qwen3DecoderLayer over a DynamicCache (64 past tokens, growing): HF eager vs patched with decoder_layer.decode_fused.
The patched - direct difference is the dispatch's own cost per call; patched vs eager is what a kernels-only bundle
gives a decode step without CUDA graphs. Variants interleave in every round; eager calls the class's forward (the
instance's is the dispatcher while patched), which skips nn.Module.__call__ (about a microsecond).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
if "cpu" in sys.argv[sys.argv.index("--device") + 1:][:1]:  # before Triton is imported: its interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kernels_runtime.ops import _common  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def b2b(fn, n):
    for _ in range(min(10, n)):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync()
    return (time.perf_counter() - t0) * 1e6 / n


def rounds(variants: dict, n: int, k: int = 5) -> dict:
    """Interleaved rounds: variant -> median us per call (and p20/p80)."""
    ts = {name: [] for name in variants}
    for _ in range(k):
        for name, (fn, cached) in variants.items():
            _common._CACHED_LAUNCH["on"] = cached
            ts[name].append(b2b(fn, n))
    _common._CACHED_LAUNCH["on"] = True
    return {name: {"p50": statistics.median(v), "p20": sorted(v)[1], "p80": sorted(v)[-2]} for name, v in ts.items()}


def render(template, family, module_class, dims):
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.taskspec import TaskSpec

    t = next(t for t in TEMPLATES if t.name == template)
    spec = TaskSpec(family=family, module_class=module_class, instances=[], phase="decode", input_names=[],
                    weight_names=[], output_names=["out"], cases=[], dtype="bfloat16",
                    hardware={"sm_count": 132})
    H, I, hq, hkv, D = dims
    spec.static.update({"hidden_size": H, "intermediate_size": I, "mlp.hidden_size": H, "mlp.intermediate_size": I,
                        "self_attn.q_proj.in_features": H, "self_attn.q_proj.out_features": hq * D,
                        "self_attn.k_proj.out_features": hkv * D})
    return t.render(spec, t.default(spec)), t.default(spec)


def patched(module, source, cls):
    from kernels_runtime.bundle import PatchBundle, PatchSpec
    from kernels_runtime.patch import apply

    holder = torch.nn.Module()
    holder._modules["m"] = module
    bundle = PatchBundle(name="decode-dispatch")
    bundle.add_patch(PatchSpec(patch_id="p", module_class=cls, instances=["m"], phase="decode", kernel=""),
                     source=source)
    return holder, apply(holder, bundle, strict=True)


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu: a smoke run at tiny sizes (Triton's "
                    "interpreter, fp32; not a result)")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        sys.exit("decode_dispatch: expected a CUDA device (or --device cpu)")
    return args


def measure_ops(x, mlp, calls: int) -> dict:
    """1. the MLP's 4 launches (gate_up_swiglu + gemv), cached launcher on and off, outputs compared."""
    from kernels_runtime.ops.gemv import gate_up_swiglu, gemv

    wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight

    def ops():
        return gemv(gate_up_swiglu(x, wg, wu, SPLIT_K=1), wd, SPLIT_K=2)

    _common._CACHED_LAUNCH["on"] = False
    a = ops()
    _common._CACHED_LAUNCH["on"] = True
    ops()
    b = ops()
    same = bool(torch.equal(a, b))
    r = rounds({"ops_jit": (ops, False), "ops_cached": (ops, True)}, calls)
    return {"measure": "mlp_ops_4_launches", "cached_equals_jit": same, **r}


def measure_mlp(x, mlp, mq, dims, calls: int) -> dict:
    """2. Qwen3MLP: HF eager, the rendered mlp.decode_gemv entry called directly, the module patched with it."""
    from kernels_runtime.patch import revert
    from kernels_runtime.tolerances import compare

    H, I = dims[0], dims[1]
    src, _ = render("mlp.decode_gemv", "mlp", f"{mq.__name__}.Qwen3MLP", dims)
    ns: dict = {}
    exec(compile(src, "<mlp.decode_gemv>", "exec"), ns)
    weights = dict(mlp.named_parameters())
    static = {"hidden_size": H, "intermediate_size": I}
    ref = mlp(x)
    direct = lambda: ns["entry"]({"x": x}, weights, {}, static)  # noqa: E731
    ok_direct = compare(direct()["out"], ref).ok
    holder, report = patched(mlp, src, f"{mq.__name__}.Qwen3MLP")
    # eager: the class's forward (the instance's is the dispatcher now; skips nn.Module.__call__, ~1 us)
    variants = {"eager": (lambda: mq.Qwen3MLP.forward(mlp, x), True), "direct_jit": (direct, False),
                "direct_cached": (direct, True)}
    ok_patched = compare(mlp(x), ref).ok
    variants.update({"patched_jit": (lambda: mlp(x), False), "patched_cached": (lambda: mlp(x), True)})
    r = rounds(variants, calls)
    row = {"measure": "Qwen3MLP", "correct_direct": ok_direct, "correct_patched": ok_patched,
           "counters": report.counters(), **r}
    revert(holder)
    return row


def measure_layer(x, cfg, mq, dims, dev: str, calls: int) -> dict:
    """3. Qwen3DecoderLayer over a growing DynamicCache: HF eager vs patched with decoder_layer.decode_fused."""
    from transformers.cache_utils import DynamicCache

    from kernels_runtime.patch import revert
    from kernels_runtime.tolerances import compare

    dt, H = x.dtype, dims[0]
    layer = mq.Qwen3DecoderLayer(cfg, 0).to(dev, dt)
    rope = mq.Qwen3RotaryEmbedding(cfg).to(dev)
    src, _ = render("decoder_layer.decode_fused", "decoder_layer", f"{mq.__name__}.Qwen3DecoderLayer", dims)

    def make_cache():
        cache = DynamicCache()
        g = torch.Generator(device=dev).manual_seed(1)  # the same past every time: reference and kernel agree
        h = torch.randn(1, 64, H, device=dev, dtype=dt, generator=g)
        pos = torch.arange(64, device=dev)[None]
        layer(h, position_ids=pos, past_key_values=cache, use_cache=True, position_embeddings=rope(h, pos))
        return cache

    state = {"cache": make_cache(), "pos": 64}

    def step(fwd=None):
        pos = torch.tensor([[state["pos"]]], device=dev)
        out = (fwd or layer)(x, position_ids=pos, past_key_values=state["cache"], use_cache=True,
                             position_embeddings=rope(x, pos))
        state["pos"] += 1
        if state["pos"] > 64 + 4 * calls:  # keep the attended length in one range for every variant
            state["cache"], state["pos"] = make_cache(), 64
        return out

    ref_cache = make_cache()
    pos = torch.tensor([[64]], device=dev)
    pe = rope(x, pos)
    ref = layer(x, position_ids=pos, past_key_values=ref_cache, use_cache=True, position_embeddings=pe)
    holder, report = patched(layer, src, f"{mq.__name__}.Qwen3DecoderLayer")
    cache2 = make_cache()
    got = layer(x, position_ids=pos, past_key_values=cache2, use_cache=True, position_embeddings=pe)
    ok = compare(got, ref).ok and compare(cache2.layers[0].keys, ref_cache.layers[0].keys).ok
    eager = lambda: step(lambda *a, **k: mq.Qwen3DecoderLayer.forward(layer, *a, **k))  # noqa: E731
    r = rounds({"eager": (eager, True), "patched_jit": (step, False), "patched_cached": (step, True)},
               max(1, calls // 3))
    row = {"measure": "Qwen3DecoderLayer_dynamic_cache", "correct_patched": ok, "counters": report.counters(), **r}
    revert(holder)
    return row


def main() -> int:
    args = _parse_args()
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as mq

    dev = args.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    meta = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke run, not a result)",
            "torch": torch.__version__, "calls": args.calls}
    dims = (2560, 9728, 32, 8, 128) if dev == "cuda" else (64, 128, 4, 2, 16)  # qwen3-4b, or tiny
    cfg = Qwen3Config(hidden_size=dims[0], intermediate_size=dims[1], num_attention_heads=dims[2],
                      num_key_value_heads=dims[3], head_dim=dims[4], num_hidden_layers=1, vocab_size=1024)
    cfg._attn_implementation = "sdpa"
    rows = []
    with torch.no_grad():
        x = torch.randn(1, 1, dims[0], device=dev, dtype=dt)
        mlp = mq.Qwen3MLP(cfg).to(dev, dt)
        rows.append(measure_ops(x, mlp, args.calls))
        show(rows[-1])
        rows.append(measure_mlp(x, mlp, mq, dims, args.calls))
        show(rows[-1])
        rows.append(measure_layer(x, cfg, mq, dims, dev, args.calls))
        show(rows[-1])
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps({**row, **meta}, default=str) + "\n")
    return 0


def show(row):
    vals = "  ".join(f"{k} {v['p50']:.1f}" for k, v in row.items() if isinstance(v, dict) and "p50" in v)
    flags = {k: v for k, v in row.items() if k.startswith(("correct", "cached"))}
    print(f"{row['measure']:<34} us/call: {vals}  {flags}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
