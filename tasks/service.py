"""Prefect tasks of the nightly run: re-validate the bundle in service, decide keep / replace / rollback
(llm4llm.nightly), the night recorded through the repository handed to it (storage.store.Store)."""
from __future__ import annotations

from prefect import task

from llm4llm import nightly
from llm4llm.config import AcceptSettings
from storage.store import Store
from tasks.common import infrastructure_only


@task(name="revalidate-current-bundle", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only)
def revalidate_current(workload_path: str, db_path: str | None, cfg: AcceptSettings) -> dict | None:
    return nightly.validate_in_service(workload_path, Store(db_path), cfg)


@task(name="decide-service", retries=1, retry_delay_seconds=5, retry_condition_fn=infrastructure_only)
def decide_service(workload_path: str, run_id: str, candidate_bundle: str | None, current: dict | None,
                   db_path: str | None, data_dir: str, cfg: AcceptSettings) -> dict:
    return nightly.decide_night(workload_path, run_id, candidate_bundle, current, Store(db_path), data_dir, cfg)
