"""Table, plots and a compact JSON export of a KernelBench run from its DuckDB file (everything from SQL).
Usage: python scripts/kb_report.py DB OUT_DIR [KB_RUN_ID]"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(db_path: str, out: str, kb_run_id: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from storage import repo
    from storage.db import Database

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with Database(db_path) as db:
        if kb_run_id is None:
            kb_run_id = db.query("SELECT kb_run_id FROM kernelbench_results ORDER BY created_at DESC LIMIT 1")[0][0]
        res = repo.kb_results(db, kb_run_id)
        summary = repo.kb_summary(db, kb_run_id)
        curves = repo.kb_curves(db, kb_run_id)
        bands = repo.kb_curve_bands(db, kb_run_id)
        cands = db.query_df(
            "SELECT c.candidate_id, c.task_id, s.mode, c.iteration, c.template, c.origin, c.config_json, c.passed, "
            "c.failure_class, substr(c.message, 1, 300) AS message, c.max_abs_err, c.speedup_cold AS speedup_eager, "
            "c.speedup_compile, c.kb_means_json, c.cold_p20_ms, c.cold_p50_ms, c.cold_p80_ms, c.ref_cold_p50_ms "
            "FROM candidates c JOIN searches s USING (search_id) WHERE s.run_id = ? ORDER BY c.task_id, c.iteration",
            [kb_run_id])
    export = {"kb_run_id": kb_run_id, "summary": json.loads(summary.to_json(orient="records", date_format="iso")),
              "problems": json.loads(res.to_json(orient="records", date_format="iso")),
              "curves": json.loads(curves.to_json(orient="records", date_format="iso")),
              "curve_bands": json.loads(bands.to_json(orient="records")),
              "candidates": json.loads(cands.to_json(orient="records", date_format="iso"))}
    (out_dir / "results.json").write_text(json.dumps(export, indent=1))

    ok = res[res["passed"]].sort_values("problem_id")
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(res)), 4))
    xs = range(len(ok))
    ax.bar([x - 0.2 for x in xs], ok["speedup_eager"], 0.4, label="over eager")
    ax.bar([x + 0.2 for x in xs], ok["speedup_compile"], 0.4, label="over torch.compile")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), [p.split("_")[0] for p in ok["problem"]])
    ax.set_xlabel("KernelBench Level 2 problem id")
    ax.set_ylabel("speedup (mean time ratio)")
    ax.set_title(f"built-in proposer, H200, {len(ok)}/{len(res)} problems passing")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "speedup_per_problem.png", dpi=120)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for mode, g in bands.groupby("mode"):  # the band: a bootstrap of the problems, 5-95 %
        line, = ax.plot(g["trial"], g["geo_best"], marker="o", label=mode)
        ax.fill_between(g["trial"], g["geo_p05"], g["geo_p95"], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("trial")
    ax.set_ylabel("geo-mean best speedup over eager so far")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "search_curves.png", dpi=120)
    cols = ["problem", "passed", "trials", "origin", "eager_ms", "compile_ms", "candidate_ms", "speedup_eager",
            "speedup_compile", "degenerate"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in res.sort_values("problem_id").iterrows():
        cells = []
        for c in cols:
            v = r[c]
            cells.append(f"{v:.3f}" if isinstance(v, float) and v == v else ("" if v is None or v != v else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    scols = list(summary.columns)
    slines = ["| " + " | ".join(scols) + " |", "|" + "---|" * len(scols)]
    for _, r in summary.iterrows():
        slines.append("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in scols)
                      + " |")
    (out_dir / "table.md").write_text("\n".join(lines) + "\n\n" + "\n".join(slines) + "\n")
    print("\n".join(lines))
    print(summary.to_string())
    print(curves.to_string())


if __name__ == "__main__":
    main(*sys.argv[1:])
