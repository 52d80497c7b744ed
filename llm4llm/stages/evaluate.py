"""The evaluate stage: the workload end to end (eager, patched, torch.compile, ...) in a sandboxed subprocess. Each
variant's measurements go to `on_measured` as the child measures them (evaluate_recorded writes them through the
repository it is handed, so a run stopped midway keeps what it finished)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Protocol

from pydantic import BaseModel, ConfigDict

from llm4llm import isolation
from llm4llm.config import EvaluateSettings
from llm4llm.e2e_result import E2EResult

DEFAULT_VARIANTS = ("eager", "patched", "torch_compile")


class E2ERow(E2EResult):
    """One variant's measurements at one point, as llm4llm.evaluate writes them: E2EResult's fields (declared there
    only) plus the GPU's name and the library versions. What run_evaluate returns and storage.store.Store.e2e_rows
    takes. Frozen; parsed from the sandboxed child's JSON lines, and written out with model_dump(mode="json") (the
    e2e_results columns)."""

    model_config = ConfigDict(frozen=True)

    gpu_name: str | None = None
    versions_json: dict[str, Any] | None = None

    @property
    def point(self) -> tuple[str, int | None, int | None]:
        """(variant, batch size, prompt length): a later row at the same point supersedes an earlier one."""
        return self.variant, self.batch_size, self.prompt_len


class EvaluateResult(BaseModel):
    """What one evaluation did, as the stage returns it to the flow, the CLI and storage (frozen: handed on
    unchanged): its run id (the `e2e_results` rows' run_id) and each variant's newest measurement at each point, in
    the order first measured. Tables (llm4llm.evaluate.table_rows, point_rows) read the rows as they are."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    rows: tuple[E2ERow, ...] = ()


class EvaluateRepository(Protocol):
    """Where the measurements go (storage.store.Store on DuckDB): the stage opens no database."""

    def e2e_rows(self, run_id: str, workload_hash: str, measured: list[E2ERow]) -> list[dict]:
        """Measurements as `e2e_results` rows; writes nothing."""

    def record_e2e(self, rows: list[dict]) -> None: ...


def evaluate_recorded(workload_path: str, repo: EvaluateRepository, settings: EvaluateSettings | None = None, *,
                      bundle: str | None = None, run_id: str | None = None,
                      deadline: float | None = None) -> EvaluateResult:
    """The workload end to end (run_evaluate) under `settings` (its variants, default eager, patched, torch_compile;
    repeats; max_s; the points batch_sizes x prompt_lens, default the workload's own), each variant's `e2e_results`
    row written through `repo` as it is measured. deadline: Unix time by which the interleaved rounds end. Returns
    an EvaluateResult: the run id and each variant's newest row at each point."""
    from llm4llm.stages.common import describe_workload, new_run_id

    s = settings if settings is not None else EvaluateSettings()
    wl = describe_workload(workload_path)
    run_id = run_id or new_run_id(wl["name"] + "-eval")

    def record(measured: list[E2ERow]) -> None:
        repo.record_e2e(repo.e2e_rows(run_id, wl["workload_hash"], measured))

    latest = run_evaluate(workload_path, bundle=bundle, repeats=s.repeats, variants=tuple(s.variants or DEFAULT_VARIANTS),
                          on_measured=record, max_s=s.max_s, deadline=deadline,
                          batch_sizes=tuple(s.batch_sizes) if s.batch_sizes else None,
                          prompt_lens=tuple(s.prompt_lens) if s.prompt_lens else None)
    return EvaluateResult(run_id=run_id, rows=tuple(latest))


def run_evaluate(workload_path: str, *, bundle: str | None = None, repeats: int = 7,
                 variants: tuple[str, ...] = DEFAULT_VARIANTS,
                 on_measured: Callable[[list[E2ERow]], None] | None = None, max_s: float | None = None,
                 deadline: float | None = None, batch_sizes: tuple[int, ...] | None = None,
                 prompt_lens: tuple[int, ...] | None = None) -> list[E2ERow]:
    """Measure the workload's variants; returns the newest measurements (llm4llm.evaluate's rows, as E2ERow) of
    each variant at each point, in the order first measured. on_measured: called with each batch of new rows as
    they arrive. max_s, deadline: the interleaved rounds' time budget and end; batch_sizes, prompt_lens: the points
    (llm4llm.evaluate.evaluate_workload)."""
    from llm4llm.evaluate import evaluate_workload
    from llm4llm.verify.sandbox import copy_readonly, make_box

    # (variant, batch, prompt) -> its newest row (the child re-sends a variant's row at a point after each round)
    latest: dict[tuple, E2ERow] = {}
    seen = [0]
    with tempfile.TemporaryDirectory(prefix="llm4llm-e2e-") as tmp:
        stream = Path(tmp) / "rows.jsonl"

        def take_new() -> None:
            new = []
            for line in (stream.read_text().splitlines() if stream.exists() else [])[seen[0]:]:
                try:
                    new.append(E2ERow.model_validate(json.loads(line)))
                except json.JSONDecodeError:  # the line being written: the next poll reads it whole
                    break
            if new:
                if on_measured is not None:
                    on_measured(new)
                seen[0] += len(new)
                latest.update((r.point, r) for r in new)

        # the bundle (candidate code) as a read-only copy in the child's private dir: the bundle store's own dirs
        # need not be reachable by the sandbox's uid (a layer the child would otherwise lose)
        box = make_box("llm4llm-e2e-")
        inside = str(copy_readonly(Path(bundle).resolve(), box / "ro" / "bundle")) if bundle else None
        isolation.in_subprocess(evaluate_workload, str(Path(workload_path).resolve()), bundle=inside,
                                variants=variants, repeats=repeats, max_s=max_s, deadline=deadline,
                                batch_sizes=batch_sizes, prompt_lens=prompt_lens,
                                outputs={"results_path": str(stream)},
                                poll=take_new, readable=isolation.workload_paths(workload_path), box=box)
    return list(latest.values())
