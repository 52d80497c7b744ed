"""Mamba (v1) selective scan: the prefill scan over a sequence and the one-token decode state update.

Semantics are HF `MambaMixer`'s torch path (`mamba_selective_scan`, `mamba_selective_state_update` in
transformers 5.17): dt = softplus(delta + delta_bias); h_t = exp(dt A) h_{t-1} + dt B_t u_t; y_t = C_t h_t
(+ D u_t) (* silu(z_t)). The kernels keep h in fp32 registers and run one program per (batch, channel block),
sequential over L. The D skip and the z gate are optional fused epilogues (pass `D`/`z` or None), so a
mixer-level replacement can absorb them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_runtime.ops._common import _TL, cast_out, dt_bias_softplus, interpreting, rnd

# Config space for the searcher. Neither kernel is autotuned: the decode update writes the SSM state in place
# (tuning launches would advance it several times); the prefill's knobs are the channel block (parallelism vs.
# per-program work), the warp count and the chunk of steps loaded and scanned at once (0: one step at a time).
SELECTIVE_SCAN_CONFIGS: list[dict] = [{"BLOCK_D": bd, "num_warps": w, "BLOCK_T": bt} for bd in (8, 16, 32, 64)
                                      for w in (1, 2, 4) for bt in (0, 8, 16, 32) if bt * bd <= 512]
SELECTIVE_STATE_UPDATE_CONFIGS: list[dict] = [{"BLOCK_D": bd, "num_warps": w} for bd in (16, 32, 64) for w in (1, 2, 4)]


@triton.jit
def _scan_combine(a1, b1, a2, b2):
    # (h -> a1 h + b1) then (h -> a2 h + b2) = (h -> a1 a2 h + (a2 b1 + b2)): the recurrence as an associative op
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _selective_scan_kernel(
    # Pointers
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, h0_ptr, y_ptr, hT_ptr,
    # Matrix dimensions
    D, L, N,
    # Strides
    stride_ub, stride_ud, stride_ul,
    stride_dtb, stride_dtd, stride_dtl,
    stride_ad, stride_an,
    stride_bb, stride_bn, stride_bl,
    stride_cb, stride_cn, stride_cl,
    stride_zb, stride_zd, stride_zl,
    stride_yb, stride_yd, stride_yl,
    stride_hb, stride_hd, stride_hn,
    # Meta-parameters
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, DT_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, Z_DTYPE: tl.constexpr, RNE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, A_IS_LOG: tl.constexpr = False,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < D
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + offs_d[:, None] * stride_ad + offs_n[None, :] * stride_an, mask=mask_dn, other=0.0).to(tl.float32)
    if A_IS_LOG:  # A = -exp(A_log) here, in fp32 as HF computes it, instead of a launch of its own
        A = -tl.exp(A)
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + offs_d, mask=mask_d & HAS_DT_BIAS, other=0.0).to(tl.float32)
    h_offs = pid_b * stride_hb + offs_d[:, None] * stride_hd + offs_n[None, :] * stride_hn
    if HAS_H0:
        h = tl.load(h0_ptr + h_offs, mask=mask_dn, other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_N]
    else:
        h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    u_base = u_ptr + pid_b * stride_ub + offs_d * stride_ud
    dt_base = dt_ptr + pid_b * stride_dtb + offs_d * stride_dtd
    z_base = z_ptr + pid_b * stride_zb + offs_d * stride_zd
    y_base = y_ptr + pid_b * stride_yb + offs_d * stride_yd
    b_base = B_ptr + pid_b * stride_bb + offs_n * stride_bn
    c_base = C_ptr + pid_b * stride_cb + offs_n * stride_cn
    if BLOCK_T == 0:  # one step at a time: a load round trip per step
        for t in range(L):
            u = tl.load(u_base + t * stride_ul, mask=mask_d, other=0.0).to(tl.float32)  # [BLOCK_D]
            dt = tl.load(dt_base + t * stride_dtl, mask=mask_d, other=0.0).to(tl.float32)
            dt = dt_bias_softplus(dt, dt_bias, HAS_DT_BIAS, DT_SOFTPLUS, DT_DTYPE)
            Bt = tl.load(b_base + t * stride_bl, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
            Ct = tl.load(c_base + t * stride_cl, mask=mask_n, other=0.0).to(tl.float32)
            h = tl.exp(dt[:, None] * A) * h + (dt[:, None] * Bt[None, :]) * u[:, None]  # HF: (dt B) u
            # HF contracts the state cast to u's dtype with C, in u's dtype
            y = rnd(tl.sum(rnd(h, Y_DTYPE) * Ct[None, :], axis=1), Y_DTYPE)
            if HAS_D:
                y += u * Dv
            if HAS_Z:
                z = tl.load(z_base + t * stride_zl, mask=mask_d, other=0.0).to(tl.float32)
                y = y * rnd(z * tl.sigmoid(z), Z_DTYPE)
            tl.store(y_base + t * stride_yl, cast_out(y, y_ptr.dtype.element_ty, RNE), mask=mask_d)
    else:  # chunks of BLOCK_T steps: each [BLOCK_T, BLOCK_D] / [BLOCK_T, N] tile loaded at once, the recurrence
        # inside the chunk by an associative scan over (exp(dt A), dt B u), carried between chunks by the state of
        # the chunk's last valid step. Same roundings as above; the fp32 state differs by summation order only.
        offs_t = tl.arange(0, BLOCK_T)
        for t0 in range(0, L, BLOCK_T):
            t = t0 + offs_t
            mask_t = t < L
            m_td = mask_t[:, None] & mask_d[None, :]
            m_tn = mask_t[:, None] & mask_n[None, :]
            u = tl.load(u_base[None, :] + t[:, None] * stride_ul, mask=m_td, other=0.0).to(tl.float32)  # [T, D]
            dt = tl.load(dt_base[None, :] + t[:, None] * stride_dtl, mask=m_td, other=0.0).to(tl.float32)
            dt = dt_bias_softplus(dt, dt_bias[None, :], HAS_DT_BIAS, DT_SOFTPLUS, DT_DTYPE)
            Bt = tl.load(b_base[None, :] + t[:, None] * stride_bl, mask=m_tn, other=0.0).to(tl.float32)  # [T, N]
            Ct = tl.load(c_base[None, :] + t[:, None] * stride_cl, mask=m_tn, other=0.0).to(tl.float32)
            a = tl.exp(dt[:, :, None] * A[None, :, :])  # [T, D, N]
            b = (dt[:, :, None] * Bt[:, None, :]) * u[:, :, None]  # HF: (dt B) u
            ca, cb = tl.associative_scan((a, b), 0, _scan_combine)
            hs = ca * h[None, :, :] + cb  # the state after each step of the chunk
            y = rnd(tl.sum(rnd(hs, Y_DTYPE) * Ct[:, None, :], axis=2), Y_DTYPE)  # [T, D]
            if HAS_D:
                y += u * Dv[None, :]
            if HAS_Z:
                z = tl.load(z_base[None, :] + t[:, None] * stride_zl, mask=m_td, other=0.0).to(tl.float32)
                y = y * rnd(z * tl.sigmoid(z), Z_DTYPE)
            tl.store(y_base[None, :] + t[:, None] * stride_yl, cast_out(y, y_ptr.dtype.element_ty, RNE), mask=m_td)
            last = tl.minimum(L - t0, BLOCK_T) - 1  # padded steps past L decay the state: carry the last valid one
            h = tl.sum(tl.where((offs_t == last)[:, None, None], hs, 0.0), axis=0)
    tl.store(hT_ptr + h_offs, h.to(hT_ptr.dtype.element_ty), mask=mask_dn)


@triton.jit
def _selective_state_update_kernel(
    # Pointers
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr,
    # Matrix dimensions
    D, N,
    # Strides
    stride_sb, stride_sd, stride_sn,
    stride_xb, stride_xd,
    stride_dtb, stride_dtd,
    stride_ad, stride_an,
    stride_bb, stride_bn,
    stride_cb, stride_cn,
    stride_zb, stride_zd,
    stride_yb, stride_yd,
    # Meta-parameters
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    DT_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, SKIP_DTYPE: tl.constexpr, Z_DTYPE: tl.constexpr,
    RNE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < D
    mask_dn = mask_d[:, None] & (offs_n[None, :] < N)
    s_ptrs = state_ptr + pid_b * stride_sb + offs_d[:, None] * stride_sd + offs_n[None, :] * stride_sn
    h = tl.load(s_ptrs, mask=mask_dn, other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_N]
    x = tl.load(x_ptr + pid_b * stride_xb + offs_d * stride_xd, mask=mask_d, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + pid_b * stride_dtb + offs_d * stride_dtd, mask=mask_d, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + offs_d, mask=mask_d & HAS_DT_BIAS, other=0.0).to(tl.float32)
    dt = dt_bias_softplus(dt, dt_bias, HAS_DT_BIAS, DT_SOFTPLUS, DT_DTYPE)
    A = tl.load(A_ptr + offs_d[:, None] * stride_ad + offs_n[None, :] * stride_an, mask=mask_dn, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + pid_b * stride_bb + offs_n * stride_bn, mask=offs_n < N, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + pid_b * stride_cb + offs_n * stride_cn, mask=offs_n < N, other=0.0).to(tl.float32)
    h = tl.exp(dt[:, None] * A) * h + (dt[:, None] * Bv[None, :]) * x[:, None]  # HF: (dt B) x
    tl.store(s_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask_dn)
    # HF: (h in C's dtype) @ C, then the skip and the gate in the promoted dtypes of their operands
    y = rnd(tl.sum(rnd(h, Y_DTYPE) * Cv[None, :], axis=1), Y_DTYPE)
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        y = rnd(y + rnd(x * Dv, SKIP_DTYPE), SKIP_DTYPE)
    if HAS_Z:
        z = tl.load(z_ptr + pid_b * stride_zb + offs_d * stride_zd, mask=mask_d, other=0.0).to(tl.float32)
        y = y * rnd(z * tl.sigmoid(z), Z_DTYPE)
    tl.store(y_ptr + pid_b * stride_yb + offs_d * stride_yd, cast_out(y, y_ptr.dtype.element_ty, RNE),
             mask=mask_d)


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=True, initial_state=None):
    """u, delta, z: [B, D, L]; A: [D, N] (= -exp(A_log), fp32); B, C: [B, N, L]; D, delta_bias: [D]
    -> (y [B, D, L] in u.dtype, final state [B, D, N] fp32).

    HF `mamba_selective_scan`'s sequential path, op for op (delta + bias and softplus in delta's dtype, the
    discretisation and the state in fp32, the state cast to u's dtype before the C contraction), with an
    optional initial state (HF always starts from zero)."""
    Bsz, Dd, L = u.shape
    dtype = u.dtype
    dt = delta
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    Bt, Ct = B.transpose(1, 2), C.transpose(1, 2)  # [B, L, N]
    dA = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [B, D, L, N]
    dBu = dt[:, :, :, None] * Bt[:, None, :, :].float() * u[:, :, :, None].float()
    h = torch.zeros(Bsz, Dd, A.shape[-1], dtype=torch.float32, device=u.device)
    if initial_state is not None:
        h = initial_state.float().clone()
    ys = []
    for t in range(L):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.matmul(h.to(dtype), Ct[:, t, :, None].to(dtype))[:, :, 0])
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + u * D.float()[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y.to(dtype), h


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True):
    """state: [B, D, N] (updated in place); x, dt, z: [B, D]; A: [D, N]; B, C: [B, N]; D, dt_bias: [D] -> y [B, D].

    HF `mamba_selective_state_update`, op for op."""
    dtype = x.dtype
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dA = torch.exp(dt.float()[..., None] * A.float())
    dBx = dt.float()[..., None] * B.float()[:, None, :] * x.float()[..., None]
    h = state.float() * dA + dBx
    state.copy_(h.to(state.dtype))
    y = torch.matmul(h.to(C.dtype), C.unsqueeze(-1)).squeeze(-1)
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z)
    return y.to(dtype)


def _check_ssm(name, A, Dd, N, **vecs):
    if tuple(A.shape) != (Dd, N):
        raise ValueError(f"{name}: expected A [{Dd}, {N}], got {tuple(A.shape)}")
    for k, v in vecs.items():
        if v is not None and tuple(v.shape) != (Dd,):
            raise ValueError(f"{name}: expected {k} [{Dd}], got {tuple(v.shape)}")


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=True, initial_state=None,
                   *, BLOCK_D=16, num_warps=2, BLOCK_T=0, A_is_log=False):
    """u, delta, z: [B, D, L]; A: [D, N]; B, C: [B, N, L]; D, delta_bias: [D]; initial_state: [B, D, N] or None
    -> (y [B, D, L] in u.dtype, final state [B, D, N] fp32). Any strides (HF passes transposed views).

    BLOCK_T = 0: one step at a time (a load round trip per step); a power of two >= 2: chunks of BLOCK_T steps,
    each loaded as one tile and scanned associatively (fewer, wider loads; BLOCK_T * BLOCK_D * N fp32 per program).
    A_is_log: A is Mamba's A_log, and A = -exp(A_log) is taken in the kernel. D and delta_bias may be in any float
    dtype (read as fp32)."""
    if BLOCK_T and (BLOCK_T < 2 or BLOCK_T & (BLOCK_T - 1)):
        raise ValueError(f"selective_scan: expected BLOCK_T 0 or a power of two >= 2, got {BLOCK_T}")
    if u.dim() != 3:
        raise ValueError(f"selective_scan: expected u [B, D, L], got {tuple(u.shape)}")
    Bsz, Dd, L = u.shape
    N = A.shape[-1]
    _check_ssm("selective_scan", A, Dd, N, D=D, delta_bias=delta_bias)
    for k, v, exp in (("delta", delta, (Bsz, Dd, L)), ("B", B, (Bsz, N, L)), ("C", C, (Bsz, N, L)),
                      ("z", z, (Bsz, Dd, L)), ("initial_state", initial_state, (Bsz, Dd, N))):
        if v is not None and tuple(v.shape) != exp:
            raise ValueError(f"selective_scan: expected {k} {list(exp)}, got {tuple(v.shape)}")
    y = torch.empty((Bsz, Dd, L), device=u.device, dtype=u.dtype)
    hT = torch.empty((Bsz, Dd, N), device=u.device, dtype=torch.float32)
    zz = z if z is not None else u
    h0 = initial_state if initial_state is not None else hT
    grid = (Bsz, triton.cdiv(Dd, BLOCK_D))
    _selective_scan_kernel[grid](
        u, delta, A, B, C, D if D is not None else A, zz, delta_bias if delta_bias is not None else A, h0, y, hT,
        Dd, L, N,
        *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(), *zz.stride(), *y.stride(), *hT.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=delta_bias is not None, DT_SOFTPLUS=delta_softplus,
        HAS_H0=initial_state is not None, DT_DTYPE=_TL[delta.dtype], Y_DTYPE=_TL[u.dtype],
        Z_DTYPE=_TL[zz.dtype], RNE=interpreting(), BLOCK_D=BLOCK_D, BLOCK_N=triton.next_power_of_2(N),
        BLOCK_T=BLOCK_T, A_IS_LOG=A_is_log, num_warps=num_warps,
    )
    return y, hT


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                           *, BLOCK_D=32, num_warps=2):
    """state: [B, D, N] updated in place; x, dt, z: [B, D]; A: [D, N]; B, C: [B, N]; D, dt_bias: [D] -> y [B, D].

    Not autotuned: it advances `state` in place, so tuning launches would corrupt it."""
    if state.dim() != 3:
        raise ValueError(f"selective_state_update: expected state [B, D, N], got {tuple(state.shape)}")
    Bsz, Dd, N = state.shape
    _check_ssm("selective_state_update", A, Dd, N, D=D, dt_bias=dt_bias)
    for k, v, exp in (("x", x, (Bsz, Dd)), ("dt", dt, (Bsz, Dd)), ("B", B, (Bsz, N)), ("C", C, (Bsz, N)),
                      ("z", z, (Bsz, Dd))):
        if v is not None and tuple(v.shape) != exp:
            raise ValueError(f"selective_state_update: expected {k} {list(exp)}, got {tuple(v.shape)}")
    y = torch.empty((Bsz, Dd), device=x.device, dtype=x.dtype)
    zz = z if z is not None else x
    skip = torch.promote_types(x.dtype, D.dtype) if D is not None else x.dtype
    grid = (Bsz, triton.cdiv(Dd, BLOCK_D))
    _selective_state_update_kernel[grid](
        state, x, dt, A, B, C, D if D is not None else A, zz, dt_bias if dt_bias is not None else A, y,
        Dd, N,
        *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *zz.stride(), *y.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        DT_DTYPE=_TL[dt.dtype], Y_DTYPE=_TL[C.dtype], SKIP_DTYPE=_TL[skip], Z_DTYPE=_TL[zz.dtype], RNE=interpreting(),
        BLOCK_D=BLOCK_D, BLOCK_N=triton.next_power_of_2(N), num_warps=num_warps,
    )
    return y
