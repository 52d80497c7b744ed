"""The padding mask of HF's SSM mixers (`apply_mask_to_padding_states`): y[b, l, c] = x[b, l, c] * mask[b, l],
in x's dtype (exact for a 0/1 mask). Any strides: x may be a [B, C, L] view of a channels-first tensor."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mask_rows_kernel(
    # Pointers
    X, M, Y,
    # Matrix dimensions
    L, C,
    # Strides
    sxb, sxl, sxc, smb, sml, syb, syl, syc,
    # Meta-parameters
    BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    ml, mc = offs_l < L, offs_c < C
    m = tl.load(M + b * smb + offs_l * sml, mask=ml, other=0).to(tl.float32)  # [BLOCK_L]
    x = tl.load(X + b * sxb + offs_l[:, None] * sxl + offs_c[None, :] * sxc, mask=ml[:, None] & mc[None, :], other=0.0)
    y = x.to(tl.float32) * m[:, None]  # [BLOCK_L, BLOCK_C]
    tl.store(Y + b * syb + offs_l[:, None] * syl + offs_c[None, :] * syc, y.to(Y.dtype.element_ty),
             mask=ml[:, None] & mc[None, :])


def mask_rows_ref(x: torch.Tensor, mask: torch.Tensor | None, channels_last: bool = True) -> torch.Tensor:
    """x: [B, L, C] (channels_last) or [B, C, L]; mask: [B, L] or None -> x * mask over L, in x's dtype."""
    if mask is None:
        return x
    m = mask[:, :, None] if channels_last else mask[:, None, :]
    return (x.float() * m.float()).to(x.dtype)


def mask_rows(x: torch.Tensor, mask: torch.Tensor | None, channels_last: bool = True, *, BLOCK_L: int = 16,
              BLOCK_C: int = 64) -> torch.Tensor:
    """x: [B, L, C] (channels_last) or [B, C, L]; mask: [B, L] or None -> a masked copy in x's layout, or x itself
    when mask is None."""
    if mask is None:
        return x
    xv = x if channels_last else x.transpose(1, 2)  # [B, L, C] view
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    yv = y if channels_last else y.transpose(1, 2)
    B, L, C = xv.shape
    _mask_rows_kernel[(B, triton.cdiv(L, BLOCK_L), triton.cdiv(C, BLOCK_C))](
        xv, mask, yv,
        L, C,
        *xv.stride(), *mask.stride(), *yv.stride(),
        BLOCK_L=BLOCK_L, BLOCK_C=BLOCK_C)
    return y


__all__ = ["mask_rows", "mask_rows_ref"]
