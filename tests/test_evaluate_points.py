"""`llm4llm evaluate --batch-sizes --prompt-lens`: one row per variant per (batch, prompt) point, stored with its point
and printed as one table; the decode step's floor counts the KV cache the batch reads; the report plots throughput
against batch size when a run has rows at several batch sizes."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import duckdb
import time

import pytest
import torch

from llm4llm import evaluate as ev
from storage import repo
from storage.db import Database

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY = (EXAMPLES / "workloads" / "tiny-llama.toml").read_text()


def _tiny_workload(tmp_path, extra: str = "", decode_len: int = 3) -> Path:
    """tiny-llama with one layer and a short decode (the CPU test stays quick), its script beside it."""
    toml = (TINY.replace('"../scripts/hf_generate.py"', f'"{EXAMPLES / "scripts" / "hf_generate.py"}"')
            .replace("decode_len = 4", f"decode_len = {decode_len}").replace("num_hidden_layers = 2",
                                                                               "num_hidden_layers = 1"))
    path = tmp_path / "wl.toml"
    path.write_text(toml.replace("[model]", extra + "\n[model]") if extra else toml)
    return path


def _in_this_process(fn, *args, poll=None, outputs=None, readable=None, box=None, **kwargs):
    """isolation.in_subprocess without the sandboxed child (tests/test_evaluate_bundle_box.py covers that; a fresh
    process costs this test its imports again): fn writes its outputs where the parent reads them, then one poll."""
    try:
        return fn(*args, **(outputs or {}), **kwargs)
    finally:
        poll()


def test_two_batch_sizes_are_rows_of_their_point_in_duckdb_and_one_table(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from llm4llm import isolation
    from cli.main import app

    monkeypatch.setattr(isolation, "in_subprocess", _in_this_process)
    monkeypatch.setenv("COLUMNS", "120")
    db = tmp_path / "db.duckdb"
    res = CliRunner().invoke(app, ["evaluate", str(_tiny_workload(tmp_path, decode_len=3)), "--batch-sizes", "1,3",
                                   "--prompt-lens", "6", "--variants", "eager,patched", "--repeats", "2",
                                   "--db", str(db)])
    assert res.exit_code == 0, res.output
    with Database(db) as d:
        rows = d.query("SELECT batch_size, prompt_len, variant, decode_ms_per_token, decode_ms_p20, decode_ms_p80, "
                       "decode_tokens_per_s, total_samples_ms, notes FROM e2e_results ORDER BY batch_size, variant")
    assert [r[:3] for r in rows] == [(1, 6, "eager"), (1, 6, "patched"), (3, 6, "eager"), (3, 6, "patched")]
    for b, _, variant, step, p20, p80, tok, samples, notes in rows:
        if variant == "patched":  # no bundle: a row saying so at every point
            assert step is None and notes == "skipped: no bundle"
            continue
        assert len(json.loads(samples)) == 2 and p20 <= step <= p80
        # batch x decoded tokens / decode time (a CPU's noise can exceed a tiny step: then it reads 0, no rate)
        assert tok == pytest.approx(b * 1e3 / step) if step else tok is None
    table = res.output[res.output.index("end to end per point"):].splitlines()
    assert max(len(line) for line in table if "│" in line or "┃" in line) <= 120
    body = [line for line in table if line.startswith("│")]
    assert [line.split("│")[1:4] for line in body][::2] == [[" 1     ", " 6      ", " eager   "],
                                                            [" 3     ", " 6      ", " eager   "]]
    assert "3x6 patched: skipped: no bundle" in res.output


@pytest.mark.parametrize("args,expected", [
    (["--batch-sizes", "1,0"], "--batch-sizes: expected comma-separated whole numbers >= 1, got '1,0'"),
    (["--prompt-lens", "8,x"], "--prompt-lens: expected comma-separated whole numbers >= 1"),
    (["--batch-sizes", "regime"], "--batch-sizes regime: expected a workload that declares a regime, got none"),
    (["--prompt-lens", "126"], "--prompt-lens: expected prompt lengths + decode_len (4) within the model's "
                               "positions, got [126]"),
])
def test_bad_points_are_one_line_before_anything_runs(tmp_path, args, expected):
    from typer.testing import CliRunner

    from cli.main import app

    db = tmp_path / "db.duckdb"
    res = CliRunner().invoke(app, ["evaluate", str(EXAMPLES / "workloads" / "tiny-llama.toml"), *args, "--db",
                                   str(db)], env={"COLUMNS": "400"})
    assert res.exit_code == 2 and expected in " ".join(res.output.split()) and "Traceback" not in res.output
    assert not db.exists() or Database(db).query("SELECT count(*) FROM e2e_results")[0][0] == 0


def test_regime_batch_sizes_are_its_buckets_and_points_keep_the_regime(tmp_path):
    from llm4llm.workload import load_workload

    path = _tiny_workload(tmp_path, '[regime]\nbatch_sizes = {min = 1, max = 8}\nprompt_lens = {min = 4, max = 16}\n'
                                    'padding = "left"\n')
    wl = load_workload(path)
    points = ev.at_points(wl, wl.regime.batch_buckets(), (16, 8))
    assert [(p.batch_size, p.prompt_len) for p in points] == [(1, 16), (2, 16), (4, 16), (8, 16), (1, 8), (2, 8),
                                                              (4, 8), (8, 8)]
    assert all(p.regime == wl.regime and p.decode_len == wl.decode_len for p in points)
    with pytest.raises(ValueError, match=r"prompt_lens: expected .* got \[126\]"):
        ev.at_points(wl, None, (126,))
    assert [(p.batch_size, p.prompt_len) for p in ev.at_points(wl)] == [(1, 16)]


def _llama(dtype=torch.float32, **cfg):
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**base, **cfg}), dtype=dtype).eval()


def test_the_floor_counts_the_weights_and_the_kv_cache_of_the_batch(monkeypatch):
    model = _llama()
    weights = sum(p.numel() for p in model.parameters()) * 4
    # K and V, 2 layers, 2 KV heads of 64 / 4 = 16 dims, fp32
    assert ev.kv_bytes_per_token(model) == 2 * 2 * 2 * 16 * 4
    assert ev.decode_floor_bytes(model, 0) == weights
    assert ev.decode_floor_bytes(model, 100) == weights + 100 * 512
    # an explicit head_dim, bf16 and three layers: 2 x 3 x 2 x 32 x 2 bytes
    assert ev.kv_bytes_per_token(_llama(torch.bfloat16, head_dim=32, num_hidden_layers=3)) == 768
    ms, gbps = ev._hbm_floor(model, "cuda", kv_tokens=100, gbps=1000.0)
    assert gbps == 1000.0 and ms == pytest.approx((weights + 51200) / 1e12 * 1e3)
    assert ev._hbm_floor(model, "cpu", kv_tokens=100) is None


def test_the_kv_tokens_of_a_padded_batch_are_its_rows_own_lengths(tmp_path):
    """A mean decode step reads each row's unpadded prompt plus half the tokens decoded; without a mask, the whole
    batch x prompt."""
    from llm4llm.workload import call_script, load_script, load_workload

    path = _tiny_workload(tmp_path, '[regime]\nbatch_sizes = [1, 4]\nprompt_lens = {min = 4, max = 16}\n'
                                    'padding = "left"\n', decode_len=4)
    wl = load_workload(path).model_copy(update={"batch_size": 4, "prompt_len": 12})
    inputs = call_script(load_script(wl).inputs, wl)
    lens = wl.regime.row_prompt_lens(4, 12, wl.seed)
    assert len(set(lens)) > 1 and int(inputs["attention_mask"].sum()) == sum(lens)
    assert ev.decode_kv_tokens(inputs, wl) == sum(lens) + 4 * 4 / 2
    assert ev.decode_kv_tokens(inputs["input_ids"], wl) == 4 * 12 + 4 * 4 / 2


def test_point_rows_order_points_and_show_the_step_against_its_floor():
    rows = [{"variant": v, "batch_size": b, "prompt_len": p, "decode_ms_per_token": ms, "decode_ms_p20": ms * 0.9,
             "decode_ms_p80": ms * 1.2, "decode_tokens_per_s": b * 1e3 / ms, "vs_compile": 1.4, "vs_compile_p20": 1.3,
             "vs_compile_p80": 1.5, "gpu_step_ms": ms * 0.8 if v == "patched_graphs" else None,
             "hbm_floor_ms": ms * 0.5}
            for p in (2048, 128) for b in (32, 1) for v, ms in (("eager", 40.0), ("patched_graphs", 8.0))]
    shown = ev.point_rows(rows)
    assert [(r["prompt_len"], r["batch_size"]) for r in shown][::2] == [(128, 1), (128, 32), (2048, 1), (2048, 32)]
    eager, ours = shown[2], shown[3]
    assert eager["ms_per_step"] == "40.0 (36.0-48.0)" and eager["x_floor"] == ""
    assert ours["ms_per_step"] == "8.00 (7.20-9.60)" and ours["x_floor"] == "1.60x"
    assert ours["tokens_per_s"] == "4000" and ours["vs_compile"] == "1.40x (1.30-1.50)"
    assert list(shown[0]) == list(ev.POINT_COLUMNS)


def _run_with_e2e(db: Database, run_id: str, points: list[tuple[int, int]]) -> None:
    repo.record_profile_run(db, {"run_id": run_id, "workload_hash": "w", "workload_name": "tiny", "kind": "cli",
                                 "status": "ok", "started_at": datetime(2026, 12, 6), "device": "cuda"},
                            {"workload_hash": "w", "name": "tiny", "path": "/w/tiny.toml",
                             "config": {"batch_size": 8, "prompt_len": 128}}, [])
    repo.record_e2e(db, [{"run_id": run_id, "workload_hash": "w", "variant": v, "batch_size": b, "prompt_len": p,
                          "total_ms": 10.0 * b, "decode_ms_per_token": ms, "decode_ms_p20": ms * 0.9,
                          "decode_ms_p80": ms * 1.1, "decode_tokens_per_s": b * 1e3 / ms, "gpu_step_ms": ms * 0.9,
                          "hbm_floor_ms": ms * 0.6}
                         for b, p in points for v, ms in (("eager", 30.0 + b), ("patched_graphs", 5.0 + b / 8))])


def test_the_report_plots_throughput_against_batch_only_with_several_batch_sizes(tmp_path):
    """The plot and its table where a run has rows at several batch sizes, no section where it has one; the
    history keeps to each workload's own point."""
    from llm4llm.report import SECTIONS, render_report
    from storage.report_queries import ReportReader

    from tests.test_report import _is_png, _parse

    with Database(tmp_path / "r.duckdb") as db:
        _run_with_e2e(db, "several", [(1, 128), (8, 128), (32, 128), (1, 2048), (8, 2048)])
        _run_with_e2e(db, "one", [(8, 128), (8, 2048)])
        reader = ReportReader(db)
        several = _parse(render_report(reader, "several"))
        one = _parse(render_report(reader, "one"))
        history = reader.frame("e2e_history", "tiny")
    assert "throughput" in [s.key for s in SECTIONS]
    plot = several["throughput"]
    assert len(plot["imgs"]) == 1 and _is_png(plot["imgs"][0])
    assert plot["tables"] == {"throughput per point": 1 + 10}
    assert several["e2e"]["tables"]["end to end"] == 1 + 10
    assert "throughput" not in one and "e2e" in one
    # the history compares runs at the workload's own point (batch 8, prompt 128) only
    assert sorted(zip(history["run_id"], history["variant"])) == [("one", "eager"), ("one", "patched_graphs"),
                                                                   ("several", "eager"), ("several", "patched_graphs")]
    assert set(history["total_ms"]) == {80.0}


