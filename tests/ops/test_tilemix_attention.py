"""TileMix: both ends of the coverage knob, the routing of every tile group, GQA, ragged batches, the INT8 KV
cache input and the error's growth with coverage (interpreter, small shapes)."""
import pytest
import torch

from kernels_runtime.ops._common import interpreting
from kernels_runtime.ops.attention_prefill import attention_prefill, attention_prefill_ref
from kernels_runtime.ops.tilemix_attention import quantize_int8, tilemix_attention, tilemix_attention_ref
from kernels_runtime.ops.tilemix_masks import (TEMPLATES, TileMask, build_tile_mask, pack_bits, uniform_mask,
                                               visible_groups)
from kernels_runtime.tolerances import assert_close

G = (16, 16)  # tile group at test scale; kernel tiles 16 x 16 (or 16 x 8: two kernel tiles per group column)
CFG = {"BLOCK_M": 16, "BLOCK_N": 16}


def _qkv(B, Hq, Hkv, S, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, S, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4, 2, 45, 16), (2, 2, 2, 33, 32)])
def test_zero_coverage_is_the_plain_flash_kernel_bit_for_bit(dtype, shape):
    q, k, v = _qkv(*shape, dtype=dtype, seed=shape[3])
    plain = attention_prefill(q, k, v, 0.3, **CFG)
    assert torch.equal(tilemix_attention(q, k, v, uniform_mask(False, shape[3], group=G), 0.3, **CFG), plain)
    # the templates' 0 % is that mask: no bit set
    assert not any(build_tile_mask(t, 0.0, shape[3], group=G).bits.any() for t in TEMPLATES)


@pytest.mark.parametrize("template", TEMPLATES)
def test_full_coverage_is_uniform_int8(template):
    q, k, v = _qkv(1, 2, 1, 50, 16, seed=3)
    out = tilemix_attention(q, k, v, build_tile_mask(template, 1.0, 50, group=G), **CFG)
    uniform = uniform_mask(True, 50, group=G)
    assert torch.equal(out, tilemix_attention(q, k, v, uniform, **CFG))
    assert_close(out, tilemix_attention_ref(q, k, v, uniform))
    # and it is INT8: farther from exact attention than the 16-bit path (fp32 inputs: ~1e-7 there)
    assert _rel(out, attention_prefill_ref(q.double(), k.double(), v.double())) > 1e-3


@pytest.mark.parametrize("template", TEMPLATES)
def test_mixed_routing_matches_its_reference(template):
    q, k, v = _qkv(1, 2, 1, 61, 16, seed=4)
    mask = build_tile_mask(template, 0.5, 61, group=G, seed=1)
    assert_close(tilemix_attention(q, k, v, mask, **CFG), tilemix_attention_ref(q, k, v, mask))
    # kernel tiles smaller than the group (two key tiles per group column) route the same
    assert_close(tilemix_attention(q, k, v, mask, BLOCK_M=16, BLOCK_N=8), tilemix_attention_ref(q, k, v, mask))
    # scale blocks shorter than a key tile: per-key scales inside the tile
    assert_close(tilemix_attention(q, k, v, mask, quant_block=8, **CFG),
                 tilemix_attention_ref(q, k, v, mask, quant_block=8))


def test_int32_scores_convert_exactly_either_way(monkeypatch):
    import kernels_runtime.ops.tilemix_attention as tm

    q, k, v = _qkv(1, 2, 1, 40, 16, seed=9)
    q[0, 0, 3] *= 50.0  # an outlier row: it quantises to +-127, the rest of its block to small integers
    mask = uniform_mask(True, 40, group=G)
    magic = tilemix_attention(q, k, v, mask, **CFG)
    monkeypatch.setattr(tm, "INT8_DEQUANT", "cvt")
    assert torch.equal(magic, tilemix_attention(q, k, v, mask, **CFG))


