"""The acceptance and leaderboard views a person reads in the Prefect UI and the report: key columns in view at
the UI's width (short ids, a cut reason, few columns), and one row per distinct reason where a crash stopped every
trial, without an empty plot."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

import pandas as pd  # noqa: E402

from llm4llm import report  # noqa: E402

RUN = "tiny-llama-20261206T091500-a1b2c3"
CRASH = ("InterpreterError: RuntimeError(\"Cannot call @triton.jit'd outside of the scope of a kernel\") in "
         "the patched model's first forward, while the reference model ran; every later trial of the run failed the "
         "same way")
TASKS = [f"{fam}-{ph}-{i:012x}" for i, (fam, ph) in enumerate(
    [("recurrent_block", "decode"), ("norm", "prefill"), ("mlp", "decode")] * 8)]


def _decisions(crashed: int, measured: list[tuple[str, float]]) -> pd.DataFrame:
    rows = [{"task_id": t, "family": t.split("-")[0], "phase": t.split("-")[1], "candidate_id": f"{i:040x}",
             "decision": "rejected", "gain": None, "e2e_before_ms": None, "e2e_after_ms": None,
             "in_model_max_abs_err": None, "metric": "logits_rel_l2_floor", "reason": CRASH}
            for i, t in enumerate(TASKS[:crashed])]
    rows += [{"task_id": f"mlp-decode-{i:012x}", "family": "mlp", "phase": "decode", "candidate_id": f"{i:040x}",
              "decision": d, "gain": g, "e2e_before_ms": 100.0, "e2e_after_ms": 100.0 * (1 - g),
              "in_model_max_abs_err": 1e-3, "metric": "logits_rel_l2_floor",
              "reason": f"in-model correctness ok; {100 * g:+.1f} % against 2 %"} for i, (d, g) in enumerate(measured)]
    return pd.DataFrame(rows)


def _trials(n_tasks: int = 2) -> pd.DataFrame:
    return pd.DataFrame([
        {"search_id": f"s{k}", "task_id": TASKS[k], "family": "norm", "phase": "decode", "mode": "episodic",
         "proposer": "library", "episode": 0, "iteration": i, "candidate_id": f"{k}{i}".ljust(40, "f"),
         "template": "recurrent_block.rg_lru_decode_fused_with_conv_state", "passed": True, "failure_class": None,
         "utility": 1.0 + i, "speedup_in_context": None, "ctx_p50_ms": 0.5, "ref_ctx_p50_ms": 0.6,
         "pooled": 1.2 + i, "max_abs_err": 1e-4, "created_at": None}
        for k in range(n_tasks) for i in range(4)])


class _Reader:
    source = "memory"

    def __init__(self, **frames: pd.DataFrame):
        self.frames = frames

    def frame(self, name: str, *args) -> pd.DataFrame:
        return self.frames[name]


def _md_rows(md: str) -> list[list[str]]:
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]


def test_one_crash_reason_is_one_row_with_its_count_and_no_plot():
    ctx = report.ReportContext(_Reader(acceptances=_decisions(24, [])), RUN, "tiny-llama")
    block = report.acceptance(ctx)
    assert block.figures == []
    assert any("nothing to plot" in n for n in block.notes) and "0 accepted, 24 rejected" in block.notes[0]
    (name, table), = block.tables
    assert len(table) == 1 and table.iloc[0]["count"] == 24 and table.iloc[0]["reason"] == CRASH
    assert table.iloc[0]["task_id"].endswith("+21 more")


def test_measured_decisions_keep_their_rows_and_plot_beside_a_grouped_crash():
    a = _decisions(5, [("accepted", 0.12), ("rejected", 0.004)])
    block = report.acceptance(report.ReportContext(_Reader(acceptances=a), RUN, "tiny-llama"))
    assert len(block.figures) == 1
    table = block.tables[0][1]
    assert list(table["count"]) == [5, 1, 1] and list(table["decision"]) == ["rejected", "accepted", "rejected"]
    html = report.render_report(_Reader(acceptances=a, run_overview=pd.DataFrame([{"workload_name": "w"}])), RUN,
                                [s for s in report.SECTIONS if s.key == "acceptance"])
    assert html.count("Cannot call @triton.jit") == 1


def test_the_acceptance_artifact_keeps_its_columns_in_view():
    md = report.markdown("acceptance", _Reader(acceptances=_decisions(24, [("accepted", 0.12)])), RUN)
    header, *rows = _md_rows(md)
    assert header == ["#", "n", "task", "candidate", "decision", "gain_%", "e2e_ms"]
    assert len(rows) == 2 and [r[1] for r in rows] == ["24", "1"]
    assert all(len(r[3]) <= 8 for r in rows) and rows[1][6] == "100.0 -> 88.0"
    reasons = md.split("Reasons, by row:")[1].strip().splitlines()
    assert reasons == ["1. " + CRASH[:report.REASON_CHARS - 1].rstrip() + "…",
                       "2. in-model correctness ok; +12.0 % against 2 %"]


def test_the_leaderboard_artifact_keeps_its_columns_in_view():
    md = report.markdown("leaderboard", _Reader(trials=_trials()), RUN)
    header, *rows = _md_rows(md)
    assert header == ["task", "candidate", "template", "score", "p50_ms", "max_err"]
    assert len(rows) == 2 * 3  # the best three of each task
    assert all(len(r[1]) == 8 and len(r[2]) <= 32 for r in rows) and rows[0][2].endswith("…")
    assert all(len(r[0]) <= 40 for r in rows)


def test_clip():
    assert report.clip("abc", 3) == "abc" and report.clip("abcd", 3) == "ab…" and report.clip(None, 5) == ""
