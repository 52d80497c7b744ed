"""gemv (decode weight-streaming GEMVs): odd sizes exercise the masks along N and K, the split-K reduction, the
segment choice of the multi-weight pass (q/k/v, gate/up), the RMSNorm prologue and every epilogue, against float64
references of the eager modules' math (tolerance table)."""
import pytest
import torch

from kernels_runtime.ops.gemv import (gate_up_swiglu, gate_up_swiglu_ref, gemv, gemv_ref, gemv_residual_rmsnorm,
                                      gemv_residual_rmsnorm_ref, qkv_norm_rope, qkv_norm_rope_ref)
from kernels_runtime.tolerances import assert_close

CFGS = [dict(BLOCK_N=4, BLOCK_K=16, SPLIT_K=1), dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=3),
        dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=2)]


def _w(n, k, dtype):
    return (torch.randn(n, k, dtype=torch.float64) / k**0.5).to(dtype)


def _ref64(fn, *args, **kw):
    # the reference in float64 for fp32 inputs; for bf16, the eager bf16 roundings are part of the semantics
    return fn(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("M,K,N", [(1, 45, 19), (3, 64, 33), (2, 96, 7)])
def test_gemv_plain_and_residual(dtype, cfg, M, K, N):
    x, w = torch.randn(M, 1, K, dtype=dtype), _w(N, K, dtype)
    out = gemv(x, w, **cfg)
    assert out.shape == (M, 1, N) and out.dtype == dtype
    assert_close(out, gemv_ref(x.double(), w.double()).to(dtype), dtype, name="gemv")
    res = torch.randn(M, 1, N, dtype=torch.float32)  # an fp32 residual stream under bf16 projections
    out = gemv(x, w, residual=res, **cfg)
    assert out.dtype == torch.float32
    assert_close(out, gemv_ref(x, w, residual=res).float(), dtype, name="gemv+residual")


@pytest.mark.parametrize("cfg", CFGS[:2])
def test_gemv_norm_prologue(cfg):
    x, w = torch.randn(2, 37, dtype=torch.bfloat16), _w(21, 37, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(37)).to(torch.bfloat16)
    assert_close(gemv(x, w, norm_w=nw, eps=1e-6, **cfg), gemv_ref(x, w, norm_w=nw, eps=1e-6), name="norm+gemv")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CFGS[1:])
def test_gemv_residual_rmsnorm(dtype, cfg):
    x, w = torch.randn(3, 50, dtype=dtype), _w(27, 50, dtype)
    res, nw = torch.randn(3, 27, dtype=dtype), (1 + 0.1 * torch.randn(27)).to(dtype)
    h, y = gemv_residual_rmsnorm(x, w, res, nw, 1e-5, **cfg)
    h_ref, y_ref = gemv_residual_rmsnorm_ref(x, w, res, nw, 1e-5)
    assert_close(h, h_ref, name="h")
    assert_close(y, y_ref, name="rmsnorm(h)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("cfg", CFGS)
def test_gate_up_swiglu(dtype, norm, cfg):
    x, wg, wu = torch.randn(2, 41, dtype=dtype), _w(23, 41, dtype), _w(23, 41, dtype)
    nw = (1 + 0.1 * torch.randn(41)).to(dtype) if norm else None
    out = gate_up_swiglu(x, wg, wu, norm_w=nw, **cfg)
    assert_close(out, gate_up_swiglu_ref(x, wg, wu, norm_w=nw), name="gate_up_swiglu")
    if dtype == torch.float32:  # and the math itself, in float64
        ref = gate_up_swiglu_ref(x.double(), wg.double(), wu.double(), norm_w=None if nw is None else nw.double())
        assert_close(out, ref.float(), dtype, name="gate_up_swiglu vs float64")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [CFGS[0], CFGS[1]])  # the paired pass (GELU in _gemv_kernel), the split reduction
