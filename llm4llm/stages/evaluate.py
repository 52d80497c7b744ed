"""The evaluate stage: the workload end to end (eager, patched, torch.compile, ...) in a sandboxed subprocess, each
variant's row written to DuckDB as it is measured."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from llm4llm import isolation
from llm4llm.stages.common import describe_workload, new_run_id
from storage.rows import e2e_row


def run_evaluate(workload_path: str, db_path: str | None, *, bundle: str | None = None, repeats: int = 7,
                 variants: tuple[str, ...] = ("eager", "patched", "torch_compile"), run_id: str | None = None) -> dict:
    from llm4llm.evaluate import evaluate_workload
    from storage import repo
    from storage.db import Database

    wl = describe_workload(workload_path)
    run_id = run_id or new_run_id(wl["name"] + "-eval")
    latest: dict[str, dict] = {}  # variant -> its newest row (the child re-sends a variant's row after each round)
    seen = [0]
    with tempfile.TemporaryDirectory(prefix="llm4llm-e2e-") as tmp:
        stream = Path(tmp) / "rows.jsonl"

        def record_new() -> None:  # each variant's row lands in DuckDB as the child measures it
            new = []
            for line in (stream.read_text().splitlines() if stream.exists() else [])[seen[0]:]:
                try:
                    new.append(e2e_row(run_id, wl["workload_hash"], json.loads(line)))
                except json.JSONDecodeError:  # the line being written: the next poll reads it whole
                    break
            if new:
                with Database(db_path) as db:
                    repo.record_e2e(db, new)
                seen[0] += len(new)
                latest.update((r["variant"], r) for r in new)

        # the bundle (candidate code) as a read-only copy in the child's private dir: the bundle store's own dirs
        # need not be reachable by the sandbox's uid (a layer the child would otherwise lose)
        from llm4llm.verify.sandbox import copy_readonly, make_box

        box = make_box("llm4llm-e2e-")
        inside = str(copy_readonly(Path(bundle).resolve(), box / "ro" / "bundle")) if bundle else None
        isolation.in_subprocess(evaluate_workload, str(Path(workload_path).resolve()), bundle=inside,
                                variants=variants, repeats=repeats, outputs={"results_path": str(stream)},
                                poll=record_new, readable=isolation.workload_paths(workload_path), box=box)
    return {"run_id": run_id, "rows": list(latest.values())}

