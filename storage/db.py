"""The DuckDB file: location, connection, versioned migrations, transactions.

The flow process is the only writer. Every write goes through `Database.transaction()`, so a failure leaves no
half-written run behind.
"""
from __future__ import annotations

import os
import re
import threading
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Iterator

import duckdb

DB_ENV = "LLM4LLM_DB"
HOME_ENV = "LLM4LLM_HOME"


def data_home() -> Path:
    """Project data dir: $LLM4LLM_HOME, else ./.llm4llm (artifacts, the DuckDB file, Prefect results)."""
    return Path(os.environ.get(HOME_ENV, ".llm4llm")).resolve()


def default_db_path() -> Path:
    return Path(os.environ[DB_ENV]).resolve() if os.environ.get(DB_ENV) else data_home() / "llm4llm.duckdb"


def _migrations() -> list[tuple[int, str, str]]:
    out = []
    for entry in resources.files("storage").joinpath("migrations").iterdir():
        m = re.match(r"(\d+)_(.+)\.sql$", entry.name)
        if m:
            out.append((int(m.group(1)), m.group(2), entry.read_text()))
    return sorted(out)


class DatabaseError(RuntimeError):
    """The database file cannot be used: its path is under a file or is a directory, it is not a DuckDB file, or it
    cannot be opened. A user error (the CLI prints it in one line)."""


def check_path(path: Path) -> None:
    """A path a database file can live at, its directory created; DatabaseError (one line) where it cannot be: a
    directory, under a file, on a read-only or virtual filesystem, or without permission."""
    if path.is_dir():
        raise DatabaseError(f"database {path}: expected a DuckDB file, got a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatabaseError(f"database {path}: cannot create its directory {path.parent} ({e.strerror or e})") from None


# The statements `llm4llm sql` runs: queries only. A read-only connection still lets COPY/EXPORT write files, ATTACH
# open (and create) other databases, INSTALL/LOAD fetch and run extensions.
READ_STATEMENTS = ("SELECT", "EXPLAIN")


def check_read_only(sql: str) -> None:
    """DatabaseError (one line) unless every statement of `sql` is a query."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise DatabaseError(f"sql: {' '.join(str(e).split())[:300]}") from None
    for st in statements:
        kind = st.type.name
        if kind not in READ_STATEMENTS:
            raise DatabaseError(f"sql: expected a read-only query ({' or '.join(READ_STATEMENTS)}), got a {kind} "
                                "statement")


class Database:
    """One DuckDB file. Open, migrate to the newest schema, write in transactions."""

    def __init__(self, path: str | Path | None = None, read_only: bool = False, must_exist: bool = False):
        """read_only: a connection that cannot write the database (read-only implies must_exist). must_exist: a
        missing file is a DatabaseError instead of a new, empty database (what a command that only reads wants: a
        mistyped --db must not leave a file behind)."""
        self.path = Path(path).resolve() if path else default_db_path()
        if (read_only or must_exist) and not self.path.exists():
            raise DatabaseError(f"no database at {self.path}: check --db / ${DB_ENV}, or run `llm4llm profile "
                                "WORKLOAD` to create one")
        check_path(self.path)
        self._lock = threading.RLock()
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except (duckdb.Error, OSError) as e:
            first = " ".join(str(e).split())[:300]
            raise DatabaseError(f"database {self.path}: cannot open it as a DuckDB file ({first})") from None
        if not read_only:
            self.migrate()

    def migrate(self) -> int:
        with self._lock:
            self.con.execute(
                "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, name VARCHAR, "
                "applied_at TIMESTAMP DEFAULT current_timestamp)"
            )
            applied = {r[0] for r in self.con.execute("SELECT version FROM schema_version").fetchall()}
            for version, name, sql in _migrations():
                if version in applied:
                    continue
                with self.transaction() as con:
                    con.execute(sql)
                    con.execute("INSERT INTO schema_version (version, name) VALUES (?, ?)", [version, name])
            return self.schema_version()

    def schema_version(self) -> int:
        row = self.con.execute("SELECT max(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._lock:
            self.con.execute("BEGIN TRANSACTION")
            try:
                yield self.con
            except BaseException:
                self.con.execute("ROLLBACK")
                raise
            else:
                self.con.execute("COMMIT")

    def query_df(self, sql: str, params: list | None = None):
        with self._lock:
            return self.con.execute(sql, params or []).df()

    def query(self, sql: str, params: list | None = None) -> list[tuple]:
        with self._lock:
            return self.con.execute(sql, params or []).fetchall()

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> "Database":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