def test_gemma2_epilogues(dtype, cfg):
    """Gemma-2's decoder layer in the GEMV epilogues: gelu_pytorch_tanh(gate) * up, the sandwich norm (the o_proj /
    down_proj output RMSNorm'd before the residual add, the pre-feedforward norm of the sum after it, or none) and
    the input_layernorm prologue of q/k/v, each with Gemma's (1 + w) fp32 norm."""
    x, wg, wu = torch.randn(2, 41, dtype=dtype) * 2, _w(23, 41, dtype), _w(23, 41, dtype)
    out = gate_up_swiglu(x, wg, wu, act="gelu_tanh", **cfg)
    assert_close(out, gate_up_swiglu_ref(x, wg, wu, act="gelu_tanh"), name="gelu_tanh")
    if dtype == torch.float32:
        ref = gate_up_swiglu_ref(x.double(), wg.double(), wu.double(), act="gelu_tanh")
        assert_close(out, ref.float(), dtype, name="gelu_tanh vs float64")
    x, w = torch.randn(3, 50, dtype=dtype), _w(27, 50, dtype)
    res = torch.randn(3, 27, dtype=dtype)
    nw, ow = 0.5 * torch.randn(27, dtype=dtype), 0.5 * torch.randn(27, dtype=dtype)
    for norm_w in (nw, None):
        h, y = gemv_residual_rmsnorm(x, w, res, norm_w, 1e-5, out_norm_w=ow, out_eps=1e-6, gemma=True, **cfg)
        h_ref, y_ref = gemv_residual_rmsnorm_ref(x, w, res, norm_w, 1e-5, out_norm_w=ow, out_eps=1e-6, gemma=True)
        assert_close(h, h_ref, name="h")
        assert (y is None) == (norm_w is None)
        if norm_w is not None:
            assert_close(y, y_ref, name="gemma rmsnorm(h)")
    D, K = 8, 35
    x = torch.randn(2, K, dtype=dtype)
    wq, wk, wv = _w(4 * D, K, dtype), _w(2 * D, K, dtype), _w(2 * D, K, dtype)
    nw = 0.5 * torch.randn(K, dtype=dtype)
    got = qkv_norm_rope(x, wq, wk, wv, None, None, D, norm_w=nw, norm_eps=1e-6, gemma_norm=True, **cfg)
    want = qkv_norm_rope_ref(x, wq, wk, wv, None, None, D, norm_w=nw, norm_eps=1e-6, gemma_norm=True)
    for name, a, b in zip("qkv", got, want):
        assert_close(a, b, name=name)


def _rope(M, D, dtype):
    pos = torch.arange(M, dtype=torch.float64)[:, None] * 7 + 3
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = torch.cat([pos * inv, pos * inv], dim=-1)
    return f.cos().to(dtype), f.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("D,hq,hkv,cfg", [(8, 4, 2, CFGS[0]), (6, 3, 1, CFGS[1]), (16, 2, 2, CFGS[2])])
def test_qkv_norm_rope(dtype, norm, D, hq, hkv, cfg):
    M, K = 2, 35
    x = torch.randn(M, K, dtype=dtype)
    wq, wk, wv = _w(hq * D, K, dtype), _w(hkv * D, K, dtype), _w(hkv * D, K, dtype)
    qn = (1 + 0.1 * torch.randn(D)).to(dtype) if norm else None
    kn = (1 + 0.1 * torch.randn(D)).to(dtype) if norm else None
    cos, sin = _rope(M, D, dtype)
    nw = (1 + 0.1 * torch.randn(K)).to(dtype) if norm else None  # and the decoder layer's input_layernorm
    q, k, v = qkv_norm_rope(x, wq, wk, wv, cos, sin, D, q_norm_w=qn, k_norm_w=kn, eps=1e-6, norm_w=nw,
                            norm_eps=1e-5, **cfg)
    qr, kr, vr = qkv_norm_rope_ref(x, wq, wk, wv, cos, sin, D, q_norm_w=qn, k_norm_w=kn, eps=1e-6, norm_w=nw,
                                   norm_eps=1e-5)
    for name, a, b in (("q", q, qr), ("k", k, kr), ("v", v, vr)):
        assert a.shape == b.shape, name
        assert_close(a, b, name=name)
    q0, k0, _ = qkv_norm_rope(x, wq, wk, wv, None, None, D, q_norm_w=qn, k_norm_w=kn, **cfg)  # no rotary
    qr0, kr0, _ = qkv_norm_rope_ref(x, wq, wk, wv, None, None, D, q_norm_w=qn, k_norm_w=kn)
    assert_close(q0, qr0, name="q without rope")
    assert_close(k0, kr0, name="k without rope")


def test_gemv_rejects_bad_config_and_shapes():
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="power of two"):
        gemv(x, w, BLOCK_K=24)
    with pytest.raises(ValueError, match="weights"):
        gemv(x, torch.randn(8, 15))



