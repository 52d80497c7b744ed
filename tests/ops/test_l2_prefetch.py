"""L2 prefetch hints (kernels_runtime.ops._common.l2_prefetch): the decode attention asks the L2 for o_proj's weight,
o_proj for the first bytes of gate/up. A hint changes no result; on sm_90 it compiles to the bulk prefetch.

Under the interpreter the prefetch is off (no PTX): these tests check the plumbing and the arguments there, and the
instruction itself by compiling the kernels for sm_90 in a subprocess without TRITON_INTERPRET."""
from __future__ import annotations

import json

import pytest
import torch
from compiled_subprocess import run_compiled

from kernels_runtime.ops._common import l2_prefetch_bytes as _prefetch_bytes
from kernels_runtime.ops.attention_decode_static import attention_decode_static
from kernels_runtime.ops.gemv import _l2_targets, gate_up_swiglu, gemv, gemv_residual_rmsnorm



def _static_case(dtype=torch.bfloat16, B=1, hq=4, hkv=2, S=24, D=16, pos=9):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    kc, vc = r(B, hkv, S, D), r(B, hkv, S, D)
    return (r(B, hq, 1, D), r(B, hkv, 1, D), r(B, hkv, 1, D), kc, vc, torch.tensor(pos), r(B, 1, D), r(B, 1, D))


def test_attention_with_a_prefetch_gives_the_same_bits_and_state():
    q, k, v, kc, vc, n, cos, sin = _static_case()
    w_o = torch.randn(32, 64).to(torch.bfloat16)
    outs = []
    for pf in (None, w_o):
        kc2, vc2, n2 = kc.clone(), vc.clone(), n.clone()
        o = attention_decode_static(q, k, v, kc2, vc2, n2, cos, sin, 0.25, BLOCK_N=16, num_splits=2, l2_prefetch=pf)
        outs.append((o, kc2, vc2, n2))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert int(outs[1][3]) == 10


def test_gemv_with_a_prefetch_gives_the_same_bits():
    x = torch.randn(1, 64).to(torch.bfloat16)
    w, r = (torch.randn(48, 64) / 8).to(torch.bfloat16), torch.randn(1, 48).to(torch.bfloat16)
    wg, wu = (torch.randn(40, 48) / 7).to(torch.bfloat16), (torch.randn(40, 48) / 7).to(torch.bfloat16)
    cfg = dict(BLOCK_N=4, BLOCK_K=32)
    pf = ((wg, 1000), (wu, None))
    assert torch.equal(gemv(x, w, residual=r, **cfg), gemv(x, w, residual=r, l2_prefetch=pf, **cfg))
    nw = torch.ones(48).to(torch.bfloat16)
    a = gemv_residual_rmsnorm(x, w, r, nw, **cfg)
    b = gemv_residual_rmsnorm(x, w, r, nw, l2_prefetch=pf, **cfg)
    assert all(torch.equal(s, t) for s, t in zip(a, b))
    h = gemv(x, w, residual=r, l2_prefetch=pf, **cfg)
    assert gate_up_swiglu(h, wg, wu, **cfg).shape == (1, 40)


def test_prefetch_byte_counts_are_clamped_and_checked():
    w = torch.zeros(10, 8, dtype=torch.bfloat16)
    assert _prefetch_bytes(None, 5) == 0 and _prefetch_bytes(w, None) == 160 and _prefetch_bytes(w, 10**9) == 160
    assert _prefetch_bytes(w, -3) == 0
    pairs = _l2_targets(((w, None), (w, 0), (w, 64)))  # an empty request takes no slot
    assert [n for _, n in pairs] == [160, 64]
    assert _l2_targets(()) == [(None, 0), (None, 0)]
    with pytest.raises(ValueError, match="contiguous"):
        _prefetch_bytes(w.t(), None)
    with pytest.raises(ValueError, match="at most two"):
        _l2_targets(((w, None),) * 3)


_PTX_CHECK = r'''
import json
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels_runtime.ops._common import _CACHED_LAUNCH
from kernels_runtime.ops.attention_decode_static import attention_decode_static
from kernels_runtime.ops.gemv import gemv
from llm4llm.verify.aot import capture_launches

_CACHED_LAUNCH["on"] = False
bf = torch.bfloat16
B, hq, hkv, S, D = 1, 8, 2, 64, 128
q, k, v = torch.zeros(B, hq, 1, D, dtype=bf), torch.zeros(B, hkv, 1, D, dtype=bf), torch.zeros(B, hkv, 1, D, dtype=bf)
kc, vc = torch.zeros(B, hkv, S, D, dtype=bf), torch.zeros(B, hkv, S, D, dtype=bf)
cos, sin, n = torch.zeros(B, 1, D, dtype=bf), torch.zeros(B, 1, D, dtype=bf), torch.tensor(5)
w_o, wg, wu = torch.zeros(256, hq * D, dtype=bf), torch.zeros(512, 256, dtype=bf), torch.zeros(512, 256, dtype=bf)
out = {}
for label, call in (
        ("attention", lambda: attention_decode_static(q, k, v, kc, vc, n, cos, sin, 0.1, PDL=True, l2_prefetch=w_o)),
        ("gemv", lambda: gemv(torch.zeros(1, hq * D, dtype=bf), w_o, residual=torch.zeros(1, 256, dtype=bf),
                              BLOCK_N=4, BLOCK_K=1024, PDL=True, l2_prefetch=((wg, 65536), (wu, 65536))))):
    first = capture_launches(call)[0]
    src = ASTSource(fn=first.fn, signature=first.signature, constexprs=first.constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=first.options or None).asm["ptx"]
    out[label] = [first.constexprs.get("L2PF"), ptx.count("cp.async.bulk.prefetch.L2.global")]
print(json.dumps(out))
'''


@pytest.mark.slow
def test_the_prefetch_compiles_to_the_bulk_l2_prefetch_on_sm90():
    res = run_compiled(["-c", _PTX_CHECK], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["attention"][0] is True and out["attention"][1] >= 1, out
    assert out["gemv"][0] == 2 and out["gemv"][1] >= 2, out  # gate's and up's share: one instruction each


@pytest.mark.gpu
def test_prefetch_in_a_cuda_graph_gives_the_same_bits_on_the_gpu():
    """qwen3-4b's shapes: the attention prefetching o_proj and o_proj prefetching gate/up, replayed from a graph,
    against the same chain without prefetches."""
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * s).to(bf)

    hq, hkv, D, S, H, I = 32, 8, 128, 640, 2560, 9728
    q, k, v = r(1, hq, 1, D), r(1, hkv, 1, D), r(1, hkv, 1, D)
    kc, vc, cos, sin = r(1, hkv, S, D), r(1, hkv, S, D), r(1, 1, D), r(1, 1, D)
    w_o, wg, wu, x = r(H, hq * D, s=0.02), r(I, H, s=0.02), r(I, H, s=0.02), r(1, H)
    n = torch.tensor(575, device=dev)

    def chain(pf):
        n.fill_(575)
        o = attention_decode_static(q, k, v, kc, vc, n, cos, sin, D ** -0.5, PDL=True, num_splits=32,
                                    l2_prefetch=w_o if pf else None)
        h = gemv(o.reshape(1, -1), w_o, residual=x, BLOCK_N=4, BLOCK_K=1024, PDL=True,
                 l2_prefetch=((wg, 8 << 20), (wu, 8 << 20)) if pf else ())
        return gate_up_swiglu(h, wg, wu, BLOCK_N=4, BLOCK_K=1024, PDL=True)

    ref = chain(False).clone()
    graph = torch.cuda.CUDAGraph()
    chain(True)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
