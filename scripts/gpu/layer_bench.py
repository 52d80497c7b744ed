"""A decode step's decoder layers on the GPU, kernel configurations side by side: what decoder_layer.decode_static
runs, layer after layer, from one CUDA graph, against the weight-streaming floor.

    python scripts/gpu/layer_bench.py --out layers.jsonl [--models qwen3-4b,llama-3.2-3b] [--max-s 200]
    python scripts/gpu/layer_bench.py --out layers.jsonl --only default --timeline default   # critical path per kernel
    python scripts/gpu/layer_bench.py --out b.jsonl --models qwen3-4b --batch 1,8,32   # decode batches, left-padded
    python scripts/gpu/layer_bench.py --device cpu --models tiny --out x.jsonl   # smoke run under the interpreter

Per model shape (published configs, seeded random bf16 weights; every layer its own weights, so a step streams all
of them from HBM as the model's decode step does; a static KV cache of --cache positions per layer, --pos of them
filled), one CUDA graph a variant of the whole stack of layers, each layer the `entry` of the template's rendered
source at that config (what a bundle ships). Every layer's length is set back to --pos before each run and replay
(outside the timed span), so every replay computes the same step. Variants interleave over --rounds rounds (A B C ... A B C ...); p20/p50/p80 of the step's GPU time (CUDA
events around one replay). floor = the layers' weight bytes over the device-to-device copy bandwidth measured first
in this process. Checks, per variant: the graph replay's output equals the eager (stream) run's bit for bit, and it
passes the verifier's criterion against the stack in plain PyTorch (`reference_step`, bf16 and fp32: within the bf16
tolerance of the one or no further from the other than FLOOR_FACTOR times eager bf16 is); a variant whose only change is
PDL, PREFETCH or an L2 prefetch must equal its base bit for bit. Variants: the template's default and seeds
(llm4llm.search.templates.decode_fused), then the launch-count and prefetch/PDL points below.
--batch B (B > 1): B rows a step, left-padded as `generate` pads a batch (row r's first pad_r keys masked in HF's
[B, 1, 1, cache] bool mask, row 0 unpadded; per-row rotary angles), the variants then the batch's own: the
template's batch default, `fma_max_m` below B (FMA rows before tl.dot tiles), and tl.dot tile points; the floor
then adds the KV bytes the step reads (every row's cache up to --pos).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

SHAPES = {  # hidden, q heads, kv heads, head_dim, intermediate, layers, Qwen3's q/k norms (published configs)
    "qwen3-4b": dict(H=2560, hq=32, hkv=8, D=128, I=9728, L=36, qk_norm=True),
    "llama-2-7b": dict(H=4096, hq=32, hkv=32, D=128, I=11008, L=32, qk_norm=False),
    "llama-3.2-3b": dict(H=3072, hq=24, hkv=8, D=128, I=8192, L=28, qk_norm=False),
    "tiny": dict(H=64, hq=4, hkv=2, D=16, I=96, L=2, qk_norm=True),
}
EPS = 1e-6


def q(vals, p):
    s = sorted(vals)
    return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]


def spec_of(s: dict, sms: int, B: int = 1):
    """The static values decoder_layer.decode_static's default and seeds read, as the extraction records them; at a
    batch one case of B rows (what gives the template its batch keys)."""
    static = {"self_attn.q_proj.in_features": s["H"], "self_attn.q_proj.out_features": s["hq"] * s["D"],
              "self_attn.k_proj.out_features": s["hkv"] * s["D"], "self_attn.head_dim": s["D"],
              "mlp.hidden_size": s["H"], "mlp.intermediate_size": s["I"]}
    # batch 1: no captured cases, so the default and seeds are the batch-1 ones
    cases = [SimpleNamespace(inputs={"hidden_states": torch.empty(B, 1, s["H"], device="meta")})] if B > 1 else []
    return SimpleNamespace(static=static, hardware={"sm_count": sms, "capability": "9.0"}, family="decoder_layer",
                           phase="decode", dtype="bfloat16", input_names=["hidden_states"] if cases else [],
                           cases=cases, recipe=None)


def batch_variants(base: dict, B: int) -> dict[str, dict]:
    """A decode batch's own points on the batch default (tl.dot past 1 row, DOT_STAGES tiles in flight): more FMA
    rows before tl.dot takes over (`fma_max_m`), the pipeline depth (`dot_stages`), and the tl.dot tiles (BLOCK_N
    rows of weight, BLOCK_K deep, warps, a K split) on every stage."""
    stages = ("qkv_", "o_", "gu_", "dn_")
    out = {f"fma{v}": {**base, "fma_max_m": v} for v in (2, 4, 8, 16) if v < B}
    out.update({f"st{v}": {**base, "dot_stages": v} for v in (2, 3) if v != base.get("dot_stages")})
    # the tl.dot tiles (the stages' DOT_* keys; the default: the GEMV sweep's best point per projection)
    for name, kv in (("n32", {"DOT_BLOCK_N": 32}), ("n128", {"DOT_BLOCK_N": 128}), ("k128", {"DOT_BLOCK_K": 128}),
                     ("k256", {"DOT_BLOCK_K": 256}), ("w8", {"num_warps": 8}), ("sk1", {"DOT_SPLIT_K": 1}),
                     ("sk2", {"DOT_SPLIT_K": 2})):
        out[f"dot_{name}"] = {**base, **{p + k: v for p in stages for k, v in kv.items()}}
    # the tiles derived from the batch-1 FMA tiles (16 x 256 here, no split): the tl.dot path before DOT_*
    out["dot_derived"] = {**base, **{p + k: 0 for p in stages for k in ("DOT_BLOCK_N", "DOT_BLOCK_K", "DOT_SPLIT_K")}}
    out["nopdl"] = {**base, "pdl": False}
    # the attention's cache split and tile at a batch (the default splits by rows: rows x KV heads x splits near
    # the GPU's target programs)
    out.update({f"attn_sp{n}": {**base, "attn_num_splits": n} for n in (2, 4, 8, 16)})
    out["attn_n64"] = {**base, "attn_BLOCK_N": 64}
    out["attn_w8"] = {**base, "attn_num_warps": 8}
    out["norm_pass"] = {**base, "norm_pass": True}  # the prologue norms' rows normalised in a pass of their own
    # one stage's tile at a time on norm_pass: more programs than SMs where the default leaves some idle (gate/up
    # 128-wide: one program per 128 columns), or fewer
    np_base = out["norm_pass"]
    for stage, kv in (("qkv", {"DOT_BLOCK_N": 32}), ("qkv", {"DOT_SPLIT_K": 2}), ("o", {"DOT_SPLIT_K": 4}),
                      ("o", {"DOT_BLOCK_N": 32}), ("gu", {"DOT_BLOCK_N": 64}), ("gu", {"DOT_BLOCK_K": 64}),
                      ("dn", {"DOT_SPLIT_K": 4}), ("dn", {"DOT_BLOCK_N": 32}), ("dn", {"DOT_SPLIT_K": 1})):
        (key, v), = kv.items()
        short = {"DOT_BLOCK_N": "n", "DOT_BLOCK_K": "k", "DOT_SPLIT_K": "sk"}[key]
        out[f"np_{stage}_{short}{v}"] = {**np_base, f"{stage}_{key}": v}
    out["np_st4"] = {**np_base, "dot_stages": 4}
    # the batch defaults before the stacked-layer bench of 2026-12-07 (post norm in gate/up's prologue, 4 tl.dot
    # tiles in flight), and the post norm's other placement
    out["prev_default"] = {**base, "post_norm_batch": "gate_up_prologue", "dot_stages": 4, "norm_pass": False}
    out["prologue_norm"] = {**base, "norm_pass": False}  # q/k/v's input norm in its prologue (before 2026-12-07's flip)
    out["gu_prologue"] = {**base, "post_norm_batch": "gate_up_prologue"}
    out["pdl_all"] = {**base, "pdl": True, "pdl_max_m": 64}  # PDL at every batch (the default: at one row only)
    return out


def variants(s: dict, sms: int, B: int = 1) -> dict[str, dict]:
    """name -> layer config: the template's default (the four-GEMV layer with PDL), its seeds, then one change at a
    time on the default (the names of docs/results/2026-12-02-h200-c say which)."""
    tpl, spec = layer_template(), spec_of(s, sms, B)
    base = tpl.default(spec)
    out = {"default": dict(base)}
    for i, sd in enumerate(tpl.seeds(spec)):
        out[f"seed{i}"] = sd
    if B > 1:
        return {**out, **batch_variants(base, B)}
    stages = ("qkv_", "o_", "gu_", "dn_")
    out["nopdl"] = {**base, "pdl": False}
    out["o_reduce_nopdl"] = {**base, "post_norm": "o_reduce", "pdl": False}  # five launches: norm in o_proj's reduction
    out["prefetch"] = {**base, **{p + "PREFETCH": True for p in stages}}
    out["w8"] = {**base, **{p + "num_warps": 8 for p in stages}}
    out["2x1024"] = {**base, **{p + "BLOCK_N": 2 for p in ("o_", "dn_")}}
    out["k512"] = {**base, **{p + "BLOCK_K": 512 for p in ("qkv_", "gu_", "dn_")}}  # K = 2560 / 9728 in whole tiles
    out["gu8x512"] = {**base, "gu_BLOCK_N": 8, "gu_BLOCK_K": 512}
    out["qkv8x512"] = {**base, "qkv_BLOCK_N": 8, "qkv_BLOCK_K": 512}
    out["gu512"] = {**base, "gu_BLOCK_K": 512}  # one stage at a time: gate/up and q/k/v are the gap on qwen3-4b
    out["gu2"] = {**base, "gu_BLOCK_N": 2}
    out["gu_st3"] = {**base, "num_stages": 3}
    out["qkv512"] = {**base, "qkv_BLOCK_K": 512}
    out["qkv8"] = {**base, "qkv_BLOCK_N": 8}
    out["attn16"] = {**base, "attn_num_splits": 16}
    out["attn64"] = {**base, "attn_num_splits": 64}
    # Whole-K tiles: with PDL a program loads all of its weight rows before the wait, so o_proj's weights could
    # stream while the attention (latency-bound, a few MB of K/V) runs; 2048 loads half of them ahead
    whole = max(128, 1 << (max(s["H"], s["hq"] * s["D"]) - 1).bit_length())
    out["o_whole"] = {**base, "o_BLOCK_K": whole}
    out["o_whole_w8"] = {**base, "o_BLOCK_K": whole, "o_num_warps": 8}
    out["o_whole_bn2"] = {**base, "o_BLOCK_K": whole, "o_BLOCK_N": 2}
    out["o_2048"] = {**base, "o_BLOCK_K": 2048}
    out["o_2048_w8"] = {**base, "o_BLOCK_K": 2048, "o_num_warps": 8}
    out["qkv_whole_w8"] = {**base, "qkv_BLOCK_K": whole, "qkv_num_warps": 8}
    out["gu_whole_w8"] = {**base, "gu_BLOCK_K": whole, "gu_num_warps": 8}
    out["o_whole_w8+qkv"] = {**out["o_whole_w8"], "qkv_BLOCK_K": whole, "qkv_num_warps": 8}
    out["o_whole_w8+onorm"] = {**out["o_whole_w8"], "post_norm": "o_reduce"}
    # L2 prefetch: the attention asks the L2 for o_proj's weight while it leaves HBM idle (l2o); o_proj, reading
    # from L2, asks for the first MB of gate/up (mN)
    out["l2o"] = {**base, "l2pf_o": True}
    for mb in (8, 16, 24):
        out[f"l2o_m{mb}"] = {**base, "l2pf_o": True, "l2pf_mlp_mb": mb}
    out["m16"] = {**base, "l2pf_mlp_mb": 16}
    out["l2o_o2048"] = {**base, "l2pf_o": True, "o_BLOCK_K": 2048}
    out["l2o_nopdl"] = {**base, "l2pf_o": True, "pdl": False}
    # gate/up and down with their weight tiles by TMA (STAGES in flight; the standalone GEMV TMA probe's best points)
    gu = {"gu_TMA": 4, "gu_BLOCK_N": 64, "gu_BLOCK_K": 128}
    dn = {"dn_TMA": 6, "dn_BLOCK_N": 8, "dn_BLOCK_K": 256}
    out["tma"] = {**base, **gu, **dn}
    out["tma_gu"] = {**base, **gu}
    out["tma_dn"] = {**base, **dn}
    # other TMA points by name in --only (`tma_variant`: gu16x256s4pl, gu16x256s4pl+o4x256s4p, ...)
    return out


TMA_STAGE = r"(gu|dn)(\d+)x(\d+)s(\d+)(p?)(l?)"
TMA_NAME = re.compile(rf"{TMA_STAGE}(\+{TMA_STAGE})*")


def tma_variant(name: str, base: dict) -> dict:
    """A TMA point named in --only: `gu16x256s4p` (gate/up by TMA, BLOCK_N 16, BLOCK_K 256, 4 stages, p: the first
    tile before PDL's wait, l: the next kernel let launch late), `+`-joined with a dn_ point for down (o_proj by TMA,
    measured in docs/results/2026-12-03-h200-f, lost and left the template)."""
    cfg = dict(base)
    for part in name.split("+"):
        st, bn, bk, stages, pre, late = re.fullmatch(TMA_STAGE, part).groups()
        cfg.update({f"{st}_TMA": int(stages), f"{st}_BLOCK_N": int(bn), f"{st}_BLOCK_K": int(bk),
                    f"{st}_TMA_PRE": bool(pre), f"{st}_TMA_LATE": bool(late)})
    return cfg


def kernel_profile(g, n_layers: int, before) -> list[dict] | str:
    """One replay under torch.profiler: the layer's kernels in order (the same sequence every layer), each
    position's median duration over the layers and the median gap since the previous kernel ended (negative:
    overlapped, as PDL allows). A string when the trace does not split into equal layers."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    before()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    if not evs or len(evs) % n_layers:
        return f"{len(evs)} kernels for {n_layers} layers"
    k = len(evs) // n_layers
    out = []
    for i in range(k):
        at = [evs[j * k + i] for j in range(n_layers)]
        gaps = [e.time_range.start - evs[j * k + i - 1].time_range.end for j, e in enumerate(at) if j * k + i > 0]
        out.append(dict(name=at[0].name[:40], us=statistics.median(e.time_range.elapsed_us() for e in at),
                        gap_us=statistics.median(gaps) if gaps else 0.0))
    return out