def test_poisoned_int8_path_changes_exactly_the_routed_tiles():
    # NaN scales on one key group's INT8 copy: a query row turns NaN iff its row of groups routes that column to
    # INT8 and sees at least one key of it; every other output is bit for bit the unpoisoned one.
    S, B, Hq, Hkv = 64, 1, 2, 1
    q, k, v = _qkv(B, Hq, Hkv, S, 16, seed=5)
    route = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    mask = TileMask(pack_bits(route), 16, 16, 4)
    starts, lens = torch.zeros(B, dtype=torch.int32), torch.full((B,), S, dtype=torch.int32)
    k8, ks = quantize_int8(k, starts, lens, S, block=16)
    clean = tilemix_attention(q, k, v, mask, k_quant=(k8, ks), quant_block=16, **CFG)
    assert torch.equal(clean, tilemix_attention(q, k, v, mask, quant_block=16, **CFG))  # k_quant = its own copy
    rows = torch.arange(S)
    for col in range(4):
        bad = ks.clone()
        bad[:, :, col] = float("nan")
        out = tilemix_attention(q, k, v, mask, k_quant=(k8, bad), quant_block=16, **CFG)
        expect = route[rows // 16, col] & (col * 16 <= rows)  # [S]
        got = torch.isnan(out).any(-1)  # [B, Hq, S]
        assert torch.equal(got, expect.expand_as(got)), col
        assert torch.equal(out[..., ~expect, :], clean[..., ~expect, :])


def test_ragged_packed_batch_with_gqa_matches_each_sequence_alone():
    lens = [37, 16, 5, 20]
    Hq, Hkv, D = 2, 1, 16
    g = torch.Generator().manual_seed(6)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    mask = build_tile_mask("bigbird", 0.6, max(lens), group=G, seed=2)
    out = tilemix_attention(q, k, v, mask, cu_seqlens=cu, **CFG)
    assert_close(out, tilemix_attention_ref(q, k, v, mask, cu_seqlens=cu))
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):  # the same as that sequence run as a batch of one
        one = tilemix_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), mask, **CFG)
        if interpreting():  # the interpreter's dots are numpy matmuls whose BLAS path can follow the tile's memory
            # alignment (a sequence packed at an odd offset): equal to an ulp or two, not bit for bit
            torch.testing.assert_close(out[a:b], one[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
        else:  # a GPU: the same tiles through the same kernel, bit for bit
            assert torch.equal(out[a:b], one[0].transpose(0, 1))
    # a padded batch with seq_lens: the same rows, zeros past each length
    S = max(lens)
    pad = lambda t: torch.stack([torch.nn.functional.pad(t[a:b], (0, 0, 0, 0, 0, S - (b - a))).transpose(0, 1)
                                 for a, b in zip(cu.tolist(), cu.tolist()[1:])])  # noqa: E731
    padded = tilemix_attention(pad(q), pad(k), pad(v), mask, seq_lens=torch.tensor(lens), **CFG)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        assert torch.equal(padded[i, :, : b - a], out[a:b].transpose(0, 1))
        assert not padded[i, :, b - a:].any()


def test_int8_kv_cache_input():
    q, k, v = _qkv(1, 2, 1, 40, 16, seed=7)
    starts, lens = torch.zeros(1, dtype=torch.int32), torch.full((1,), 40, dtype=torch.int32)
    (k8, ks), (v8, vs) = quantize_int8(k, starts, lens, 40), quantize_int8(v, starts, lens, 40)
    for cov in (0.0, 0.5, 1.0):
        mask = build_tile_mask("sink_local", cov, 40, group=G)
        out = tilemix_attention(q, k8, v8, mask, k_scale=ks, v_scale=vs, **CFG)
        assert_close(out, tilemix_attention_ref(q, k8, v8, mask, k_scale=ks, v_scale=vs))
        assert _rel(out, attention_prefill_ref(q, k, v)) < 0.05  # the cache's own quantisation error only


def test_error_grows_with_coverage_and_stays_under_uniform_int8():
    S = 96
    q, k, v = _qkv(1, 1, 1, S, 16, seed=8)
    exact = attention_prefill_ref(q.double(), k.double(), v.double())
    for template in TEMPLATES:
        errs = [_rel(tilemix_attention(q, k, v, build_tile_mask(template, c, S, group=G), **CFG), exact)
                for c in (0.0, 0.3, 0.7, 1.0)]
        assert errs == sorted(errs), (template, errs)
        assert errs[0] < 1e-5 and errs[1] < 0.8 * errs[-1] and errs[2] < errs[-1], (template, errs)


def test_masks_hit_their_coverage_nested_and_keep_the_diagonal_16bit():
    S = 1000
    vis = visible_groups(S, 128, 128)
    diag = torch.eye(vis.shape[0], dtype=torch.bool)
    for template in TEMPLATES:
        prev = torch.zeros_like(vis)
        for cov in (0.0, 0.25, 0.5, 0.75, 0.9, 1.0):
            m = build_tile_mask(template, cov, S)
            route = m.unpack()
            if template != "row_random":  # one global ranking: exact, nested
                assert abs(m.realised_coverage(S) - cov) <= 1 / vis.sum()
                assert not (prev & ~route).any(), (template, cov)
                if cov < 0.9:
                    assert not (route & diag).any()
            prev = route
        assert (m.unpack() & vis).sum() == vis.sum()  # coverage 1: every visible group INT8
    sink = build_tile_mask("sink_local", 0.5, S).unpack()
    assert not sink[:, 0].any() and sink[-1, 1]  # the first keys stay 16-bit, the far past of the last row is INT8


def test_pack_roundtrip_and_contract_errors():
    route = torch.rand(5, 70) > 0.5
    assert torch.equal(TileMask(pack_bits(route), 16, 16, 70).unpack(), route)
    q, k, v = _qkv(1, 4, 3, 20, 16)
    with pytest.raises(ValueError, match="Hkv dividing"):
        tilemix_attention(q, k, v, uniform_mask(False, 20, group=G))
    q, k, v = _qkv(1, 4, 2, 40, 16)
    with pytest.raises(ValueError, match="covering 40 tokens"):
        tilemix_attention(q, k, v, uniform_mask(False, 20, group=G))
    with pytest.raises(ValueError, match="BLOCK_M"):
        tilemix_attention(q, k, v, uniform_mask(False, 40, group=G), BLOCK_M=32, BLOCK_N=16)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        tilemix_attention(q, k.to(torch.int8), v.to(torch.int8), uniform_mask(False, 40, group=G))
    with pytest.raises(ValueError, match="coverage in"):
        build_tile_mask("sink_local", 1.5, 40)


def test_per_call_setup_is_built_once_and_changes_no_bit():
    """What a model pays on every layer's call: the padded batch's start/length vectors are one cached pair per
    shape (bit for bit the explicit seq_lens path, which builds them per call), and a mask built on another device
    is copied to the kernel's once (bit for bit the mask built there)."""
    from kernels_runtime.ops import tilemix_attention as tm

    q, k, v = _qkv(2, 4, 2, 45, 32, seed=7)
    host = build_tile_mask("bigbird", 0.5, 45, group=G)
    out = tilemix_attention(q, k, v, host, **CFG)
    assert torch.equal(out, tilemix_attention(q, k, v, host, seq_lens=torch.full((2,), 45), **CFG))
    assert tm._padded_lengths(2, 45, q.device) is tm._padded_lengths(2, 45, q.device)
    start, length = tm._padded_lengths(2, 45, q.device)
    assert start.tolist() == [0, 0] and length.tolist() == [45, 45] and length.dtype == torch.int32
    # the mask on a second device (meta stands in for the GPU): copied once, then the same tensor
    meta = torch.device("meta")
    first = tm._device_bits(host, meta)
    assert first.device == meta and tm._device_bits(host, meta) is first
    assert tm._device_bits(host, q.device) is host.bits and torch.equal(tilemix_attention(q, k, v, host, **CFG), out)


@pytest.mark.parametrize("layout", ["contiguous", "model", "packed"])
def test_tma_descriptors_load_the_same_tiles(layout):
    """TMA on: the fully visible K/V (and K8) tiles come by host-made descriptors. Every layout the kernel takes
    (contiguous [B, H, S, D], the model's transposed [B, S, H, D], packed [T, H, D]) maps onto descriptor rows, and
    the output is bit for bit the pointer path's, at 0 %, mixed and 100 % coverage."""
    from kernels_runtime.ops import tilemix_attention as tm

    B, Hq, Hkv, S, D = 2, 4, 2, 70, 32
    q, k, v = _qkv(B, Hq, Hkv, S, D, dtype=torch.bfloat16, seed=11)
    kw = {}
    if layout == "model":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif layout == "packed":
        lens = [S, 41]
        q, k, v = (torch.cat([t[0].transpose(0, 1), t[1, :, :41].transpose(0, 1)]) for t in (q, k, v))
        kw["cu_seqlens"] = torch.tensor([0, S, S + 41], dtype=torch.int32)
    lays = [tm._tma_rows(t, 1 if layout == "packed" else B, t.shape[0 if layout == "packed" else 2]) for t in (k, v)]
    assert all(lay is not None for lay in lays)
    for cov in (0.0, 0.5, 1.0):
        mask = build_tile_mask("sink_local", cov, S, group=G)
        plain = tilemix_attention(q, k, v, mask, **CFG, **kw)
        assert torch.equal(tilemix_attention(q, k, v, mask, TMA=True, **CFG, **kw), plain), cov
    # the kernel really reads the fully visible tiles through the descriptors: hand it descriptors of another K and
    # V and exactly the rows past the first key block change (the diagonal blocks still load by pointers)
    zero = build_tile_mask("sink_local", 0.0, S, group=G)
    plain0 = tilemix_attention(q, k, v, zero, **CFG, **kw)
    real = tm._descriptors
    other_k, other_v = k + 1, v.flip(-1)
    try:
        tm._descriptors = lambda k_, v_, k8, *a: real(other_k, other_v, other_k, *a)
        fed = tilemix_attention(q, k, v, zero, TMA=True, **CFG, **kw)
    finally:
        tm._descriptors = real
    tok = 0 if layout == "packed" else 2
    assert torch.equal(fed.narrow(tok, 0, 16), plain0.narrow(tok, 0, 16)) and not torch.equal(fed, plain0)
    # a layout TMA cannot walk (a last dim with a stride) falls back to pointers with the same bits
    kt = torch.randn(B, Hkv, D, S).to(torch.bfloat16).transpose(2, 3)
    assert tm._tma_rows(kt, B, S) is None
    mask = build_tile_mask("sink_local", 0.5, S, group=G)
    qs = q if layout != "packed" else _qkv(B, Hq, Hkv, S, D, dtype=torch.bfloat16, seed=11)[0]
    assert torch.equal(tilemix_attention(qs, kt, kt, mask, TMA=True, **CFG), tilemix_attention(qs, kt, kt, mask, **CFG))


def test_default_tiles_take_tma_only_where_it_runs(monkeypatch):
    """head_dim 128 defaults to the TMA config on sm_90+, to the pointer path before it (an A100) and for
    head_dim > 128; a TMA config asked for on a GPU without TMA runs the pointer path (`_launch` checks tma_ok)."""
    from kernels_runtime.ops import tilemix_attention as tm

    cuda = torch.device("cuda")
    monkeypatch.setattr(tm, "interpreting", lambda: False)
    for cap, want in (((8, 0), tm.POINTER_DEFAULT), ((9, 0), tm.CONFIGS[0]), ((10, 0), tm.CONFIGS[0])):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
        assert tm.default_config(128, cuda) == want
        assert tm.tma_ok(cuda) == (cap[0] >= 9)
    assert tm.default_config(256, cuda) == tm.POINTER_DEFAULT and tm.default_config(64, cuda)["BLOCK_M"] == 64
    assert not tm.tma_ok(torch.device("cpu")) and tm.CONFIGS[0]["TMA"] and "TMA" not in tm.POINTER_DEFAULT
