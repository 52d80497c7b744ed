"""Run reports: one self-contained HTML file per run (plots embedded as PNG), and the markdown tables a run
publishes as Prefect artifacts, both from the DuckDB rows. The queries live in storage/report_queries.py and reach
a report through a Reader (storage.report_queries.ReportReader on an open database), so this module opens none.

A report is a list of sections. Each is a function of a `ReportContext` returning a `Block` (notes, matplotlib
figures, tables), registered with `@section(key, title)`; adding one, e.g. a kernel's roofline frontier, is one
query in storage/report_queries.py and one decorated function here (or in any module imported before rendering).
"""
from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Protocol

import pandas as pd

# The Prefect UI's markdown tables do not wrap their cells: at a 1400-pixel window a row of ids and numbers already
# fills the artifact's width, so an acceptance reason goes in a numbered list under the table, cut here (ellipsis)
REASON_CHARS = 160
# a grouped row of identical decisions names this many of its tasks, then how many more
GROUP_NAMES = 3
# mode -> colour, so one mode reads the same in every plot
MODE_COLOURS = {"episodic": "#1f77b4", "sample": "#ff7f0e", "iter": "#2ca02c"}
VARIANT_ORDER = ("eager", "torch_compile", "eager_graphs", "patched", "patched_graphs")


@dataclass
class Block:
    """What a section shows: short notes, figures (embedded as PNG) and titled tables, in that order."""

    notes: list[str] = field(default_factory=list)
    figures: list[Any] = field(default_factory=list)  # matplotlib.figure.Figure
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)


class Reader(Protocol):
    """Where a report's rows come from: `frame(name, *args)` runs the query `name` of storage/report_queries.py;
    `source` names the database (shown on the page)."""

    source: str

    def frame(self, name: str, *args) -> pd.DataFrame: ...


@dataclass
class ReportContext:
    """The run a report is about; `df(name)` runs a report query once per report."""

    reader: Reader
    run_id: str
    workload: str
    kind: str = "model"  # "kernelbench": a KernelBench run (`kernelbench_results`, no `runs` row)
    _cache: dict = field(default_factory=dict)

    def df(self, name: str, *args) -> pd.DataFrame:
        key = (name, args)
        if key not in self._cache:
            self._cache[key] = self.reader.frame(name, *(args or (self._arg(name),)))
        return self._cache[key]

    def _arg(self, name: str) -> str:
        return self.workload if name in ("e2e_history", "run_history", "service_history") else self.run_id


# the kinds of run a report is about: a model's run (a `runs` row) and a KernelBench run (its `kb_run_id`)
RUN_KINDS = ("model", "kernelbench")


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    build: Callable[[ReportContext], Block | None]  # None: the section has nothing for this run and is left out
    kinds: tuple[str, ...] = ("model",)  # the kinds of run (RUN_KINDS) whose report has this section


SECTIONS: list[Section] = []


def section(key: str, title: str, kinds: tuple[str, ...] = ("model",)) -> Callable:
    """Register a report section (in report order; a key registered again replaces the earlier one in place) for
    the reports of the runs of `kinds`. A section whose function returns None is left out of that report."""
    unknown = set(kinds) - set(RUN_KINDS)
    if unknown:
        raise ValueError(f"kinds: expected some of {RUN_KINDS}, got {sorted(unknown)}")

    def register(fn: Callable[[ReportContext], Block | None]) -> Callable[[ReportContext], Block | None]:
        new = Section(key, title, fn, tuple(kinds))
        for i, s in enumerate(SECTIONS):
            if s.key == key:
                SECTIONS[i] = new
                return fn
        SECTIONS.append(new)
        return fn
    return register


# ---- helpers ----------------------------------------------------------------------------------------------------

def _figure(w: float = 11.0, h: float = 4.0):
    # Figure objects, not pyplot: no global state, no display backend
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h))


def _samples(v) -> list[float]:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return []
    return [float(x) for x in (json.loads(v) if isinstance(v, str) else v)]


def _spread(v) -> str:
    s = _samples(v)
    return f"{min(s):.1f}-{max(s):.1f}" if s else ""


def clip(text, n: int) -> str:
    """`text` in at most n characters, an ellipsis marking a cut."""
    text = "" if text is None or (isinstance(text, float) and pd.isna(text)) else str(text)
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def _short(task_id: str, n: int = 28) -> str:
    return clip(task_id, n)


def grouped_decisions(a: pd.DataFrame) -> pd.DataFrame:
    """The acceptance rows in the order tried, with a `count` column: a decision whose gain was measured keeps its
    own row (it carries numbers), and the unmeasured ones that share a decision and a reason (a crash that stopped
    every trial, say) become one row at the place of the first, naming its first GROUP_NAMES tasks."""
    a = a.reset_index(drop=True)
    measured = a["gain"].notna()
    key = a["decision"].astype(str) + "\0" + a["reason"].fillna("").astype(str)
    rows = []
    for i, row in a.iterrows():
        if measured[i]:
            rows.append(row.to_dict() | {"count": 1})
            continue
        same = a.index[~measured & (key == key[i])]
        if same[0] != i:
            continue
        out = row.to_dict() | {"count": len(same)}
        if len(same) > 1:
            names = [_short(t, 24) for t in a.loc[same[:GROUP_NAMES], "task_id"]]
            more = f" +{len(same) - GROUP_NAMES} more" if len(same) > GROUP_NAMES else ""
            out |= {"task_id": ", ".join(names) + more, "candidate_id": ""}
        rows.append(out)
    return pd.DataFrame(rows, columns=["count", *a.columns])


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes, color="#555")
    ax.set_xticks([])
    ax.set_yticks([])