def test_more_rows_than_a_decode_block_stay_correct():
    """A prefill-sized call (37 rows > MAX_M) reaching a decode kernel: row blocks on the tl.dot path, correct."""
    x, w = torch.randn(37, 24), _w(19, 24, torch.float32)
    assert_close(gemv(x, w, BLOCK_N=4, BLOCK_K=1024), gemv_ref(x, w), name="gemv 37 rows")
    wg = _w(19, 24, torch.float32)
    assert_close(gate_up_swiglu(x, w, wg, SPLIT_K=2), gate_up_swiglu_ref(x, w, wg), name="gate/up 37 rows")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gemv_ops_on_gpu_at_model_shapes():
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(1, 2560, dtype=dt, device=dev)
    wq, wk, wv = (_w(n, 2560, dt).to(dev) for n in (4096, 1024, 1024))
    qn, kn = (1 + 0.1 * torch.randn(128, device=dev)).to(dt), (1 + 0.1 * torch.randn(128, device=dev)).to(dt)
    cos, sin = (t.to(dev) for t in _rope(1, 128, dt))
    for cfg in (dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1), dict(BLOCK_N=8, BLOCK_K=256, SPLIT_K=4)):
        for a, b in zip(qkv_norm_rope(x, wq, wk, wv, cos, sin, 128, q_norm_w=qn, k_norm_w=kn, **cfg),
                        qkv_norm_rope_ref(x, wq, wk, wv, cos, sin, 128, q_norm_w=qn, k_norm_w=kn)):
            assert_close(a, b, name="qkv")
        wg, wu, wd = _w(9728, 2560, dt).to(dev), _w(9728, 2560, dt).to(dev), _w(2560, 9728, dt).to(dev)
        h = gate_up_swiglu(x, wg, wu, **cfg)
        assert_close(h, gate_up_swiglu_ref(x, wg, wu), name="gate_up")
        res = torch.randn(1, 2560, dtype=dt, device=dev)
        assert_close(gemv(h, wd, residual=res, **cfg), gemv_ref(h, wd, residual=res), name="down+res")
        nw = (1 + 0.1 * torch.randn(2560, device=dev)).to(dt)
        for a, b in zip(gemv_residual_rmsnorm(h, wd, res, nw, **cfg), gemv_residual_rmsnorm_ref(h, wd, res, nw)):
            assert_close(a, b, name="down+res+norm")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("M", [1, 8])
