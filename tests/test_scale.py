"""Scale-out through Ray (prefect-ray's RayTaskRunner): a local Ray instance on the CPU that advertises two GPUs;
three task searches, one GPU each, never more at once than there are GPUs; the flow writes every row."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from llm4llm.errors import Llm4llmError
from llm4llm.scale import ScaleOut, pack_dir, scale_options, unpack_dir

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "workloads"


def test_scale_options_and_task_transport(tmp_path):
    assert scale_options() == ScaleOut()
    with pytest.raises(Llm4llmError, match="--task-runner: expected one of local, ray"):
        scale_options("dask")
    with pytest.raises(Llm4llmError, match="--ray-address: expected --task-runner ray"):
        scale_options("local", "auto")
    with pytest.raises(Llm4llmError, match="--ray-gpus-per-eval"):
        scale_options("local", None, -1)
    src = tmp_path / "task-1"
    (src / "cases").mkdir(parents=True)
    (src / "spec.json").write_text("{}")
    (src / "cases" / "0.safetensors").write_bytes(bytes(range(256)))
    out = unpack_dir(pack_dir(src), tmp_path / "elsewhere")
    assert out == tmp_path / "elsewhere" / "task-1"
    assert (out / "cases" / "0.safetensors").read_bytes() == bytes(range(256))


@pytest.fixture(scope="module")
def ray_two_gpus():
    ray = pytest.importorskip("ray")
    pytest.importorskip("prefect_ray")
    # the workers import this checkout (not an installed copy) and run Triton under its interpreter, as the tests do
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           **{k: os.environ[k] for k in ("TRITON_INTERPRET", "LLM4LLM_AOT_ARCH", "PREFECT_SERVER_ANALYTICS_ENABLED")
              if k in os.environ}}
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()


def _max_concurrent(spans: list[tuple[float, float]]) -> int:
    return max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)


@pytest.fixture(scope="module")
def scaled(prefect_harness, ray_two_gpus, tmp_path_factory):
    """tiny-llama's three hottest searchable MLP / norm tasks searched on Ray (one trial each), through the optimize
    flow."""
    from flows.optimize import optimize_workload
    from llm4llm.config import OptimizeConfig

    root = tmp_path_factory.mktemp("scale")
    db_path, data = str(root / "scale.duckdb"), str(root / "data")
    # the fan-out is under test, not a kernel: three MLP / norm tasks (the hottest, the fused decoder layer, costs
    # ~25 s of interpreter in applicability and its trial)
    cfg = OptimizeConfig(stages=["profile", "extract", "search"],
                         search={"budget": 1, "top": 3, "families": ["mlp", "norm"]},
                         scale=ScaleOut(task_runner="ray"))
    out = optimize_workload(str(EXAMPLES / "tiny-llama.toml"), cfg, db_path=db_path, data_dir=data)
    return db_path, data, out


def test_searches_fan_out_one_gpu_each_and_the_flow_writes_the_rows(scaled):
    from storage import repo
    from storage.db import Database

    db_path, data, out = scaled
    searches = out.searches
    assert len(searches) == 3
    places = [s.placement for s in searches]
    assert all(len(p["gpu_ids"]) == 1 and p["cuda_visible_devices"] == p["gpu_ids"][0] for p in places), places
    assert all(p["pid"] != os.getpid() for p in places)  # evaluated in Ray workers, not in the flow
    spans = [(p["started"], p["finished"]) for p in places]
    assert _max_concurrent(spans) <= 2  # three searches, two GPUs
    for i, a in enumerate(places):  # searches that overlapped in time held different GPUs
        for b in places[i + 1:]:
            if a["started"] < b["finished"] and b["started"] < a["finished"]:
                assert a["gpu_ids"] != b["gpu_ids"]
    with Database(db_path) as db:
        rows = repo.table_df(db, "searches")
        cands = repo.candidate_rows(db)
        eps = repo.table_df(db, "episodes")
        exp = repo.table_df(db, "experience")
    assert sorted(rows["search_id"]) == sorted(s.search_id for s in searches)
    assert (rows["trials"] == 1).all() and rows["finished_at"].notna().all() and (rows["run_id"] == out.run_id).all()
    assert len(cands) == 3 and cands["passed"].all()  # the library's default of each template is correct
    assert all(Path(p).is_file() and Path(p).is_relative_to(data) for p in cands["source_path"])
    assert set(eps["search_id"]) == set(rows["search_id"]) == set(exp["search_id"])
    assert all(Path(p).is_file() for p in eps["transcript_path"])
    from prefect.artifacts import Artifact  # the stages' markdown artifacts, keyed per workload

    board = Artifact.get("tiny-llama-leaderboard")
    assert board is not None and all(s.task_id in board.data for s in searches)
    assert Artifact.get("tiny-llama-hotspots") is not None


def test_a_cluster_without_the_gpus_fails_at_once(scaled):
    from flows.search import search_flow
    from llm4llm.config import SearchSettings

    db_path, data, out = scaled
    scale = ScaleOut(task_runner="ray", gpus_per_eval=3)
    with pytest.raises(Llm4llmError, match="expected at least 3 GPU for one search, got 2"):
        search_flow(scale)(out.run_id, SearchSettings(budget=1, top=1), db_path=db_path, data_dir=data,
                           scale=scale)
