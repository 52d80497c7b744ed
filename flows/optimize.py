from __future__ import annotations

from prefect import flow

from flows.profile import extract_tasks, profile_workload


@flow(name="optimize-workload", log_prints=True)
def optimize_workload(workload_path: str, db_path: str | None = None, data_dir: str | None = None,
                      min_score: float = 0.0, refresh: bool = False) -> dict:
    """The closed loop over one workload. Stages: profile -> extract (search and acceptance join as they land)."""
    prof = profile_workload(workload_path, db_path=db_path, data_dir=data_dir, refresh=refresh)
    ext = extract_tasks(workload_path, prof["run_id"], prof["profile_path"], db_path=db_path, data_dir=data_dir,
                        min_score=min_score, refresh=refresh)
    return {"run_id": prof["run_id"], "profile_path": prof["profile_path"], "index_path": ext["index_path"],
            "tasks": ext["tasks"]}
