"""Candidate from template ssm_mixer.mamba for a ssm_mixer/prefill task (bfloat16)."""
import torch
import triton
import triton.language as tl
from kernels_runtime.ops.linear import linear
from kernels_runtime.ops.causal_conv1d import causal_conv1d
from kernels_runtime.ops.selective_scan import selective_scan

CONFIG = {'conv_BLOCK_C': 32, 'conv_BLOCK_L': 64, 'lin_BLOCK_K': 32, 'lin_BLOCK_M': 64, 'lin_BLOCK_N': 64, 'lin_num_stages': 3, 'lin_num_warps': 4, 'scan_BLOCK_D': 8, 'scan_BLOCK_T': 16, 'scan_num_warps': 4}

def _static(static, *names):
    for n in names:
        if n in static:
            return static[n]
    raise KeyError(f"static: expected one of {names}, got {sorted(static)}")
LIN = {k[4:]: v for k, v in CONFIG.items() if k.startswith('lin_')}

@triton.jit
def _neg_exp_kernel(X, Y, n, BLOCK: tl.constexpr):
    # A = -exp(A_log) in fp32 (the scan ops take A, not A_log)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(Y + offs, -tl.exp(x), mask=offs < n)


def _neg_exp(a_log):
    a = torch.empty(a_log.shape, dtype=torch.float32, device=a_log.device)
    _neg_exp_kernel[(triton.cdiv(a_log.numel(), 1024),)](a_log.contiguous(), a, a_log.numel(), BLOCK=1024)
    return a


@triton.jit
def _mask_rows_kernel(X, M, Y, L, C, sxb, sxl, sxc, smb, sml, syb, syl, syc,
                      BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    # y[b, l, c] = x[b, l, c] * mask[b, l]: HF's apply_mask_to_padding_states (any strides: x may be a [B, C, L] view)
    b = tl.program_id(0).to(tl.int64)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    ml, mc = offs_l < L, offs_c < C
    m = tl.load(M + b * smb + offs_l * sml, mask=ml, other=0).to(tl.float32)
    x = tl.load(X + b * sxb + offs_l[:, None] * sxl + offs_c[None, :] * sxc, mask=ml[:, None] & mc[None, :], other=0.0)
    y = x.to(tl.float32) * m[:, None]
    tl.store(Y + b * syb + offs_l[:, None] * syl + offs_c[None, :] * syc, y.to(Y.dtype.element_ty),
             mask=ml[:, None] & mc[None, :])


def _mask_rows(x, mask, channels_last=True):
    # x: [B, L, C] (channels_last) or [B, C, L]; mask: [B, L] or None -> a masked copy in x's layout (or x itself)
    if mask is None:
        return x
    xv = x if channels_last else x.transpose(1, 2)  # [B, L, C] view
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    yv = y if channels_last else y.transpose(1, 2)
    B, L, C = xv.shape
    _mask_rows_kernel[(B, triton.cdiv(L, 16), triton.cdiv(C, 64))](
        xv, mask, yv, L, C, *xv.stride(), *mask.stride(), *yv.stride(), BLOCK_L=16, BLOCK_C=64)
    return y


def _copy(t):
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out




def _ssm_params(xc, weights, static):
    # xc: [..., I] -> dt [..., I] (no bias: the scan adds dt_proj.bias in fp32, as HF does), B, C [..., N]
    N = weights["A_log"].shape[1]
    R = weights["dt_proj.weight"].shape[1]
    p = linear(xc, weights["x_proj.weight"], **LIN)  # [..., R + 2N]
    dt = linear(p[..., :R], weights["dt_proj.weight"], **LIN)
    return dt, p[..., R:R + N], p[..., R + N:]


def entry(inputs, weights, state, static):
    out, conv_state, ssm_state = _prefill_step(inputs["hidden_states"], inputs.get("attention_mask"), weights, static)
    return {"out": out, "state_out.conv_state": conv_state, "state_out.ssm_state": ssm_state}


def _prefill_step(x, mask, weights, static, residual=None):
    # x: [B, L, H]; mask: [B, L] or None
    x = _mask_rows(x, mask)
    I = weights["in_proj.weight"].shape[0] // 2
    proj = linear(x, weights["in_proj.weight"], weights.get("in_proj.bias"), **LIN)  # [B, L, 2I]
    xs, gate = proj[..., :I].transpose(1, 2), proj[..., I:].transpose(1, 2)  # [B, I, L] views
    conv_w = weights["conv1d.weight"]  # [I, 1, K]
    xc, conv_state = causal_conv1d(xs, conv_w.view(I, conv_w.shape[-1]), weights.get("conv1d.bias"), silu=True,
                                   BLOCK_C=CONFIG["conv_BLOCK_C"], BLOCK_L=CONFIG["conv_BLOCK_L"])  # [B, I, L]
    xc = _mask_rows(xc, mask, channels_last=False)
    dt, Bm, Cm = _ssm_params(xc.transpose(1, 2), weights, static)  # [B, L, I], [B, L, N], [B, L, N]
    # A = -exp(A_log) in the kernel; D and the dt bias read as fp32 there (HF's .float() copies, no launches here)
    y, ssm_state = selective_scan(xc, dt.transpose(1, 2), weights["A_log"], Bm.transpose(1, 2),
                                  Cm.transpose(1, 2), D=weights["D"], z=gate,
                                  delta_bias=weights["dt_proj.bias"], delta_softplus=True,
                                  BLOCK_D=CONFIG["scan_BLOCK_D"], num_warps=CONFIG["scan_num_warps"],
                                  BLOCK_T=CONFIG.get("scan_BLOCK_T", 0), A_is_log=True)  # [B, I, L]
    out = linear(y.transpose(1, 2), weights["out_proj.weight"], weights.get("out_proj.bias"), residual=residual,
                 **LIN)  # [B, L, H] (+ residual)
    # the cache keeps the scan's final state as it comes (fp32: HF's discretisation runs in fp32)
    return out, conv_state, ssm_state
