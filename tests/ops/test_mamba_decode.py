"""The fused Mamba decode kernels against the composition of the per-op references (HF's torch path), on outputs
and both states, across dtypes and odd sizes; the states written out of place (inputs untouched) or, with
inplace=True, over the state read (the cache updated by the kernel, no copy back)."""
import pytest
import torch
import torch.nn.functional as F

from kernels_runtime.ops.causal_conv1d import causal_conv1d_update_ref
from kernels_runtime.ops.mamba_decode import gated_norm_linear, mamba_dt_state_update, mamba_in_proj_conv, proj_conv
from kernels_runtime.ops.selective_scan import selective_state_update_ref
from kernels_runtime.tolerances import assert_close

DTYPES = [torch.float32, torch.bfloat16]


def _weights(H, I, K, N, R, dtype, seed, bias):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "in_w": (r(2 * I, H) / H**0.5).to(dtype), "in_b": r(2 * I).to(dtype) if bias else None,
        "conv_w": (r(I, K) / K**0.5).to(dtype), "conv_b": r(I).to(dtype),
        "x_w": (r(R + 2 * N, I) / I**0.5).to(dtype), "dt_w": (r(I, R) / R**0.5).to(dtype),
        "dt_b": (r(I) * 0.5 - 2).to(dtype), "A_log": (r(I, N) * 0.5).to(dtype), "D": r(I).to(dtype),
        "x": r(2, H).to(dtype), "conv_state": r(2, I, K).to(dtype), "ssm_state": r(2, I, N),
    }


def _reference(w, mask):
    """The unfused decode step as the ssm_mixer.mamba_decode template composes it (each op's _ref)."""
    x = w["x"] if mask is None else (w["x"] * mask).to(w["x"].dtype)
    proj = F.linear(x.float(), w["in_w"].float(), None if w["in_b"] is None else w["in_b"].float()).to(x.dtype)
    I = w["conv_w"].shape[0]
    xs, z = proj[:, :I], proj[:, I:]
    conv_state = w["conv_state"].clone()
    xc = causal_conv1d_update_ref(xs, conv_state, w["conv_w"], w["conv_b"], silu=True)
    if mask is not None:
        xc = (xc * mask).to(xc.dtype)
    R = w["dt_w"].shape[1]
    N = w["A_log"].shape[1]
    p = F.linear(xc.float(), w["x_w"].float()).to(xc.dtype)
    dt = F.linear(p[:, :R].float(), w["dt_w"].float()).to(xc.dtype)
    ssm_state = w["ssm_state"].clone()
    y = selective_state_update_ref(ssm_state, xc, dt, -torch.exp(w["A_log"].float()), p[:, R:R + N],
                                   p[:, R + N:], D=w["D"], z=z, dt_bias=w["dt_b"].float(), dt_softplus=True)
    return xc, z, conv_state, p, y, ssm_state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,I,K,N,R", [(48, 96, 4, 16, 3), (33, 40, 4, 12, 5)])
@pytest.mark.parametrize("bias,masked", [(False, False), (True, True)])
def test_fused_decode_matches_the_composed_references(dtype, H, I, K, N, R, bias, masked):
    w = _weights(H, I, K, N, R, dtype, seed=H + I, bias=bias)
    mask = torch.tensor([[1], [0]], dtype=torch.long) if masked else None
    xc_r, z_r, cs_r, p_r, y_r, ss_r = _reference(w, mask)
    before = {k: v.clone() for k, v in w.items() if isinstance(v, torch.Tensor)}
    xc, z, cs = mamba_in_proj_conv(w["x"], w["in_w"], w["in_b"], w["conv_state"], w["conv_w"], w["conv_b"], mask,
                                   BLOCK_C=16, BLOCK_H=16)
    assert_close(z, z_r, name="z")
    assert_close(xc, xc_r, name="xc")
    assert_close(cs, cs_r, name="conv state")
    y, ss = mamba_dt_state_update(p_r, w["dt_w"], w["dt_b"], w["A_log"], w["D"], xc_r, z_r, w["ssm_state"],
                                  BLOCK_D=16)
    assert_close(y, y_r, name="y")
    assert_close(ss, ss_r, torch.float32, name="ssm state")
    for k, v in before.items():  # out of place: no input changed
        assert torch.equal(w[k], v), k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,I,K,N,R", [(48, 96, 4, 16, 3), (33, 40, 4, 12, 5)])