def timeline(entry, x, layers, cos, sin, before, replays: int = 5) -> list[dict] | str:
    """The step captured again with the kernel timeline on (kernels_runtime.ops._common.TIMELINE: every program of
    the instrumented kernels writes %globaltimer at its start, when PDL's wait released it and at its end), then
    replayed `replays` times. Per kernel position in the layer, medians over the layers after the first and over
    the replays, in us, each relative to `prev_end`, the last program end of the kernel before it:
    - early: how long before prev_end its first program started (PDL's early launch; negative: after it);
    - release: its first program's release from the wait after prev_end (its start, without PDL);
    - last_start: when its last program started (programs that waited for an SM);
    - body: a program's end minus its release (median over the programs);
    - span: its last program end after prev_end: the kernel's share of the step's critical path (the spans add
      up to the layer).
    Also the timer's resolution (the smallest non-zero difference seen, ns). A string when it cannot be read."""
    from kernels_runtime.ops import _common

    rows = 1 << 20  # 32 MB: qwen3-4b's step has 283k programs
    buf = torch.zeros(rows, 4, dtype=torch.int64, device="cuda")

    def run():
        _common.TIMELINE.update(next=0, sites=[])
        return step(x, layers, cos, sin, entry)

    _common.TIMELINE.update(buf=buf, next=0, sites=[])
    try:
        g, _ = graph_of(run, before)
        sites = list(_common.TIMELINE["sites"])
    finally:
        _common.TIMELINE.update(buf=None, next=0, sites=[])
    n_layers = len(layers)
    if not sites or len(sites) % n_layers:
        return f"{len(sites)} instrumented launches for {n_layers} layers"
    k = len(sites) // n_layers
    per: list[dict[str, list[float]]] = [{} for _ in range(k)]
    res = []
    for _ in range(replays):
        before()
        g.replay()
        torch.cuda.synchronize()
        t = buf.cpu()
        prev_end = None
        for j, (name, off, n) in enumerate(sites):
            a = t[off:off + n].double()
            t0, t1, t2 = a[:, 0], a[:, 1], a[:, 2]
            d = torch.cat([t0, t1, t2]).unique().sort().values.diff()
            res.append(float(d[d > 0].min()) if (d > 0).any() else float("nan"))
            if prev_end is not None and j >= k:  # the first layer has no kernel before its first one
                m = per[j % k]
                for key, v in (("early", prev_end - t0.min()), ("release", t1.min() - prev_end),
                               ("last_start", t0.max() - prev_end), ("body", (t2 - t1).median()),
                               ("span", t2.max() - prev_end)):
                    m.setdefault(key, []).append(float(v) / 1e3)
            prev_end = float(t2.max())
    out = []
    for i in range(k):
        name, _, n = sites[i]
        out.append(dict(name=name, programs=n, **{key: statistics.median(v) for key, v in per[i].items()}))
    out.append(dict(name="timer_resolution_ns", programs=0, span=min(res)))
    return out