def test_gemma_options_on_gpu_at_gemma2_shapes(M):
    """Gemma-2-2B's layer passes (hidden 2304, MLP 9216, 8 q / 4 kv heads of 256) on the GPU, compiled by Triton
    rather than interpreted: gelu-tanh gate/up, Gemma's (1 + w) norms in the q/k/v prologue and in o_proj's sandwich
    reduction (post-attention norm, residual, pre-feedforward norm); batch 1 (register pass) and 8 (tl.dot)."""
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(M, 2304, dtype=dt, device=dev)

    def nw(n):  # Gemma's norm weights sit near 0 (the norm scales by 1 + w)
        return (0.1 * torch.randn(n, device=dev)).to(dt)

    wq, wk, wv = (_w(n, 2304, dt).to(dev) for n in (2048, 1024, 1024))
    cos, sin = (t.to(dev) for t in _rope(M, 256, dt))
    wg, wu, wo = _w(9216, 2304, dt).to(dev), _w(9216, 2304, dt).to(dev), _w(2304, 2048, dt).to(dev)
    attn, res, n_in, n_post, n_pre = torch.randn(M, 2048, dtype=dt, device=dev), torch.randn_like(x), *(
        nw(2304) for _ in range(3))
    for cfg in (dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1), dict(BLOCK_N=8, BLOCK_K=256, SPLIT_K=4)):
        for a, b in zip(qkv_norm_rope(x, wq, wk, wv, cos, sin, 256, norm_w=n_in, gemma_norm=True, **cfg),
                        qkv_norm_rope_ref(x, wq, wk, wv, cos, sin, 256, norm_w=n_in, gemma_norm=True)):
            assert_close(a, b, name=f"gemma qkv M={M}")
        assert_close(gate_up_swiglu(x, wg, wu, act="gelu_tanh", **cfg),
                     gate_up_swiglu_ref(x, wg, wu, act="gelu_tanh"), name=f"gelu gate/up M={M}")
        for a, b in zip(gemv_residual_rmsnorm(attn, wo, res, n_pre, out_norm_w=n_post, gemma=True, **cfg),
                        gemv_residual_rmsnorm_ref(attn, wo, res, n_pre, out_norm_w=n_post, gemma=True)):
            assert_close(a, b, name=f"gemma o_proj sandwich M={M}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3])
def test_dot_path_every_op(dtype, M):
    """DOT=True (tl.dot over x padded to 16 rows; small blocks raised to 16) gives the same results as the reduction
    path: every op, with a K split and the RMSNorm prologue."""
    cfg = dict(BLOCK_N=8, BLOCK_K=16, SPLIT_K=2, DOT=True)
    K, N = 40, 37
    x, w = torch.randn(M, K, dtype=dtype), _w(N, K, dtype)
    nw = (1 + 0.1 * torch.randn(K)).to(dtype)
    assert_close(gemv(x, w, norm_w=nw, **cfg), gemv_ref(x, w, norm_w=nw), name="gemv dot")
    assert_close(gemv(x, w, BLOCK_N=16, BLOCK_K=32, DOT=True), gemv_ref(x, w), name="gemv dot, direct")
    assert_close(gate_up_swiglu(x, w, w, **cfg), gate_up_swiglu_ref(x, w, w), name="gate/up")
    res, nw2 = torch.randn(M, N, dtype=dtype), (1 + 0.1 * torch.randn(N)).to(dtype)
    for a, b in zip(gemv_residual_rmsnorm(x, w, res, nw2, **cfg), gemv_residual_rmsnorm_ref(x, w, res, nw2)):
        assert_close(a, b, name="residual rmsnorm dot")
    D = 8
    wq, wk = _w(4 * D, K, dtype), _w(2 * D, K, dtype)
    cos, sin = _rope(M, D, dtype)
    for a, b in zip(qkv_norm_rope(x, wq, wk, wk, cos, sin, D, **cfg), qkv_norm_rope_ref(x, wq, wk, wk, cos, sin, D)):
        assert_close(a, b, name="qkv dot")


# One launch where there was two (the paired gate/up pass, q/k/v written by the pass) and the prefetching / PDL
# loop (under the interpreter PDL runs as PREFETCH: the first tile loaded ahead, then the loop two tiles deep):
# every variant gives the bits of the two-launch, one-tile path, on even and ragged K, split and unsplit, and with
# the whole K range in one tile (ONE_TILE: the slab loaded before the wait).
PIPE_CFGS = [dict(BLOCK_N=4, BLOCK_K=16, SPLIT_K=1), dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=3),
             dict(BLOCK_N=8, BLOCK_K=16, SPLIT_K=2), dict(BLOCK_N=4, BLOCK_K=64, SPLIT_K=1)]  # last: one whole-K tile


@pytest.mark.parametrize("pipe", [dict(PREFETCH=True), dict(PDL=True)])
@pytest.mark.parametrize("cfg", PIPE_CFGS)
@pytest.mark.parametrize("K", [64, 45])
def test_prefetch_and_pdl_give_the_same_bits(pipe, cfg, K):
    torch.manual_seed(K)
    dt = torch.bfloat16
    x, w, nw = torch.randn(3, K, dtype=dt), _w(37, K, dt), torch.rand(K, dtype=dt) + 0.5
    res = torch.randn(3, 37, dtype=dt)
    assert torch.equal(gemv(x, w, **cfg, **pipe), gemv(x, w, **cfg))
    assert torch.equal(gemv(x, w, residual=res, norm_w=nw, **cfg, **pipe), gemv(x, w, residual=res, norm_w=nw, **cfg))
    h0, y0 = gemv_residual_rmsnorm(x, w, res, torch.rand(37, dtype=dt) + 0.5, **cfg)
    wg, wu = _w(21, K, dt), _w(21, K, dt)
    assert torch.equal(gate_up_swiglu(x, wg, wu, norm_w=nw, **cfg, **pipe),
                       gate_up_swiglu(x, wg, wu, norm_w=nw, paired=False, **cfg))
    wq, wk, wv = _w(16, K, dt), _w(8, K, dt), _w(8, K, dt)
    for a, b in zip(qkv_norm_rope(x, wq, wk, wv, None, None, 4, norm_w=nw, **cfg, **pipe),
                    qkv_norm_rope(x, wq, wk, wv, None, None, 4, norm_w=nw, **cfg)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3])
