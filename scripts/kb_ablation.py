"""The search-mode ablation across KernelBench runs, from their exported candidate and search rows (parquet): per
mode and trial index, the geo-mean over problems of the best speedup over eager found so far (nothing passing yet
counts 1.0), on the problems that every mode took through the whole budget. Prints the table, writes a plot.
Usage: python scripts/kb_ablation.py OUT_PNG BUDGET ROWS_DIR RUN_ID [RUN_ID ...]
  (ROWS_DIR: a results folder's rows/, with candidates.parquet and searches.parquet as scripts/compact_results.py
   writes them; the runs whose searches count: one run per mode, or one run of several modes)"""
from __future__ import annotations

import sys

import duckdb

SQL = """
WITH t AS (
  SELECT s.mode, s.task_id, c.iteration, CASE WHEN c.passed THEN c.speedup_cold END AS sp, c.passed::INT AS ok
  FROM read_parquet($cands) c JOIN read_parquet($searches) s ON c.call = s.call AND c.search_id = s.search_id
  WHERE list_contains($runs, s.run_id)),
n AS (SELECT task_id, mode, count(*) AS trials FROM t GROUP BY ALL),
done AS (SELECT task_id FROM n WHERE trials >= $budget GROUP BY task_id
         HAVING count(DISTINCT mode) = (SELECT count(DISTINCT mode) FROM t)),
b AS (SELECT mode, task_id, iteration, max(sp) OVER w AS best, max(ok) OVER w AS solved
      FROM t WHERE task_id IN (SELECT task_id FROM done)
      WINDOW w AS (PARTITION BY mode, task_id ORDER BY iteration ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW))
SELECT mode, iteration + 1 AS trial, count(*) AS problems, exp(avg(ln(coalesce(best, 1.0)))) AS geo_best,
       avg(solved) AS solved
FROM b WHERE iteration < $budget GROUP BY ALL ORDER BY mode, trial"""


def main(out_png: str, budget: int, rows: str, runs: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = duckdb.connect().execute(SQL, {"cands": f"{rows}/candidates.parquet", "runs": runs,
                                        "searches": f"{rows}/searches.parquet", "budget": budget}).df()
    print(df.to_string(index=False))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for mode, g in df.groupby("mode"):
        ax.plot(g["trial"], g["geo_best"], marker="o", label=mode)
    ax.set_xlabel("trial")
    ax.set_ylabel("geo-mean best speedup over eager so far")
    ax.set_title(f"{int(df['problems'].max()) if len(df) else 0} problems, budget {budget}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
