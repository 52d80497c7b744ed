"""decoder_layer.decode_static at decode batches: tiny-qwen3 (q/k norms, GQA) extracted on the static cache at batch
3 with a regime of batches 1 and 20, fp32, Triton interpreter. The layer's GEMVs take every row of the batch in one
weight pass (the FMA reduction up to `fma_max_m` rows, tl.dot tiles past it), keep their fusions (the paired
gate/up + SwiGLU pass) at batch 20, and the layer equals the eager module's outputs (the captured cases) there; the
search space gets the batch key only for tasks with batches."""
from __future__ import annotations

from pathlib import Path

import pytest

from kernels_runtime.tolerances import assert_close
from llm4llm.taskspec import load_task

WORKLOADS = Path(__file__).resolve().parents[1] / "examples" / "workloads"
NAME = "decoder_layer.decode_static"


def _template(name):
    from llm4llm.search.templates import TEMPLATES

    return next(t for t in TEMPLATES if t.name == name)


@pytest.fixture(scope="module")
def batch_layer(tmp_path_factory):
    """(task dir, task) of tiny-qwen3's decoder-layer decode task captured at batches 3 (the workload), 1 and 20."""
    from llm4llm.stages.extract import run_extract
    from llm4llm.stages.profile import run_profile

    tmp = tmp_path_factory.mktemp("batch-layer")
    text = (WORKLOADS / "tiny-qwen3.toml").read_text().replace("batch_size = 1", "batch_size = 3")
    text = text.replace('"../scripts/hf_generate.py"', f'"{WORKLOADS.parent / "scripts" / "hf_generate.py"}"')
    wl = tmp / "w.toml"
    wl.write_text(text.replace("decode_len = 4", "decode_len = 2")
                  + "\n[regime]\nbatch_sizes = [1, 20]\nprompt_lens = [16]\n")
    data = tmp / "data"
    run_extract(str(wl), run_profile(str(wl), str(data)), str(data), static_cache=True)
    d = next(d for d in sorted((data / "tasks").iterdir()) if d.name.startswith("decoder_layer-decode-"))
    return d, load_task(d)


def _gemv_launches(monkeypatch):
    from kernels_runtime.ops import gemv as G

    seen = []
    real = G.launch

    def spy(fn, grid, args, cx, **kw):
        seen.append((fn.__name__, tuple(grid)[-1], cx.get("DOT"), args[0].shape[0]))  # x: [M, K]
        return real(fn, grid, args, cx, **kw)

    monkeypatch.setattr(G, "launch", spy)
    return seen


def _run_case(task, source, case, tmp_path, monkeypatch):
    from llm4llm.verify.candidate import load_candidate, unload_candidate

    mod = load_candidate(source, tmp_path, "batch_layer_candidate")
    seen = _gemv_launches(monkeypatch)
    try:
        state = {n: t.clone() for n, t in case.state.items()}
        out = mod.entry(dict(case.inputs), dict(case.weights), state, dict(task.spec.static))
    finally:
        unload_candidate("batch_layer_candidate")
        monkeypatch.undo()
    return out, seen


def test_batch_task_gets_the_rows_key_and_batch_one_does_not(batch_layer, tiny_extracted):
    spec = batch_layer[1].spec
    assert sorted({c.inputs["hidden_states"].shape[0] for c in spec.cases}) == [1, 3, 20]
    tpl = _template(NAME)
    assert tpl.space(spec)["fma_max_m"] == [1, 2, 4, 8, 16] and tpl.default(spec)["fma_max_m"] == 1
    assert tpl.space(spec)["dot_stages"] == [3, 4, 2] and tpl.default(spec)["dot_stages"] == 3
    assert tpl.default(spec)["post_norm_batch"] == "o_reduce" and tpl.default(spec)["qkv_DOT_BLOCK_N"] == 64
    # the cache split is left to the op per call (rows x KV heads) at a batch; batch 1 keeps the fixed split
    assert tpl.default(spec)["attn_num_splits"] is None
    one = load_task(next(d for d in tiny_extracted("tiny-qwen3+static")
                         if d.name.startswith("decoder_layer-decode-"))).spec
    assert "fma_max_m" not in tpl.space(one) and "post_norm_batch" not in tpl.space(one)
    assert isinstance(tpl.default(one)["attn_num_splits"], int)


@pytest.mark.parametrize("fma_max_m,dot_rows", [(16, {20}), (2, {3, 20})])
def test_layer_at_a_batch_equals_eager_with_one_weight_pass(batch_layer, fma_max_m, dot_rows, tmp_path,
                                                            monkeypatch):
    """Every captured batch (1, 3, 20) against the eager module's outputs and cache; each GEMV one row block, on
    tl.dot exactly for the batches past fma_max_m; gate/up one paired launch at every batch (no SwiGLU reduce)."""
    _, task = batch_layer
    tpl = _template(NAME)
    config = {**tpl.default(task.spec), "fma_max_m": fma_max_m, "attn_num_splits": 4, "attn_BLOCK_N": 16,
              **{p + "BLOCK_N": 32 for p in ("qkv_", "o_", "gu_", "dn_")}}
    source = tpl.render(task.spec, config)
    for case in task.cases:
        rows = case.inputs["hidden_states"].shape[0]
        out, seen = _run_case(task, source, case, tmp_path, monkeypatch)
        assert_close(out["out"], case.ref["out"], name=f"out at batch {rows}")
        for name in ("key_cache", "value_cache"):
            assert_close(out["state_out." + name], case.ref["state_out." + name], name=f"{name} at batch {rows}")
        gemvs = [s for s in seen if s[0] == "_gemv_kernel"]
        assert len(gemvs) == 4 and "_swiglu_reduce_kernel" not in {s[0] for s in seen}, seen
        assert all(blocks == 1 and m == rows and dot == (rows in dot_rows) for _, blocks, dot, m in gemvs), seen


def test_layer_at_batches_passes_the_verifier(batch_layer):
    """The verifier's gates (every captured case and a fresh draw) with tl.dot from 2 rows."""
    from llm4llm.verify.gates import run_gates

    task_dir, task = batch_layer
    tpl = _template(NAME)
    config = {**tpl.default(task.spec), "fma_max_m": 1, "attn_num_splits": 4, "attn_BLOCK_N": 16}
    v, _ = run_gates(str(task_dir), tpl.render(task.spec, config), device="cpu", draws=1, timing=False)
    assert v.passed, f"{v.failure_class}: {v.message}"
