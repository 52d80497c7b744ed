"""gemv at decode batches (M = 2..64 rows): every op and fused epilogue against float64 references, on the FMA path
and on tl.dot tiles; each weight tile read once for all rows (one row block up to MAX_ROWS), the paired gate/up +
SwiGLU pass kept at every batch, and FMA_MAX_M moving rows from the FMA path to tl.dot."""
import pytest
import torch

from kernels_runtime.ops import gemv as G
from kernels_runtime.ops.gemv import (gate_up_swiglu, gate_up_swiglu_ref, gemv, gemv_ref, gemv_residual_rmsnorm,
                                      gemv_residual_rmsnorm_ref, qkv_norm_rope, qkv_norm_rope_ref)
from kernels_runtime.tolerances import assert_close

K, N, D = 40, 24, 8  # K not a multiple of the tiles, N not of the rows a program


def _w(n, k, dtype):
    return (torch.randn(n, k, dtype=torch.float64) / k**0.5).to(dtype)


def _rope(M, D):
    pos = torch.arange(M, dtype=torch.float64)[:, None] * 5 + 2  # a different position per row
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = torch.cat([pos * inv, pos * inv], dim=-1)
    return f.cos(), f.sin()


@pytest.fixture
def launches(monkeypatch):
    """(kernel name, grid, DOT, BLOCK_M) of every launch of the gemv module."""
    seen = []
    real = G.launch

    def spy(fn, grid, args, cx, **kw):
        seen.append((fn.__name__, tuple(grid), cx.get("DOT"), cx.get("BLOCK_M")))
        return real(fn, grid, args, cx, **kw)

    monkeypatch.setattr(G, "launch", spy)
    return seen


@pytest.mark.parametrize("M", [2, 5, 16, 33])
@pytest.mark.parametrize("fma_max_m", [16, 1])  # the default split of paths, and tl.dot from 2 rows
def test_batch_rows_every_op_against_float64(M, fma_max_m):
    torch.manual_seed(M)
    dt = torch.float32
    cfg = dict(BLOCK_N=8, BLOCK_K=16, FMA_MAX_M=fma_max_m)
    x, w, res = torch.randn(M, 1, K, dtype=dt), _w(N, K, dt), torch.randn(M, 1, N, dtype=dt)
    nw = (1 + 0.1 * torch.randn(K)).to(dt)
    x64, w64, nw64 = x.double(), w.double(), nw.double()
    out = gemv(x, w, residual=res, norm_w=nw, **cfg)
    assert out.shape == (M, 1, N)
    assert_close(out, gemv_ref(x64, w64, residual=res.double(), norm_w=nw64).float(), dt, name="norm+gemv+res")
    wg, wu = _w(N, K, dt), _w(N, K, dt)
    assert_close(gate_up_swiglu(x, wg, wu, norm_w=nw, **cfg),
                 gate_up_swiglu_ref(x64, wg.double(), wu.double(), norm_w=nw64).float(), dt, name="gate/up")
    nw2 = (1 + 0.1 * torch.randn(N)).to(dt)
    for a, b in zip(gemv_residual_rmsnorm(x, w, res, nw2, 1e-5, **cfg, SPLIT_K=2),
                    gemv_residual_rmsnorm_ref(x64, w64, res.double(), nw2.double(), 1e-5)):
        assert_close(a, b.float(), dt, name="residual + rmsnorm")
    wq, wk, wv = _w(4 * D, K, dt), _w(2 * D, K, dt), _w(2 * D, K, dt)
    qn, kn = (1 + 0.1 * torch.randn(D)).to(dt), (1 + 0.1 * torch.randn(D)).to(dt)
    cos, sin = _rope(M, D)
    got = qkv_norm_rope(x.view(M, K), wq, wk, wv, cos.to(dt), sin.to(dt), D, q_norm_w=qn, k_norm_w=kn, norm_w=nw,
                        **cfg)
    want = qkv_norm_rope_ref(x64.view(M, K), wq.double(), wk.double(), wv.double(), cos, sin, D,
                             q_norm_w=qn.double(), k_norm_w=kn.double(), norm_w=nw64)
    for name, a, b in zip("qkv", got, want):
        assert_close(a, b.float(), dt, name=name)