def make_layers(s: dict, n_layers: int, cache: int, pos: int, device: str, dt, B: int = 1):
    """Per layer the (weights, state, static) the template's entry takes, named as the extraction names them; the
    rotary (cos, sin) per row, and at B > 1 the left-padded batch's [B, 1, 1, cache] bool mask (else None)."""
    g = torch.Generator(device=device).manual_seed(0)  # on the device: billions of weights

    def w(n, k):
        return (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dt)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g, device=device)).to(dt)

    H, D, hq, hkv, I = s["H"], s["D"], s["hq"], s["hkv"], s["I"]
    static = {"self_attn.head_dim": D, "self_attn.scaling": D ** -0.5, "input_layernorm.variance_epsilon": EPS,
              "post_attention_layernorm.variance_epsilon": EPS, "self_attn.q_norm.variance_epsilon": EPS}
    layers = []
    for _ in range(n_layers):
        kc = torch.randn(B, hkv, cache, D, generator=g, device=device).to(dt)
        vc = torch.randn(B, hkv, cache, D, generator=g, device=device).to(dt)
        kc[:, :, pos:], vc[:, :, pos:] = 0, 0
        weights = {"self_attn.q_proj.weight": w(hq * D, H), "self_attn.k_proj.weight": w(hkv * D, H),
                   "self_attn.v_proj.weight": w(hkv * D, H), "self_attn.o_proj.weight": w(H, hq * D),
                   "mlp.gate_proj.weight": w(I, H), "mlp.up_proj.weight": w(I, H), "mlp.down_proj.weight": w(H, I),
                   "input_layernorm.weight": norm(H), "post_attention_layernorm.weight": norm(H)}
        if s["qk_norm"]:
            weights.update({"self_attn.q_norm.weight": norm(D), "self_attn.k_norm.weight": norm(D)})
        n = torch.tensor(pos, dtype=torch.int64, device=device)
        state = {"key_cache": kc, "value_cache": vc, "cache_len": n}
        layers.append((weights, state, static))
    ang = torch.rand(B, 1, D // 2, generator=g, device=device) * 6.28
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dt).view(B, 1, D)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dt).view(B, 1, D)
    mask = None
    if B > 1:  # row r's first pad_r positions are padding (row 0 none); keys past the write position not yet seen
        pads = torch.randint(0, max(1, pos // 2), (B,), generator=g, device=device)
        pads[0] = 0
        j = torch.arange(cache, device=device)
        mask = ((j[None] >= pads[:, None]) & (j[None] <= pos)).view(B, 1, 1, cache)
    return layers, cos, sin, mask


def layer_template():
    from llm4llm.search.templates import TEMPLATES

    return next(t for t in TEMPLATES if t.name == "decoder_layer.decode_static")


def template_entry(spec, cfg):
    """The `entry` of decoder_layer.decode_static's rendered source at `cfg` (the template's own check of the
    config, then the source exactly as a bundle ships it)."""
    ns: dict = {"__name__": "layer_bench_candidate"}
    exec(compile(layer_template().render(spec, cfg), "<decoder_layer.decode_static>", "exec"), ns)  # noqa: S102
    return ns["entry"]


def reset(layers, pos: int) -> None:
    """Each layer's length back to `pos`: the entry advances it, and every run and replay times the same step."""
    for _, state, _ in layers:
        state["cache_len"].fill_(pos)


def with_mask(entry, mask):
    """The entry called with the batch's attention mask among its inputs (as the extraction records it)."""
    if mask is None:
        return entry
    return lambda inputs, weights, state, static: entry({**inputs, "attention_mask": mask}, weights, state, static)


def step(x, layers, cos, sin, entry):
    for weights, state, static in layers:
        inputs = {"hidden_states": x, "position_embeddings.0": cos, "position_embeddings.1": sin}
        x = entry(inputs, weights, state, static)["out"]
    return x


def _rms(x, w, dt):
    """HF's LlamaRMSNorm in dtype dt: the variance in fp32, the normalised row rounded to dt, then the weight."""
    xf = x.float()
    return w.to(dt) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(dt)


def _rotate(t, cos, sin):
    h = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., h:], t[..., :h]], -1) * sin


