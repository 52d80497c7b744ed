"""The decode layer's batch-only choices (kernels_runtime.hosts.decode_layer.mlp_half's `post_norm_batch`, the
batch rows' space in llm4llm.search.templates.decode_fused): a call of one row keeps the batch-1 config's post
norm in gate/up's prologue, a call of more rows takes `post_norm_batch` (default: o_proj's reduction, where the
stacked-layer bench measured it 2-18 % faster at batch 8 and 32); batch-1 tasks' spaces do not change."""
import torch

from kernels_runtime.hosts import decode_layer
from kernels_runtime.ops import gemv as G
from llm4llm.search.templates import decode_fused


def _weights(H=32, I=48, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)
    return {"self_attn.o_proj.weight": w(H, H), "post_attention_layernorm.weight": 1 + 0.1 * w(H),
            "mlp.gate_proj.weight": w(I, H), "mlp.up_proj.weight": w(I, H), "mlp.down_proj.weight": w(H, I)}


def _config(**kw):
    stage = {"BLOCK_N": 8, "BLOCK_K": 16, "SPLIT_K": 1, "num_warps": 4, "DOT": False, "PREFETCH": False}
    cfg = {p + k: v for p in ("o_", "gu_", "dn_") for k, v in stage.items()}
    return {**cfg, "num_stages": 1, "post_norm": "gate_up_prologue", "l2pf_mlp_mb": 0, **kw}


def test_post_norm_batch_moves_the_norm_to_o_proj_for_rows_only(monkeypatch):
    seen = []
    real = G.launch

    def spy(fn, grid, args, cx, **kw):
        seen.append(fn.__name__)
        return real(fn, grid, args, cx, **kw)

    monkeypatch.setattr(G, "launch", spy)
    weights, static = _weights(), {"post_attention_layernorm.variance_epsilon": 1e-6}
    mlp = decode_layer.mlp_half(_config(post_norm_batch="o_reduce"))
    outs = {}
    for rows in (1, 4):
        seen.clear()
        o, x2 = torch.randn(rows, 32), torch.randn(rows, 32)
        outs[rows] = (mlp(o, x2, weights, static), o, x2)
        assert ("_residual_rmsnorm_reduce_kernel" in seen) == (rows > 1), (rows, seen)
    # both placements compute the same layer half
    for rows, (got, o, x2) in outs.items():
        want = decode_layer.mlp_half(_config())(o, x2, weights, static)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_post_norm_batch_one_placement_serves_every_call():
    cfg = _config()
    assert decode_layer.mlp_half(cfg).__name__ == "mlp_prologue"
    assert decode_layer.mlp_half({**cfg, "post_norm_batch": "gate_up_prologue"}).__name__ == "mlp_prologue"


def test_batch_space_defaults_and_batch_one_spaces(monkeypatch):
    monkeypatch.setattr(decode_fused, "task_rows", lambda spec: 32)
    assert decode_fused.post_norm_rows_space(None) == {"post_norm_batch": ["o_reduce", "gate_up_prologue"]}
    space = decode_fused.rows_space(None, "qkv_", "gu_")
    assert space["dot_stages"][0] == 3 and space["norm_pass"][0] is True
    assert space["gu_DOT_BLOCK_N"][0] == 128 and space["qkv_DOT_BLOCK_K"][0] == 128 and space["gu_DOT_SPLIT_K"][-1] == 0
    monkeypatch.setattr(decode_fused, "task_rows", lambda spec: 1)
    assert decode_fused.post_norm_rows_space(None) == {} and decode_fused.rows_space(None, "qkv_") == {}