def _variant_rank(v: str) -> int:
    return VARIANT_ORDER.index(v) if v in VARIANT_ORDER else len(VARIANT_ORDER)


# ---- sections ---------------------------------------------------------------------------------------------------

@section("overview", "Run")
def overview(ctx: ReportContext) -> Block:
    run = ctx.df("run_overview")
    if run.empty:
        return Block(notes=[f"run {ctx.run_id}: no row in `runs`"])
    r = run.iloc[0]
    keys = ["run_id", "kind", "profile_of", "workload_name", "workload_path", "status", "started_at", "finished_at",
            "device", "gpu_name", "capability",
            "torch_version", "triton_version", "transformers_version", "timer", "prefill_ms", "decode_ms",
            "prefill_forwards", "decode_forwards"]
    info = pd.DataFrame({"field": keys, "value": [r.get(k) for k in keys]})
    notes = []
    if not str(r.get("device") or "").startswith("cuda"):
        notes.append("CPU run: Triton kernels ran under the interpreter, nothing was timed and the latency gate "
                     "accepts no patch. Only GPU runs produce speedups and bundles.")
    return Block(notes=notes, tables=[("run", info)])


@section("hotspots", "Hotspots per phase")
def hotspots(ctx: ReportContext) -> Block:
    df = ctx.df("hotspots")
    if df.empty:
        return Block(notes=["no profile rows for this run"])
    phases = list(dict.fromkeys(df["phase"]))
    fig = _figure(11.0, 0.28 * df.groupby("phase").size().max() + 1.4)
    for ax, phase in zip(fig.subplots(1, len(phases), squeeze=False)[0], phases):
        d = df[df["phase"] == phase].iloc[::-1]
        ax.barh([f"{m} ({c})" for m, c in zip(d["module_path"], d["class_name"])], d["share"] * 100,
                color="#4c72b0")
        w = d["weight"].dropna()
        ax.set_title(f"{phase}" + (f" (weight {w.iloc[0]:.2f})" if len(w) else ""))
        ax.set_xlabel("% of the phase's time")
        ax.tick_params(axis="y", labelsize=7)
    cols = ["phase", "rank", "module_path", "class_name", "family", "calls", "time_ms", "share", "hotspot_score"]
    return Block(notes=["Inclusive time: a container (a decoder layer) includes its children. hotspot_score = share "
                        "x the phase's weight in the workload."], figures=[fig], tables=[("hotspots", df[cols])])


@section("speedups", "Per-task speedup distribution")
def speedups(ctx: ReportContext) -> Block:
    t = ctx.df("trials")
    if t.empty:
        return Block(notes=["no searches in this run"])
    tasks = list(dict.fromkeys(t["task_id"]))
    fig = _figure(11.0, 0.35 * len(tasks) + 1.8)
    ax_s, ax_o = fig.subplots(1, 2, width_ratios=[3, 2])
    timed = t[t["pooled"].notna()]
    if timed.empty:
        _no_data(ax_s, "no timed candidates\n(on the CPU the verifier times nothing)")
    else:
        data = [timed.loc[timed["task_id"] == k, "pooled"].to_numpy() for k in tasks]
        ax_s.boxplot([d if len(d) else [float("nan")] for d in data], orientation="horizontal",
                     tick_labels=[_short(k) for k in tasks], showfliers=False)
        for i, d in enumerate(data):
            ax_s.scatter(d, [i + 1] * len(d), s=12, alpha=0.6, color="#dd8452", zorder=3)
        ax_s.axvline(1.0, color="#999", lw=1, ls="--")
        ax_s.set_xlabel("speedup over the search's pooled reference (passing candidates)")
        ax_s.tick_params(axis="y", labelsize=7)
    outcome = t.assign(outcome=t["failure_class"].where(~t["passed"], "passed").fillna("failed"))
    counts = outcome.pivot_table(index="task_id", columns="outcome", aggfunc="size", fill_value=0).reindex(tasks)
    left = pd.Series(0, index=counts.index)
    for col in sorted(counts.columns, key=lambda c: (c != "passed", c)):
        ax_o.barh([_short(k) for k in counts.index], counts[col], left=left, label=col,
                  color="#55a868" if col == "passed" else None)
        left = left + counts[col]
    ax_o.invert_yaxis()
    ax_o.set_xlabel("trials by outcome")
    ax_o.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, frameon=False)
    if timed.empty:
        ax_o.tick_params(axis="y", labelsize=7)
    else:
        ax_o.set_yticks([])  # the speedup panel beside it names the tasks
        ax_s.invert_yaxis()
    g = t.groupby("task_id", sort=False)
    table = pd.DataFrame({
        "family": g["family"].first(), "phase": g["phase"].first(), "trials": g.size(),
        "passed": g["passed"].sum(), "pass_rate": g["passed"].mean().round(3),
        "speedup_p20": g["pooled"].quantile(0.2), "speedup_p50": g["pooled"].median(),
        "speedup_p80": g["pooled"].quantile(0.8), "speedup_best": g["pooled"].max(),
    }).reset_index()
    return Block(figures=[fig], tables=[("speedups per task", table)])


def _best_so_far(d: pd.DataFrame) -> pd.Series:
    score = d["pooled"].where(d["pooled"].notna(), d["utility"]).where(d["passed"], 0.0)
    return score.cummax()