def reference_step(x, layers, cos, sin, mask, pos: int, s: dict, dt):
    """The stack in plain PyTorch at dtype dt (HF's Llama/Qwen3 decoder layer, eagerly): each layer's weights and
    cache cast one layer at a time, the token's key and value written at `pos` into a copy of the cache, attention
    over the cache under the batch's mask (keys up to `pos` at batch 1)."""
    B, D, hq, hkv = x.shape[0], s["D"], s["hq"], s["hkv"]
    h, c, sn = x.to(dt), cos.to(dt).unsqueeze(1), sin.to(dt).unsqueeze(1)
    for weights, state, _ in layers:
        W = {k: v.to(dt) for k, v in weights.items()}
        n = _rms(h, W["input_layernorm.weight"], dt)
        qh = (n @ W["self_attn.q_proj.weight"].T).view(B, 1, hq, D).transpose(1, 2)
        kh = (n @ W["self_attn.k_proj.weight"].T).view(B, 1, hkv, D).transpose(1, 2)
        vh = (n @ W["self_attn.v_proj.weight"].T).view(B, 1, hkv, D).transpose(1, 2)
        if s["qk_norm"]:
            qh, kh = _rms(qh, W["self_attn.q_norm.weight"], dt), _rms(kh, W["self_attn.k_norm.weight"], dt)
        qh, kh = _rotate(qh, c, sn), _rotate(kh, c, sn)
        kc, vc = state["key_cache"].to(dt), state["value_cache"].to(dt)  # copies: the kernels own the real cache
        kc[:, :, pos], vc[:, :, pos] = kh[:, :, 0], vh[:, :, 0]
        keep = mask if mask is not None else (torch.arange(kc.shape[2], device=x.device) <= pos).view(1, 1, 1, -1)
        rep = hq // hkv
        kc, vc = kc.repeat_interleave(rep, 1), vc.repeat_interleave(rep, 1)
        att = torch.softmax(((qh @ kc.transpose(-1, -2)) * D ** -0.5).float().masked_fill(~keep, float("-inf")),
                            -1).to(dt)
        o = (att @ vc).transpose(1, 2).reshape(B, 1, hq * D)
        h = h + o @ W["self_attn.o_proj.weight"].T
        n = _rms(h, W["post_attention_layernorm.weight"], dt)
        g, u = n @ W["mlp.gate_proj.weight"].T, n @ W["mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(g) * u) @ W["mlp.down_proj.weight"].T
    return h


def graph_of(fn, before):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            before()
            fn()
        before()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


def build_variants(vs, spec, x, layers, cos, sin, pos, gpu, mask=None):
    """Each variant's step run eagerly and captured in a graph; -> (graphs, eager outputs, problems)."""
    runs, outs, bad = {}, {}, {}
    for name, cfg in vs.items():
        try:
            entry = with_mask(template_entry(spec, cfg), mask)
            reset(layers, pos)
            eager = step(x, layers, cos, sin, entry)
            if gpu:
                torch.cuda.synchronize()
                g, out = graph_of(lambda entry=entry: step(x, layers, cos, sin, entry),
                                  lambda: reset(layers, pos))
                reset(layers, pos)
                g.replay()
                torch.cuda.synchronize()
                if not torch.equal(out, eager):
                    bad[name] = "graph replay differs from the eager run"
                runs[name] = g
            outs[name] = eager.clone()
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others go on
            bad[name] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"{name}: FAILED {bad[name]}", flush=True)
    return runs, outs, bad


