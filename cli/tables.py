"""How the CLI's tables print: sized to the terminal (80 columns and up), one way to show an empty value, and ids
that are never folded over lines (a long run id is shortened in its middle instead, and `--run` takes it back)."""
from __future__ import annotations

import math
import re
import textwrap

from rich.table import Table

# every empty cell (None, NaN, <NA>, NaT, '') prints as this, in every table
EMPTY = "-"
# marks the middle of a shortened id; `--run` also takes three dots for it
ELLIPSIS = "…"
# widths at which a table keeps more of its columns: below NARROW it shows only what identifies a row and its result
NARROW, WIDE = 100, 140
# a column whose cells are at most this long (numbers, flags, short names) is kept on one line where it fits
SHORT = 12
# a run id as stages/common.py makes it: <workload name>-<UTC stamp>-<6 hex>
_RUN_ID = re.compile(r"^(?P<name>.+)-(?P<stamp>\d{8}T\d{6})-(?P<tail>[0-9a-f]{6})$")


def is_empty(v) -> bool:
    if v is None or (isinstance(v, str) and v == ""):
        return True
    try:
        import pandas as pd

        return bool(pd.isna(v)) if not isinstance(v, (list, tuple, dict)) else False
    except (TypeError, ValueError):  # an array-like cell is a value
        return False


def cell(v, floats: int = 3) -> str:
    """One cell as text: floats to `floats` places, booleans as yes/no, timestamps to the second, empty as EMPTY."""
    if is_empty(v):
        return EMPTY
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{floats}f}" if math.isfinite(v) else str(v)
    if hasattr(v, "strftime"):
        return v.strftime("%Y-%m-%d %H:%M:%S")
    return str(v)


def short_run_id(run_id: str, width: int = 22) -> str:
    """A run id in at most `width` characters: whole when it fits, else the workload name (cut if need be) and the
    id's unique hex tail around an ellipsis (the time is in the table's `started` column). Ids of another form keep
    their head and last six characters."""
    if len(run_id) <= width:
        return run_id
    m = _RUN_ID.match(run_id)
    head, tail = (m["name"], m["tail"]) if m else (run_id[:-6], run_id[-6:])
    return head[:width - len(tail) - 1].rstrip("-_") + ELLIPSIS + tail


def id_pattern(text: str) -> tuple[str, str] | None:
    """(head, tail) of a shortened id as `short_run_id` prints it (or typed with three dots); None for a plain id."""
    for mark in (ELLIPSIS, "..."):
        if mark in text:
            head, _, tail = text.partition(mark)
            return head, tail
    return None


def is_id_column(name: str) -> bool:
    return name in ("run", "task", "run_id", "task_id") or name.endswith("_id")


def df_table(df, title: str, columns: list[str] | None = None, floats: int = 3,
             headers: dict[str, str] | None = None, whole: tuple[str, ...] = (), width: int | None = None) -> Table:
    """A DataFrame as a rich table. Id columns (and those in `whole`) never wrap and never shrink, nor do columns of
    short cells (numbers, flags) where `width` leaves room: rich narrows the columns of longer text instead, folding
    them. Where `width` leaves those no room (an arbitrary `sql` result may not), every column folds. `headers`
    renames columns for display. The table is at least as wide as its title (which names a run id) where `width`
    allows, so the title is never folded."""
    table = Table(title=title, show_lines=False, min_width=min(len(title), width or len(title)))
    cols = columns or list(df.columns)
    names = [(headers or {}).get(c, str(c)) for c in cols]
    rows = [[cell(row[c], floats) for c in cols] for _, row in df.iterrows()]
    longest = [max([len(w) for w in n.split()] + [len(r[i]) for r in rows]) for i, n in enumerate(names)]
    ids = [i for i, c in enumerate(cols) if is_id_column(str(c)) or c in whole]
    short = ids + [i for i in range(len(cols)) if i not in ids and longest[i] <= SHORT]
    keep = next((k for k in (short, ids) if _fits(k, longest, width)), [])
    for i, name in enumerate(names):
        if i in keep:  # its header wrapped by hand at word breaks to the cells' width (no_wrap holds for it too)
            table.add_column("\n".join(textwrap.wrap(name, longest[i])), no_wrap=True, min_width=longest[i])
        else:
            table.add_column(name, overflow="fold")
    for r in rows:
        table.add_row(*r)
    return table


def _fits(keep: list[int], longest: list[int], width: int | None) -> bool:
    """Whether the columns `keep` at their longest cell leave each other column a few characters of `width`."""
    return not width or sum(longest[i] + 3 for i in keep) + 7 * (len(longest) - len(keep)) + 1 <= width


