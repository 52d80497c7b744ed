"""Merge the DuckDB files of KernelBench shards into one (same schema: every table's rows appended)."""
import sys
from pathlib import Path

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from storage.db import Database  # noqa: E402

out, *parts = sys.argv[1:]
Database(out).close()  # the schema, migrated
con = duckdb.connect(out)
tables = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables WHERE table_schema='main'")
          .fetchall() if r[0] != "schema_version"]
for i, p in enumerate(parts):
    try:
        con.execute(f"ATTACH '{p}' AS s{i} (READ_ONLY)")
    except Exception as e:  # noqa: BLE001 - a shard killed mid-write leaves a file DuckDB may refuse
        print(f"skip {p}: {e}")
        continue
    for t in tables:
        try:
            cols = [r[0] for r in con.execute(f"SELECT column_name FROM information_schema.columns WHERE "
                                               f"table_name='{t}' AND table_catalog='s{i}'").fetchall()]
            if cols:
                cl = ", ".join(cols)
                con.execute(f"INSERT OR IGNORE INTO {t} ({cl}) SELECT {cl} FROM s{i}.{t}")
        except Exception as e:  # noqa: BLE001
            print(f"{p}.{t}: {e}")
    con.execute(f"DETACH s{i}")
for t in ("kernelbench_results", "candidates", "searches"):
    print(t, con.execute(f"SELECT count(*) FROM {t}").fetchone()[0])
con.close()
