"""The device scripts under scripts/ run end to end on the CPU (smoke runs: their numbers mean nothing here), so a
device call is never the first place one of them breaks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_trace_decode_writes_a_trace_and_a_summary(tmp_path):
    out = tmp_path / "trace"
    res = _run(["scripts/gpu/trace_decode.py", "examples/workloads/tiny-llama.toml", "--out", str(out),
                "--decode-len", "2"])
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["decode_len"] == 2 and [r["variant"] for r in summary["rows"]] == ["eager"]
    assert summary["rows"][0]["wall_ms"] > 0
    assert (out / "eager.json.gz").stat().st_size > 0 and "Self CPU" in (out / "eager.txt").read_text()


def test_dispatch_overhead_smoke_run(tmp_path):
    out = tmp_path / "dispatch.jsonl"
    res = _run(["scripts/gpu/dispatch_overhead.py", "--device", "cpu", "--calls", "5", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["measure"] for r in rows} == {"identity_back_to_back", "triton_back_to_back"}
    for r in rows:
        if r["measure"] == "identity_back_to_back":  # what the dispatch adds over the module call itself
            assert 0 < r["module_call_us"] < r["patched_us"] and r["overhead_us"] > 0
    real = next(r for r in rows if r["measure"] == "triton_back_to_back")
    assert real["patched_equals_direct"] is True  # the patched module returned the kernel's own result


def test_graph_diag_smoke_run_and_bad_arguments(tmp_path):
    """graph_diag.py with the emulating graph backend on a tiny Mamba2: a row per variant, the decode template's
    graph captured and replayed; an unknown template or a config that is not a JSON object is one usage error."""
    out = tmp_path / "diag.json"
    res = _run(["scripts/gpu/graph_diag.py", "examples/workloads/tiny-mamba2.toml", "--template",
                "ssm_mixer.mamba2_decode_fused", "--graphs-only", "--emulate", "--repeats", "1", "--out", str(out),
                "--save-bundle", str(tmp_path / "bundle")])
    assert res.returncode == 0, res.stderr[-2000:]
    from kernels_runtime import load_bundle
    saved = load_bundle(tmp_path / "bundle")  # for trace_decode.py --bundle: the last row's patch, graphs on
    assert saved.decode_graphs and [p.module_class.rsplit(".", 1)[1] for p in saved.patches] == ["Mamba2Mixer"]
    trace = tmp_path / "trace"  # the saved bundle traced without the eager run (a slow model's fills the limit)
    res = _run(["scripts/gpu/trace_decode.py", "examples/workloads/tiny-mamba2.toml", "--out", str(trace),
                "--decode-len", "2", "--bundle", str(tmp_path / "bundle"), "--skip-eager"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert [r["variant"] for r in json.loads((trace / "summary.json").read_text())["rows"]] == ["patched"]
    res = _run(["scripts/gpu/trace_decode.py", "examples/workloads/tiny-mamba2.toml", "--out", str(trace),
                "--skip-eager"])
    assert res.returncode == 2 and "--skip-eager" in res.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"eager", "eager_graphs", "ssm_mixer.mamba2_decode_fused#0+graphs"}
    patched = rows["ssm_mixer.mamba2_decode_fused#0+graphs"]
    assert patched["graphs"]["graphs"] == 1 and patched["graphs"]["replays"] > 0 and patched["calls"]["kernel"] > 0
    for bad in (["--template", "nope"], ["--template", "ssm_mixer.mamba2_decode", "--config", "[1"]):
        res = _run(["scripts/gpu/graph_diag.py", "examples/workloads/tiny-mamba2.toml", *bad, "--out", str(out)])
        assert res.returncode == 2 and "error:" in res.stderr and "Traceback" not in res.stderr


def test_decode_step_ops_counts_kernels_per_layer(tmp_path):
    """scripts/decode_step_ops.py on tiny Mamba: the HF decode step's kernels per layer, fewer once the fused
    decode template runs (its Triton launches counted, the interpreter's own tensor traffic not), and the
    extrapolation to the real layer count; an unknown template or a --layers-of file without a model type is one
    usage error before anything runs."""
    counts = {}
    for name, extra in (("hf", []), ("fused", ["--template", "ssm_mixer.mamba_decode_fused"])):
        out = tmp_path / f"{name}.json"
        res = _run(["scripts/decode_step_ops.py", "examples/workloads/tiny-mamba.toml", "--layers-of",
                    "examples/workloads/mamba-130m.toml", *extra, "--json", str(out)])
        assert res.returncode == 0, res.stderr[-2000:]
        counts[name] = json.loads(out.read_text())
    hf, fused = counts["hf"], counts["fused"]
    assert hf["triton"] == 0 and fused["triton"] == 8  # 4 launches per layer (x_proj its own GEMV), 2 layers, a step
    assert hf["per_layer"]["MambaBlock"][0] > 2 * fused["per_layer"]["MambaBlock"][0] > 0
    assert hf["layers"] == 24 and hf["estimate"] == hf["outside"] + 24 * hf["per_layer"]["MambaBlock"][0]
    res = _run(["scripts/decode_step_ops.py", "examples/workloads/tiny-mamba.toml", "--template", "nope"])
    assert res.returncode == 2 and "template: expected one of" in res.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "no-model-type"\n[model]\n')
    res = _run(["scripts/decode_step_ops.py", "examples/workloads/tiny-mamba.toml", "--layers-of", str(bad)])
    assert res.returncode == 2 and "--layers-of: expected [model] model_type" in res.stderr
    assert "Traceback" not in res.stderr


def test_task_timing_check_smoke_run_and_bad_arguments(tmp_path):
    """task_timing_check.py on tiny Mamba2 without CUDA: the fused decode template's candidate runs through the
    dispatch (the kernel, not the fallback) and the module once each; a prefill template or a non-object config is
    one usage error."""
    out = tmp_path / "tt.json"
    res = _run(["scripts/gpu/task_timing_check.py", "examples/workloads/tiny-mamba2.toml", "--template",
                "ssm_mixer.mamba2_decode_fused", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["task"].startswith("ssm_mixer-decode-") and got["config"]["state_inplace"] is True
    cand, ref = got["rows"]
    assert cand["who"] == "candidate" and cand["kernel_calls"] == 1 and ref["who"] == "reference"
    for bad in (["--template", "ssm_mixer.mamba2"], ["--template", "ssm_mixer.mamba2_decode", "--config", "[1]"]):
        res = _run(["scripts/gpu/task_timing_check.py", "examples/workloads/tiny-mamba2.toml", *bad, "--out", str(out)])
        assert res.returncode == 2 and "error:" in res.stderr and "Traceback" not in res.stderr


def test_layer_bench_smoke_run(tmp_path):
    """scripts/gpu/layer_bench.py on a two-layer toy shape: every variant (the template's default and seeds, the
    PDL / prefetch / tile points), each the template's own rendered entry, runs the layer stack and matches the
    first variant; the PDL and PREFETCH points give their base's bits (under the interpreter PDL runs as
    PREFETCH)."""
    out = tmp_path / "layers.jsonl"
    res = _run(["scripts/gpu/layer_bench.py", "--device", "cpu", "--models", "tiny", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 10 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {"default", "nopdl", "o_reduce_nopdl", "seed1"} <= {r["variant"] for r in rows}
    assert any(r["config"]["post_norm"] == "o_reduce" for r in rows if r["variant"].startswith("seed"))
    assert next(r for r in rows if r["variant"] == "seed0")["config"]["gu_TMA"] > 0  # the TMA seeds, first
    assert {"tma", "tma_gu", "tma_dn"} <= {r["variant"] for r in rows}
    assert next(r for r in rows if r["variant"] == "default")["config"]["pdl"] is True


def test_tilemix_bench_records_the_committed_frontier_into_duckdb(tmp_path):
    """`tilemix_bench.py record` (what `frontier --db` runs after its rows are written) on the committed H200
    rows: every frontier row lands in `tilemix_frontier` under the bench id and workload, once even if recorded
    twice; without --db it is a usage error."""
    rows = ROOT / "docs/results/2026-12-01-h200-tilemix/frontier.jsonl"
    db = tmp_path / "t.duckdb"
    args = ["scripts/gpu/tilemix_bench.py", "record", "--rows", str(rows), "--db", str(db), "--bench-id", "h200-1201",
            "--workload", "qwen3-4b-long", "--gpu", "NVIDIA H200"]
    for _ in range(2):
        res = _run(args)
        assert res.returncode == 0, res.stderr[-2000:]
    from storage import report_queries as q
    from storage.db import Database

    with Database(db, read_only=True) as con:
        got = q.tilemix_frontier(con, "some-run", "qwen3-4b-long")
    want = [json.loads(line) for line in rows.read_text().splitlines() if '"kind": "frontier"' in line]
    assert len(got) == len(want) == 60 and set(got["bench_id"]) == {"h200-1201"}
    assert set(got["gpu_name"]) == {"NVIDIA H200"} and set(got["heads_q"]) == {32}
    res = _run(["scripts/gpu/tilemix_bench.py", "record", "--rows", str(rows)])
    assert res.returncode == 2 and "expected --rows FILE and --db FILE" in res.stderr


def test_tilemix_layer_smoke_run(tmp_path):
    """`tilemix_bench.py layer` at a tiny Qwen3 shape: every variant timed, the HF layer reaches the attention
    function with q a transposed view and k, v the cache's contiguous copies and no mask, and the kernel gives the
    same bits on the model's layouts as on contiguous copies (and through the attention function)."""
    res = _run(["scripts/gpu/tilemix_bench.py", "layer", "--device", "cpu", "--arch", "tiny", "--seq", "128",
                "--rounds", "1", "--out", str(tmp_path)])
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "layer.jsonl").read_text().splitlines()]
    check = next(r for r in rows if r["kind"] == "layer_check")
    assert check["hf_mask_is_none"] and check["kernel_layouts_equal"] and check["fwd_equals_kernel"]
    assert check["strides"]["q"] == [128 * 4 * 64, 64, 4 * 64, 1] and check["strides"]["k"] == [2 * 128 * 64,
                                                                                                128 * 64, 64, 1]
    assert check["layer_rel_l2_vs_sdpa"] < 0.05 and check["template_rel_l2_vs_sdpa"] < 0.05
    assert any("scaled_dot_product" in op for op in check["sdpa_ops"])
    timed = {r["variant"] for r in rows if r["kind"] == "layer"}
    assert {"hf_layer_sdpa", "hf_layer_tilemix", "template_entry", "sdpa_default", "tilemix_fwd",
            "kernel_model_layout", "kernel_contiguous", "quantize_q", "quantize_k", "sdpa_flash"} <= timed