def test_rows_from_before_the_points_keep_their_workloads_point(tmp_path):
    """A file migrated from before 016: each e2e row takes its workload's batch_size and prompt_len (0 where the
    workload is unknown), and a run may then hold one row per variant per point."""
    from storage.db import _migrations

    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name VARCHAR, "
                "applied_at TIMESTAMP DEFAULT current_timestamp)")
    for version, name, sql in _migrations():
        if version < 16:
            con.execute(sql)
            con.execute("INSERT INTO schema_version (version, name) VALUES (?, ?)", [version, name])
    con.execute("INSERT INTO workloads (workload_hash, name, path, config_json) VALUES ('w', 'a', '/a.toml', ?)",
                [json.dumps({"batch_size": 4, "prompt_len": 64})])
    con.execute("INSERT INTO e2e_results (run_id, workload_hash, variant, total_ms, total_samples_ms) VALUES "
                "('r0', 'w', 'eager', 9.5, '[9.0, 10.0]'), ('r1', 'gone', 'eager', 3.0, NULL)")
    con.close()
    with Database(path) as db:
        assert db.query("SELECT run_id, batch_size, prompt_len, total_ms, total_samples_ms FROM e2e_results "
                        "ORDER BY run_id") == [("r0", 4, 64, 9.5, "[9.0, 10.0]"), ("r1", 0, 0, 3.0, None)]
        repo.record_e2e(db, [{"run_id": "r0", "workload_hash": "w", "variant": "eager", "batch_size": b,
                              "prompt_len": 64, "total_ms": 1.0} for b in (1, 4)])
        assert db.query("SELECT batch_size, total_ms FROM e2e_results WHERE run_id = 'r0' ORDER BY batch_size") == \
            [(1, 1.0), (4, 1.0)]