@section("search", "Search curves")
def search_curves(ctx: ReportContext) -> Block:
    t = ctx.df("trials")
    if t.empty:
        return Block(notes=["no searches in this run"])
    tasks = list(dict.fromkeys(t["task_id"]))
    ncol = min(3, len(tasks))
    nrow = -(-len(tasks) // ncol)
    fig = _figure(11.0, 2.6 * nrow + 0.6)
    axes = fig.subplots(nrow, ncol, squeeze=False).ravel()
    for ax, task in zip(axes, tasks):
        seen: dict[str, int] = {}
        for _, d in t[t["task_id"] == task].groupby("search_id", sort=False):
            d = d.sort_values("iteration")
            mode = d["mode"].iloc[0]
            seen[mode] = seen.get(mode, 0) + 1
            x = d["iteration"].to_numpy() + 1
            colour = MODE_COLOURS.get(mode, "#7f7f7f")
            label = mode if seen[mode] == 1 else f"{mode} #{seen[mode]}"
            ax.step(x, _best_so_far(d), where="post", color=colour, label=label)
            ok = d["passed"].to_numpy()
            raw = d["pooled"].where(d["pooled"].notna(), d["utility"]).fillna(0.0).to_numpy()
            ax.scatter(x[ok], raw[ok], s=14, color=colour, zorder=3)
            ax.scatter(x[~ok], [0.0] * int((~ok).sum()), s=18, marker="x", color="#c44e52", zorder=3)
            for start in d.loc[d["episode"].diff().fillna(0) != 0, "iteration"] + 1:
                ax.axvline(start - 0.5, color=colour, lw=0.8, ls=":")
        ax.set_title(_short(task, 40), fontsize=8)
        ax.set_xlabel("trial")
        ax.set_ylabel("best utility so far")
        ax.legend(fontsize=6)
    for ax in axes[len(tasks):]:
        ax.set_visible(False)
    notes = ["utility: speedup over the search's pooled reference for passing trials (0 for failing ones, marked "
             "x); dotted lines: a new episode starts (a restart from the distilled experience)."]
    if t["pooled"].isna().all():
        notes.append("no trial was timed (CPU): every passing trial scores 0, the curves show pass/fail only.")
    return Block(notes=notes, figures=[fig], tables=[("searches", ctx.df("searches"))])


@section("acceptance", "Acceptance decisions")
def acceptance(ctx: ReportContext) -> Block:
    a = ctx.df("acceptances")
    if a.empty:
        return Block(notes=["no acceptance decisions for this run"])
    n_acc = int((a["decision"] == "accepted").sum())
    notes = [f"{n_acc} accepted, {len(a) - n_acc} rejected, in the order tried"]
    measured = a[a["gain"].notna()]
    figures = [_gain_plot(measured)] if not measured.empty else []
    if measured.empty:
        notes.append("no trial reached a latency measurement: nothing to plot")
    cols = ["count", "task_id", "family", "phase", "candidate_id", "decision", "gain", "e2e_before_ms",
            "e2e_after_ms", "in_model_max_abs_err", "metric", "reason"]
    return Block(notes=notes, figures=figures, tables=[("decisions", grouped_decisions(a)[cols])])


def _gain_plot(a: pd.DataFrame):
    """One bar per decision whose end-to-end gain was measured, green where accepted."""
    fig = _figure(11.0, 0.35 * len(a) + 1.4)
    ax = fig.subplots()
    labels = [f"{_short(t)} / {c[:8]}" for t, c in zip(a["task_id"], a["candidate_id"])]
    gains = a["gain"] * 100
    ax.barh(labels, gains, color=["#55a868" if d == "accepted" else "#c44e52" for d in a["decision"]])
    for i, (g, d) in enumerate(zip(gains, a["decision"])):
        ax.text(g, i, f" {d}", va="center", fontsize=7)
    ax.axvline(0, color="#999", lw=1)
    ax.invert_yaxis()
    ax.set_xlabel("end-to-end gain of the trial, % (green: accepted, red: rejected)")
    ax.tick_params(axis="y", labelsize=7)
    return fig


def e2e_table(e: pd.DataFrame) -> pd.DataFrame:
    """The end-to-end rows with the total's spread over the timed runs and the ratio to eager's median."""
    e = e.copy()
    point = list(zip(e["batch_size"], e["prompt_len"]))
    eager = {p: t for p, v, t in zip(point, e["variant"], e["total_ms"]) if v == "eager" and pd.notna(t)}
    e["total_range_ms"] = e["total_samples_ms"].map(_spread)
    e["runs"] = e["total_samples_ms"].map(lambda v: len(_samples(v)))
    e["speedup_vs_eager"] = [eager[p] / t if p in eager and pd.notna(t) and t > 0 else None
                             for p, t in zip(point, e["total_ms"])]
    cols = ["batch_size", "prompt_len", "variant", "total_ms", "total_range_ms", "runs", "speedup_vs_eager",
            "prefill_ms", "decode_ms_per_token", "tokens_per_s", "decode_tokens_per_s", "peak_mem_mb", "compile_s",
            "gpu_name", "notes"]
    return e[cols]


@section("e2e", "End to end")
def end_to_end(ctx: ReportContext) -> Block:
    e = ctx.df("e2e")
    if e.empty:
        return Block(notes=["no end-to-end rows for this run"])
    e = e.sort_values("variant", key=lambda s: s.map(_variant_rank), kind="stable")
    table = e2e_table(e)
    measured = e[e["total_ms"].notna()]
    several = len(set(zip(measured["batch_size"], measured["prompt_len"]))) > 1
    labels = [f"{v}\n{b}x{p}" if several else v
              for v, b, p in zip(measured["variant"], measured["batch_size"], measured["prompt_len"])]
    fig = _figure(11.0, 3.6)
    ax_t, ax_d = fig.subplots(1, 2)
    for i, r in enumerate(measured.itertuples()):
        s = _samples(r.total_samples_ms)
        lo, hi = (min(s), max(s)) if s else (r.total_ms, r.total_ms)
        ax_t.bar(i, r.total_ms, color="#4c72b0" if "patched" not in r.variant else "#55a868")
        ax_t.errorbar(i, r.total_ms, yerr=[[r.total_ms - lo], [hi - r.total_ms]], color="k", capsize=4)
        ax_t.scatter([i] * len(s), s, s=10, color="#333", zorder=3)
        ax_d.bar(i, r.decode_ms_per_token or 0.0, color="#4c72b0" if "patched" not in r.variant else "#55a868")
    for ax in (ax_t, ax_d):
        ax.set_xticks(range(len(measured)), labels, rotation=15, fontsize=8)
    if len(measured) and measured["total_ms"].max() > 10 * measured["total_ms"].min():
        ax_t.set_yscale("log")
    ax_t.set_ylabel("total ms")
    ax_d.set_ylabel("decode ms per token (median)")
    skipped = e[e["total_ms"].isna()]
    notes = ["Bars: the median total of the script's run (prefill + decode); whiskers: min-max of the timed runs; "
             "dots: each run. Every variant was measured in one process."]
    notes += [f"{r.variant}: {r.notes}" for r in skipped.itertuples()]
    return Block(notes=notes, figures=[fig], tables=[("end to end", table)])


@section("throughput", "Throughput against batch size")
def throughput(ctx: ReportContext) -> Block | None:
    """Decode tokens/s against batch size, one line per variant and prompt length; left out unless the run has
    measured rows at more than one batch size (`llm4llm evaluate --batch-sizes`)."""
    e = ctx.df("e2e")
    e = e[e["decode_tokens_per_s"].notna()] if not e.empty else e
    if e.empty or e["batch_size"].nunique() < 2:
        return None
    fig = _figure(11.0, 4.0)
    ax_t, ax_s = fig.subplots(1, 2)
    styles = {p: ls for p, ls in zip(sorted(e["prompt_len"].unique()), ("-", "--", "-.", ":") * 4)}
    variants = sorted(e["variant"].unique(), key=_variant_rank)
    colours = {v: f"C{i}" for i, v in enumerate(variants)}
    for (variant, prompt), d in sorted(e.groupby(["variant", "prompt_len"]), key=lambda kv: _variant_rank(kv[0][0])):
        d = d.sort_values("batch_size")
        tok = d["decode_tokens_per_s"]
        # the step's p80 is the throughput's p20 and the other way round
        lo = (d["batch_size"] * 1e3 / d["decode_ms_p80"]).fillna(tok)
        hi = (d["batch_size"] * 1e3 / d["decode_ms_p20"]).fillna(tok)
        kw = dict(color=colours[variant], ls=styles[prompt], marker="o", ms=3, label=f"{variant}, prompt {prompt}")
        ax_t.errorbar(d["batch_size"], tok, yerr=[(tok - lo).clip(lower=0), (hi - tok).clip(lower=0)], capsize=3,
                      **kw)
        ax_s.plot(d["batch_size"], d["decode_ms_per_token"], **kw)
    for ax in (ax_t, ax_s):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
    ax_t.set_ylabel("decode tokens/s (batch x tokens / decode time)")
    ax_s.set_ylabel("ms per decode step (median)")
    ax_t.legend(fontsize=6, ncol=2)
    cols = ["batch_size", "prompt_len", "variant", "decode_ms_per_token", "decode_ms_p20", "decode_ms_p80",
            "decode_tokens_per_s", "tokens_per_s", "gpu_step_ms", "hbm_floor_ms"]
    table = e.sort_values(["prompt_len", "batch_size"], kind="stable")[cols].assign(
        x_floor=lambda d: d["gpu_step_ms"] / d["hbm_floor_ms"])
    return Block(notes=["Whiskers: the p20-p80 of the decode step over the interleaved rounds. tokens_per_s in the "
                        "table is end to end (prefill included); x_floor: the step's GPU time over weights + the KV "
                        "cache read at the copy bandwidth (graph variants on a GPU)."],
                 figures=[fig], tables=[("throughput per point", table)])


SERVICE_COLOURS = {"replace": "#55a868", "rollback": "#c44e52"}  # a night that changed the bundle in service


def _service_tables(nights: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    return [("service decisions", nights.drop(columns=["in_service"]))] if not nights.empty else []


def _service_note(ctx: ReportContext, nights: pd.DataFrame) -> list[str]:
    if nights.empty:
        return []
    now = nights["in_service"].iloc[-1]
    counts = nights["decision"].value_counts()
    made = ", ".join(f"{counts[d]} {d}" for d in ("keep", "replace", "rollback") if d in counts)
    version = "none" if pd.isna(now) else f"version {int(now)}"
    return [f"The service: {len(nights)} night(s) of {ctx.workload} ({made}); in service now: {version}. "
            "Vertical lines mark the nights that replaced (green) or rolled back (red) the bundle."]


def _mark_service_nights(ax, nights: pd.DataFrame, x_of: dict[str, int]) -> None:
    """A vertical line per night that changed the bundle in service, at that night's evaluated run."""
    for r in nights.itertuples():
        x = x_of.get(f"{r.run_id}-e2e", x_of.get(r.run_id))
        if x is None or r.decision not in SERVICE_COLOURS:
            continue
        ax.axvline(x, color=SERVICE_COLOURS[r.decision], lw=1.2, ls=":")
        to = "none" if pd.isna(r.to_version) else f"v{int(r.to_version)}"
        ax.annotate(f" {r.decision} -> {to}", (x, 0.03), xycoords=("data", "axes fraction"), fontsize=7,
                    color=SERVICE_COLOURS[r.decision], rotation=90, ha="left", va="bottom")


@section("history", "History of the workload")
def history(ctx: ReportContext) -> Block:
    h = ctx.df("e2e_history")
    runs = ctx.df("run_history")
    nights = ctx.df("service_history")
    if h.empty:
        return Block(notes=[f"no end-to-end rows for {ctx.workload} yet", *_service_note(ctx, nights)],
                     tables=[("runs", runs), *_service_tables(nights)])
    h = h[h["total_ms"].notna()]
    order = list(dict.fromkeys(h["run_id"]))
    fig = _figure(11.0, 3.8)
    ax_t, ax_r = fig.subplots(1, 2, width_ratios=[3, 2])
    x_of = {r: i for i, r in enumerate(order)}
    for variant, d in sorted(h.groupby("variant"), key=lambda kv: _variant_rank(kv[0])):
        xs = [x_of[r] for r in d["run_id"]]
        lo = [min(_samples(s) or [t]) for s, t in zip(d["total_samples_ms"], d["total_ms"])]
        hi = [max(_samples(s) or [t]) for s, t in zip(d["total_samples_ms"], d["total_ms"])]
        ax_t.errorbar(xs, d["total_ms"], yerr=[d["total_ms"] - lo, pd.Series(hi, index=d.index) - d["total_ms"]],
                      marker="o", capsize=3, label=variant)
    labels = [str(h.loc[h["run_id"] == r, "run_started"].iloc[0])[:16] for r in order]
    ax_t.set_xticks(range(len(order)), labels, rotation=20, fontsize=7)
    if h["total_ms"].max() > 10 * h["total_ms"].min():
        ax_t.set_yscale("log")
    ax_t.set_ylabel("total ms (median, min-max)")
    ax_t.legend(fontsize=7)
    _mark_service_nights(ax_t, nights, x_of)
    ratio = h.pivot_table(index="run_id", columns="variant", values="total_ms", aggfunc="last").reindex(order)
    if "eager" in ratio:
        for variant in [c for c in ratio.columns if c != "eager"]:
            ax_r.plot(range(len(order)), ratio["eager"] / ratio[variant], marker="o", label=f"eager / {variant}")
        ax_r.axhline(1.0, color="#999", lw=1, ls="--")
        ax_r.set_ylabel("speedup over eager (same run)")
        ax_r.legend(fontsize=7)
        ax_r.set_xticks(range(len(order)), labels, rotation=20, fontsize=7)
    else:
        _no_data(ax_r, "no eager baseline in these runs")
    table = h.assign(total_range_ms=h["total_samples_ms"].map(_spread))[
        ["run_started", "run_id", "variant", "total_ms", "total_range_ms", "decode_ms_per_token", "gpu_name",
         "accepted", "rejected", "workload_hash"]]
    return Block(notes=[f"{len(order)} evaluated run(s) of {ctx.workload}, oldest first", *_service_note(ctx, nights)],
                 figures=[fig], tables=[("end to end per run", table), ("runs", runs), *_service_tables(nights)])


TILEMIX_ENDS = ("all_16bit", "all_int8")  # 0 % and 100 %: one routing each, shared by every template's line


def _tilemix_lines(f: pd.DataFrame) -> list[tuple[str, int, pd.DataFrame]]:
    """(template, prompt length, its points by coverage: 0 %, the template's coverages, 100 %) per line."""
    lines = []
    for S, d in f.groupby("seq_len", sort=True):
        ends = d[d["template"].isin(TILEMIX_ENDS)]
        for tpl in [t for t in dict.fromkeys(d["template"]) if t not in TILEMIX_ENDS + ("sdpa_flash",)]:
            pts = pd.concat([ends, d[d["template"] == tpl]]).sort_values("coverage")
            lines.append((tpl, int(S), pts))
    return lines


@section("tilemix", "TileMix frontier")
def tilemix_frontier(ctx: ReportContext) -> Block | None:
    f = ctx.df("tilemix_frontier", ctx.run_id, ctx.workload)
    if f.empty:
        return None
    fig = _figure(11.0, 4.0)
    ax_s, ax_e = fig.subplots(1, 2)
    colours = {t: f"C{i}" for i, t in enumerate(dict.fromkeys(tpl for tpl, _, _ in _tilemix_lines(f)))}
    styles = {S: ls for S, ls in zip(sorted(f["seq_len"].unique()), ("-", "--", "-.", ":") * 4)}
    for tpl, S, pts in _tilemix_lines(f):
        label = f"{tpl}, {S // 1024}k" if S >= 1024 else f"{tpl}, {S}"
        for ax, col in ((ax_s, "vs_sdpa"), (ax_e, "rel_err_fp32")):
            ax.plot(pts["coverage"] * 100, pts[col], marker="o", ms=3, color=colours[tpl], ls=styles[S],
                    label=label)
    ax_s.axhline(1.0, color="#999", lw=1, ls="--")
    ax_s.set_ylabel("throughput / SDPA flash (same length and batch)")
    sdpa = f[f["template"] == "sdpa_flash"]
    if len(sdpa):
        ax_e.axhline(float(sdpa["rel_err_fp32"].median()), color="#999", lw=1, ls="--", label="SDPA flash (bf16)")
    ax_e.set_yscale("log")
    ax_e.set_ylabel("output rel-L2 error vs fp32")
    for ax in (ax_s, ax_e):
        ax.set_xlabel("INT8 coverage, % of the visible tile groups")
        ax.grid(alpha=0.3)
    ax_e.legend(fontsize=6, ncol=2)
    r = f.iloc[0]
    notes = [f"bench {r['bench_id']} on {r['gpu_name'] or 'an unrecorded GPU'}: "
             f"{r['heads_q']} query / {r['heads_kv']} KV heads, head_dim {r['head_dim']}, batch "
             f"{', '.join(str(b) for b in sorted(f['batch'].unique()))}; 0 % is our bf16 kernel and 100 % uniform "
             "INT8, both shared by every template's line; dashed: SDPA flash."]
    cols = ["seq_len", "batch", "template", "coverage", "realised_coverage", "p50_ms", "p20_ms", "p80_ms",
            "tokens_per_s", "tflops", "vs_sdpa", "vs_0pct", "vs_100pct", "rel_err_fp32"]
    return Block(notes=notes, figures=[fig], tables=[("frontier", f[cols])])


KB_KINDS = ("model", "kernelbench")  # a KernelBench section shows wherever the run has KernelBench rows
KB_SUMMARY_COLS = ["mode", "problems", "pass_rate", "fast_1", "fast_compile", "degenerate", "geo_eager_real",
                   "geo_eager_p05", "geo_eager_p95", "geo_compile_real", "geo_compile_p05", "geo_compile_p95",
                   "geo_eager", "geo_compile", "geo_eager_fail_as_1", "geo_compile_over_eager"]
KB_PROBLEM_COLS = ["problem", "mode", "passed", "trials", "origin", "eager_ms", "compile_ms", "candidate_ms",
                   "speedup_eager", "speedup_compile", "skipped_reason"]


def _is_degenerate(df: pd.DataFrame) -> pd.Series:
    return df["degenerate"].astype("boolean").fillna(False).astype(bool)


def _kb_geo_panel(ax, summary: pd.DataFrame) -> None:
    """Per mode, the geo-means over eager and over torch.compile without the degenerate problems, whiskers at
    their bootstrap 5-95 %."""
    xs = range(len(summary))
    for off, col, colour in ((-0.2, "eager", "#4c72b0"), (0.2, "compile", "#dd8452")):
        geo = summary[f"geo_{col}_real"].astype(float)
        lo = (geo - summary[f"geo_{col}_p05"].astype(float)).clip(lower=0).fillna(0)
        hi = (summary[f"geo_{col}_p95"].astype(float) - geo).clip(lower=0).fillna(0)
        ax.bar([x + off for x in xs], geo.fillna(0), 0.4, yerr=[lo, hi], capsize=4, color=colour,
               label=f"over {'eager' if col == 'eager' else 'torch.compile'}")
    ax.axhline(1.0, color="#999", lw=1, ls="--")
    ax.set_xticks(list(xs), [f"{m}\n{r:.0%} pass" for m, r in zip(summary["mode"], summary["pass_rate"])])
    ax.set_ylabel("geo-mean speedup, passing problems\n(degenerate left out; 5-95 % bootstrap)")
    ax.legend(fontsize=7)


def _kb_problem_panel(ax, problems: pd.DataFrame) -> None:
    """Each problem's speedup over eager per mode (log scale over a wide range); degenerate problems hollow, apart
    on the right."""
    ok = problems[problems["passed"] & problems["speedup_eager"].notna()]
    order = list(dict.fromkeys(ok.sort_values(["degenerate_", "problem_id"])["problem_id"]))
    x_of = {pid: i for i, pid in enumerate(order)}
    for mode, d in ok.groupby("mode", sort=True):
        colour = MODE_COLOURS.get(mode, "#7f7f7f")
        for deg, dd in d.groupby("degenerate_"):
            ax.scatter([x_of[p] for p in dd["problem_id"]], dd["speedup_eager"], s=18, label=None if deg else mode,
                       facecolors="none" if deg else colour, edgecolors=colour)
    n_deg = ok.loc[ok["degenerate_"], "problem_id"].nunique()
    if n_deg:
        ax.axvline(len(order) - n_deg - 0.5, color="#999", lw=1, ls=":")
    ax.axhline(1.0, color="#999", lw=1, ls="--")
    if ok["speedup_eager"].max() > 10 * ok["speedup_eager"].min():
        ax.set_yscale("log")
    ax.set_xticks(range(len(order)), [str(p) for p in order], fontsize=6, rotation=90)
    ax.set_xlabel("problem id" + (" (hollow, right of the dotted line: degenerate)" if n_deg else ""))
    ax.set_ylabel("best speedup over eager")
    ax.legend(fontsize=7)


@section("kernelbench", "KernelBench results", kinds=KB_KINDS)
def kernelbench_results(ctx: ReportContext) -> Block | None:
    """Pass rate and the geo-means over eager and torch.compile per search mode with their spread, each problem's
    speedup, and the degenerate problems apart (out of the geo-means); left out without KernelBench rows."""
    run = ctx.df("kb_run")
    if run.empty:
        return None
    summary = ctx.df("kb_summary")
    problems = ctx.df("kb_problems")
    problems = problems.assign(degenerate_=_is_degenerate(problems))
    deg = problems[problems["degenerate_"]]
    fig = _figure(11.0, 4.2)
    ax_g, ax_p = fig.subplots(1, 2, width_ratios=[2, 5])
    _kb_geo_panel(ax_g, summary)
    if problems["speedup_eager"].notna().any():
        _kb_problem_panel(ax_p, problems)
    else:
        _no_data(ax_p, "no timed problem\n(on the CPU KernelBench's protocol checks correctness only)")
    notes = [f"KernelBench run {ctx.run_id}: {run.iloc[0]['problems']} problem(s), mode(s) {run.iloc[0]['modes']}, "
             f"proposer {run.iloc[0]['proposer']}, budget {run.iloc[0]['budget']}. Geo-means over the passing "
             "problems without the degenerate ones (`*_real`), their 5-95 % over a seeded bootstrap of the "
             "problems; `geo_eager` / `geo_compile` keep the degenerate ones, `geo_eager_fail_as_1` counts a "
             "failed problem 1.0."]
    if len(deg):
        notes.append(f"{deg['problem'].nunique()} degenerate problem(s) (the output ignores the inputs): listed "
                     "apart, left out of the geo-means and of the ablation curves.")
    tables = [("summary per mode", summary[[c for c in KB_SUMMARY_COLS if c in summary]]),
              ("problems", problems.loc[~problems["degenerate_"], KB_PROBLEM_COLS])]
    if len(deg):
        tables.insert(1, ("degenerate problems", deg[KB_PROBLEM_COLS]))
    return Block(notes=notes, figures=[fig], tables=tables)


@section("kb_ablation", "KernelBench search-mode ablation", kinds=KB_KINDS)
def kernelbench_ablation(ctx: ReportContext) -> Block | None:
    """Per search mode at equal budget, the geo-mean of the best speedup over eager so far against the trial, in
    its bootstrap band; and each pair of modes at the full budget, paired by problem."""
    if ctx.df("kb_run").empty:
        return None
    bands = ctx.df("kb_curve_bands")
    if bands.empty:
        return Block(notes=["no trial was recorded for this KernelBench run"])
    contrasts = ctx.df("kb_mode_contrasts")
    fig = _figure(11.0, 4.0)
    ax = fig.subplots()
    for mode, g in bands.groupby("mode", sort=True):
        colour = MODE_COLOURS.get(mode, "#7f7f7f")
        ax.plot(g["trial"], g["geo_best"], marker="o", color=colour, label=f"{mode} ({g['problems'].iloc[0]})")
        ax.fill_between(g["trial"], g["geo_p05"], g["geo_p95"], color=colour, alpha=0.2)
    ax.axhline(1.0, color="#999", lw=1, ls="--")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("trial (equal budget per problem and mode)")
    ax.set_ylabel("geo-mean best speedup over eager so far")
    ax.legend(fontsize=7, title="mode (problems)", title_fontsize=7)
    notes = ["Each problem counts the best of the reference (1.0) and its passing trials so far; a search that "
             "stopped early keeps its best. Bands: 5-95 % over a seeded bootstrap of the problems, paired across "
             "trials. Degenerate problems are left out. The contrasts compare two modes on the same problems "
             "(geo-mean of the ratio of their best speedups at the full budget, with its 5-95 %): a band that "
             "excludes 1.0 separates the modes."]
    if bands["mode"].nunique() < 2:
        notes.append("one search mode only: no ablation (run `llm4llm kernelbench` with several --mode).")
    elif bands["problems"].nunique() > 1:
        counts = ", ".join(f"{m} {n}" for m, n in bands.groupby("mode")["problems"].first().items())
        notes.append(f"the modes cover different problems ({counts}): compare them by the contrasts, which pair "
                     "the problems both ran.")
    tables = [("curves", bands)] + ([("mode contrasts", contrasts)] if not contrasts.empty else [])
    return Block(notes=notes, figures=[fig], tables=tables)


# ---- rendering --------------------------------------------------------------------------------------------------

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
nav a { margin-right: 1em; } .note { color: #444; margin: 0.3em 0; } .plot { max-width: 100%; display: block; }
table.data { border-collapse: collapse; font-size: 12px; margin: 0.6em 0 1.2em; }
table.data th, table.data td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
table.data th { background: #f4f4f4; } table.data td { max-width: 520px; overflow-wrap: anywhere; }
.wide { overflow-x: auto; } .meta { color: #666; }
"""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode()


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def html_table(name: str, df: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
                   for row in df.itertuples(index=False))
    return (f'<h3>{html.escape(name)}</h3><div class="wide"><table class="data" data-table="{html.escape(name)}">'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


def render_section(s: Section, ctx: ReportContext) -> str:
    """The section's HTML, or "" where it has nothing for this run."""
    block = s.build(ctx)
    return "" if block is None else render_block(s, block)


def render_block(s: Section, block: Block) -> str:
    parts = [f'<section id="{s.key}" data-section="{s.key}"><h2>{html.escape(s.title)}</h2>']
    parts += [f'<p class="note">{html.escape(n)}</p>' for n in block.notes]
    parts += [f'<img class="plot" alt="{s.key} plot {i}" src="data:image/png;base64,{_png(f)}">'
              for i, f in enumerate(block.figures)]
    parts += [html_table(name, df) for name, df in block.tables]
    return "".join(parts) + "</section>"


def report_context(reader: Reader, run_id: str) -> ReportContext:
    """The context of a model's run (its `runs` row) or, without one, of a KernelBench run (its `kb_run_id`)."""
    run = reader.frame("run_overview", run_id)
    if not run.empty:
        return ReportContext(reader, run_id, str(run.iloc[0]["workload_name"]))
    if not reader.frame("kb_run", run_id).empty:
        return ReportContext(reader, run_id, "kernelbench", kind="kernelbench")
    raise ValueError(f"run: expected an existing run id or KernelBench run id, got {run_id!r}")


def render_report(reader: Reader, run_id: str, sections: list[Section] | None = None) -> str:
    """The whole report of one run as one HTML string (nothing external: plots are inline PNG): the sections of
    its kind of run (RUN_KINDS) that have something for it."""
    ctx = report_context(reader, run_id)
    chosen = [s for s in (sections if sections is not None else SECTIONS) if ctx.kind in s.kinds]
    shown = [(s, b) for s, b in ((s, s.build(ctx)) for s in chosen) if b is not None]
    body = "".join(render_block(s, b) for s, b in shown)
    nav = "".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s, _ in shown)
    made = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = f"llm4llm report: {ctx.workload} ({run_id})"
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f'<p class="meta">made {made} from {html.escape(reader.source)}</p><nav>{nav}</nav>{body}</body></html>')


# ---- markdown (Prefect artifacts) -------------------------------------------------------------------------------

def markdown_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "_no rows_"
    cell = lambda v: _fmt(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def leaderboard(trials: pd.DataFrame, per_task: int = 3) -> pd.DataFrame:
    """The best passing candidates of each task (by pooled speedup where timed, else by utility)."""
    ok = trials[trials["passed"]].assign(score=lambda d: d["pooled"].where(d["pooled"].notna(), d["utility"]))
    ok = ok.sort_values(["task_id", "score", "max_abs_err"], ascending=[True, False, True])
    top = ok.groupby("task_id", sort=False).head(per_task)
    return top[["task_id", "phase", "candidate_id", "template", "mode", "score", "ctx_p50_ms", "ref_ctx_p50_ms",
                "max_abs_err"]]


def _artifact_leaderboard(trials: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard in the columns an artifact's width keeps in view at a 1400-pixel window (the phase is in the
    task id; the reference's time is in the score)."""
    b = leaderboard(trials)
    return pd.DataFrame({"task": b["task_id"].map(lambda t: _short(t, 40)), "candidate": b["candidate_id"].str[:8],
                         "template": b["template"].map(lambda t: clip(t, 32)), "score": b["score"],
                         "p50_ms": b["ctx_p50_ms"], "max_err": b["max_abs_err"]})


def _artifact_decisions(a: pd.DataFrame) -> str:
    """The acceptance decisions, grouped (grouped_decisions), as a table of what the Prefect UI keeps in view (row
    number, count, short ids, decision, gain in %, latency before -> after) and each row's reason in a numbered list
    under it, cut at REASON_CHARS."""
    g = grouped_decisions(a)
    ms = lambda v: "" if pd.isna(v) else f"{v:.1f}"  # noqa: E731
    table = pd.DataFrame({"#": range(1, len(g) + 1), "n": g["count"], "task": g["task_id"].map(lambda t: clip(t, 40)),
                          "candidate": g["candidate_id"].fillna("").str[:8], "decision": g["decision"],
                          "gain_%": g["gain"] * 100,
                          "e2e_ms": [f"{ms(b)} -> {ms(x)}" if pd.notna(b) else "" for b, x in
                                     zip(g["e2e_before_ms"], g["e2e_after_ms"])]})
    reasons = [f"{i}. {clip(r, REASON_CHARS) or '(no reason recorded)'}" for i, r in enumerate(g["reason"], 1)]
    return markdown_table(table) + "\n\nReasons, by row:\n\n" + "\n".join(reasons)


ARTIFACTS = ("hotspots", "leaderboard", "acceptance", "e2e")


def markdown(kind: str, reader: Reader, run_id: str) -> str:
    """One of the run's markdown artifacts (ARTIFACTS)."""
    if kind == "hotspots":
        df = reader.frame("hotspots", run_id, 10)
        return f"## Hotspots of run `{run_id}`\n\nShare of each phase's time (containers include children).\n\n" \
               + markdown_table(df[["phase", "rank", "module_path", "family", "calls", "time_ms", "share",
                                    "hotspot_score"]])
    if kind == "leaderboard":
        t = reader.frame("trials", run_id)
        timed = "" if t.empty or t["pooled"].notna().any() else "\n\nNo trial was timed (CPU): scores are 0."
        return f"## Leaderboard of run `{run_id}`\n\nBest passing candidates per task (score: speedup over the " \
               f"search's pooled reference).{timed}\n\n" + (markdown_table(_artifact_leaderboard(t)) if not t.empty
                                                             else "_no searches_")
    if kind == "acceptance":
        a = reader.frame("acceptances", run_id)
        n = int((a["decision"] == "accepted").sum()) if not a.empty else 0
        table = _artifact_decisions(a) if not a.empty else "_no decisions_"
        return f"## Acceptance of run `{run_id}`\n\n{n} accepted, {len(a) - n} rejected.\n\n" + table
    if kind == "e2e":
        e = reader.frame("e2e", run_id)
        return f"## End to end, run `{run_id}`\n\nMedians; range: min-max of the timed runs.\n\n" + (
            markdown_table(e2e_table(e)) if not e.empty else "_no rows_")
    raise ValueError(f"kind: expected one of {ARTIFACTS}, got {kind!r}")


def artifact_key(workload: str, kind: str) -> str:
    """A Prefect artifact key per workload and kind (keys allow lowercase letters, digits and dashes)."""
    import re

    return re.sub(r"[^a-z0-9-]+", "-", f"{workload}-{kind}".lower()).strip("-")
