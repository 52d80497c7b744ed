"""Mamba2 SSD (state-space duality) scan: chunked prefill and the one-token decode state update.

Semantics are HF `Mamba2Mixer`'s torch path (`mamba2_chunk_scan`, `mamba2_selective_state_update` in
transformers 5.17), per head h of group g = h // (H / G):
    dt = clamp(softplus(dt + dt_bias), dt_limit);  S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T;  y_t = S_t C_t + D_h x_t
The prefill kernel runs one program per (batch, head, head_dim block), sequential over chunks of BLOCK_T steps; inside
a chunk it uses the quadratic (attention-like) form on tensor cores:
    Y = (C B^T * decay * dt) X + exp(cumsum a) * C S^T,   S <- exp(sum a) S + (X * dt * exp(sum a - cumsum a))^T B
The result does not depend on HF's `chunk_size` (it only changes float rounding), so BLOCK_T is a free config.
The D skip and a `y * silu(z)` gate are optional fused epilogues.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_runtime.ops._common import _TL, rnd, softplus

# Config space for the searcher. Not autotuned: the decode update writes the state in place, and the prefill's best
# tile depends on N and head_dim in ways a searcher should measure (register pressure: S is BLOCK_P x N fp32).
SSD_CONFIGS: list[dict] = [
    {"BLOCK_T": bt, "BLOCK_P": bp, "num_warps": w}
    for bt in (16, 32, 64)
    for bp in (16, 32, 64)
    for w in (4, 8)
]
SSD_STATE_UPDATE_CONFIGS: list[dict] = [{"BLOCK_P": bp, "num_warps": w} for bp in (16, 32, 64) for w in (2, 4, 8)]


@triton.jit
def _ssd_dt(dt, dt_bias, dt_min, dt_max, DT_SOFTPLUS: tl.constexpr, DT_DTYPE: tl.constexpr):
    # HF adds the bias and applies softplus in dt's dtype, then clamps
    dt = rnd(dt + rnd(dt_bias, DT_DTYPE), DT_DTYPE)
    if DT_SOFTPLUS:
        dt = rnd(softplus(dt), DT_DTYPE)
    return tl.minimum(tl.maximum(dt, dt_min), dt_max)


@triton.jit
def _ssd_kernel(
    # Pointers
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, s0_ptr, y_ptr, sT_ptr,
    # Matrix dimensions
    L, H, P, N, HEADS_PER_GROUP, dt_min, dt_max,
    # Strides
    stride_xb, stride_xl, stride_xh, stride_xp,
    stride_dtb, stride_dtl, stride_dth,
    stride_bb, stride_bl, stride_bg, stride_bn,
    stride_cb, stride_cl, stride_cg, stride_cn,
    stride_zb, stride_zl, stride_zh, stride_zp,
    stride_yb, stride_yl, stride_yh, stride_yp,
    stride_sb, stride_sh, stride_sp, stride_sn,
    # Meta-parameters
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_S0: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    DT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, A_IS_LOG: tl.constexpr = False,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_p = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    g = h // HEADS_PER_GROUP
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < P, offs_n < N
    A = tl.load(A_ptr + h).to(tl.float32)
    if A_IS_LOG:  # A = -exp(A_log) in fp32, as HF computes it, instead of a launch of its own
        A = -tl.exp(A)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    s_offs = b * stride_sb + h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn
    if HAS_S0:
        S = tl.load(s0_ptr + s_offs, mask=mask_p[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)  # [BLOCK_P, BLOCK_N]
    Dh = 0.0
    if HAS_D:
        Dh = tl.load(D_ptr + h).to(tl.float32)
    offs_tt = tl.arange(0, BLOCK_T)
    for t0 in range(0, L, BLOCK_T):
        offs_t = t0 + offs_tt
        mask_t = offs_t < L
        dt = tl.load(dt_ptr + b * stride_dtb + offs_t * stride_dtl + h * stride_dth, mask=mask_t, other=0.0)
        dt = tl.where(mask_t, _ssd_dt(dt.to(tl.float32), dt_bias, dt_min, dt_max, DT_SOFTPLUS, DT_DTYPE), 0.0)
        acum = tl.cumsum(dt * A, axis=0)  # [BLOCK_T]; padded steps add 0
        a_tot = tl.sum(dt * A, axis=0)
        mtp = mask_t[:, None] & mask_p[None, :]
        mtn = mask_t[:, None] & mask_n[None, :]
        X = tl.load(x_ptr + b * stride_xb + offs_t[:, None] * stride_xl + h * stride_xh + offs_p[None, :] * stride_xp,
                    mask=mtp, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_P]
        Bc = tl.load(B_ptr + b * stride_bb + offs_t[:, None] * stride_bl + g * stride_bg + offs_n[None, :] * stride_bn,
                     mask=mtn, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_N]
        Cc = tl.load(C_ptr + b * stride_cb + offs_t[:, None] * stride_cl + g * stride_cg + offs_n[None, :] * stride_cn,
                     mask=mtn, other=0.0).to(tl.float32)
        G = tl.dot(Cc, tl.trans(Bc), input_precision=PRECISION)  # [BLOCK_T, BLOCK_T]
        causal = offs_tt[:, None] >= offs_tt[None, :]
        decay = tl.exp(tl.where(causal, acum[:, None] - acum[None, :], float("-inf")))
        M = G * decay * dt[None, :]
        Y = tl.dot(M, X, input_precision=PRECISION)  # [BLOCK_T, BLOCK_P]
        Y += tl.exp(acum)[:, None] * tl.dot(Cc, tl.trans(S), input_precision=PRECISION)
        if HAS_D:
            Y += Dh * X
        if HAS_Z:
            z = tl.load(z_ptr + b * stride_zb + offs_t[:, None] * stride_zl + h * stride_zh + offs_p[None, :] * stride_zp,
                        mask=mtp, other=0.0).to(tl.float32)
            Y = Y * z * tl.sigmoid(z)
        tl.store(y_ptr + b * stride_yb + offs_t[:, None] * stride_yl + h * stride_yh + offs_p[None, :] * stride_yp,
                 Y.to(y_ptr.dtype.element_ty), mask=mtp)
        w = tl.exp(a_tot - acum) * dt  # [BLOCK_T]
        S = tl.exp(a_tot) * S + tl.dot(tl.trans(X * w[:, None]), Bc, input_precision=PRECISION)
    tl.store(sT_ptr + s_offs, S.to(sT_ptr.dtype.element_ty), mask=mask_p[:, None] & mask_n[None, :])


@triton.jit
def _ssd_state_update_kernel(
    # Pointers
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, s_out_ptr,
    # Matrix dimensions
    H, P, N, HEADS_PER_GROUP,
    # Strides
    stride_sb, stride_sh, stride_sp, stride_sn,
    stride_xb, stride_xh, stride_xp,
    stride_dtb, stride_dth,
    stride_bb, stride_bg, stride_bn,
    stride_cb, stride_cg, stride_cn,
    stride_zb, stride_zh, stride_zp,
    stride_yb, stride_yh, stride_yp,
    # Meta-parameters
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, DT_SOFTPLUS: tl.constexpr, A_IS_LOG: tl.constexpr,
    IO_DTYPE: tl.constexpr, SKIP_DTYPE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_p = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    g = h // HEADS_PER_GROUP
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < P, offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    s_ptrs = state_ptr + b * stride_sb + h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn
    S = tl.load(s_ptrs, mask=mask_pn, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
    x = tl.load(x_ptr + b * stride_xb + h * stride_xh + offs_p * stride_xp, mask=mask_p, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * stride_dtb + h * stride_dth).to(tl.float32)
    dt = _ssd_dt(dt, tl.load(dt_bias_ptr + h).to(tl.float32), 0.0, float("inf"), DT_SOFTPLUS, IO_DTYPE)
    A = tl.load(A_ptr + h).to(tl.float32)
    if A_IS_LOG:  # A = -exp(A_log) in fp32, as HF computes it
        A = -tl.exp(A)
    Bv = tl.load(B_ptr + b * stride_bb + g * stride_bg + offs_n * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b * stride_cb + g * stride_cg + offs_n * stride_cn, mask=mask_n, other=0.0).to(tl.float32)
    # HF: dB = dt * B and dB * x in the inputs' dtype, the state update in fp32
    dBx = rnd(rnd(dt * Bv, IO_DTYPE)[None, :] * x[:, None], IO_DTYPE)
    S = tl.exp(dt * A) * S + dBx
    # the new state in place, or to s_out (same strides) when the caller keeps the old one
    s_out_ptrs = s_out_ptr + b * stride_sb + h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn
    tl.store(s_out_ptrs, S.to(s_out_ptr.dtype.element_ty), mask=mask_pn)
    y = rnd(tl.sum(rnd(S, IO_DTYPE) * Cv[None, :], axis=1), IO_DTYPE)  # [BLOCK_P]
    if HAS_D:
        Dh = tl.load(D_ptr + h).to(tl.float32)
        y = rnd(y + rnd(x * Dh, SKIP_DTYPE), SKIP_DTYPE)
    if HAS_Z:
        z = tl.load(z_ptr + b * stride_zb + h * stride_zh + offs_p * stride_zp, mask=mask_p, other=0.0).to(tl.float32)
        y = y * rnd(z * tl.sigmoid(z), IO_DTYPE)
    tl.store(y_ptr + b * stride_yb + h * stride_yh + offs_p * stride_yp, y.to(y_ptr.dtype.element_ty), mask=mask_p)


def _segment_sum(a):
    T = a.size(-1)
    a = a[..., None].expand(*a.size(), T)
    a = a.masked_fill(~torch.tril(torch.ones(T, T, device=a.device, dtype=torch.bool), diagonal=-1), 0)
    s = torch.cumsum(a, dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(T, T, device=a.device, dtype=torch.bool), diagonal=0), -torch.inf)


def _chunks(t, pad, T):
    t = F.pad(t, (0, 0, 0, 0, 0, pad) if t.dim() == 4 else (0, 0, 0, pad))
    return t.reshape(t.shape[0], -1, T, *t.shape[2:])


def ssd_ref(x, dt, A, B, C, chunk_size=256, D=None, z=None, dt_bias=None, initial_state=None, dt_softplus=True,
            dt_limit=(0.0, float("inf")), out_dtype=None):
    """x, z: [B, L, H, P]; dt: [B, L, H]; A, D, dt_bias: [H]; B, C: [B, L, G, N]; initial_state: [B, H, P, N]
    -> (y [B, L, H, P] in out_dtype (default x.dtype; HF keeps fp32), final state [B, H, P, N] fp32).

    HF `mamba2_chunk_scan` op for op (dt in its own dtype, the rest in fp32), plus the optional z gate."""
    Bsz, L, H, P = x.shape
    T = chunk_size
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    xf = x.float()
    Bf = B.float().repeat_interleave(H // B.shape[2], dim=2)
    Cf = C.float().repeat_interleave(H // C.shape[2], dim=2)
    pad = (T - L % T) % T
    D_res = D[..., None] * F.pad(xf, (0, 0, 0, 0, 0, pad)) if D is not None else None
    xf = xf * dt[..., None].float()
    a = A.to(torch.float32) * dt.float()
    xf, a, Bf, Cf = [_chunks(t, pad, T) for t in (xf, a, Bf, Cf)]
    a = a.permute(0, 3, 1, 2)  # [B, H, chunks, T]
    acum = torch.cumsum(a, dim=-1)
    Lm = torch.exp(_segment_sum(a))
    G = (Cf[:, :, :, None, :, :] * Bf[:, :, None, :, :, :]).sum(dim=-1)
    M = (G[..., None] * Lm.permute(0, 2, 3, 4, 1)[..., None]).sum(dim=-1)
    y_diag = (M[..., None] * xf[:, :, None]).sum(dim=3)
    decay_states = torch.exp(acum[:, :, :, -1:] - acum)
    states = ((Bf * decay_states.permute(0, -2, -1, 1)[..., None])[..., None, :] * xf[..., None]).sum(dim=2)
    prev = initial_state[:, None].float() if initial_state is not None else torch.zeros_like(states[:, :1])
    states = torch.cat([prev, states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(acum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = (decay_chunk[..., None, None] * states[:, :, None, ...]).sum(dim=1)
    states, final = new_states[:, :-1], new_states[:, -1]
    y_off = (Cf[..., None, :] * states[:, :, None, ...]).sum(-1) * torch.exp(acum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(Bsz, -1, H, P)
    if D_res is not None:
        y = y + D_res
    y = y[:, :L]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(out_dtype or x.dtype), final


def ssd_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True):
    """state: [B, H, P, N] (updated in place); x, z: [B, H, P]; dt: [B, H]; A, D, dt_bias: [H]; B, C: [B, G, N]
    -> y [B, H, P]. HF `mamba2_selective_state_update` op for op (HF passes dt, A, D, dt_bias expanded over P)."""
    Bsz, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt[:, :, None, None]  # [B, H, 1, 1]
    dA = torch.exp(dt.float() * A.float()[None, :, None, None])
    Bh = B[:, :, None, :].expand(Bsz, G, H // G, N).reshape(Bsz, H, 1, N)
    dBx = (dt * Bh) * x[..., None]
    S = state * dA + dBx
    state.copy_(S.to(state.dtype))
    Ch = C[:, :, None, :].expand(Bsz, G, H // G, N).reshape(Bsz * H, N, 1)
    y = torch.bmm(S.to(C.dtype).reshape(Bsz * H, P, N), Ch).view(Bsz, H, P)
    if D is not None:
        y = (y + x * D[:, None]).to(y.dtype)
    if z is not None:
        y = y * F.silu(z)
    return y.to(x.dtype)


def _check_ssd(name, x, B, A, **vecs):
    H, G = x.shape[-2], B.shape[-2]
    if H % G:
        raise ValueError(f"{name}: expected heads ({H}) divisible by n_groups ({G})")
    for k, v in {"A": A, **vecs}.items():
        if v is not None and tuple(v.shape) != (H,):
            raise ValueError(f"{name}: expected {k} [{H}], got {tuple(v.shape)}")


def ssd(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_state=None, dt_softplus=True,
        dt_limit=(0.0, float("inf")), out_dtype=None, *, BLOCK_T=32, BLOCK_P=32, num_warps=4, A_is_log=False):
    """x, z: [B, L, H, P]; dt: [B, L, H]; A (or A_log with A_is_log: A = -exp(A_log) in-kernel), D, dt_bias: [H];
    B, C: [B, L, G, N]; initial_state: [B, H, P, N] -> (y [B, L, H, P] in out_dtype (default x.dtype), final state
    [B, H, P, N] fp32). HF's chunk_size is not an argument: the result does not depend on it; BLOCK_T is the kernel's
    own chunk."""
    if x.dim() != 4 or B.dim() != 4 or tuple(C.shape) != tuple(B.shape) or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"ssd: expected x [B, L, H, P], B and C [B, L, G, N], got {tuple(x.shape)}, "
                         f"{tuple(B.shape)}, {tuple(C.shape)}")
    Bsz, L, H, P = x.shape
    N = B.shape[-1]
    _check_ssd("ssd", x, B, A, D=D, dt_bias=dt_bias)
    y = torch.empty((Bsz, L, H, P), device=x.device, dtype=out_dtype or x.dtype)
    sT = torch.empty((Bsz, H, P, N), device=x.device, dtype=torch.float32)
    zz = z if z is not None else x
    bias = dt_bias if dt_bias is not None else torch.zeros(H, device=x.device, dtype=dt.dtype)
    grid = (Bsz * H, triton.cdiv(P, BLOCK_P))
    _ssd_kernel[grid](
        x, dt, A, B, C, D if D is not None else A, zz, bias, initial_state if initial_state is not None else sT, y, sT,
        L, H, P, N, H // B.shape[2], float(dt_limit[0]), float(dt_limit[1]),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zz.stride(), *y.stride(), *sT.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_S0=initial_state is not None, DT_SOFTPLUS=dt_softplus,
        DT_DTYPE=_TL[dt.dtype], PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_T=BLOCK_T, BLOCK_P=BLOCK_P, BLOCK_N=max(16, triton.next_power_of_2(N)), A_IS_LOG=A_is_log,
        num_warps=num_warps,
    )
    return y, sT


def ssd_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                     *, out_state=None, A_is_log=False, BLOCK_P=32, num_warps=4):
    """state: [B, H, P, N] updated in place, or left as is with the new state written to `out_state` (same shape,
    dtype and strides); x, z: [B, H, P]; dt: [B, H]; A (or A_log with A_is_log: A = -exp(A_log) in-kernel), D,
    dt_bias: [H]; B, C: [B, G, N] -> y [B, H, P]. Not autotuned: in place, tuning launches would corrupt the state."""
    if state.dim() != 4 or tuple(state.shape[:3]) != tuple(x.shape) or tuple(dt.shape) != tuple(x.shape[:2]):
        raise ValueError(f"ssd_state_update: expected state [B, H, P, N], x [B, H, P], dt [B, H], got "
                         f"{tuple(state.shape)}, {tuple(x.shape)}, {tuple(dt.shape)}")
    Bsz, H, P, N = state.shape
    _check_ssd("ssd_state_update", x, B, A, D=D, dt_bias=dt_bias)
    if len({x.dtype, dt.dtype, B.dtype, C.dtype}) != 1:
        raise ValueError(f"ssd_state_update: expected x, dt, B, C in one dtype, got {x.dtype}, {dt.dtype}, "
                         f"{B.dtype}, {C.dtype}")
    if out_state is not None and (out_state.shape != state.shape or out_state.dtype != state.dtype
                                  or out_state.stride() != state.stride()):
        raise ValueError(f"ssd_state_update: expected out_state like state {tuple(state.shape)} {state.dtype} "
                         f"strides {state.stride()}, got {tuple(out_state.shape)} {out_state.dtype} "
                         f"strides {out_state.stride()}")
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    zz = z if z is not None else x
    bias = dt_bias if dt_bias is not None else torch.zeros(H, device=x.device, dtype=dt.dtype)
    skip = torch.promote_types(x.dtype, D.dtype) if D is not None else x.dtype
    grid = (Bsz * H, triton.cdiv(P, BLOCK_P))
    _ssd_state_update_kernel[grid](
        state, x, dt, A, B, C, D if D is not None else A, zz, bias, y, out_state if out_state is not None else state,
        H, P, N, H // B.shape[1],
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zz.stride(), *y.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, DT_SOFTPLUS=dt_softplus, A_IS_LOG=A_is_log,
        IO_DTYPE=_TL[x.dtype], SKIP_DTYPE=_TL[skip],
        BLOCK_P=BLOCK_P, BLOCK_N=triton.next_power_of_2(N), num_warps=num_warps,
    )
    return y