FAKE = '''
import time
import torch

SEEN = []


def build(workload):
    return torch.nn.Linear(4, 4)


def inputs(workload):
    SEEN.append((workload.batch_size, workload.prompt_len))
    return torch.zeros(workload.batch_size, 4)


def run(model, workload, inputs):
    time.sleep(0.002 * model.cost * inputs.shape[0] * (1 if workload.decode_len == 1 else 3))
'''


def test_each_variant_is_set_up_once_and_measured_afresh_at_every_point(tmp_path, monkeypatch):
    """Two points share one set-up per variant; each point's rows hold that point's runs only (every round of it),
    its ratio paired within the point."""
    (tmp_path / "s.py").write_text(FAKE)
    (tmp_path / "wl.toml").write_text(TINY.replace('"../scripts/hf_generate.py"', '"s.py"'))
    set_up = []

    def setup(variant, model, clean, wl, script, bundle):
        m = clean() if variant != "eager" else model
        m.cost = {"eager": 2.0, "patched": 1.0}[variant]
        set_up.append((variant, wl.batch_size))
        setup.script = script
        return ev._Slot(variant, m)

    monkeypatch.setattr(ev, "_setup", setup)
    rows = ev.evaluate_workload(str(tmp_path / "wl.toml"), variants=("eager", "patched"), repeats=4,
                                batch_sizes=(1, 4))
    assert set_up == [("eager", 1), ("patched", 1)]
    assert setup.script.SEEN == [(1, 16), (4, 16)]
    assert [(r.variant, r.batch_size, r.prompt_len) for r in rows] == [("eager", 1, 16), ("patched", 1, 16),
                                                                       ("eager", 4, 16), ("patched", 4, 16)]
    one, four = rows[0], rows[2]
    assert len(one.total_samples_ms) == len(four.total_samples_ms) == len(four.prefill_samples_ms) == 4
    assert min(four.total_samples_ms) > max(one.total_samples_ms)  # batch 4's runs only: 4x the sleep of batch 1's
    ours = rows[3]
    assert 1.5 < ours.vs_eager < 2.6 and ours.decode_tokens_per_s == pytest.approx(4e3 / ours.decode_ms_per_token)


