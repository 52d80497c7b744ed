import pytest
import torch

from kernels_runtime.ops.attention_decode_static import attention_decode_static, attention_decode_static_ref
from kernels_runtime.tolerances import assert_close


def _case(B, Hq, Hkv, S, D, dtype, norm, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    ang = torch.randn(B, 1, D // 2, generator=g) * 3
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    w = (lambda: (torch.rand(D, generator=g) + 0.5).to(dtype)) if norm else (lambda: None)
    return dict(q=r(B, Hq, 1, D), k=r(B, Hkv, 1, D), v=r(B, Hkv, 1, D), k_cache=r(B, Hkv, S, D),
                v_cache=r(B, Hkv, S, D), cos=cos, sin=sin, q_norm_weight=w(), k_norm_weight=w())


def _wide(c):
    return {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in c.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,pos", [((2, 4, 2, 37, 16), 36), ((1, 6, 2, 50, 32), 0), ((1, 8, 1, 21, 16), 13)])
@pytest.mark.parametrize("norm,window,cap", [(True, None, None), (False, 9, None), (False, None, 4.0)])
def test_static_decode_matches_float64_and_writes_the_cache(dtype, shape, pos, norm, window, cap):
    """GQA groups of 2/3/8, odd cache sizes, the position first / inside / last; Qwen3's q/k norms, a sliding window,
    soft-capping. Output vs float64 and vs the same-dtype reference; the mutated cache: the rotated k and the raw v
    at `pos` and nothing else changed; the length advanced by one on the device."""
    c = _case(*shape, dtype, norm, seed=pos + shape[1])
    n = torch.tensor(pos)
    kw = dict(sliding_window=window, softcap=cap)
    ref64 = attention_decode_static_ref(**_wide(c), cache_len=n, scale=0.3, **kw)
    ref = attention_decode_static_ref(**c, cache_len=n, scale=0.3, **kw)
    k_mut, v_mut, n_mut = c["k_cache"].clone(), c["v_cache"].clone(), n.clone()
    out = attention_decode_static(**{**c, "k_cache": k_mut, "v_cache": v_mut}, cache_len=n_mut, scale=0.3, **kw,
                                  BLOCK_N=16, num_splits=3)
    assert out.shape == c["q"].shape and out.dtype == dtype
    assert_close(out, ref[0], dtype)
    assert_close(out, ref64[0].to(dtype), dtype, name="vs float64")
    assert torch.equal(v_mut, ref[2])
    assert_close(k_mut, ref[1], dtype, name="k cache")
    assert torch.equal(torch.cat([k_mut[:, :, :pos], k_mut[:, :, pos + 1:]], 2),
                       torch.cat([c["k_cache"][:, :, :pos], c["k_cache"][:, :, pos + 1:]], 2))
    assert n_mut.item() == pos + 1


@pytest.mark.parametrize("shape,pos,window", [((2, 4, 2, 37, 16), 36, None), ((1, 8, 1, 21, 16), 13, 5),
                                              ((1, 6, 2, 50, 32), 0, None)])
def test_one_split_writes_the_output_itself_and_advances_only_when_asked(shape, pos, window):
    """num_splits = 1: one program per (batch, kv head) over the whole cache writes o directly (no partials, no
    merge kernel): the same output as the reference; with advance the length moves by one (a one-program kernel
    after it), without it the length stays where it was."""
    c = _case(*shape, torch.float32, True, seed=pos + 7)
    ref = attention_decode_static_ref(**c, cache_len=torch.tensor(pos), scale=0.3, sliding_window=window)
    for advance in (True, False):
        k_mut, v_mut, n = c["k_cache"].clone(), c["v_cache"].clone(), torch.tensor(pos)
        out = attention_decode_static(**{**c, "k_cache": k_mut, "v_cache": v_mut}, cache_len=n, scale=0.3,
                                      sliding_window=window, BLOCK_N=16, num_splits=1, advance=advance)
        assert_close(out, ref[0])
        assert torch.equal(v_mut, ref[2])
        assert_close(k_mut, ref[1], name="k cache")
        assert n.item() == pos + int(advance)


def test_static_decode_reads_the_position_from_device_memory_only():
    """One launch configuration for every position: the grid and the arguments do not depend on the length's
    value (what a CUDA graph freezes), and the host never reads it."""
    from tests.ops.test_attention_decode import _NoHostRead

    c = _case(1, 4, 2, 40, 16, torch.float32, True, seed=3)
    for pos in (2, 30):
        spy = torch.tensor(pos).as_subclass(_NoHostRead)
        k_mut, v_mut = c["k_cache"].clone(), c["v_cache"].clone()
        out = attention_decode_static(**{**c, "k_cache": k_mut, "v_cache": v_mut}, cache_len=spy, scale=0.25,
                                      BLOCK_N=16)
        ref = attention_decode_static_ref(**c, cache_len=torch.tensor(pos), scale=0.25)
        assert_close(out, ref[0])
        assert torch.Tensor.item(spy.as_subclass(torch.Tensor)) == pos + 1


def test_static_decode_at_a_full_cache_writes_nothing():
    c = _case(1, 4, 2, 20, 16, torch.float32, False, seed=5)
    k_mut, v_mut, n = c["k_cache"].clone(), c["v_cache"].clone(), torch.tensor(20)
    attention_decode_static(**{**c, "k_cache": k_mut, "v_cache": v_mut}, cache_len=n, scale=0.25, BLOCK_N=16)
    assert torch.equal(k_mut, c["k_cache"]) and torch.equal(v_mut, c["v_cache"]) and n.item() == 20


def test_static_decode_rejects_a_host_length():
    c = _case(1, 4, 2, 20, 16, torch.float32, False, seed=5)
    with pytest.raises(ValueError, match="one-element integer tensor"):
        attention_decode_static(**c, cache_len=3, scale=0.25)


def _left_padded(B, S, pos, pads):
    """HF's decode-row key mask for a left-padded batch on the static cache: row b attends [pads[b], pos], nothing
    past the write position."""
    j = torch.arange(S)
    return torch.stack([(j >= p) & (j <= pos) for p in pads])[:B]  # [B, S] bool


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits,pads", [(3, (0, 5, 17)), (1, (11, 0, 2)), (4, (0, 33, 1))])
def test_left_padded_rows_attend_only_their_own_keys(dtype, num_splits, pads):
    """Three rows left-padded by different lengths (one not at all), the 2-D key mask a strided view of HF's
    [B, 1, 1, S_max] decode mask: each row matches the float64 reference over its own keys, including a row whose
    padding covers whole BLOCK_N tiles and whole splits (no NaN from an empty tile), and differs from attending
    causally over the pads."""
    B, Hq, Hkv, S, D, pos = 3, 4, 2, 40, 16, 34
    c = _case(B, Hq, Hkv, S, D, dtype, True, seed=sum(pads) + num_splits)
    mask4 = _left_padded(B, S, pos, pads)[:, None, None, :]  # [B, 1, 1, S] as HF passes it
    mask = mask4[:, 0, -1]  # [B, S] view
    n = torch.tensor(pos)
    ref64 = attention_decode_static_ref(**_wide(c), cache_len=n, scale=0.3, kv_mask=mask)
    causal = attention_decode_static_ref(**c, cache_len=n, scale=0.3)
    k_mut, v_mut, n_mut = c["k_cache"].clone(), c["v_cache"].clone(), n.clone()
    out = attention_decode_static(**{**c, "k_cache": k_mut, "v_cache": v_mut}, cache_len=n_mut, scale=0.3,
                                  kv_mask=mask, BLOCK_N=8, num_splits=num_splits)
    assert torch.isfinite(out).all()
    assert_close(out, ref64[0].to(dtype), dtype, name="vs float64")
    assert_close(k_mut, ref64[1].to(dtype), dtype, name="k cache")
    assert n_mut.item() == pos + 1
    for b, p in enumerate(pads):  # the unpadded row is the causal one; a padded row is far from it
        if p == 0:
            assert_close(out[b], causal[0][b], dtype, name=f"row {b}")
        else:
            assert (out[b].float() - causal[0][b].float()).abs().max() > 0.05, b


@pytest.mark.parametrize("num_splits", [1, 2])
def test_a_key_mask_with_holes_is_applied_tile_by_tile(num_splits):
    """A key mask that is no prefix (random holes in every tile; the kernel loads a tile's mask two tiles ahead of
    its scores): each row matches the float64 reference over exactly its own keys."""
    B, Hq, Hkv, S, D, pos = 2, 4, 2, 48, 16, 41
    c = _case(B, Hq, Hkv, S, D, torch.float32, True, seed=7 + num_splits)
    g = torch.Generator().manual_seed(num_splits)
    mask = (torch.rand(B, S, generator=g) < 0.6) & (torch.arange(S) <= pos)
    mask[:, pos] = True  # the decode query sees itself
    n = torch.tensor(pos)
    ref64 = attention_decode_static_ref(**_wide(c), cache_len=n, scale=0.3, kv_mask=mask)
    out = attention_decode_static(**{**c, "k_cache": c["k_cache"].clone(), "v_cache": c["v_cache"].clone()},
                                  cache_len=n.clone(), scale=0.3, kv_mask=mask, BLOCK_N=8, num_splits=num_splits)
    assert_close(out, ref64[0].float(), torch.float32, name="vs float64")


def test_a_row_with_every_key_masked_gets_zeros_not_nan():
    """SDPA's answer for a fully masked row (zeros) in the merge of empty splits and in the one-split path."""
    c = _case(2, 4, 2, 24, 16, torch.float32, False, seed=9)
    mask = _left_padded(2, 24, 10, (0, 0))
    mask[1] = False
    ref = attention_decode_static_ref(**c, cache_len=torch.tensor(10), scale=0.3, kv_mask=mask)
    for splits in (1, 3):
        out = attention_decode_static(**{**c, "k_cache": c["k_cache"].clone(), "v_cache": c["v_cache"].clone()},
                                      cache_len=torch.tensor(10), scale=0.3, kv_mask=mask, BLOCK_N=8,
                                      num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()
        assert_close(out, ref[0])


def test_static_decode_rejects_a_float_or_misshapen_key_mask():
    c = _case(2, 4, 2, 20, 16, torch.float32, False, seed=5)
    for bad in (torch.zeros(2, 20), torch.ones(2, 19, dtype=torch.bool), torch.ones(20, dtype=torch.bool)):
        with pytest.raises(ValueError, match="expected kv_mask"):
            attention_decode_static(**c, cache_len=torch.tensor(3), scale=0.25, kv_mask=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("S,pos,kw", [(576, 575, {}), (576, 575, dict(num_splits=1, PDL=True)), (4096, 1000, {}),
                                      (4096, 1000, dict(num_splits=1, BLOCK_N=64, num_warps=8, PDL=True)),
                                      (32768, 32000, {})])
def test_static_decode_on_the_gpu_at_qwen3_shapes(S, pos, kw):
    """qwen3-4b's attention (32 q heads, 8 kv heads, head_dim 128, q/k norms) in bf16 against the float64 reference,
    and replayed from a CUDA graph at two positions (the length advanced by the kernel between replays)."""
    dev = torch.device("cuda")
    c = {n: (t.to(dev) if t is not None else None)
         for n, t in _case(1, 32, 8, S, 128, torch.bfloat16, True, seed=1).items()}
    n = torch.tensor(pos, device=dev)
    ref = attention_decode_static_ref(**_wide(c), cache_len=n, scale=128 ** -0.5)
    ref16 = attention_decode_static_ref(**c, cache_len=n, scale=128 ** -0.5)  # HF's bf16 roundings
    k_mut, v_mut, n_mut = c["k_cache"].clone(), c["v_cache"].clone(), n.clone()
    args = {**c, "k_cache": k_mut, "v_cache": v_mut}
    out = attention_decode_static(**args, cache_len=n_mut, scale=128 ** -0.5, **kw)
    assert_close(out, ref[0].to(torch.bfloat16), torch.bfloat16)
    # the written k against the bf16 chain: against float64 one bf16 ulp of |k| ~ 2-4 (0.0156) is over atol 0.01
    # (seen on the H200 at 32768, 2026-12-01)
    assert_close(k_mut, ref16[1], torch.bfloat16, name="k cache")
    assert n_mut.item() == pos + 1
    n_mut.fill_(pos - 7)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = attention_decode_static(**args, cache_len=n_mut, scale=128 ** -0.5, **kw)
    for p in (pos - 7, pos - 3):
        n_mut.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        want = attention_decode_static_ref(**_wide({**c, "k_cache": k_mut, "v_cache": v_mut}), cache_len=torch.tensor(p),
                                           scale=128 ** -0.5)[0]
        assert_close(g_out, want.to(torch.bfloat16), torch.bfloat16, name=f"replay at {p}")
        assert n_mut.item() == p + 1
