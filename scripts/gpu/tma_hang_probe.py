"""Which part of the TMA GEMV pass hangs on the H200 (2026-12-03): one mode a process, run under `timeout`.

    python scripts/gpu/tma_hang_probe.py MODE
MODE: plain | norm | pdl | pdl_norm | pdl_res (one TMA pass, eagerly); chain_pdl (gate/up then down, both TMA
with PDL, eagerly); graph_nopdl / graph_pdl (that chain captured in a CUDA graph and replayed).
"""
import sys
import time

import torch

from kernels_runtime.ops import gemv as G

mode = sys.argv[1]
dt, dev = torch.bfloat16, "cuda"
torch.manual_seed(0)
x = torch.randn(1, 2560, dtype=dt, device=dev)
wg = (torch.randn(9728, 2560, device=dev) / 50).to(dt)
wu = (torch.randn(9728, 2560, device=dev) / 50).to(dt)
nw = (1 + 0.1 * torch.randn(2560, device=dev)).to(dt)
kw = dict(BLOCK_N=64, BLOCK_K=128, TMA=4, PDL="pdl" in mode, norm_w=nw if "norm" in mode else None)
t0 = time.time()
if mode.startswith(("chain", "graph")):
    pdl = mode.endswith("_pdl")
    w = (torch.randn(2560, 9728, device=dev) / 100).to(dt)
    r = torch.randn(1, 2560, dtype=dt, device=dev)

    def chain(tma):
        h = G.gate_up_swiglu(x, wg, wu, norm_w=nw, BLOCK_N=64, BLOCK_K=128, TMA=tma, PDL=pdl)
        return G.gemv(h, w, residual=r, BLOCK_N=8, BLOCK_K=256, TMA=2 * tma - 2 if tma else 0, PDL=pdl)
    ref = chain(0)
    if mode.startswith("chain"):
        y = chain(4)
    else:
        chain(4)
        torch.cuda.synchronize()
        print("eager chain ok", flush=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = chain(4)
        print("captured", flush=True)
        g.replay()
elif mode == "pdl_res":
    w = (torch.randn(2560, 9728, device=dev) / 100).to(dt)
    h = torch.randn(1, 9728, dtype=dt, device=dev)
    r = torch.randn(1, 2560, dtype=dt, device=dev)
    y = G.gemv(h, w, residual=r, BLOCK_N=8, BLOCK_K=256, TMA=6, PDL=True)
    ref = G.gemv(h, w, residual=r, BLOCK_N=8, BLOCK_K=256, PDL=True)
else:
    y = G.gate_up_swiglu(x, wg, wu, **kw)
    ref = G.gate_up_swiglu(x, wg, wu, **{**kw, "TMA": 0})
torch.cuda.synchronize()
print(mode, "ok", f"{time.time() - t0:.1f}s", "max diff", float((y.float() - ref.float()).abs().max()), flush=True)