@pytest.mark.parametrize("M", [3, 33])
def test_batch_rows_bf16_follow_the_eager_roundings(M):
    """bf16: the eager modules' roundings (each projection, silu, the product; the residual add) at a batch."""
    dt = torch.bfloat16
    x, wg, wu = torch.randn(M, K, dtype=dt), _w(N, K, dt), _w(N, K, dt)
    nw = (1 + 0.1 * torch.randn(K)).to(dt)
    assert_close(gate_up_swiglu(x, wg, wu, norm_w=nw, BLOCK_N=8, BLOCK_K=16),
                 gate_up_swiglu_ref(x, wg, wu, norm_w=nw), dt, name="gate/up bf16")
    res = torch.randn(M, N, dtype=dt)
    assert_close(gemv(x, wg, residual=res, BLOCK_N=8, BLOCK_K=16), gemv_ref(x, wg, residual=res), dt, name="gemv bf16")


@pytest.mark.parametrize("M", [2, 5, 16, 33, 64])
def test_each_weight_tile_is_read_once_for_the_whole_batch(M, launches):
    """One row block (grid's third axis) for any decode batch up to MAX_ROWS, on either path; the paired gate/up +
    SwiGLU pass stays one launch at every batch, and q/k/v written by its pass."""
    x, w = torch.randn(M, K), _w(N, K, torch.float32)
    gemv(x, w, BLOCK_N=8, BLOCK_K=16)
    gate_up_swiglu(x, w, w, BLOCK_N=8, BLOCK_K=16)
    qkv_norm_rope(x, _w(2 * D, K, torch.float32), w[:D], w[:D], None, None, D, BLOCK_N=8, BLOCK_K=16)
    assert [name for name, *_ in launches] == ["_gemv_kernel"] * 3, launches
    assert all(grid[2] == 1 for _, grid, _, _ in launches), launches
    assert all(dot == (M > G.MAX_FMA_M) for _, _, dot, _ in launches), launches


def test_past_max_rows_the_row_blocks_repeat_and_stay_correct(launches):
    M = G.MAX_ROWS + 3  # a prefill-sized call reaching a decode kernel
    x, w = torch.randn(M, K), _w(N, K, torch.float32)
    assert_close(gemv(x, w, BLOCK_N=8, BLOCK_K=16), gemv_ref(x.double(), w.double()).float(), name="67 rows")
    assert launches[-1][1][2] == 2 and launches[-1][3] == G.MAX_ROWS


def test_fma_max_m_moves_rows_to_tl_dot(launches):
    """FMA_MAX_M (the search's per-batch choice): at most that many rows on the FMA path, more on tl.dot tiles of
    at least 16 rows; a value outside 0..MAX_FMA_M is refused with one line."""
    x, w = torch.randn(5, K), _w(N, K, torch.float32)
    gemv(x[:4], w, FMA_MAX_M=4)
    gemv(x, w, FMA_MAX_M=4)
    gemv(x, w, FMA_MAX_M=0)
    assert [(dot, bm) for _, _, dot, bm in launches] == [(False, 4), (True, 16), (True, 16)]
    with pytest.raises(ValueError, match=r"expected FMA_MAX_M an int in 0\.\.16, got 17"):
        gemv(x, w, FMA_MAX_M=17)


@pytest.mark.parametrize("M", [1, 5, 33])
def test_norm_pass_normalises_the_rows_once_and_matches_float64(M, launches):
    """NORM_PASS: with more than one row a program, one program a row normalises the rows first and the GEMV
    streams against them without its prologue; at one row the one-load prologue stays and nothing more is
    launched. Every norm'd op (gemv, gate/up, q/k/v) matches its float64 reference either way."""
    torch.manual_seed(M)
    dt = torch.float32
    cfg = dict(BLOCK_N=8, BLOCK_K=16, NORM_PASS=True)
    x, w = torch.randn(M, K, dtype=dt), _w(N, K, dt)
    nw = (1 + 0.1 * torch.randn(K)).to(dt)
    x64, nw64 = x.double(), nw.double()
    assert_close(gemv(x, w, norm_w=nw, **cfg), gemv_ref(x64, w.double(), norm_w=nw64).float(), dt, name="gemv")
    wg, wu = _w(N, K, dt), _w(N, K, dt)
    assert_close(gate_up_swiglu(x, wg, wu, norm_w=nw, **cfg),
                 gate_up_swiglu_ref(x64, wg.double(), wu.double(), norm_w=nw64).float(), dt, name="gate/up")
    wq, wk, wv = _w(4 * D, K, dt), _w(2 * D, K, dt), _w(2 * D, K, dt)
    got = qkv_norm_rope(x, wq, wk, wv, None, None, D, norm_w=nw, norm_eps=1e-5, **cfg)
    want = qkv_norm_rope_ref(x64, wq.double(), wk.double(), wv.double(), None, None, D, norm_w=nw64, norm_eps=1e-5)
    for name, a, b in zip("qkv", got, want):
        assert_close(a, b.float(), dt, name=name)
    names = [name for name, *_ in launches]
    if M == 1:
        assert "_row_norm_kernel" not in names, names
    else:
        assert names == ["_row_norm_kernel", "_gemv_kernel"] * 3, names
        assert all(grid == (M,) for name, grid, *_ in launches if name == "_row_norm_kernel"), launches