def test_paired_gate_up_and_direct_qkv_are_one_launch(dtype, M, monkeypatch):
    from kernels_runtime.ops import gemv as G

    kernels = []
    real = G.launch
    monkeypatch.setattr(G, "launch", lambda fn, *a, **k: (kernels.append(fn.__name__), real(fn, *a, **k))[1])
    x, wg, wu = torch.randn(M, 48, dtype=dtype), _w(19, 48, dtype), _w(19, 48, dtype)
    for bn in (4, 2):  # BLOCK_N / 2 rows of each weight a program: 2, then 1
        kernels.clear()
        out = gate_up_swiglu(x, wg, wu, BLOCK_N=bn, BLOCK_K=16)
        assert kernels == ["_gemv_kernel"]
        assert_close(out, gate_up_swiglu_ref(x.double(), wg.double(), wu.double()).to(dtype), dtype, name="paired")
    kernels.clear()
    wq, wk, wv = _w(24, 48, dtype), _w(8, 48, dtype), _w(8, 48, dtype)
    q, k, v = qkv_norm_rope(x, wq, wk, wv, None, None, 8, BLOCK_N=4, BLOCK_K=16)
    assert kernels == ["_gemv_kernel"]
    for got, want in zip((q, k, v), qkv_norm_rope_ref(x.double(), wq.double(), wk.double(), wv.double(), None,
                                                      None, 8)):
        assert_close(got, want.to(dtype), dtype, name="direct qkv")
    kernels.clear()
    gate_up_swiglu(x, wg, wu, BLOCK_N=4, BLOCK_K=16, SPLIT_K=2)  # a K split keeps the reduction launch
    assert kernels == ["_gemv_kernel", "_swiglu_reduce_kernel"]


@pytest.mark.parametrize("K", [45, 300])
def test_one_row_norm_prologue_reads_the_row_in_one_load(K):
    """Batch 1: the RMSNorm prologue loads the whole row at once (NORM_ROW) instead of tile by tile; same math."""
    from kernels_runtime.ops.gemv import _norm_row

    assert _norm_row(True, 1, K) == triton_next_pow2(K) and _norm_row(True, 4, K) == 0 and _norm_row(False, 1, K) == 0
    assert _norm_row(True, 1, 9000) == 0  # wider rows keep the loop (registers)
    dt = torch.bfloat16
    x, w, nw = torch.randn(1, K, dtype=dt), _w(23, K, dt), torch.rand(K, dtype=dt) + 0.5
    from kernels_runtime.ops import gemv as G

    seen, real = [], G.launch
    G.launch = lambda fn, grid, args, cx, **o: (seen.append(cx.get("NORM_ROW")), real(fn, grid, args, cx, **o))[1]
    try:
        assert_close(gemv(x, w, norm_w=nw, BLOCK_N=4, BLOCK_K=32), gemv_ref(x, w, norm_w=nw), dt, name="norm row")
    finally:
        G.launch = real
    assert seen == [triton_next_pow2(K)]  # the kernel took the one-load path
    wg, wu = _w(13, K, dt), _w(13, K, dt)
    assert_close(gate_up_swiglu(x, wg, wu, norm_w=nw, BLOCK_N=4, BLOCK_K=32, PDL=True),
                 gate_up_swiglu_ref(x, wg, wu, norm_w=nw), dt, name="paired norm row")


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90+")
def test_pdl_chain_in_a_cuda_graph_gives_the_bits_of_the_plain_chain():
    """A decode layer's GEMV chain (norm + q/k/v, o_proj + residual, the norm in gate/up's prologue, down +
    residual) with every kernel launched with PDL, replayed from a CUDA graph, against the same chain without PDL
    run eagerly: bit for bit (each kernel waits for the one before before it reads what that one wrote)."""
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(1, 2560, dtype=dt, device=dev)
    wq, wk, wv, wo = (_w(n, k, dt).to(dev) for n, k in ((4096, 2560), (1024, 2560), (1024, 2560), (2560, 4096)))
    wg, wu, wd = _w(9728, 2560, dt).to(dev), _w(9728, 2560, dt).to(dev), _w(2560, 9728, dt).to(dev)
    n1, n2 = ((1 + 0.1 * torch.randn(2560, device=dev)).to(dt) for _ in range(2))
    cfg = dict(BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1)

    def chain(pdl):
        h = x
        for _ in range(3):
            q, _, _ = qkv_norm_rope(h, wq, wk, wv, None, None, 128, norm_w=n1, PDL=pdl, **cfg)
            o = gemv(q.reshape(1, -1), wo, residual=h, PDL=pdl, **cfg)
            g = gate_up_swiglu(o, wg, wu, norm_w=n2, PDL=pdl, **cfg)
            h = gemv(g, wd, residual=o, PDL=pdl, **cfg)
        return h

    want = chain(False)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = chain(True)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@pytest.mark.parametrize("K,N,cfg", [(200, 40, dict(BLOCK_N=8, BLOCK_K=64, TMA=3)),
                                     (96, 19, dict(BLOCK_N=16, BLOCK_K=32, TMA=4, TMA_PRE=True)),
                                     (24, 8, dict(BLOCK_N=8, BLOCK_K=32, TMA=3, TMA_PRE=True))])
