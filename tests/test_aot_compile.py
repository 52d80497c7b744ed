"""Every built-in template's kernels compile for the H200 (sm_90), checked on the CPU: Triton's interpreter, which
runs every other CPU test, accepts programs the GPU compiler rejects. Launches are recorded, not run, in a
subprocess without TRITON_INTERPRET (under it the kernels are not compiled objects); fp32 and bf16 code paths."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compiled_subprocess import run_compiled

from llm4llm.search.templates import TEMPLATES
from llm4llm.taskspec import load_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_task_dirs(tiny_extracted) -> list[str]:
    return [str(d) for name in ("tiny-llama", "tiny-qwen3", "tiny-qwen3+static", "tiny-mamba", "tiny-mamba2",
                                "tiny-recurrentgemma", "tiny-gpt-neox", "tiny-falcon-mamba", "tiny-gemma2+static")
            for d in tiny_extracted(name)]


@pytest.mark.slow
def test_every_template_compiles_for_sm90(tiny_task_dirs):
    res = run_compiled(["-m", "llm4llm.verify.aot", *tiny_task_dirs], timeout=1200)
    assert res.stdout.strip(), res.stderr[-3000:]
    result = json.loads(res.stdout)
    covered = {key.split("/")[0] for key in result}
    assert covered == {t.name for t in TEMPLATES}, sorted({t.name for t in TEMPLATES} - covered)
    failed = {k: v for k, v in result.items() if v}
    assert not failed, json.dumps(failed, indent=1)[:4000]
    assert res.returncode == 0


def test_a_kernel_the_gpu_compiler_rejects_is_reported():
    """The check is not vacuous: a kernel that rebinds a variable to another shape in a runtime branch (the
    interpreter runs it) fails to compile for sm_90, with its name in the message."""
    src = ROOT / "tests" / "_aot_bad_kernel.py"
    res = run_compiled([str(src)], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    errors = json.loads(res.stdout)
    assert len(errors) == 1 and errors[0].startswith("_bad_kernel:"), errors


def test_launch_signatures_follow_the_arguments():
    from llm4llm.verify.aot import _arg_type

    assert _arg_type(torch.zeros(1, dtype=torch.bfloat16)) == "*bf16" and _arg_type(3) == "i32"
    assert _arg_type(2**40) == "i64" and _arg_type(1.5) == "fp32" and _arg_type(True) == "i1"
    assert _arg_type(None) is None


_INTERPRETER_ONLY_RMSNORM = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _norm(X, W, Y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    if N > 0:  # a runtime branch rebinding a scalar to a block: the interpreter runs it, the GPU compiler refuses
        scale = scale + tl.zeros((BLOCK,), dtype=tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (w * (x * scale).to(X.dtype.element_ty).to(tl.float32)).to(Y.dtype.element_ty),
             mask=cols < N)


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"].contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    eps = float(static.get("variance_epsilon", static.get("eps", 1e-6)))
    _norm[(x.numel() // n,)](x, weights["weight"], y, n, eps, BLOCK=triton.next_power_of_2(n))
    return {"out": y}
'''


def test_cpu_verifier_rejects_what_only_the_interpreter_runs(tiny_task_dirs, monkeypatch):
    """With the gate on, a candidate correct under the interpreter but not compilable for sm_90 fails with the
    compiler's message; a template's rendering passes it."""
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.verify import VerifierPool

    monkeypatch.setenv("LLM4LLM_AOT_ARCH", "90")
    task_dir = next(d for d in tiny_task_dirs if "/tiny-llama" in d and Path(d).name.startswith("norm-decode"))
    pool = VerifierPool("cpu", draws=1, timing=False)  # the gate runs from the parent, in its own sandbox
    v = pool.verify(task_dir, _INTERPRETER_ONLY_RMSNORM)
    assert not v.passed and v.failure_class == "compile", v.message
    assert "compile_sm90" in [g.name for g in v.gates] and "_norm" in v.message
    assert "correctness" in [g.name for g in v.gates if g.passed]  # the interpreter had passed it

    spec = load_spec(Path(task_dir))
    t = next(t for t in TEMPLATES if t.name == "norm.rmsnorm_op")
    good = pool.verify(task_dir, t.render(spec, t.default(spec)))
    pool.close()
    assert good.passed, good.message
    assert [g.name for g in good.gates if g.name.startswith("compile_sm")] == ["compile_sm90"]


def test_a_checker_that_cannot_run_skips_the_gate_and_says_why(monkeypatch, tmp_path):
    """A broken checker (this machine's Triton, an import error) is not the candidate's fault: the gate passes with
    the reason, so a CPU search loses nothing to it; a compiler rejection still fails."""
    from llm4llm.verify import aot, sandbox

    class Fake:
        def __init__(self, target, *, box, args, **kw):
            self.pid, self.returncode, self.args = 0, 1, args

        def communicate(self, timeout=None):
            return Fake.answer(self.args)

    monkeypatch.setattr(sandbox, "sandboxed_popen", Fake)
    Fake.answer = staticmethod(lambda args: ("", "ImportError: no triton backend"))
    g = aot.aot_gate(str(tmp_path), "def entry(inputs, weights, state, static):\n    return {}\n")
    assert g.passed and g.detail.startswith("skipped:") and "ImportError" in g.detail
    Fake.answer = staticmethod(lambda args: ('{"%s": ["_k: CompilationError"]}' % args[-2], ""))
    bad = aot.aot_gate(str(tmp_path), "x = 1\n")
    assert not bad.passed and "_k: CompilationError" in bad.detail


def test_pdl_and_prefetch_gemvs_compile_for_sm90():
    """The programmatic-dependent-launch GEMVs (griddepcontrol, sm_90 only) and the prefetching loop compile for the
    H200, and so do the one-split attention (its direct output and advance kernel), the TMA-fed GEMV pass and the
    kernel timeline's stamped builds; the interpreter runs them with PDL off and without stamps, so this is their only CPU check."""
    script = '''
import json, torch
from kernels_runtime.ops import gemv as G
from llm4llm.verify.aot import capture_launches, compile_launches
x = torch.randn(1, 256, dtype=torch.bfloat16)
w, wu, r = torch.randn(96, 256, dtype=torch.bfloat16), torch.randn(96, 256, dtype=torch.bfloat16), torch.randn(1, 96, dtype=torch.bfloat16)
nw = torch.rand(256, dtype=torch.bfloat16)
def calls():
    for pipe in (dict(PDL=True), dict(PREFETCH=True)):
        G.gemv(x, w, residual=r, BLOCK_N=4, BLOCK_K=128, **pipe)
        G.gemv(x, w, BLOCK_N=4, BLOCK_K=128, SPLIT_K=2, **pipe)
        G.gate_up_swiglu(x, w, wu, norm_w=nw, BLOCK_N=4, BLOCK_K=128, **pipe)
        G.gemv_residual_rmsnorm(x, w[:, :256], r, nw[:96], BLOCK_N=4, BLOCK_K=128, **pipe)
        G.qkv_norm_rope(x, w[:64], w[64:80], w[80:96], None, None, 16, norm_w=nw, BLOCK_N=4, BLOCK_K=128, **pipe)
        G.gate_up_swiglu(x, w, wu, norm_w=nw, BLOCK_N=8, BLOCK_K=128, TMA=3, **pipe)  # weight tiles by TMA
        G.gemv(x, w, residual=r, BLOCK_N=4, BLOCK_K=128, TMA=4, **pipe)
        # host-made descriptors as kernel parameters, the first tile before the wait, the next kernel let go late
        G.gate_up_swiglu(x, w, wu, norm_w=nw, BLOCK_N=8, BLOCK_K=128, TMA=3, TMA_PRE=True, TMA_LATE=True, **pipe)
        G.gemv(x, w, residual=r, BLOCK_N=4, BLOCK_K=128, TMA=4, TMA_PRE=True, **pipe)
def attn():
    from kernels_runtime.ops.attention_decode_static import attention_decode_static
    bf = torch.bfloat16
    q, k, v = torch.randn(1, 4, 1, 16, dtype=bf), torch.randn(1, 2, 1, 16, dtype=bf), torch.randn(1, 2, 1, 16, dtype=bf)
    kc, vc = torch.randn(1, 2, 64, 16, dtype=bf), torch.randn(1, 2, 64, 16, dtype=bf)
    cs = torch.randn(1, 1, 16, dtype=bf)
    attention_decode_static(q, k, v, kc, vc, torch.tensor(9), cs, cs, 0.25, q_norm_weight=torch.ones(16, dtype=bf),
                            k_norm_weight=torch.ones(16, dtype=bf), BLOCK_N=16, num_splits=2, PDL=True)
    n = torch.tensor(9)  # one split: the output written by stage 1, the length advanced by a one-program kernel
    attention_decode_static(q, k, v, kc, vc, n, cs, cs, 0.25, BLOCK_N=16, num_splits=1, PDL=True)
launches = capture_launches(calls) + capture_launches(attn)
pdl = [l for l in launches if l.options.get("launch_pdl")]
from kernels_runtime.ops import _common  # the kernel timeline's instrumented builds (%globaltimer, %smid)
_common.TIMELINE.update(buf=torch.zeros(1 << 12, 4, dtype=torch.int64), next=0, sites=[])
stamped = capture_launches(calls) + capture_launches(attn)
stamped = [l for l in stamped if l.constexprs.get("TIMELINE") is True]
print(json.dumps({"n": len(launches), "pdl": len(pdl), "errors": compile_launches(launches),
                  "tma": sum(l.name == "_gemv_tma_kernel" for l in launches),
                  "stamped": len(stamped), "stamped_errors": compile_launches(stamped),
                  "sites": len(_common.TIMELINE["sites"])}))
'''
    res = run_compiled(["-c", script], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["errors"] == [] and out["pdl"] >= 7, out
    assert out["stamped_errors"] == [] and out["stamped"] >= 3 and out["sites"] >= 3, out
    assert out["tma"] >= 4, out