def runs_view(df, width: int):
    """`llm4llm runs` at `width` columns: (frame, columns, headers). Narrow: a short run id, kind, status, the
    start to the minute, device and decode time; up to WIDE: the full id and the GPU; beyond: every column."""
    df = df.copy()
    df["started"] = [EMPTY if is_empty(t) else t.strftime("%m-%d %H:%M" if width < NARROW else "%Y-%m-%d %H:%M")
                     for t in df["started_at"]]
    if width < NARROW:
        df["run"] = [short_run_id(r) for r in df["run_id"]]
        return df, ["run", "kind", "status", "started", "device", "decode_ms"], {"decode_ms": "decode ms"}
    df["run"] = [short_run_id(r, 40) for r in df["run_id"]]
    headers = {"prefill_ms": "prefill ms", "decode_ms": "decode ms", "gpu_name": "gpu"}
    df["gpu_name"] = [g.removeprefix("NVIDIA ") if isinstance(g, str) else g for g in df["gpu_name"]]
    if width < WIDE:
        return df, ["run", "kind", "status", "started", "device", "gpu_name", "prefill_ms", "decode_ms"], headers
    # the run id starts with the workload's name: no column of its own
    headers |= {"prefill_forwards": "prefill fwd", "decode_forwards": "decode fwd"}
    return df, ["run_id", "kind", "status", "started", "device", "gpu_name", "prefill_ms", "decode_ms",
                "prefill_forwards", "decode_forwards"], headers


def tasks_view(df, width: int) -> tuple[list[str], dict[str, str]]:
    """`llm4llm tasks` at `width` columns: (columns, headers). A task id starts with its family and phase, so
    below WIDE those two columns go; below NARROW the dtype too (the title names it)."""
    headers = {"instances": "n", "deployable": "deploy"}
    if width < NARROW:
        return ["task_id", "instances", "score", "deployable", "reason"], headers
    if width < WIDE:
        return ["task_id", "instances", "dtype", "score", "deployable", "reason"], headers
    return ["task_id", "family", "phase", "instances", "dtype", "score", "deployable", "reason"], {}



# the e2e table's ratio cells, `median (p20-p80)`: kept whole, like ids
RATIOS = ("vs_eager", "vs_eager_cpu", "vs_compile")


# the e2e table's columns, the most wanted first: a narrower terminal drops them from the end of this list
E2E_PRIORITY = ("variant", "decode_ms_per_token", "total_ms", "vs_compile", "vs_eager", "tokens_per_s",
                "gpu_step_ms", "hbm_floor_ms", "prefill_ms", "compile_s", "total_range_ms", "peak_mem_mb",
                "vs_eager_cpu")
E2E_HEADERS = {"prefill_ms": "prefill ms", "decode_ms_per_token": "decode ms/tok", "total_ms": "total ms",
               "total_range_ms": "total range", "tokens_per_s": "tok/s", "vs_eager": "vs eager",
               "vs_eager_cpu": "vs eager cpu", "vs_compile": "vs compile", "gpu_step_ms": "gpu step ms",
               "hbm_floor_ms": "hbm floor ms", "peak_mem_mb": "peak MB", "compile_s": "compile s"}


def e2e_view(df, width: int, floats: int = 3) -> tuple[list[str], dict[str, str]]:
    """The e2e table's columns at `width`: as many of E2E_PRIORITY as fit whole at their longest cell (a header
    wraps at its words), in the frame's order; the notes (free text, often longer than a line) never in the table
    but under it (`e2e_notes`). A CI log's 160 columns once held every column and the notes: rich folded each
    number into five-character slivers, a row over thirty lines. The rest is in `llm4llm sql` and the report."""
    def need(c: str) -> int:
        words = E2E_HEADERS.get(c, c).split()
        return max([max(len(w) for w in words)] + [len(cell(v, floats)) for v in df[c]]) + 3

    keep, used = [], 1
    for c in (c for c in E2E_PRIORITY if c in df.columns):
        if not keep or used + need(c) <= width:
            keep.append(c)
            used += need(c)
    return [c for c in df.columns if c in keep], E2E_HEADERS


def e2e_notes(df, columns: list[str]) -> list[str]:
    """`variant: notes` lines for the rows whose notes the table leaves out."""
    if "notes" in columns or "notes" not in df:
        return []
    return [f"{r['variant']}: {r['notes']}" for _, r in df.iterrows() if not is_empty(r["notes"])]