def test_a_point_after_the_first_is_not_started_past_the_deadline(tmp_path, monkeypatch):
    """A run's evaluation ends near its time budget: the first point is measured whatever the deadline (one
    interleaved round at least), a later point is not started once the deadline has passed; its rows say why."""
    (tmp_path / "s.py").write_text(FAKE)
    (tmp_path / "wl.toml").write_text(TINY.replace('"../scripts/hf_generate.py"', '"s.py"'))
    def setup(variant, model, clean, wl, script, bundle):
        model.cost = 1.0
        return ev._Slot(variant, model)

    monkeypatch.setattr(ev, "_setup", setup)
    rows = ev.evaluate_workload(str(tmp_path / "wl.toml"), variants=("eager",), repeats=2, batch_sizes=(1, 4),
                                deadline=time.time() - 1.0, results_path=None)
    assert [(r.variant, r.batch_size) for r in rows] == [("eager", 1), ("eager", 4)]
    assert rows[0].total_ms is not None and len(rows[0].total_samples_ms) == 2
    assert rows[1].total_ms is None and rows[1].notes == ev.PAST_DEADLINE


def test_a_point_that_would_end_past_the_deadline_is_not_started(tmp_path, monkeypatch):
    """The deadline is still ahead after the first point, but less of it is left than that point took: the second
    point (which recompiles and warms up again) is not started, so the run ends inside its budget."""
    (tmp_path / "s.py").write_text(FAKE)
    (tmp_path / "wl.toml").write_text(TINY.replace('"../scripts/hf_generate.py"', '"s.py"'))
    now = [1000.0]  # the clock: each point takes 10 s of it

    def setup(variant, model, clean, wl, script, bundle):
        model.cost = 1.0
        return ev._Slot(variant, model)

    def point(*args, **kwargs):
        out = real_point(*args, **kwargs)
        now[0] += 10.0
        return out

    real_point = ev._evaluate_point
    monkeypatch.setattr(ev, "_setup", setup)
    monkeypatch.setattr(ev, "_evaluate_point", point)
    monkeypatch.setattr(ev.time, "time", lambda: now[0])
    rows = ev.evaluate_workload(str(tmp_path / "wl.toml"), variants=("eager",), repeats=2, batch_sizes=(1, 4),
                                deadline=1015.0, results_path=None)
    assert rows[0].total_ms is not None
    assert rows[1].total_ms is None and rows[1].notes == ev.PAST_DEADLINE