def test_dt_state_update_with_x_proj_inside(dtype, H, I, K, N, R):
    """x_proj computed inside the state-update launch (x_proj_w, p=None): the composed references' y and state."""
    w = _weights(H, I, K, N, R, dtype, seed=H + 2 * I, bias=False)
    xc_r, z_r, _, p_r, y_r, ss_r = _reference(w, None)
    y, ss = mamba_dt_state_update(None, w["dt_w"], w["dt_b"], w["A_log"], w["D"], xc_r, z_r, w["ssm_state"],
                                  BLOCK_D=16, x_proj_w=w["x_w"], BLOCK_I=32)
    assert_close(y, y_r, name="y")
    assert_close(ss, ss_r, torch.float32, name="ssm state")
    y_p, _ = mamba_dt_state_update(p_r, w["dt_w"], w["dt_b"], w["A_log"], w["D"], xc_r, z_r, w["ssm_state"],
                                   BLOCK_D=16)
    assert_close(y, y_p, name="y vs x_proj's own launch")  # the same computation but x_proj's summation order
    with pytest.raises(ValueError, match="exactly one of p and x_proj_w"):
        mamba_dt_state_update(p_r, w["dt_w"], w["dt_b"], w["A_log"], w["D"], xc_r, z_r, w["ssm_state"],
                              x_proj_w=w["x_w"])


