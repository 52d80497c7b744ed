"""Mamba (v1) mixer decode step in four launches: (in_proj + conv update + SiLU), x_proj, (dt_proj + softplus +
selective state update + D skip + silu(z) gate), out_proj.

Why: a decode step is host-bound, so launches are what it costs. HF's torch path issues ~30 ops per mixer, the
unfused Triton composition ~7 Triton launches plus copies, each costing the host more than its GPU work.
These two kernels fuse what needs no grid-wide dependency: the conv update of channel c only needs in_proj's row c,
and dt_proj's row c only feeds channel c's state update. x_proj and out_proj reduce over all channels, so they stay
separate (`kernels_runtime.ops.linear`).

Both kernels write the new state either to a fresh buffer (out of place; whoever owns the cache then copies it
back: kernels_runtime's state write-back, one launch per state) or, with inplace=True, over the state they read (the
state must be contiguous): then the cache is updated by the kernel itself and nothing is copied, two launches fewer
per Mamba layer and decode step. In place, every program reads and writes only its own channels' state, and a
barrier separates its last state load from its first state store (the conv window shifts across threads).

Semantics and rounding are those of `causal_conv1d_update` and `selective_state_update` in this package (HF's torch
path, transformers 5.17): in_proj and dt_proj outputs rounded to the activation dtype as nn.Linear's are, the conv
result rounded to the weight dtype before the SiLU, dt + bias and softplus in dt's dtype, the state in C's dtype
before the C contraction. Not autotuned: tune the block sizes by hand (the searcher's space); a decode step is one
call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_runtime.ops._common import _TL, cast_out, dt_bias_softplus, gemv_store, interpreting, rnd


@triton.jit
def _proj_conv_kernel(
    x_ptr, m_ptr, w_ptr, b_ptr, s_ptr, cw_ptr, cb_ptr, o_ptr, s_out_ptr, nw_ptr, eps,
    H, NR, C0, CD, S,
    stride_xb, stride_mb, stride_wn, stride_sb, stride_sc, stride_ss, stride_cwc, stride_ob,
    K: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr, ACT_DTYPE: tl.constexpr, RNE: tl.constexpr, INPLACE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # o[b, r] = in_proj row r of x (of rmsnorm(x) with HAS_NORM); rows C0 <= r < C0 + CD (the conv channels
    # c = r - C0) get the conv update, the SiLU and the mask instead, and their new conv state goes to s_out
    pid_b = tl.program_id(0).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_r = offs_r < NR
    m = 1.0
    if HAS_MASK:
        m = tl.load(m_ptr + pid_b * stride_mb).to(tl.float32)
    rstd = 1.0
    if HAS_NORM:  # every program reads the whole row anyway: its sum of squares first (HF: x cast to the norm's
        # dtype, then mean(x^2) in fp32)
        ss = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            xv = rnd(tl.load(x_ptr + pid_b * stride_xb + offs_h, mask=offs_h < H, other=0.0).to(tl.float32),
                     ACT_DTYPE)
            ss += xv * xv
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / H + eps)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        xv = tl.load(x_ptr + pid_b * stride_xb + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        if HAS_NORM:  # HF's RMSNorm: weight * (x * rstd).to(dtype), in the norm's dtype
            nw = tl.load(nw_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            xv = rnd(nw * rnd(rnd(xv, ACT_DTYPE) * rstd, ACT_DTYPE), ACT_DTYPE)
        xv = rnd(xv * m, ACT_DTYPE)  # HF masks the hidden states in their dtype before in_proj (exact for 0/1)
        w = tl.load(w_ptr + offs_r[:, None] * stride_wn + offs_h[None, :], mask=mask_r[:, None] & mask_h[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * xv[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    raw = rnd(acc, ACT_DTYPE)  # nn.Linear's output dtype
    offs_c = offs_r - C0
    is_conv = mask_r & (offs_r >= C0) & (offs_c < CD)
    c_safe = tl.where(is_conv, offs_c, 0)
    s_base = s_ptr + pid_b * stride_sb + c_safe[:, None] * stride_sc
    offs_k = tl.arange(0, BLOCK_K)
    idx = S + 1 - K + offs_k
    mk = is_conv[:, None] & (offs_k[None, :] < K) & (idx[None, :] < S)
    win = tl.load(s_base + idx[None, :] * stride_ss, mask=mk, other=0.0).to(tl.float32)
    xs_state = rnd(raw, s_ptr.dtype.element_ty)  # the state holds in_proj's output in the state's dtype
    win = tl.where(idx[None, :] == S, xs_state[:, None], win)
    cw = tl.load(cw_ptr + c_safe[:, None] * stride_cwc + offs_k[None, :],
                 mask=is_conv[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
    conv = tl.sum(win * cw, axis=1)
    if HAS_CONV_BIAS:
        conv += tl.load(cb_ptr + c_safe, mask=is_conv, other=0.0).to(tl.float32)
    conv = rnd(conv, cw_ptr.dtype.element_ty)  # HF convolves in the weight dtype, then the SiLU
    conv = rnd(conv * tl.sigmoid(conv), ACT_DTYPE) * m  # and masks the conv output again
    out = tl.where(is_conv, conv, raw)
    tl.store(o_ptr + pid_b * stride_ob + offs_r, cast_out(out, o_ptr.dtype.element_ty, RNE), mask=mask_r)
    # new state = old state shifted left by one, in_proj's output appended (a fresh buffer, or s itself)
    offs_s = tl.arange(0, BLOCK_S)
    ms = is_conv[:, None] & (offs_s[None, :] < S)
    shifted = tl.load(s_base + (offs_s[None, :] + 1) * stride_ss, mask=ms & (offs_s[None, :] + 1 < S), other=0.0)
    shifted = tl.where(offs_s[None, :] == S - 1, xs_state[:, None].to(shifted.dtype), shifted)
    if INPLACE:  # s_out is s: every thread's loads of the window before any thread's store (the shift crosses them)
        tl.debug_barrier()
    tl.store(s_out_ptr + pid_b * stride_sb + c_safe[:, None] * stride_sc + offs_s[None, :] * stride_ss, shifted,
             mask=ms)


@triton.jit
def _xproj_rows(xw_ptr, xc_ptr, stride_xw, rows, mask_rows, I, ACT_DTYPE: tl.constexpr, BLOCK_I: tl.constexpr):
    # x_proj's output at `rows` for one token: xw[rows, :] @ xc, rounded to the activation dtype as nn.Linear's
    acc = tl.zeros_like(rows).to(tl.float32)
    for i0 in range(0, I, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask_i = offs_i < I
        xv = tl.load(xc_ptr + offs_i, mask=mask_i, other=0.0).to(tl.float32)
        w = tl.load(xw_ptr + rows[:, None] * stride_xw + offs_i[None, :], mask=mask_rows[:, None] & mask_i[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * xv[None, :], axis=1)
    return rnd(acc, ACT_DTYPE)


@triton.jit
def _dt_state_update_kernel(
    p_ptr, xw_ptr, dtw_ptr, dtb_ptr, alog_ptr, d_ptr, xc_ptr, z_ptr, s_ptr, s_out_ptr, y_ptr,
    I, N, R,
    stride_pb, stride_xw, stride_dtw, stride_ad, stride_ob, stride_sb, stride_sd,
    DT_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, SKIP_DTYPE: tl.constexpr, Z_DTYPE: tl.constexpr,
    RNE: tl.constexpr, INPLACE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_XPROJ: tl.constexpr = False, BLOCK_I: tl.constexpr = 128, HAS_RMS: tl.constexpr = False, rms_eps=1e-6,
):
    # HAS_XPROJ: x_proj's output (dt_low, B, C: R + 2N values, each a reduction over all I channels) computed here
    # by every program from xc and x_proj's weight, instead of by a launch of its own (it is small: R + 2N rows)
    # HAS_RMS: Falcon-Mamba's weightless RMSNorms on dt_low, B and C (each over its own R or N values, in fp32,
    # rounded to the activation dtype), applied as x_proj's output is read: every program reads all of it anyway
    pid_b = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < I
    dt_rstd = 1.0
    if HAS_RMS:  # dt_low's statistics first (R values, in chunks)
        ss = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r < R
            if HAS_XPROJ:
                pv = _xproj_rows(xw_ptr, xc_ptr + pid_b * stride_ob, stride_xw, offs_r, mask_r, I, DT_DTYPE,
                                 BLOCK_I)
            else:
                pv = tl.load(p_ptr + pid_b * stride_pb + offs_r, mask=mask_r, other=0.0).to(tl.float32)
            ss += pv * pv
        dt_rstd = tl.rsqrt(tl.sum(ss, axis=0) / R + rms_eps)
    # dt_proj row d over the first R entries of x_proj's output (no bias: added in fp32 below, as HF's update does)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        if HAS_XPROJ:
            pv = _xproj_rows(xw_ptr, xc_ptr + pid_b * stride_ob, stride_xw, offs_r, mask_r, I, DT_DTYPE, BLOCK_I)
        else:
            pv = tl.load(p_ptr + pid_b * stride_pb + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        if HAS_RMS:
            pv = rnd(pv * dt_rstd, DT_DTYPE)
        w = tl.load(dtw_ptr + offs_d[:, None] * stride_dtw + offs_r[None, :],
                    mask=mask_d[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * pv[None, :], axis=1)
    dt = rnd(acc, DT_DTYPE)  # nn.Linear's output dtype
    dt_bias = tl.load(dtb_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    dt = dt_bias_softplus(dt, dt_bias, True, True, DT_DTYPE)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = -tl.exp(tl.load(alog_ptr + offs_d[:, None] * stride_ad + offs_n[None, :], mask=mask_dn,
                        other=0.0).to(tl.float32))
    if HAS_XPROJ:
        Bv = _xproj_rows(xw_ptr, xc_ptr + pid_b * stride_ob, stride_xw, R + offs_n, mask_n, I, DT_DTYPE, BLOCK_I)
        Cv = _xproj_rows(xw_ptr, xc_ptr + pid_b * stride_ob, stride_xw, R + N + offs_n, mask_n, I, DT_DTYPE, BLOCK_I)
    else:
        Bv = tl.load(p_ptr + pid_b * stride_pb + R + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        Cv = tl.load(p_ptr + pid_b * stride_pb + R + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_RMS:
        Bv = rnd(Bv * tl.rsqrt(tl.sum(Bv * Bv, axis=0) / N + rms_eps), DT_DTYPE)
        Cv = rnd(Cv * tl.rsqrt(tl.sum(Cv * Cv, axis=0) / N + rms_eps), DT_DTYPE)
    x = tl.load(xc_ptr + pid_b * stride_ob + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    s_offs = pid_b * stride_sb + offs_d[:, None] * stride_sd + offs_n[None, :]
    h = tl.load(s_ptr + s_offs, mask=mask_dn, other=0.0).to(tl.float32)
    h = tl.exp(dt[:, None] * A) * h + (dt[:, None] * Bv[None, :]) * x[:, None]  # HF: (dt B) x
    if INPLACE:  # s_out is s: the load above before the store, whatever layout each one uses
        tl.debug_barrier()
    tl.store(s_out_ptr + s_offs, h.to(s_out_ptr.dtype.element_ty), mask=mask_dn)
    y = rnd(tl.sum(rnd(h, Y_DTYPE) * Cv[None, :], axis=1), Y_DTYPE)
    Dv = tl.load(d_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    y = rnd(y + rnd(x * Dv, SKIP_DTYPE), SKIP_DTYPE)
    z = tl.load(z_ptr + pid_b * stride_ob + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    y = y * rnd(z * tl.sigmoid(z), Z_DTYPE)
    tl.store(y_ptr + pid_b * stride_ob + offs_d, cast_out(y, y_ptr.dtype.element_ty, RNE), mask=mask_d)


def _contig(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a unit stride in the last dimension, got strides {tuple(t.stride())}")
    return t


def proj_conv(x, in_proj_w, in_proj_b, conv_state, conv_w, conv_b, mask=None, *, conv_start=0, BLOCK_C=64,
              BLOCK_H=128, num_warps=4, inplace=False, norm_w=None, norm_eps=1e-5):
    """in_proj for one token with the conv update fused on a range of its rows. x: [B, H]; in_proj_w: [NR, H];
    conv_state: [B, CD, S] (S >= K - 1; not modified, or with inplace=True updated in place and returned: it must
    be contiguous); conv_w: [CD, K]; rows conv_start .. conv_start + CD are the conv channels; mask: [B, 1] or None
    -> (o [B, NR]: in_proj's output with the conv rows replaced by masked silu(conv), new conv state [B, CD, S]).
    Mamba: rows [x | z], conv_start 0; Mamba2: [z | xBC | dt], conv_start I.

    norm_w [H] (a residual block's RMSNorm, fused in front): in_proj reads rmsnorm(x.to(norm_w.dtype)) with
    norm_eps, as HF's Mamba/Mamba2 blocks compute it, and o is in norm_w's dtype; x may then be the fp32 residual
    stream."""
    if x.dim() != 2 or in_proj_w.dim() != 2 or in_proj_w.shape[1] != x.shape[1]:
        raise ValueError(f"proj_conv: expected x [B, H] and in_proj_w [NR, H], got {tuple(x.shape)}, "
                         f"{tuple(in_proj_w.shape)}")
    Bsz, H = x.shape
    NR = in_proj_w.shape[0]
    if conv_w.dim() != 2:
        raise ValueError(f"proj_conv: expected conv_w [CD, K], got {tuple(conv_w.shape)}")
    CD, K = conv_w.shape
    if not 0 <= conv_start <= NR - CD:
        raise ValueError(f"proj_conv: expected the conv rows [{conv_start}, {conv_start + CD}) inside [0, {NR})")
    if conv_state.dim() != 3 or tuple(conv_state.shape[:2]) != (Bsz, CD) or conv_state.shape[2] < K - 1:
        raise ValueError(f"proj_conv: expected conv_state [{Bsz}, {CD}, >= {K - 1}], got {tuple(conv_state.shape)}")
    if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (Bsz, 1)):
        raise ValueError(f"proj_conv: expected mask [{Bsz}, 1], got {tuple(mask.shape)}")
    if norm_w is not None and tuple(norm_w.shape) != (H,):
        raise ValueError(f"proj_conv: expected norm_w [{H}], got {tuple(norm_w.shape)}")
    for name, t in (("x", x), ("in_proj_w", in_proj_w), ("conv_w", conv_w)):
        _contig(name, t)
    if inplace and not conv_state.is_contiguous():
        raise ValueError(f"proj_conv: inplace=True needs a contiguous conv_state, got strides {conv_state.stride()}")
    conv_state = conv_state.contiguous()
    S = conv_state.shape[2]
    act = norm_w.dtype if norm_w is not None else x.dtype
    o = torch.empty((Bsz, NR), device=x.device, dtype=act)
    s_out = conv_state if inplace else torch.empty_like(conv_state)
    grid = (Bsz, triton.cdiv(NR, BLOCK_C))
    _proj_conv_kernel[grid](
        x, mask if mask is not None else x, in_proj_w, in_proj_b if in_proj_b is not None else in_proj_w,
        conv_state, conv_w, conv_b if conv_b is not None else conv_w, o, s_out,
        norm_w if norm_w is not None else x, float(norm_eps),
        H, NR, conv_start, CD, S,
        x.stride(0), mask.stride(0) if mask is not None else 0, in_proj_w.stride(0), *conv_state.stride(),
        conv_w.stride(0), o.stride(0),
        K=K, HAS_MASK=mask is not None, HAS_BIAS=in_proj_b is not None, HAS_CONV_BIAS=conv_b is not None,
        HAS_NORM=norm_w is not None, ACT_DTYPE=_TL[act], RNE=interpreting(), INPLACE=inplace,
        BLOCK_C=BLOCK_C, BLOCK_H=BLOCK_H, BLOCK_S=triton.next_power_of_2(S), BLOCK_K=triton.next_power_of_2(K),
        num_warps=num_warps,
    )
    return o, s_out


def mamba_in_proj_conv(x, in_proj_w, in_proj_b, conv_state, conv_w, conv_b, mask=None, *, BLOCK_C=64,
                       BLOCK_H=128, num_warps=4, inplace=False, norm_w=None, norm_eps=1e-5):
    """Mamba's in_proj ([x | z] rows, [2I, H]) with the conv update on the x rows -> (xc [B, I] = masked
    silu(conv), z [B, I] (the gate before its SiLU), new conv state [B, I, S]); conv_state is not modified, or with
    inplace=True updated in place and returned. norm_w: the block's RMSNorm fused in front (see proj_conv)."""
    if in_proj_w.dim() != 2 or in_proj_w.shape[0] % 2 or conv_w.dim() != 2 or \
            conv_w.shape[0] != in_proj_w.shape[0] // 2:
        raise ValueError(f"mamba_in_proj_conv: expected in_proj_w [2I, H] and conv_w [I, K], got "
                         f"{tuple(in_proj_w.shape)}, {tuple(conv_w.shape)}")
    I = conv_w.shape[0]
    o, s_out = proj_conv(x, in_proj_w, in_proj_b, conv_state, conv_w, conv_b, mask, conv_start=0, BLOCK_C=BLOCK_C,
                         BLOCK_H=BLOCK_H, num_warps=num_warps, inplace=inplace, norm_w=norm_w, norm_eps=norm_eps)
    return o[:, :I], o[:, I:], s_out


def mamba_dt_state_update(p, dt_proj_w, dt_proj_b, A_log, D, xc, z, ssm_state, *, BLOCK_D=32, num_warps=2,
                          inplace=False, x_proj_w=None, BLOCK_I=128, rms_eps=None):
    """p: [B, R + 2N] (x_proj's output: dt_low, B, C); dt_proj_w: [I, R]; dt_proj_b, D: [I]; A_log: [I, N];
    xc, z: [B, I]; ssm_state: [B, I, N] (not modified, or with inplace=True updated in place and returned: it must
    be contiguous) -> (y [B, I], new ssm state [B, I, N] in ssm_state's dtype).

    x_proj_w [R + 2N, I] with p=None: x_proj is computed inside this launch (every program reduces the R + 2N rows
    over xc in chunks of BLOCK_I), one launch a layer fewer; its output rounded as nn.Linear's, in xc's dtype.

    rms_eps (Falcon-Mamba, `mixer_rms_eps`): dt_low, B and C each RMS-normalized (no weight) before use, in fp32 and
    rounded to the activation dtype, as `FalconMambaWeightlessRMSNorm` does (see ops/bcdt_rmsnorm.py)."""
    Bsz, I = xc.shape
    N = A_log.shape[1]
    R = dt_proj_w.shape[1]
    if (p is None) == (x_proj_w is None):
        raise ValueError("mamba_dt_state_update: expected exactly one of p and x_proj_w")
    if p is None:
        if tuple(x_proj_w.shape) != (R + 2 * N, I):
            raise ValueError(f"mamba_dt_state_update: expected x_proj_w [R + 2N = {R + 2 * N}, {I}], got "
                             f"{tuple(x_proj_w.shape)}")
        _contig("x_proj_w", x_proj_w)
    elif tuple(p.shape) != (Bsz, R + 2 * N):
        raise ValueError(f"mamba_dt_state_update: expected p [{Bsz}, R + 2N = {R + 2 * N}], got {tuple(p.shape)}")
    if tuple(dt_proj_w.shape) != (I, R) or tuple(A_log.shape) != (I, N):
        raise ValueError(f"mamba_dt_state_update: expected dt_proj_w [{I}, R], A_log [{I}, N], "
                         f"got {tuple(dt_proj_w.shape)}, {tuple(A_log.shape)}")
    if tuple(ssm_state.shape) != (Bsz, I, N) or tuple(z.shape) != (Bsz, I):
        raise ValueError(f"mamba_dt_state_update: expected ssm_state [{Bsz}, {I}, {N}] and z [{Bsz}, {I}], got "
                         f"{tuple(ssm_state.shape)}, {tuple(z.shape)}")
    for name, t in (("p", p if p is not None else xc), ("dt_proj_w", dt_proj_w), ("A_log", A_log)):
        _contig(name, t)
    if inplace and not ssm_state.is_contiguous():
        raise ValueError(f"mamba_dt_state_update: inplace=True needs a contiguous ssm_state, got strides "
                         f"{ssm_state.stride()}")
    xc, z, ssm_state = xc.contiguous(), z.contiguous(), ssm_state.contiguous()
    y = torch.empty((Bsz, I), device=xc.device, dtype=xc.dtype)
    s_out = ssm_state if inplace else torch.empty_like(ssm_state)
    skip = torch.promote_types(xc.dtype, D.dtype)
    grid = (Bsz, triton.cdiv(I, BLOCK_D))
    pp = p if p is not None else xc  # the activation dtype either way (x_proj's output is xc's dtype)
    xw = x_proj_w if x_proj_w is not None else dt_proj_w
    _dt_state_update_kernel[grid](
        pp, xw, dt_proj_w, dt_proj_b, A_log, D, xc, z, ssm_state, s_out, y,
        I, N, R,
        pp.stride(0), xw.stride(0), dt_proj_w.stride(0), A_log.stride(0), xc.stride(0), ssm_state.stride(0),
        ssm_state.stride(1),
        DT_DTYPE=_TL[pp.dtype], Y_DTYPE=_TL[pp.dtype], SKIP_DTYPE=_TL[skip], Z_DTYPE=_TL[z.dtype], RNE=interpreting(),
        INPLACE=inplace, BLOCK_D=BLOCK_D, BLOCK_N=triton.next_power_of_2(N), BLOCK_R=min(64, triton.next_power_of_2(R)),
        HAS_XPROJ=x_proj_w is not None, BLOCK_I=BLOCK_I, HAS_RMS=rms_eps is not None,
        rms_eps=float(rms_eps) if rms_eps is not None else 0.0, num_warps=num_warps,
    )
    return y, s_out


@triton.jit
def _gated_norm_gemv_kernel(
    y_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, r_ptr, o_ptr, eps,
    M, N, K,
    stride_ym, stride_zm, stride_wn, stride_rm, stride_om,
    IN_DTYPE: tl.constexpr, ACT_DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    RNE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # o[row, rn] = (w_norm * rmsnorm(y * silu(z))) @ w.T (+ bias) (+ residual): HF's MambaRMSNormGated feeding
    # out_proj. Every program reads the whole row anyway: its sum of squares first, then the normalized row.
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        y = tl.load(y_ptr + row * stride_ym + kk, mask=kk < K, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * stride_zm + kk, mask=kk < K, other=0.0).to(tl.float32)
        h = y * (z * tl.sigmoid(z))
        ss += h * h
    rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        y = tl.load(y_ptr + row * stride_ym + kk, mask=kk < K, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * stride_zm + kk, mask=kk < K, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        x = rnd(nw * rnd(y * (z * tl.sigmoid(z)) * rstd, IN_DTYPE), ACT_DTYPE)  # the norm's output, rounded
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    # linear's GEMV tail: + bias, out_proj's output rounded to the activation dtype, + the block's residual in fp32
    gemv_store(acc, acc, b_ptr, r_ptr, o_ptr, row, rn, N, stride_rm, stride_om, 1, HAS_BIAS, False, 0, False,
               HAS_RES, ACT_DTYPE, RNE)


def gated_norm_linear(y, z, norm_w, eps, w, bias=None, residual=None, *, out_dtype=None, GEMV_BLOCK_N=16,
                      GEMV_BLOCK_K=128, num_warps=8):
    """Mamba2's decode tail in one launch: out_proj(MambaRMSNormGated(y, gate=z)), optionally + residual (a block's
    add). y, z: [M, K] (unit stride along K; z may be a view of in_proj's output); norm_w: [K]; w: [N, K] ->
    [M, N] in out_dtype (default: the norm's output dtype, out_dtype of _gated_rmsnorm) or, with residual [M, N],
    in promote(that, residual.dtype). Roundings are HF's: y * silu(z) and the statistics in fp32, the normalized
    value in y's dtype, its product with the norm weight in the activation dtype, out_proj's output in it too."""
    if y.dim() != 2 or z.shape != y.shape or w.dim() != 2 or w.shape[1] != y.shape[1] or norm_w.shape != (y.shape[1],):
        raise ValueError(f"gated_norm_linear: expected y, z [M, K], norm_w [K], w [N, K], got {tuple(y.shape)}, "
                         f"{tuple(z.shape)}, {tuple(norm_w.shape)}, {tuple(w.shape)}")
    for name, t in (("y", y), ("z", z), ("w", w)):
        _contig(name, t)
    M, K = y.shape
    N = w.shape[0]
    act = out_dtype or y.dtype
    if residual is not None and tuple(residual.shape) != (M, N):
        raise ValueError(f"gated_norm_linear: expected residual [{M}, {N}], got {tuple(residual.shape)}")
    res = _contig("residual", residual) if residual is not None else None
    o = torch.empty((M, N), device=y.device,
                    dtype=torch.promote_types(act, residual.dtype) if residual is not None else act)
    if M == 0:
        return o
    _gated_norm_gemv_kernel[(M, triton.cdiv(N, GEMV_BLOCK_N))](
        y, z, norm_w, w, bias if bias is not None else w, res if res is not None else o, o, float(eps),
        M, N, K, y.stride(0), z.stride(0), w.stride(0), (res if res is not None else o).stride(0), o.stride(0),
        IN_DTYPE=_TL[y.dtype], ACT_DTYPE=_TL[act], HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        RNE=interpreting(), BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K, num_warps=num_warps,
    )
    return o
