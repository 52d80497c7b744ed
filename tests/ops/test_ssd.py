import pytest
import torch

from kernels_runtime.ops.ssd import ssd, ssd_ref, ssd_state_update, ssd_state_update_ref
from kernels_runtime.tolerances import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(Bsz, L, H, P, G, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, z = r(Bsz, L, H, P).to(dtype), r(Bsz, L, H, P).to(dtype)
    dt = (r(Bsz, L, H) * 0.5 - 1.0).to(dtype)
    A = -torch.exp(r(H) * 0.5)  # fp32: HF passes -exp(A_log.float())
    B, C = (r(Bsz, L, G, N) / N**0.25).to(dtype), (r(Bsz, L, G, N) / N**0.25).to(dtype)
    D, dt_bias = r(H).to(dtype), (r(H) * 0.5).to(dtype)  # parameters, in the model dtype
    return x, dt, A, B, C, D, z, dt_bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Bsz,L,H,P,G,N,chunk", [(2, 37, 4, 24, 2, 16, 8), (1, 5, 3, 16, 1, 12, 4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_ssd_prefill(dtype, Bsz, L, H, P, G, N, chunk, seed):
    x, dt, A, B, C, D, _, dt_bias = _inputs(Bsz, L, H, P, G, N, dtype, seed)
    s0 = torch.randn(Bsz, H, P, N) if seed else None
    y_ref, s_ref = ssd_ref(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, initial_state=s0, dt_limit=(0.0, 4.0))
    y, s = ssd(x, dt, A, B, C, D=D, dt_bias=dt_bias, initial_state=s0, dt_limit=(0.0, 4.0), BLOCK_T=16, BLOCK_P=16)
    assert_close(y, y_ref, name="y")
    assert_close(s, s_ref, torch.float32 if dtype == torch.float32 else dtype, name="final state")


def test_ssd_fused_gate_and_fp32_out():
    x, dt, A, B, C, D, z, dt_bias = _inputs(1, 19, 2, 16, 1, 16, torch.bfloat16, 5)
    y_ref, _ = ssd_ref(x, dt, A, B, C, 8, D=D, z=z, dt_bias=dt_bias, out_dtype=torch.float32)
    y, _ = ssd(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, out_dtype=torch.float32, BLOCK_T=16, BLOCK_P=16)
    assert_close(y, y_ref, torch.bfloat16)


def test_ssd_prefill_from_a_log():
    """A_is_log: the kernel takes A = -exp(A_log) itself (the template needs no launch for it)."""
    x, dt, _, B, C, D, z, dt_bias = _inputs(1, 19, 2, 16, 1, 16, torch.bfloat16, 6)
    a_log = (torch.randn(2, generator=torch.Generator().manual_seed(1)) * 0.5).to(torch.bfloat16)
    y_ref, s_ref = ssd(x, dt, -torch.exp(a_log.float()), B, C, D=D, z=z, dt_bias=dt_bias, BLOCK_T=16, BLOCK_P=16)
    y, s = ssd(x, dt, a_log, B, C, D=D, z=z, dt_bias=dt_bias, BLOCK_T=16, BLOCK_P=16, A_is_log=True)
    assert_close(y, y_ref, name="y")
    assert_close(s, s_ref, torch.bfloat16, name="final state")


def test_ssd_ref_matches_hf_torch_path():
    from transformers.models.mamba2 import modeling_mamba2 as hf

    x, dt, A, B, C, D, _, dt_bias = _inputs(2, 21, 4, 8, 2, 16, torch.float32, 6)
    s0 = torch.randn(2, 4, 8, 16)
    y_hf, s_hf = hf.mamba2_chunk_scan(x, dt, A, B, C, 8, D=D, dt_bias=dt_bias, initial_states=s0, dt_softplus=True,
                                      return_final_states=True)
    y_ref, s_ref = ssd_ref(x, dt, A, B, C, 8, D=D, dt_bias=dt_bias, initial_state=s0)
    assert_close(y_ref, y_hf)
    assert_close(s_ref, s_hf)
    P = x.shape[-1]
    sh, sr = s_ref.clone(), s_ref.clone()
    y_hf = hf.mamba2_selective_state_update(
        sh, x[:, 0], dt[:, 0, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, 16), B[:, 0], C[:, 0],
        D[:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True)
    assert_close(ssd_state_update_ref(sr, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, dt_bias=dt_bias), y_hf)
    assert_close(sr, sh)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ssd_state_update_matches_prefill(dtype, seed):
    Bsz, L, H, P, G, N = 2, 9, 4, 24, 2, 16
    x, dt, A, B, C, D, _, dt_bias = _inputs(Bsz, L + 1, H, P, G, N, dtype, seed)
    y_full, s_full = ssd_ref(x, dt, A, B, C, 4, D=D, dt_bias=dt_bias)
    _, state = ssd(x[:, :L], dt[:, :L], A, B[:, :L], C[:, :L], D=D, dt_bias=dt_bias, BLOCK_T=16, BLOCK_P=16)
    state_ref = state.clone()
    args = (x[:, L], dt[:, L], A, B[:, L], C[:, L], D)
    y_ref = ssd_state_update_ref(state_ref, *args, dt_bias=dt_bias)
    y = ssd_state_update(state, *args, dt_bias=dt_bias, BLOCK_P=16)
    assert_close(y, y_ref, name="y")
    assert_close(state, state_ref, name="state")
    if dtype == torch.float32:
        assert_close(y, y_full[:, L], name="decode vs prefill")
    else:  # HF's decode path rounds to the model dtype at each op, its prefill stays fp32: allow both roundings
        torch.testing.assert_close(y.float(), y_full[:, L].float(), atol=3e-2, rtol=3e-2)
    assert_close(state, s_full, torch.float32 if dtype == torch.float32 else dtype, name="state vs prefill over L+1")


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_state_update_out_of_place_from_a_log(dtype):
    """out_state gets the new state and `state` stays as it was; A_is_log computes A = -exp(A_log) in the kernel."""
    Bsz, H, P, G, N = 2, 4, 24, 2, 16
    x, dt, A, B, C, D, _, dt_bias = _inputs(Bsz, 1, H, P, G, N, dtype, 5)
    A_log = torch.log(-A)
    state = torch.randn(Bsz, H, P, N)
    before = state.clone()
    state_ref = state.clone()
    args = (x[:, 0], dt[:, 0])
    y_ref = ssd_state_update_ref(state_ref, *args, A, B[:, 0], C[:, 0], D, dt_bias=dt_bias)
    out = torch.empty_like(state)
    y = ssd_state_update(state, *args, A_log, B[:, 0], C[:, 0], D, dt_bias=dt_bias, out_state=out, A_is_log=True,
                         BLOCK_P=16)
    assert torch.equal(state, before)
    assert_close(y, y_ref, name="y")
    assert_close(out, state_ref, name="state")
    with pytest.raises(ValueError, match="out_state"):
        ssd_state_update(state, *args, A, B[:, 0], C[:, 0], D, out_state=torch.empty(Bsz, H, P, N + 1))