def test_fused_decode_rejects_bad_shapes():
    w = _weights(16, 8, 4, 4, 2, torch.float32, 0, False)
    with pytest.raises(ValueError, match="conv_state"):
        mamba_in_proj_conv(w["x"], w["in_w"], None, w["conv_state"][:, :4], w["conv_w"], None)
    with pytest.raises(ValueError, match="mask"):
        mamba_in_proj_conv(w["x"], w["in_w"], None, w["conv_state"], w["conv_w"], None, torch.ones(2, 3))
    with pytest.raises(ValueError, match="p"):
        mamba_dt_state_update(torch.zeros(2, 5), w["dt_w"], w["dt_b"], w["A_log"], w["D"], torch.zeros(2, 8),
                              torch.zeros(2, 8), w["ssm_state"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", [False, True])
def test_proj_conv_on_a_middle_row_range(dtype, masked):
    """Mamba2's layout: in_proj rows [z | xBC | dt], the conv on xBC only; the other rows are in_proj's output."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    H, I, CD, NH, K = 40, 48, 80, 6, 4
    NR = I + CD + NH
    x, w = r(2, H).to(dtype), (r(NR, H) / H**0.5).to(dtype)
    conv_w, conv_b, state = (r(CD, K) / 2).to(dtype), r(CD).to(dtype), r(2, CD, K).to(dtype)
    mask = torch.tensor([[1], [0]]) if masked else None
    xm = x if mask is None else (x * mask).to(dtype)
    proj = F.linear(xm.float(), w.float()).to(dtype)
    state_ref = state.clone()
    xc_ref = causal_conv1d_update_ref(proj[:, I:I + CD], state_ref, conv_w, conv_b, silu=True)
    if mask is not None:
        xc_ref = (xc_ref * mask).to(dtype)
    before = state.clone()
    o, s_out = proj_conv(x, w, None, state, conv_w, conv_b, mask, conv_start=I, BLOCK_C=16, BLOCK_H=16)
    assert torch.equal(state, before)
    assert_close(o[:, :I], proj[:, :I], name="z rows")
    assert_close(o[:, I + CD:], proj[:, I + CD:], name="dt rows")
    assert_close(o[:, I:I + CD], xc_ref, name="conv rows")
    assert_close(s_out, state_ref, name="conv state")
    with pytest.raises(ValueError, match="conv rows"):
        proj_conv(x, w, None, state, conv_w, conv_b, conv_start=NR - CD + 1)


@pytest.mark.parametrize("dtype,stream", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("masked", [False, True])
def test_proj_conv_with_the_block_norm_in_front(dtype, stream, masked):
    """A residual block's RMSNorm fused into in_proj: the same as HF's MambaRMSNorm(x.to(norm dtype)) followed by
    the unfused proj_conv, with x the fp32 residual stream (residual_in_fp32, every block after the first) or in
    the activation dtype (the first block)."""
    from transformers.models.mamba.modeling_mamba import MambaRMSNorm

    H, I, K, N, R = 40, 48, 4, 8, 3
    w = _weights(H, I, K, N, R, dtype, seed=11, bias=False)
    x = (torch.randn(2, H, generator=torch.Generator().manual_seed(3)) * 3).to(stream)
    norm = MambaRMSNorm(H, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(H, generator=torch.Generator().manual_seed(4)))
        xn = norm(x.to(dtype))
    mask = torch.tensor([[1], [0]]) if masked else None
    o_ref, s_ref = proj_conv(xn, w["in_w"], None, w["conv_state"], w["conv_w"], w["conv_b"], mask, BLOCK_C=16,
                             BLOCK_H=16)
    o, s_out = proj_conv(x, w["in_w"], None, w["conv_state"], w["conv_w"], w["conv_b"], mask, BLOCK_C=16,
                         BLOCK_H=16, norm_w=norm.weight.detach(), norm_eps=1e-5)
    assert o.dtype == dtype
    assert_close(o, o_ref, name="in_proj of the normed x, conv rows")
    assert_close(s_out, s_ref, name="conv state")
    with pytest.raises(ValueError, match="norm_w"):
        proj_conv(x, w["in_w"], None, w["conv_state"], w["conv_w"], w["conv_b"], norm_w=norm.weight[:-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_gated_norm_linear_is_hf_gated_norm_then_out_proj(dtype, with_residual):
    """Mamba2's decode tail in one launch: out_proj(MambaRMSNormGated(y, z)) (+ the block's fp32 residual), with z a
    view into in_proj's output as the template passes it."""
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    g = torch.Generator().manual_seed(8)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    M, Kd, Nd = 2, 80, 40
    y = r(M, Kd).to(dtype)
    proj = r(M, 3 * Kd).to(dtype)
    z = proj[:, :Kd]  # row stride 3K
    norm = MambaRMSNormGated(Kd, eps=1e-6).to(dtype)
    w, b = (r(Nd, Kd) / Kd**0.5).to(dtype), r(Nd).to(dtype)
    res = r(M, Nd) * 4 if with_residual else None
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * r(Kd))
        ref = F.linear(norm(y, z).float(), w.float(), b.float()).to(dtype)
    if res is not None:
        ref = res + ref.float()
    out = gated_norm_linear(y, z, norm.weight.detach(), 1e-6, w, b, res, GEMV_BLOCK_N=16, GEMV_BLOCK_K=32,
                            num_warps=4)
    assert out.dtype == ref.dtype and out.shape == (M, Nd)
    assert_close(out, ref, dtype, name="gated norm + out_proj")
    with pytest.raises(ValueError, match="gated_norm_linear"):
        gated_norm_linear(y, z[:, :-1], norm.weight.detach(), 1e-6, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,I,K,N,R", [(48, 96, 4, 16, 3), (33, 40, 4, 12, 5)])
def test_fused_decode_in_place_updates_the_states_it_reads(dtype, H, I, K, N, R):
    """inplace=True: the returned states are the very tensors passed in, holding what the out-of-place call
    returns (bit for bit: the same arithmetic), and nothing else changed."""
    w = _weights(H, I, K, N, R, dtype, seed=3 * H + I, bias=True)
    mask = torch.tensor([[1], [0]], dtype=torch.long)
    xc_o, z_o, cs_o = mamba_in_proj_conv(w["x"], w["in_w"], w["in_b"], w["conv_state"], w["conv_w"], w["conv_b"],
                                         mask, BLOCK_C=16, BLOCK_H=16)
    p = torch.randn(2, R + 2 * N, generator=torch.Generator().manual_seed(1)).to(dtype)
    y_o, ss_o = mamba_dt_state_update(p, w["dt_w"], w["dt_b"], w["A_log"], w["D"], xc_o, z_o, w["ssm_state"],
                                      BLOCK_D=16)
    before = {k: v.clone() for k, v in w.items() if isinstance(v, torch.Tensor)}
    conv_state, ssm_state = w["conv_state"], w["ssm_state"]
    xc, z, cs = mamba_in_proj_conv(w["x"], w["in_w"], w["in_b"], conv_state, w["conv_w"], w["conv_b"], mask,
                                   BLOCK_C=16, BLOCK_H=16, inplace=True)
    y, ss = mamba_dt_state_update(p, w["dt_w"], w["dt_b"], w["A_log"], w["D"], xc, z, ssm_state, BLOCK_D=16,
                                  inplace=True)
    assert cs is conv_state and ss is ssm_state
    assert torch.equal(cs, cs_o) and torch.equal(ss, ss_o)
    assert torch.equal(xc, xc_o) and torch.equal(z, z_o) and torch.equal(y, y_o)
    assert not torch.equal(conv_state, before["conv_state"]) and not torch.equal(ssm_state, before["ssm_state"])
    for k, v in before.items():
        if k not in ("conv_state", "ssm_state"):
            assert torch.equal(w[k], v), k


def test_in_place_needs_a_contiguous_state():
    """A non-contiguous state would be updated in a copy and the update lost: refused."""
    w = _weights(16, 8, 4, 4, 2, torch.float32, 0, False)
    cs = w["conv_state"].transpose(1, 2).contiguous().transpose(1, 2)  # [2, 8, 4] with permuted strides
    with pytest.raises(ValueError, match="contiguous conv_state"):
        mamba_in_proj_conv(w["x"], w["in_w"], None, cs, w["conv_w"], None, inplace=True)
    ss = w["ssm_state"].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous ssm_state"):
        mamba_dt_state_update(torch.zeros(2, 10), w["dt_w"], w["dt_b"], w["A_log"], w["D"], torch.zeros(2, 8),
                              torch.zeros(2, 8), ss, inplace=True)


@pytest.mark.gpu
@pytest.mark.parametrize("H,I,N,R", [(768, 1536, 16, 48)])  # mamba-130m's mixer
def test_in_place_on_cuda_matches_out_of_place_at_real_sizes(H, I, N, R):
    """On the GPU the in-place kernels (a barrier between the state loads and stores) give bit for bit what the
    out-of-place ones give, at mamba-130m's sizes in bf16, over several chained steps; and Mamba2's proj_conv at
    mamba2-2.7b's in_proj rows likewise."""
    w = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
         for k, v in _weights(H, I, 4, N, R, torch.bfloat16, seed=5, bias=False).items()}
    cs_o, ss_o = w["conv_state"].clone(), w["ssm_state"].clone()
    cs_i, ss_i = w["conv_state"].clone(), w["ssm_state"].clone()
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(4):
        x = torch.randn(2, H, device="cuda", generator=g).to(torch.bfloat16)
        p = torch.randn(2, R + 2 * N, device="cuda", generator=g).to(torch.bfloat16)
        xc_o, z_o, cs_o = mamba_in_proj_conv(x, w["in_w"], None, cs_o, w["conv_w"], w["conv_b"], BLOCK_C=16,
                                             BLOCK_H=128, num_warps=8)
        y_o, ss_o = mamba_dt_state_update(p, w["dt_w"], w["dt_b"], w["A_log"], w["D"], xc_o, z_o, ss_o, BLOCK_D=64,
                                          num_warps=1)
        xc_i, z_i, _ = mamba_in_proj_conv(x, w["in_w"], None, cs_i, w["conv_w"], w["conv_b"], BLOCK_C=16,
                                          BLOCK_H=128, num_warps=8, inplace=True)
        y_i, _ = mamba_dt_state_update(p, w["dt_w"], w["dt_b"], w["A_log"], w["D"], xc_i, z_i, ss_i, BLOCK_D=64,
                                       num_warps=1, inplace=True)
        assert torch.equal(xc_i, xc_o) and torch.equal(y_i, y_o)
        assert torch.equal(cs_i, cs_o) and torch.equal(ss_i, ss_o)
    # Mamba2: rows [z | xBC | dt] = [5120 | 5376 | 80] of hidden 2560, the conv on xBC
    Hd, I2, CD, NH = 2560, 5120, 5376, 80
    xw = (torch.randn(I2 + CD + NH, Hd, device="cuda", generator=g) / Hd**0.5).to(torch.bfloat16)
    cw, cb = (torch.randn(CD, 4, device="cuda", generator=g) / 2).to(torch.bfloat16), None
    st_o = torch.randn(1, CD, 4, device="cuda", generator=g).to(torch.bfloat16)
    st_i = st_o.clone()
    for _ in range(3):
        x = torch.randn(1, Hd, device="cuda", generator=g).to(torch.bfloat16)
        o_o, st_o = proj_conv(x, xw, None, st_o, cw, cb, conv_start=I2, BLOCK_C=16, BLOCK_H=128, num_warps=8)
        o_i, st_back = proj_conv(x, xw, None, st_i, cw, cb, conv_start=I2, BLOCK_C=16, BLOCK_H=128, num_warps=8,
                                 inplace=True)
        assert st_back is st_i and torch.equal(o_i, o_o) and torch.equal(st_i, st_o)