def test_a_time_budget_is_shared_by_the_points_still_to_run(monkeypatch):
    vs = ev._Variants(None, lambda: None, None, None, lambda r: None, max_s=10.0, deadline=None)
    assert vs.budget(2) == 5.0
    vs.spent_s = 4.0
    assert vs.budget(3) == 2.0
    monkeypatch.setattr(ev.time, "time", lambda: 1000.0)
    vs.deadline = 1003.0  # sooner than what max_s leaves
    assert vs.budget(3) == 1.0
    vs.deadline = 990.0  # past: no time, yet _rounds still runs one interleaved round
    assert vs.budget(1) == 0.0
    assert ev._Variants(None, lambda: None, None, None, lambda r: None, None, None).budget(2) is None


def test_optimize_evaluates_a_regime_at_its_representative_and_largest_batch(tmp_path):
    """The run's evaluation (llm4llm.evaluate.eval_batches): a workload with a [regime] is measured at its batch_size
    and at the regime's largest decode bucket; without a regime at its batch_size alone (None); batches the
    settings name win."""
    from llm4llm.evaluate import eval_batches
    from llm4llm.config import EvaluateSettings

    serving = _tiny_workload(tmp_path, "[regime]\nbatch_sizes = {min = 1, max = 32}\nprompt_lens = [16]\n")
    text = serving.read_text().replace("batch_size = 1", "batch_size = 8")
    serving.write_text(text)
    assert eval_batches(str(serving), EvaluateSettings()) == [8, 32]
    assert eval_batches(str(serving), EvaluateSettings(batch_sizes=[4])) == [4]
    plain = tmp_path / "plain"
    plain.mkdir()
    assert eval_batches(str(_tiny_workload(plain)), EvaluateSettings()) is None
    with pytest.raises(ValueError):
        EvaluateSettings(batch_sizes=[0])


def test_the_closing_lines_give_one_result_per_point():
    """Rows at two points end the run with one result line each, named by its point; rows at one point keep the
    single unnamed line."""
    from llm4llm.outcome import summary_lines

    def row(variant, b, ms, vs=None):
        return {"variant": variant, "batch_size": b, "prompt_len": 512, "total_ms": ms, "vs_compile": vs,
                "vs_compile_p20": vs, "vs_compile_p80": vs, "repeats": 3}

    rows = [row("patched_graphs", 8, 300.0, 1.4), row("torch_compile", 8, 420.0),
            row("patched_graphs", 32, 700.0, 1.3), row("torch_compile", 32, 910.0)]
    lines = summary_lines(rows, None, [], {}, 10.0, None, "cuda")
    assert lines[0].startswith("result at batch 8, prompt 512: patched_graphs 300.0 ms") and "1.40x" in lines[0]
    assert lines[1].startswith("result at batch 32, prompt 512: patched_graphs 700.0 ms") and "1.30x" in lines[1]
    one = summary_lines(rows[:2], None, [], {}, 10.0, None, "cuda")
    assert one[0].startswith("result: patched_graphs 300.0 ms")