def check_outputs(outs, bad, refs=None):
    """Every variant against the eager references (ref16, ref32) by the verifier's criterion (compare_floor: within
    the bf16 tolerance of the eager bf16 stack, or no further from the fp32 stack than FLOOR_FACTOR times eager bf16
    is); without references, within the bf16 tolerance of the first variant. PDL / PREFETCH points bit-equal to their
    base. -> each variant's max |out - ref32| (empty without references)."""
    from kernels_runtime.tolerances import compare, compare_floor

    first = next(iter(outs), None)
    errs = {}
    for name in outs:
        if refs is not None:  # bf16's tolerance alone fails a deep stack: roundings grow layer by layer
            c = compare_floor(outs[name], *refs)
            errs[name] = float((outs[name].double() - refs[1].double()).abs().max())
            if not c.ok:
                bad.setdefault(name, f"off the eager reference: {c}"[:300])
        elif not (c := compare(outs[name], outs[first])).ok:
            bad.setdefault(name, f"differs from {first}: {c}"[:300])
    for a, b in (("prefetch", "default"), ("nopdl", "default"), ("pdl_all", "default"), ("l2o", "default"),
                 ("l2o_m16", "default"), ("m16", "default")):
        if a in outs and b in outs and not torch.equal(outs[a], outs[b]):
            bad.setdefault(a, f"PDL, PREFETCH or an L2 prefetch changed the bits of {b}")
    return errs


