"""Attention of architectures beyond Llama/Qwen3 in the built-in attention templates: partial rotary (StableLM
`partial_rotary_factor`, GPT-NeoX `rotary_pct`: cos/sin narrower than the head) in the rotary op, and fused q/k/v
projections (Phi-3's `qkv_proj` as [q | k | v] blocks, GPT-NeoX's `query_key_value` per head [q_h, k_h, v_h], with
its bias) as the `qkv_layout` option of attention.prefill_flash / attention.decode_splitkv, chosen by the
applicability check (llm4llm/search/applicability.py) by running it on the task's captured calls.

Op level: against HF's own `apply_rotary_pos_emb` and a float64 reference on fresh random inputs. Model level:
tiny seeded transformers models are profiled and extracted; the check must judge the template applicable (pinned to
the layout that matches) and a trial of its default config must pass the verifier with fresh draws."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels_runtime.ops.rotary import qk_norm_rotary, qk_norm_rotary_ref, rotary, rotary_ref
from kernels_runtime.tolerances import assert_close

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "scripts" / "hf_generate.py"


# ---- partial rotary, op level ------------------------------------------------------------------------------------

def _qk_cos_sin(B, Hq, Hkv, S, D, R, dtype):
    q = torch.randn(B, S, Hq, D, dtype=dtype).transpose(1, 2)  # HF's transposed projection views
    k = torch.randn(B, S, Hkv, D, dtype=dtype).transpose(1, 2)
    pos = torch.arange(S, dtype=torch.float32)[None, :, None] + torch.randint(0, 50, (B, 1, 1))
    inv_freq = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float32) / R)
    emb = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)  # [B, S, R]
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(2, 4, 2, 11, 16, 8), (1, 3, 1, 5, 24, 6), (1, 2, 2, 3, 20, 20)])
def test_partial_rotary_matches_hf_and_float64(dtype, shape):
    from transformers.models.stablelm.modeling_stablelm import apply_rotary_pos_emb

    q, k, cos, sin = _qk_cos_sin(*shape, dtype)
    R = shape[-1]
    qo, ko = rotary(q, k, cos, sin, BLOCK_H=2)
    # HF's StableLM slices the rotated part, applies rotary to it and concatenates the rest
    qh, kh = apply_rotary_pos_emb(q[..., :R], k[..., :R], cos, sin)
    assert_close(qo, torch.cat([qh, q[..., R:]], -1), dtype, name="q vs HF")
    assert_close(ko, torch.cat([kh, k[..., R:]], -1), dtype, name="k vs HF")
    q64, k64 = rotary_ref(q.double(), k.double(), cos.double(), sin.double())
    assert_close(qo, q64.to(dtype), dtype, name="q vs float64")
    assert_close(ko, k64.to(dtype), dtype, name="k vs float64")
    assert torch.equal(qo[..., R:], q[..., R:]) and torch.equal(ko[..., R:], k[..., R:])  # passed through bitwise


def test_partial_rotary_with_qk_norm_matches_float64():
    q, k, cos, sin = _qk_cos_sin(2, 4, 2, 7, 24, 10, torch.float32)
    q, k = q * 3, k * 3
    qw, kw = torch.randn(24), torch.randn(24)
    qo, ko = qk_norm_rotary(q, k, cos, sin, qw, kw, 1e-6, BLOCK_H=4)
    qr, kr = qk_norm_rotary_ref(q.double(), k.double(), cos.double(), sin.double(), qw.double(), kw.double(), 1e-6)
    assert_close(qo, qr.float(), torch.float32, name="q")
    assert_close(ko, kr.float(), torch.float32, name="k")


def test_partial_rotary_rejects_bad_widths():
    q, k, cos, sin = _qk_cos_sin(1, 2, 1, 4, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="R even"):
        rotary(q, k, cos[..., :7], sin[..., :7])
    wide = torch.cat([cos, cos, cos], -1)  # 24 > 16
    with pytest.raises(ValueError, match="R even"):
        rotary(q, k, wide, wide)
