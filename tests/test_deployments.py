"""Deployments: a nightly re-optimization per workload plus manual ones, and the config-change trigger."""
from __future__ import annotations

import shutil
from pathlib import Path

from deployments.serve import build_deployments
from deployments.triggers import changed_workloads, workload_files
from llm4llm.workload import load_workload
from storage import repo
from storage.db import Database

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_nightly_and_manual_deployments():
    deps = build_deployments([EXAMPLES / "workloads" / "tiny-llama.toml"], cron="0 3 * * *")
    names = {d.name for d in deps}
    assert names == {"nightly-tiny-llama", "manual"}
    nightly = next(d for d in deps if d.name == "nightly-tiny-llama")
    assert nightly.schedules and nightly.schedules[0].schedule.cron == "0 3 * * *"
    assert nightly.parameters["workload_path"].endswith("tiny-llama.toml")


def _copy_workload(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(EXAMPLES / "scripts" / "hf_generate.py", tmp_path / "scripts")
    (tmp_path / "workloads").mkdir()
    dst = tmp_path / "workloads" / "w.toml"
    shutil.copy(EXAMPLES / "workloads" / "tiny-llama.toml", dst)
    return dst


def test_config_change_trigger(tmp_path):
    path = _copy_workload(tmp_path)
    db_path = str(tmp_path / "db.duckdb")
    assert workload_files([tmp_path / "workloads"]) == [path]
    assert [p for p, _ in changed_workloads([tmp_path / "workloads"], db_path)] == [path]  # never run
    h = load_workload(path, check_device=False).content_hash()
    with Database(db_path) as db:
        repo.record_profile_run(db, {"run_id": "r1", "workload_hash": h, "workload_name": "tiny-llama", "kind": "profile",
                                     "status": "ok", "started_at": "2026-11-30 00:00:00"},
                                {"workload_hash": h, "name": "tiny-llama", "path": str(path), "config": {}}, [])
    assert changed_workloads([tmp_path / "workloads"], db_path) == []  # this content already has a run
    path.write_text(path.read_text().replace("decode_len = 4", "decode_len = 5"))
    assert [p for p, _ in changed_workloads([tmp_path / "workloads"], db_path)] == [path]  # edited: re-run
    (tmp_path / "scripts" / "hf_generate.py").write_text((tmp_path / "scripts" / "hf_generate.py").read_text() + "\n#")
    h2 = load_workload(path, check_device=False).content_hash()
    assert h2 != h  # the script is part of the workload's identity