def time_interleaved(runs, rounds, before):
    """us a step per variant, the variants interleaved round by round (A B C ... A B C ...); `before` runs ahead
    of each replay, outside the timed span."""
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, g in runs.items():
            before()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            times[k].append(e0.elapsed_time(e1) * 1e3)
    return times


def print_table(model, s, wbytes, floor_us, rows):
    print(f"\n{model}: {s['L']} layers, {wbytes / 1e9:.2f} GB of weights, floor {floor_us:.0f} us a step", flush=True)
    if rows:
        print(f"max |eager bf16 - fp32| {rows[0]['eager_bf16_err_vs_fp32']:.4g} (err: each variant's)", flush=True)
    print(f"{'variant':<22} {'step us p50 (p20-p80)':>26} {'us/layer':>9} {'x floor':>8} {'err':>8}  ok", flush=True)
    for r in rows:
        ok = r["ok"] or r["problem"]
        err = f"{r['err_vs_fp32']:8.4g}" if r.get("err_vs_fp32") is not None else f"{'-':>8}"
        if "p50" in r:
            print(f"{r['variant']:<22} {r['p50']:10.1f} ({r['p20']:.1f}-{r['p80']:.1f}) "
                  f"{r['per_layer_us']:9.2f} {r['vs_floor']:8.3f} {err}  {ok}", flush=True)
        else:
            print(f"{r['variant']:<22} {'-':>26} {'-':>9} {'-':>8} {err}  {ok}", flush=True)


