"""The README's command as the planner runs it: the plan and the stage progress on the console and in DuckDB, the
most valuable target accepted before the rest are searched, what an interrupted run leaves, and the closing lines.

On a CPU the latency gate never accepts a patch, so the test that needs an accepted bundle replaces the acceptance
step with one that accepts (it writes a real bundle through kernels_runtime.save_bundle and records it as the real
step does): what is under test is the flow's order and the CLI's handling of the stop, not acceptance itself
(tests/test_accept.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from llm4llm.outcome import OptimizeResult
from llm4llm.stages.accept import AcceptSummary
from storage import repo
from storage.db import Database

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "workloads"


def _cli(args: list[str]):
    """The CLI in this process. Prefect binds its console log handler to the sys.stderr of the moment it configures
    logging, which inside CliRunner.invoke is the runner's stream, closed afterwards: configured again around each
    call, a later flow run in this process does not log to a closed stream."""
    from prefect.logging.configuration import setup_logging
    from typer.testing import CliRunner

    from cli.main import app

    setup_logging(incremental=False)
    try:
        return CliRunner().invoke(app, args)
    finally:
        setup_logging(incremental=False)


def test_the_default_command_plans_reports_progress_and_ends_with_a_summary(prefect_harness, tmp_path):
    """No --top: the plan searches its targets in order of expected saving, the decode layer among them and not
    the modules inside it; every stage and trial is a line of output with the clock; the plan and the stage times
    are rows. (tiny-llama's CPU profile moves with the host's load, prefill's share from 0.3 to 0.97 under the
    suite's two workers, so the decode layer's expected saving can fall under the default delta: --phase decode
    --delta 0.001 keep it a target whatever the profile, and the test holds to what does not depend on it.)"""
    db = tmp_path / "db.duckdb"
    res = _cli(["optimize", str(EXAMPLES / "tiny-llama.toml"), "--db", str(db), "--data-dir", str(tmp_path / "d"),
                "--stages", "profile,extract,search", "--budget", "1", "--time-budget", "4m",
                "--phase", "decode", "--delta", "0.001"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "/ 4:00] profile: started" in out and "task(s) to search, expected end-to-end saving" in out
    assert "fallback  attention-decode-" in out and "searched only if that fails" in out
    assert "search decoder_layer-decode-" in out and ": trial 1/1 decoder_layer." in out
    assert out.strip().splitlines()[-1].startswith("time: ") and "of the 4:00 budget" in out
    with Database(str(db)) as d:
        run_id = repo.list_runs(d)["run_id"].iloc[0]
        plan = repo.plan_rows(d, run_id)
        stages = repo.stage_time_rows(d, run_id)
        searched = d.query("select t.family, t.phase from searches s join tasks t using (task_id) order by s.started_at")
    targets = plan[plan["action"] == "search"]
    assert list(targets["saving"]) == sorted(targets["saving"], reverse=True) and (plan["budget_s"] == 240).all()
    assert searched == list(zip(targets["family"], targets["phase"]))  # in the plan's order
    assert ("decoder_layer", "decode") in searched
    assert ("attention", "decode") not in searched and ("mlp", "decode") not in searched  # inside the layer
    assert list(stages["stage"])[:3] == ["profile", "extract", "plan"] and "search" in set(stages["stage"])
    assert stages[stages["stage"] == "search"]["trials"].sum() == len(searched)


def test_an_interrupted_run_keeps_the_bundle_of_its_first_target(prefect_harness, tmp_path, monkeypatch):
    """The first target is searched and accepted alone; Ctrl-C in what follows (the next target's search, or the
    evaluation when the plan has one target: tiny-llama's CPU profile decides) ends the command (exit 130) with the
    bundle accepted so far and the line that installs it."""
    import flows.optimize as opt
    from kernels_runtime.bundle import PatchBundle, save_bundle

    db = tmp_path / "db.duckdb"
    order: list[str] = []
    real_search = opt.search_task

    def search(task_dir, *a, **kw):
        order.append(f"search {Path(task_dir).name}")
        if sum(o.startswith("search") for o in order) > 1:
            raise KeyboardInterrupt
        return real_search(task_dir, *a, **kw)

    def accept(workload_path, run_id, cfg, db_path, data_dir, task_ids=None, base_bundle=None, graphs=None,
               deadline=None, bundle_deadline=None):
        order.append(f"accept {','.join(task_ids)}")
        path = save_bundle(PatchBundle(name="tiny-llama", decode_graphs=False), Path(data_dir) / "bundles" / run_id)
        with Database(db_path) as d:
            repo.record_patch_bundle(d, {"bundle_id": f"{run_id}-bundle", "run_id": run_id, "workload_hash": "h",
                                         "bundle_path": str(path), "manifest_json": {}})
        return AcceptSummary(bundle=str(path), accepted=1, accepted_tasks=tuple(task_ids))

    def evaluate(*a, **kw):
        order.append("evaluate")
        raise KeyboardInterrupt

    monkeypatch.setattr(opt, "search_task", search)
    monkeypatch.setattr(opt, "accept_patches", accept)
    monkeypatch.setattr(opt, "evaluate_e2e", evaluate)
    # the flow's order is under test, not which module is searched: RMSNorm targets (verified in a second under the
    # interpreter; the fused decoder layer costs ~25 s of applicability checks in the plans), --delta 0.001 keeps
    # them targets whatever the host's load makes of the CPU profile
    res = _cli(["optimize", str(EXAMPLES / "tiny-llama.toml"), "--db", str(db), "--data-dir", str(tmp_path / "d"),
                "--budget", "1", "--family", "norm", "--delta", "0.001"])
    assert res.exit_code == 130, res.output
    assert [o.split()[0] for o in order][:2] == ["search", "accept"] and order[2].split()[0] in ("search", "evaluate")
    assert len(order) == 3
    assert order[1] == f"accept {order[0].split()[1]}"  # the first target alone, before any other search
    with Database(str(db)) as d:
        bundle = d.query("select bundle_path from patches")[0][0]
    assert Path(bundle, "manifest.json").is_file()
    assert f"bundle accepted so far: {bundle}" in res.output
    assert f"install: kernels_runtime.apply(model, '{bundle}')" in res.output


def test_time_budget_flag_errors_are_one_line(tmp_path):
    res = _cli(["optimize", str(EXAMPLES / "tiny-llama.toml"), "--time-budget", "soon", "--db",
                str(tmp_path / "db.duckdb")])
    assert res.exit_code == 2 and "--time-budget: expected a duration" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "db.duckdb").exists()


@pytest.mark.parametrize("budget,expected", [("off", None), ("90s", 90.0)])
def test_time_budget_reaches_the_config(budget, expected, monkeypatch, tmp_path):
    import flows.optimize as opt

    seen = {}

    def fake(workload_path, cfg, db_path=None, data_dir=None, kind=None):
        seen["budget"] = cfg.time_budget_s
        return OptimizeResult(run_id="r")

    monkeypatch.setattr(opt, "optimize_workload", fake)
    monkeypatch.setattr("cli.main._print_run", lambda out, db: None)
    res = _cli(["optimize", str(EXAMPLES / "tiny-llama.toml"), "--time-budget", budget, "--db",
                str(tmp_path / "db.duckdb")])
    assert res.exit_code == 0, res.output
    assert seen["budget"] == expected


def test_each_command_is_a_run_of_its_own(prefect_harness, tmp_path):
    """A second optimize of the same workload reuses the cached profile but records a run of its own (its rows,
    plan and stage times stay apart from the first's; `runs.profile_of` names the run that measured the profile)."""
    db = tmp_path / "db.duckdb"
    args = ["optimize", str(EXAMPLES / "tiny-llama.toml"), "--db", str(db), "--data-dir", str(tmp_path / "d"),
            "--stages", "profile,extract"]
    for _ in range(2):
        res = _cli(args)
        assert res.exit_code == 0, res.output
    with Database(str(db)) as d:
        runs = d.query("select run_id, profile_of from runs order by started_at")
        per_run = d.query("select run_id, count(*) from stage_times group by 1 order by 1")
    assert len(runs) == 2 and runs[1][1] == runs[0][0]
    assert len(per_run) == 2 and all(n == 2 for _, n in per_run)  # profile, extract



def test_a_sandboxed_child_runs_triton_when_its_parent_never_set_the_interpreter(tmp_path):
    """A served run's process (a Prefect worker's flow run) has no CLI to set TRITON_INTERPRET on a CPU host; its
    acceptance child imported the kernels before setting it and every in-model check failed with "Cannot call
    @triton.jit'd outside of the scope of a kernel" (issue 40). The parent now sets it before the child starts."""
    import os
    import subprocess
    import sys

    (tmp_path / "l4l_probe.py").write_text(
        "def run():\n"
        "    import torch\n"
        "    from kernels_runtime.ops.rmsnorm import rmsnorm, rmsnorm_ref\n"
        "    x, w = torch.randn(4, 64), torch.randn(64)\n"
        "    return float((rmsnorm(x, w) - rmsnorm_ref(x, w)).abs().max())\n")
    code = ("import l4l_probe; from llm4llm.isolation import in_subprocess; "
            f"print('err', in_subprocess(l4l_probe.run, timeout_s=120, readable=[{str(tmp_path)!r}]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split("err")[-1]) < 1e-4


def test_a_run_with_nothing_to_search_ends_with_its_summary(prefect_harness, tmp_path):
    """A plan with no target (here no task can save a delta of 99 %) ends the command normally: the plan's reason,
    no acceptance and no evaluation, the closing lines; before, the flow read the missing acceptance and raised."""
    db = tmp_path / "db.duckdb"
    res = _cli(["optimize", str(EXAMPLES / "tiny-llama.toml"), "--db", str(db), "--data-dir", str(tmp_path / "d"),
                "--delta", "0.99", "--time-budget", "4m"])
    assert res.exit_code == 0, res.output
    assert "note: nothing to search: no task can save delta end to end" in res.output
    assert "accept:" not in res.output and res.output.strip().splitlines()[-1].startswith("time: ")