@pytest.mark.parametrize("gemma", [False, True])
def test_norm_pass_bf16_equals_the_prologue(gemma):
    """bf16 at a batch: the rows normalised by their own pass (HF's roundings; Gemma's 1 + w) give what the GEMV's
    prologue gives, to the bit here, and the eager roundings."""
    dt, M = torch.bfloat16, 9
    x, w = torch.randn(M, K, dtype=dt), _w(N, K, dt)
    nw = (1 + 0.1 * torch.randn(K)).to(dt)
    wq, wk = _w(4 * D, K, dt), _w(2 * D, K, dt)
    cfg = dict(BLOCK_N=8, BLOCK_K=16, norm_w=nw, norm_eps=1e-5, gemma_norm=gemma)
    a = qkv_norm_rope(x, wq, wk, wk, None, None, D, **cfg)
    b = qkv_norm_rope(x, wq, wk, wk, None, None, D, NORM_PASS=True, **cfg)
    for name, p, q in zip("qkv", a, b):
        assert torch.equal(p, q), name
    want = qkv_norm_rope_ref(x, wq, wk, wk, None, None, D, norm_w=nw, norm_eps=1e-5, gemma_norm=gemma)
    for name, p, q in zip("qkv", b, want):
        assert_close(p, q, dt, name=name)


def test_dot_tiles_apply_to_calls_on_tl_dot_only(launches):
    """DOT_BLOCK_N / DOT_BLOCK_K / DOT_SPLIT_K: a call of more rows than FMA_MAX_M runs at the tl.dot tile (grid:
    N over DOT_BLOCK_N, DOT_SPLIT_K splits), a call on the FMA path at the stage's own tile; 0 keeps the stage's
    tile on tl.dot too. Both match float64."""
    Kb, Nb = 64, 48
    w = _w(Nb, Kb, torch.float32)
    cfg = dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=1, FMA_MAX_M=4, DOT_BLOCK_N=16, DOT_BLOCK_K=16, DOT_SPLIT_K=2)
    for M in (3, 9):
        x = torch.randn(M, Kb)
        assert_close(gemv(x, w, **cfg), gemv_ref(x.double(), w.double()).float(), name=f"{M} rows")
    gemv(torch.randn(9, Kb), w, **{**cfg, "DOT_BLOCK_N": 0, "DOT_BLOCK_K": 0, "DOT_SPLIT_K": 0})
    grids = [(grid[:2], dot) for name, grid, dot, _ in launches if name == "_gemv_kernel"]
    assert grids == [((6, 1), False), ((3, 2), True), ((3, 1), True)], grids


def test_gate_up_dot_tiles_count_gate_and_up_rows_together(launches):
    """gate_up_swiglu's DOT_BLOCK_N, as its BLOCK_N: gate and up rows of a paired program together (32 -> 16 of
    each); a DOT_SPLIT_K past 1 takes the unpaired pass (blocks of 32 rows of each weight) and its reduction."""
    M, I = 20, 64
    x, wg, wu = torch.randn(M, K), _w(I, K, torch.float32), _w(I, K, torch.float32)
    want = gate_up_swiglu_ref(x.double(), wg.double(), wu.double()).float()
    assert_close(gate_up_swiglu(x, wg, wu, DOT_BLOCK_N=32, DOT_BLOCK_K=16), want, name="paired")
    assert_close(gate_up_swiglu(x, wg, wu, DOT_BLOCK_N=32, DOT_BLOCK_K=16, DOT_SPLIT_K=2), want, name="split")
    assert [(n, g[:2]) for n, g, *_ in launches] == [("_gemv_kernel", (4, 1)), ("_gemv_kernel", (4, 2)),
                                                     ("_swiglu_reduce_kernel", (M, 1))], launches
