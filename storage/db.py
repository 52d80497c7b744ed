"""The DuckDB file: location, connections, versioned migrations, transactions.

DuckDB lets one process hold a read-write handle on a file, and while it does no other process can open the file
at all, not even read-only. So no connection outlives a burst of statements: every `transaction()` and every query
opens the file (or reuses the connection of a statement that ended less than `LINGER_S` ago), runs, and the file is
closed once `LINGER_S` pass without a statement (a `session()` holds one connection across statements that belong
together). A run holds the file for milliseconds at a time, and `llm4llm runs`, `sql` and `report` in another
process read between its writes. An open that meets another process's handle waits and tries again, for at most
`LOCK_WAIT_S` (a reader `READ_WAIT_S`), then fails in one line.

Every write goes through `Database.transaction()`, so a failure leaves no half-written run behind.
"""
from __future__ import annotations

import os
import re
import threading
import time
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Iterator

import duckdb

DB_ENV = "LLM4LLM_DB"
HOME_ENV = "LLM4LLM_HOME"
# How long an open waits for another process's handle to close. Handles are held for one transaction (a run's
# writes: milliseconds; a reader's query: well under a second), so waiting this long means something is wrong.
LOCK_WAIT_S = 60.0
READ_WAIT_S = 20.0
_FIRST_RETRY_S, _MAX_RETRY_S = 0.02, 0.5
# An open costs tens of milliseconds (more on a loaded host) and a close checkpoints: statements that follow one
# another this closely share one connection.
LINGER_S = 0.2


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
    """The database file cannot be used: its path is under a file or is a directory, it is not a DuckDB file, it
    does not exist (a reader never creates one), or another process held it for too long. A user error (the CLI
    prints it in one line)."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def is_lock_conflict(e: BaseException) -> bool:
    """Whether DuckDB refused an open because another process holds the file, or because another Database object
    of this process holds it in the other mode (read-only against read-write) for a moment longer."""
    text = str(e).lower()
    return ((isinstance(e, duckdb.IOException) and "lock" in text)
            or (isinstance(e, duckdb.ConnectionException) and "different configuration" in text))


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
    """One DuckDB file. Opened read-write it is created when missing and migrated to the newest schema; opened
    read-only it must exist already. Connections are opened per statement (see the module's doc)."""

    def __init__(self, path: str | Path | None = None, read_only: bool = False, must_exist: bool = False,
                 wait_s: float | None = None):
        """read_only: connections that cannot write (implies must_exist). must_exist: a missing file is a
        DatabaseError instead of a new, empty database (a command that only reads must not leave a file behind at a
        mistyped --db). wait_s: how long an open waits while another process holds the file."""
        self.path = Path(path).resolve() if path else default_db_path()
        self.read_only = read_only
        self.wait_s = wait_s if wait_s is not None else (READ_WAIT_S if read_only else LOCK_WAIT_S)
        if (read_only or must_exist) and not self.path.exists():
            raise DatabaseError(f"no database at {self.path}: check --db / ${DB_ENV}, or run `llm4llm profile "
                                "WORKLOAD` to create one")
        check_path(self.path)  # a directory, or a directory that cannot be created: one line
        self._lock = threading.RLock()
        self._con: duckdb.DuckDBPyConnection | None = None
        self._depth, self._idle_since, self._timer = 0, 0.0, None
        with self.session():  # a file that is no DuckDB file fails here, in one line
            if not read_only:
                self.migrate()

    def _connect(self) -> duckdb.DuckDBPyConnection:
        """Open the file, waiting with backoff while another process holds it (at most `wait_s`)."""
        deadline, delay = time.monotonic() + self.wait_s, _FIRST_RETRY_S
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=self.read_only)
            except duckdb.Error as e:
                if not is_lock_conflict(e):
                    raise DatabaseError(f"database {self.path}: cannot open it as a DuckDB file ({_one_line(e)})") \
                        from None
                if time.monotonic() + delay > deadline:
                    raise DatabaseError(f"database {self.path}: another process held it for over {self.wait_s:.0f} "
                                        f"s ({_one_line(e)})") from None
            except OSError as e:
                raise DatabaseError(f"database {self.path}: cannot open it as a DuckDB file ({_one_line(e)})") \
                    from None
            time.sleep(delay)
            delay = min(2 * delay, _MAX_RETRY_S)

    @contextmanager
    def session(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """One connection for the statements inside the block (nested blocks share it); closed `LINGER_S` after
        the outermost one ends unless another statement comes first, which lets other processes open the file."""
        with self._lock:
            if self._con is None:
                self._con = self._connect()
            self._depth += 1
            try:
                yield self._con
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._idle_since = time.monotonic()
                    self._schedule_release(LINGER_S)

    def _schedule_release(self, delay: float) -> None:
        if self._timer is None:
            self._timer = threading.Timer(delay, self._release_if_idle)
            self._timer.daemon = True
            self._timer.start()

    def _release_if_idle(self) -> None:
        with self._lock:
            self._timer = None
            if self._con is None or self._depth:
                return
            idle = time.monotonic() - self._idle_since
            if idle >= LINGER_S:
                self._con.close()
                self._con = None
            else:
                self._schedule_release(LINGER_S - idle)

    def migrate(self) -> int:
        with self.session() as con:
            con.execute(
                "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, name VARCHAR, "
                "applied_at TIMESTAMP DEFAULT current_timestamp)"
            )
            applied = {r[0] for r in con.execute("SELECT version FROM schema_version").fetchall()}
            for version, name, sql in _migrations():
                if version in applied:
                    continue
                with self.transaction() as tx:
                    tx.execute(sql)
                    tx.execute("INSERT INTO schema_version (version, name) VALUES (?, ?)", [version, name])
            return self.schema_version()

    def schema_version(self) -> int:
        row = self.query("SELECT max(version) FROM schema_version")[0]
        return int(row[0] or 0)

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self.session() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            else:
                con.execute("COMMIT")

    def query_df(self, sql: str, params: list | None = None):
        with self.session() as con:
            return con.execute(sql, params or []).df()

    def query(self, sql: str, params: list | None = None) -> list[tuple]:
        with self.session() as con:
            return con.execute(sql, params or []).fetchall()

    def close(self) -> None:
        """Close the connection now (rather than `LINGER_S` after the last statement)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._con is not None:
                self._con.close()
                self._con, self._depth = None, 0

    def __enter__(self) -> "Database":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
