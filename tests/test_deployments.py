"""Deployments: a nightly run per workload (staggered, only for devices this host has), manual and on-change ones,
and the workload identity the change trigger hashes. The same deployments run against a real server in
tests/test_service.py."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from deployments.serve import build_deployments, nightly_crons
from deployments.triggers import workload_files
from llm4llm.workload import load_workload

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def test_nightly_and_manual_deployments():
    deps = build_deployments([EXAMPLES / "workloads" / "tiny-llama.toml", EXAMPLES / "workloads" / "qwen3-4b.toml"])
    names = {(d.flow_name, d.name) for d in deps}
    # qwen3-4b runs on cuda: not scheduled on a host without one (tests run on the CPU)
    assert names == {("nightly-workload", "nightly-tiny-llama"), ("optimize-workload", "manual"),
                     ("optimize-workload", "on-change"), ("profile-workload", "manual")}
    nightly = next(d for d in deps if d.name == "nightly-tiny-llama")
    assert nightly.schedules and nightly.schedules[0].schedule.cron == "0 3 * * *"
    assert nightly.parameters["workload_path"].endswith("tiny-llama.toml")
    assert nightly.entrypoint == "flows.nightly.nightly_workload"
    on_change = next(d for d in deps if d.name == "on-change")
    (trigger,) = on_change.triggers
    assert trigger.expect == {"llm4llm.workload.changed"}
    assert trigger.parameters["workload_path"] == "{{ event.payload.path }}"


def test_nightly_runs_are_staggered():
    assert nightly_crons(4, "03:00", 45) == ["0 3 * * *", "45 3 * * *", "30 4 * * *", "15 5 * * *"]
    assert nightly_crons(2, "23:30", 45) == ["30 23 * * *", "15 0 * * *"]


def test_no_flow_module_shadows_the_standard_library():
    """Prefect loads a file entrypoint as a module named after the file: flows/profile.py hid the stdlib's profile
    (then cProfile, torch._dynamo and transformers failed to import in every deployment run)."""
    for d in ("flows", "tasks", "deployments"):
        for f in (ROOT / d).glob("*.py"):
            assert f.stem not in sys.stdlib_module_names, f


def _copy_workload(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(EXAMPLES / "scripts" / "hf_generate.py", tmp_path / "scripts")
    (tmp_path / "workloads").mkdir()
    dst = tmp_path / "workloads" / "w.toml"
    shutil.copy(EXAMPLES / "workloads" / "tiny-llama.toml", dst)
    return dst


def test_workload_identity_is_the_parsed_config_and_the_script(tmp_path):
    path = _copy_workload(tmp_path)
    assert workload_files([tmp_path / "workloads"]) == [path]
    h = load_workload(path, check_device=False).content_hash()
    path.write_text("# a comment\n" + path.read_text())
    assert load_workload(path, check_device=False).content_hash() == h  # comments are not configuration
    path.write_text(path.read_text().replace("decode_len = 4", "decode_len = 5"))
    h1 = load_workload(path, check_device=False).content_hash()
    assert h1 != h  # edited: re-run
    (tmp_path / "scripts" / "hf_generate.py").write_text((tmp_path / "scripts" / "hf_generate.py").read_text() + "\n#")
    h2 = load_workload(path, check_device=False).content_hash()
    assert h2 != h1  # the script is part of the workload's identity


def test_each_deployment_starts_runs_of_its_own_kind():
    """`runs.kind` of a run that a deployment started follows from the deployment's name (llm4llm.config)."""
    from llm4llm.config import kind_of_deployment

    deps = build_deployments([EXAMPLES / "workloads" / "tiny-llama.toml"])
    kinds = {d.name: kind_of_deployment(d.name) for d in deps}
    assert kinds == {"nightly-tiny-llama": "nightly", "manual": "manual", "on-change": "on-change"}
    # the work-pool deployments (deployments.deploy) of a GPU queue, one of a person's own, and no deployment at all
    assert [kind_of_deployment(n) for n in ("manual-gpu-cuda-0", "on-change-gpu-cuda-0", "my-sweep", None)] == \
        ["manual", "on-change", "manual", "cli"]
