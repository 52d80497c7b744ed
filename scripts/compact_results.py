"""Fold a results folder's DuckDB exports into one parquet file per table: docs/results/<dir>/rows/<table>.parquet,
each row tagged with the export it came from (`call`: `call3_db`, `search_db`, `call2_kernelbench`, ...). A call's
README and one compact export per table keep the repository from growing by a file per table per call.

    python scripts/compact_results.py docs/results/2026-11-30-h200-i [...]     # folders to fold, in place

Reads `<export>_db/` folders (DuckDB `EXPORT DATABASE ... (FORMAT parquet)`: the parquet files, schema.sql,
load.sql; its `e_e_results` is `e2e_results`) and `rows/call<N>[_kernelbench]_<table>.parquet` files; folders already
in the compact form are left as they are. Columns are unioned by name across exports."""
from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import duckdb

CALL_FILE = re.compile(r"(call\d+(?:_kernelbench)?)_(.+)")


def sources(folder: Path) -> dict[str, list[tuple[str, Path]]]:
    """table -> [(export, parquet file)] of the folder's exports not yet compact."""
    out: dict[str, list[tuple[str, Path]]] = defaultdict(list)
    for f in sorted(folder.glob("*_db/*.parquet")):
        table = "e2e_results" if f.stem == "e_e_results" else f.stem
        out[table].append((f.parent.name, f))
    for f in sorted(folder.glob("rows/call*_*.parquet")):
        m = CALL_FILE.fullmatch(f.stem)
        if m:
            out[m.group(2)].append((m.group(1), f))
    return out


def compact(folder: Path) -> int:
    """Writes rows/<table>.parquet for each table, removes what it folded; -> files removed."""
    con = duckdb.connect()
    removed = 0
    for table, parts in sources(folder).items():
        target = folder / "rows" / f"{table}.parquet"
        target.parent.mkdir(exist_ok=True)
        selects = [f"SELECT '{call}' AS call, * FROM read_parquet('{f}')" for call, f in parts]
        if target.exists():  # a later call of the same folder: its rows join the earlier calls'
            selects.insert(0, f"SELECT * FROM read_parquet('{target}')")
        tmp = target.with_suffix(".tmp.parquet")
        con.execute(f"COPY ({' UNION ALL BY NAME '.join(selects)}) TO '{tmp}' (FORMAT parquet, COMPRESSION zstd)")
        tmp.replace(target)
        for _, f in parts:
            f.unlink()
            removed += 1
    for d in folder.glob("*_db"):
        for extra in ("schema.sql", "load.sql"):
            if (d / extra).exists():
                (d / extra).unlink()
                removed += 1
        if not any(d.iterdir()):
            d.rmdir()
    return removed


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(arg, compact(Path(arg)), "files folded")