@pytest.mark.gpu
@pytest.mark.parametrize("H,NR,CD,C0", [(768, 3072, 1536, 0), (2560, 10576, 5376, 5120)])  # mamba-130m, mamba2-2.7b
def test_proj_conv_with_the_block_norm_on_cuda(H, NR, CD, C0):
    """The block norm fused into in_proj on the GPU at the real widths, from the fp32 residual stream: as the norm
    (HF's MambaRMSNorm of x.to(bf16)) followed by the unfused proj_conv."""
    from transformers.models.mamba.modeling_mamba import MambaRMSNorm

    g = torch.Generator(device="cuda").manual_seed(H)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    x = r(1, H) * 3
    w = (r(NR, H) / H**0.5).to(torch.bfloat16)
    conv_w, conv_b, state = (r(CD, 4) / 2).to(torch.bfloat16), r(CD).to(torch.bfloat16), r(1, CD, 4).to(torch.bfloat16)
    norm = MambaRMSNorm(H, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * r(H))
        xn = norm(x.to(torch.bfloat16))
    o_ref, s_ref = proj_conv(xn, w, None, state, conv_w, conv_b, conv_start=C0, BLOCK_C=16, BLOCK_H=128, num_warps=8)
    o, s_out = proj_conv(x, w, None, state, conv_w, conv_b, conv_start=C0, BLOCK_C=16, BLOCK_H=128, num_warps=8,
                         norm_w=norm.weight.detach(), norm_eps=1e-5)
    assert_close(o, o_ref, name="in_proj of the normed x")
    assert_close(s_out, s_ref, name="conv state")


@pytest.mark.gpu
def test_gated_norm_linear_on_cuda_at_mamba2_sizes():
    """Mamba2-2.7b's decode tail (I 5120 -> H 2560, bf16, the block's fp32 residual) on the GPU, against HF's gated
    norm followed by out_proj."""
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    y, proj = r(1, 5120).to(torch.bfloat16), r(1, 10576).to(torch.bfloat16)
    z = proj[:, :5120]
    norm = MambaRMSNormGated(5120, eps=1e-5).to("cuda", torch.bfloat16)
    w = (r(2560, 5120) / 5120**0.5).to(torch.bfloat16)
    res = r(1, 2560) * 4
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * r(5120))
        ref = res + F.linear(norm(y, z).float(), w.float()).to(torch.bfloat16).float()
    out = gated_norm_linear(y, z, norm.weight.detach(), 1e-5, w, None, res, GEMV_BLOCK_N=16, GEMV_BLOCK_K=128)
    assert_close(out, ref, torch.bfloat16, name="gated norm + out_proj + residual")
