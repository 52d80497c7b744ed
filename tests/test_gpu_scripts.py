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
    res = _run(["scripts/gpu/trace_decode.py", "examples/workloads/tiny-llama.toml", "--out", str(out),
                "--skip-eager"])
    assert res.returncode == 2 and "--skip-eager" in res.stderr  # nothing left to trace without a bundle


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


def test_layer_bench_smoke_run(tmp_path):
    """scripts/gpu/layer_bench.py on a two-layer toy shape: every variant (the template's default and seeds, the
    PDL / prefetch / tile points), each the template's own rendered entry, runs the layer stack and matches the
    first variant; the PDL and PREFETCH points give their base's bits (under the interpreter PDL runs as
    PREFETCH). The seeds and one point of each kind (PDL off, the o_proj-reduction norm, prefetch, TMA) through
    --only: the other ~30 points are tile changes on the default, same code path, 3x the interpreter's time."""
    out = tmp_path / "layers.jsonl"
    only = ["default", "nopdl", "o_reduce_nopdl", "prefetch", "tma", "tma_gu", "tma_dn", *(f"seed{i}" for i in range(10))]
    res = _run(["scripts/gpu/layer_bench.py", "--device", "cpu", "--models", "tiny", "--out", str(out),
                "--only", ",".join(only)])
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 10 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {"default", "nopdl", "o_reduce_nopdl", "seed1"} <= {r["variant"] for r in rows}
    assert any(r["config"]["post_norm"] == "o_reduce" for r in rows if r["variant"].startswith("seed"))
    assert next(r for r in rows if r["variant"] == "seed0")["config"]["gu_TMA"] > 0  # the TMA seeds, first
    assert {"tma", "tma_gu", "tma_dn"} <= {r["variant"] for r in rows}
    assert next(r for r in rows if r["variant"] == "default")["config"]["pdl"] is True


def test_layer_bench_runs_a_left_padded_batch(tmp_path):
    """layer_bench.py --batch 3: the stack at three rows, the batch's mask among the entry's inputs, the batch
    default (tl.dot past one row, 3 stages, the post norm in o_proj's reduction) and its own points (the earlier
    default, q/k/v's input norm in its prologue), each passing the verifier's criterion
against the stack in plain PyTorch (bf16 and fp32)."""
    out = tmp_path / "layers.jsonl"
    res = _run(["scripts/gpu/layer_bench.py", "--device", "cpu", "--models", "tiny", "--batch", "3", "--out", str(out),
                "--only", "default,fma2,st2,prev_default,prologue_norm"])
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["default", "fma2", "st2", "prev_default", "prologue_norm"]
    assert all(r["ok"] and r["batch"] == 3 and r["kv_bytes"] > 0 for r in rows), rows
    default = rows[0]["config"]
    assert default["fma_max_m"] == 1 and default["dot_stages"] == 3 and default["post_norm_batch"] == "o_reduce"
    assert default["norm_pass"] is True
    assert rows[3]["config"]["dot_stages"] == 4 and rows[4]["config"]["norm_pass"] is False
    # each variant checked against the stack in plain PyTorch: no further from its fp32 form than eager bf16 is
    assert all(0 < r["err_vs_fp32"] <= 2 * r["eager_bf16_err_vs_fp32"] for r in rows), rows


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
