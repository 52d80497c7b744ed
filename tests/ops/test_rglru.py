import pytest
import torch
import torch.nn.functional as F

from kernels_runtime.ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from kernels_runtime.ops.rglru import rglru, rglru_ref
from kernels_runtime.tolerances import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _weights(W, H, dtype, g):
    bw = W // H
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(W).to(dtype), (r(H, bw, bw) / bw**0.5).to(dtype), r(H, bw).to(dtype),
            (r(H, bw, bw) / bw**0.5).to(dtype), r(H, bw).to(dtype))


def _positions(Bsz, L, start=0):
    pos = torch.arange(start, start + L)[None].repeat(Bsz, 1)
    if Bsz > 1 and L > 5:
        pos[1, 5:] = torch.arange(L - 5)  # a document boundary mid-sequence: reset at step 5
    return pos


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Bsz,L,W,H", [(2, 37, 40, 2), (1, 3, 24, 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_rglru_prefill(dtype, Bsz, L, W, H, seed):
    g = torch.Generator().manual_seed(seed)
    x, yb = torch.randn(Bsz, L, W, generator=g).to(dtype), torch.randn(Bsz, L, W, generator=g).to(dtype)
    w = _weights(W, H, dtype, g)
    pos = _positions(Bsz, L)
    h0 = torch.randn(Bsz, W, generator=g) if seed else None  # reset at position 0 must discard it
    y_ref, h_ref = rglru_ref(x, pos, *w, state=h0, y_branch=yb)
    y, h = rglru(x, pos, *w, state=h0, y_branch=yb, BLOCK_W=16)
    assert_close(y, y_ref, name="y")
    assert_close(h, h_ref, torch.float32 if dtype == torch.float32 else dtype, name="final state")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rglru_decode_matches_prefill(dtype, seed):
    Bsz, L, W, H = 2, 9, 40, 2
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(Bsz, L + 1, W, generator=g).to(dtype)
    w = _weights(W, H, dtype, g)
    pos = _positions(Bsz, L + 1)
    y_full, h_full = rglru_ref(x, pos, *w)
    _, h = rglru(x[:, :L], pos[:, :L], *w)
    y_ref, h_ref = rglru_ref(x[:, L:], pos[:, L:], *w, state=h)
    y, h1 = rglru(x[:, L:], pos[:, L:], *w, state=h, BLOCK_W=16)
    assert_close(y, y_ref, name="y")
    assert_close(h1, h_ref, torch.float32 if dtype == torch.float32 else dtype, name="state")
    assert_close(y, y_full[:, L:], name="decode vs prefill")
    assert_close(h1, h_full, torch.float32 if dtype == torch.float32 else dtype, name="state vs prefill over L+1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rglru_in_place_writes_the_state_it_read(dtype):
    """inplace=True: the new state is written over the one passed in (returned as that same tensor), bit for bit
    what the out-of-place call returns; a state that is not contiguous fp32 is refused (its update would be lost)."""
    Bsz, W, H = 2, 40, 2
    g = torch.Generator().manual_seed(4)
    w = _weights(W, H, dtype, g)
    h = torch.randn(Bsz, W, generator=g)
    for step in range(3):
        x, yb = torch.randn(Bsz, 1, W, generator=g).to(dtype), torch.randn(Bsz, 1, W, generator=g).to(dtype)
        pos = torch.full((Bsz, 1), 7 + step)
        y_o, h_o = rglru(x, pos, *w, state=h.clone(), y_branch=yb, BLOCK_W=16)
        y_i, h_i = rglru(x, pos, *w, state=h, y_branch=yb, BLOCK_W=16, inplace=True)
        assert h_i is h and torch.equal(h, h_o) and torch.equal(y_i, y_o)
    with pytest.raises(ValueError, match="contiguous fp32 state"):
        rglru(x, pos, *w, state=h.to(torch.float16), inplace=True)
    with pytest.raises(ValueError, match="contiguous fp32 state"):
        rglru(x, pos, *w, state=torch.randn(W, Bsz).t(), inplace=True)


def _ops_block(block, x_in, pos, conv_state, h):
    # RecurrentGemmaRecurrentBlock.forward from the ops: conv (state K-1, bias, no activation) -> RG-LRU -> * y
    yb = F.gelu(block.linear_y(x_in), approximate="tanh")
    xb = block.linear_x(x_in).transpose(1, 2)  # [B, W, L]
    w, b = block.conv_1d.weight[:, 0, :], block.conv_1d.bias
    if x_in.shape[1] > 1:
        xc, conv_state = causal_conv1d(xb, w, b, silu=False, state_len=block.conv1d_width - 1)
    else:
        xc = causal_conv1d_update(xb[:, :, 0], conv_state, w, b)[:, :, None]
    lru = block.rg_lru
    y, h = rglru(xc.transpose(1, 2), pos, lru.recurrent_param, lru.input_gate_weight, lru.input_gate_bias,
                 lru.recurrent_gate_weight, lru.recurrent_gate_bias, state=h, y_branch=yb)
    return block.linear_out(y), conv_state, h


@torch.no_grad()
def test_recurrent_block_matches_hf():
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRecurrentBlock

    cfg = RecurrentGemmaConfig(hidden_size=32, lru_width=32, num_attention_heads=2, conv1d_width=4,
                               hidden_activation="gelu_pytorch_tanh")
    block = RecurrentGemmaRecurrentBlock(cfg, 0).eval()
    for p in block.parameters():
        p.normal_(0, 0.3)
    Bsz, L = 2, 11
    x = torch.randn(Bsz, L + 1, 32)
    pos = torch.arange(L + 1)[None].repeat(Bsz, 1)
    block._setup_cache(Bsz, x.device, x.dtype)
    out_hf, _ = block(x[:, :L], pos[:, :L], None)
    out, conv_state, h = _ops_block(block, x[:, :L], pos[:, :L], None, None)
    assert_close(out, out_hf, name="prefill out")
    assert_close(conv_state, block.conv1d_state, name="conv state")
    assert_close(h, block.rg_lru.recurrent_states, name="rg_lru state")
    out_hf, _ = block(x[:, L:], pos[:, L:], None)
    out, conv_state, h = _ops_block(block, x[:, L:], pos[:, L:], conv_state, h)
    assert_close(out, out_hf, name="decode out")
    assert_close(conv_state, block.conv1d_state, name="conv state after decode")
    assert_close(h, block.rg_lru.recurrent_states, name="rg_lru state after decode")


@pytest.mark.gpu
def test_rglru_and_conv_update_in_place_on_cuda_at_real_sizes():
    """recurrentgemma-2b's widths on the GPU: the RG-LRU in place gives bit for bit the out-of-place result over
    chained steps, and the in-place conv update (its barrier between the shift's loads and stores) matches its
    reference; bf16 activations, fp32 LRU state."""
    from kernels_runtime.ops.causal_conv1d import causal_conv1d_update_ref

    Bsz, W, H, K = 2, 2560, 10, 4
    g = torch.Generator().manual_seed(9)
    w = tuple(t.cuda() for t in _weights(W, H, torch.bfloat16, g))
    h = torch.randn(Bsz, W, generator=g).cuda()
    conv_w = (torch.randn(W, K, generator=g) / 2).to(torch.bfloat16).cuda()
    conv_b = torch.randn(W, generator=g).to(torch.bfloat16).cuda()
    cs = torch.randn(Bsz, W, K - 1, generator=g).to(torch.bfloat16).cuda()
    for step in range(4):
        xb = torch.randn(Bsz, W, generator=g).to(torch.bfloat16).cuda()
        cs_ref = cs.clone()
        xc_ref = causal_conv1d_update_ref(xb, cs_ref, conv_w, conv_b)
        xc = causal_conv1d_update(xb, cs, conv_w, conv_b, BLOCK_C=128)
        assert_close(xc, xc_ref, name="conv out")
        assert torch.equal(cs, cs_ref)  # the shifted window, exactly
        yb = torch.randn(Bsz, 1, W, generator=g).to(torch.bfloat16).cuda()
        pos = torch.full((Bsz, 1), 5 + step, device="cuda")
        y_o, h_o = rglru(xc[:, None], pos, *w, state=h.clone(), y_branch=yb, BLOCK_W=128)
        y_i, h_i = rglru(xc[:, None], pos, *w, state=h, y_branch=yb, BLOCK_W=128, inplace=True)
        assert h_i is h and torch.equal(h, h_o) and torch.equal(y_i, y_o)