def test_tma_pass_matches_the_register_pass(K, N, cfg):
    """The TMA-fed pass (batch 1: the weight tiles through tensor descriptors, the interpreter's too): K not a
    multiple of the tile (the descriptor's zero fill), N not a multiple of the rows; plain + residual, gate/up with
    the norm prologue and SwiGLU, each against the register pass at the same tiles and against the reference; the
    first tile loaded ahead of the loop (TMA_PRE), also where it is the whole of K."""
    dt = torch.bfloat16
    x, w, r = torch.randn(1, K, dtype=dt), _w(N, K, dt), torch.randn(1, N, dtype=dt)
    plain = {k: v for k, v in cfg.items() if not k.startswith("TMA")}
    got = gemv(x, w, residual=r, **cfg)
    assert_close(got, gemv(x, w, residual=r, **plain), dt, name="tma vs register pass")
    assert_close(got, gemv_ref(x, w, residual=r), dt, name="tma vs reference")
    wg, wu, nw = _w(N, K, dt), _w(N, K, dt), (1 + 0.1 * torch.randn(K)).to(dt)
    gu = gate_up_swiglu(x, wg, wu, norm_w=nw, **cfg)
    assert_close(gu, gate_up_swiglu(x, wg, wu, norm_w=nw, **plain), dt, name="gate/up tma vs register pass")
    assert_close(gu, gate_up_swiglu_ref(x, wg, wu, norm_w=nw), dt, name="gate/up tma vs reference")


def test_tma_pass_takes_only_what_it_fits_and_the_register_pass_takes_the_rest(monkeypatch):
    """Two rows, a K split or a K that TMA cannot address (rows not 16-byte multiples, bf16 or fp32): the register
    pass runs them (same result as without TMA); one bf16 row with a 16-byte K takes the TMA kernel."""
    from kernels_runtime.ops import gemv as G

    launched = []
    real = G._gemv_tma_kernel
    monkeypatch.setattr(G, "_gemv_tma_kernel", type("Spy", (), {"__getitem__": lambda self, grid: (
        launched.append(grid), real[grid])[1]})())
    for M, K, dt, split in ((2, 64, torch.bfloat16, 1), (1, 62, torch.float32, 1), (1, 64, torch.bfloat16, 2),
                            (1, 60, torch.bfloat16, 1)):
        x, w = torch.randn(M, K, dtype=dt), _w(24, K, dt)
        cfg = dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=split)
        assert torch.equal(gemv(x, w, TMA=3, **cfg), gemv(x, w, **cfg))
    assert launched == []
    gemv(torch.randn(1, 64, dtype=torch.bfloat16), _w(24, 64, torch.bfloat16), BLOCK_N=8, BLOCK_K=32, TMA=3)
    assert launched == [(3,)]


@pytest.mark.gpu
def test_tma_pass_on_gpu_at_qwen3_shapes_in_a_cuda_graph():
    """qwen3-4b's gate/up (norm prologue, SwiGLU) and down (+ residual) through the TMA pass with PDL, eagerly and
    replayed from a CUDA graph, against the register pass; with the first tile before the wait, and with the next
    kernel let launch late."""
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(1, 2560, dtype=dt, device=dev)
    wg, wu, wd = _w(9728, 2560, dt).to(dev), _w(9728, 2560, dt).to(dev), _w(2560, 9728, dt).to(dev)
    nw = (1 + 0.1 * torch.randn(2560, device=dev)).to(dt)
    res = torch.randn(1, 2560, dtype=dt, device=dev)

    def chain(**kw):
        h = gate_up_swiglu(x, wg, wu, norm_w=nw, BLOCK_N=64, BLOCK_K=128, PDL=True, **kw)
        return h, gemv(h, wd, residual=res, BLOCK_N=8, BLOCK_K=256, PDL=True, **kw)

    want = chain()
    for kw in (dict(TMA=4), dict(TMA=4, TMA_PRE=True), dict(TMA=4, TMA_PRE=True, TMA_LATE=True)):
        got = chain(**kw)
        for a, b in zip(got, want):
            assert_close(a, b, dt, name=f"eager {kw}")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain(**kw)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        for a, b in zip(out, want):
            assert_close(a, b, dt, name=f"replayed {kw}")