def bench_model(model, args, meta, sms, gpu, dt, B: int = 1):
    s = SHAPES[model]
    cache, pos = (args.cache, args.pos) if gpu else (16, 9)
    layers, cos, sin, mask = make_layers(s, s["L"], cache, pos, args.device, dt, B)
    wbytes = sum(t.numel() * t.element_size() for weights, _, _ in layers for k, t in weights.items()
                 if k.endswith("proj.weight"))
    # the KV bytes a step reads: every row's keys and values up to the write position (padding included: the
    # kernels skip masked keys' math, not their tiles)
    kvbytes = sum(2 * B * state["key_cache"].shape[1] * (pos + 1) * state["key_cache"].shape[3]
                  * state["key_cache"].element_size() for _, state, _ in layers)
    floor_us = (wbytes + kvbytes) / (meta["copy_GBps"] * 1e9) * 1e6 if gpu else float("nan")
    x = torch.randn(B, 1, s["H"], generator=torch.Generator().manual_seed(1)).to(dt).to(args.device)
    vs, spec = variants(s, sms, B), spec_of(s, sms, B)
    if args.only:
        names = args.only.split(",")
        vs = {**{k: v for k, v in vs.items() if k in names},
              **{k: tma_variant(k, vs["default"]) for k in names if k not in vs and TMA_NAME.fullmatch(k)}}
    runs, outs, bad = build_variants(vs, spec, x, layers, cos, sin, pos, gpu, mask)
    timelines = {}
    for name in (args.timeline.split(",") if gpu and args.timeline else []):
        if name in vs and name not in bad:
            try:
                timelines[name] = timeline(with_mask(template_entry(spec, vs[name]), mask), x, layers, cos, sin,
                                           lambda: reset(layers, pos))
            except Exception as exc:  # noqa: BLE001 - a timeline that cannot be taken costs the breakdown only
                timelines[name] = f"{type(exc).__name__}: {exc}"[:300]
    refs = (reference_step(x, layers, cos, sin, mask, pos, s, dt), reference_step(x, layers, cos, sin, mask, pos, s,
                                                                                 torch.float32))
    errs = check_outputs(outs, bad, refs)
    times = time_interleaved(runs, args.rounds if gpu else 0, lambda: reset(layers, pos))
    profiles = {}
    for name in (args.profile.split(",") if gpu and args.profile else []):
        if name in runs:
            try:
                profiles[name] = kernel_profile(runs[name], s["L"], lambda: reset(layers, pos))
            except Exception as exc:  # noqa: BLE001 - a profiler that does not run costs the breakdown only
                profiles[name] = f"{type(exc).__name__}: {exc}"[:200]
    rows = []
    for name, cfg in vs.items():
        ts = times.get(name) or []
        row = dict(model=model, batch=B, variant=name, layers=s["L"], weight_bytes=wbytes, kv_bytes=kvbytes,
                   floor_us=floor_us, err_vs_fp32=errs.get(name),
                   eager_bf16_err_vs_fp32=float((refs[0].double() - refs[1].double()).abs().max()),
                   ok=name not in bad, problem=bad.get(name), config=cfg, **meta)
        if ts:
            p50 = statistics.median(ts)
            row.update(p20=q(ts, 0.2), p50=p50, p80=q(ts, 0.8), per_layer_us=p50 / s["L"], vs_floor=p50 / floor_us,
                       times_us=ts)
        if name in profiles:
            row["kernels"] = profiles[name]
        if name in timelines:
            row["timeline"] = timelines[name]
        rows.append(row)
    print_table(f"{model} batch {B}", s, wbytes + kvbytes, floor_us, rows)
    for name, tln in timelines.items():
        if isinstance(tln, str):
            print(f"{model} {name} timeline: {tln}", flush=True)
            continue
        print(f"{model} {name} timeline (us after the previous kernel's last program ended; timer resolution "
              f"{tln[-1]['span']:.0f} ns):", flush=True)
        print(f"  {'kernel':<10} {'programs':>8} {'early':>7} {'release':>8} {'last_start':>10} {'body':>7} "
              f"{'span':>7}", flush=True)
        for r in tln[:-1]:
            print(f"  {r['name']:<10} {r['programs']:>8} {r['early']:7.2f} {r['release']:8.2f} {r['last_start']:10.2f} "
                  f"{r['body']:7.2f} {r['span']:7.2f}", flush=True)
        print(f"  sum of spans {sum(r['span'] for r in tln[:-1]):.2f} us a layer", flush=True)
    for name, prof in profiles.items():
        print(f"{model} {name}: " + (prof if isinstance(prof, str) else "  ".join(
            f"{k['name'][:22]} {k['us']:.1f}us (gap {k['gap_us']:.1f})" for k in prof)), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3-4b,llama-3.2-3b,llama-2-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cache", type=int, default=640, help="static cache positions a layer")
    ap.add_argument("--pos", type=int, default=575, help="the length before the token (the write position)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batch", default="1", help="comma-separated decode batch sizes (rows a step, left-padded)")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--max-s", type=float, default=200.0, help="stop starting new models after this many seconds")
    ap.add_argument("--profile", default="", help="comma-separated variants to break down kernel by kernel")
    ap.add_argument("--timeline", default="", help="comma-separated variants to time program by program (the "
                    "kernels' %%globaltimer stamps: each kernel's share of the layer's critical path)")
    args = ap.parse_args()
    from kernels_runtime.interp import enable_fast_interpreter

    enable_fast_interpreter()  # --device cpu under TRITON_INTERPRET=1 (a no-op on the GPU)
    t0 = time.time()
    gpu = args.device.startswith("cuda")
    meta = dict(torch=torch.__version__, device=args.device, cache=args.cache, pos=args.pos)
    sms = 132
    if gpu:
        import triton

        from llm4llm.evaluate import copy_bandwidth_gbps

        meta.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__, copy_GBps=copy_bandwidth_gbps())
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"copy bandwidth {meta['copy_GBps']:.0f} GB/s on {meta['gpu']}, {sms} SMs", flush=True)
    with torch.no_grad(), open(args.out, "w") as f:
        for model in args.models.split(","):
            if time.time() - t0 > args.max_s:
                print(f"time limit: skipped {model}", flush=True)
                continue
            for B in (int(b) for b in args.batch.split(",")):
                if time.time() - t0 > args.max_s:
                    print(f"time limit: skipped {model} batch {B}", flush=True)
                    continue
                for row in bench_model(model, args, meta, sms, gpu, torch.bfloat16, B):
                    f.write(json.dumps(row) + "\n")
                f.flush()
                if gpu:
                    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
