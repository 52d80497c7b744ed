"""What a run gave its user, in the few lines `llm4llm optimize` ends with: end to end against eager and against
torch.compile (median and spread over the interleaved rounds), the bundle, the line that installs it, the time."""
from __future__ import annotations

from llm4llm.planner import fmt_s

# the variant that is what the bundle gives in serving, best first
SERVED = ("patched_graphs", "patched")


def _ratio(row: dict, key: str) -> str | None:
    v = row.get(key)
    if v is None or v != v:
        return None
    lo, hi = row.get(f"{key}_p20"), row.get(f"{key}_p80")
    spread = f" (p20-p80 {lo:.2f}-{hi:.2f})" if lo is not None and hi is not None and lo == lo and hi == hi else ""
    return f"{v:.2f}x{spread}"


def _ms(row: dict | None) -> str:
    v = (row or {}).get("total_ms")
    return f"{v:.1f} ms" if v is not None and v == v else "-"


def result_lines(rows: list[dict]) -> list[str]:
    """One result line per measured point (batch size, prompt length), in the order measured: one line, as
    `result_line`, where the run measured one point."""
    points = list(dict.fromkeys((r.get("batch_size"), r.get("prompt_len")) for r in rows))
    if len(points) <= 1:
        return [result_line(rows)]
    return [result_line([r for r in rows if (r.get("batch_size"), r.get("prompt_len")) == (b, p)],
                        at=f"batch {b}, prompt {p}") for b, p in points]


def result_line(rows: list[dict], at: str = "") -> str:
    """The run's end-to-end result, from its e2e rows (one per variant) at one point (`at` names it)."""
    head = f"result at {at}:" if at else "result:"
    by = {r["variant"]: r for r in rows}
    ours = next((by[v] for v in SERVED if v in by and by[v].get("total_ms") is not None
                 and by[v].get("total_ms") == by[v].get("total_ms")), None)
    if ours is None:
        why = next((by[v].get("notes") for v in SERVED if v in by and by[v].get("notes")), "")
        base = f"eager {_ms(by.get('eager'))}, torch.compile {_ms(by.get('torch_compile'))}"
        return f"{head} no patched run to compare ({why or 'no bundle'}); {base}"
    parts = [f"{head} {ours['variant']} {_ms(ours)} a request"]
    vs_c, vs_e = _ratio(ours, "vs_compile"), _ratio(ours, "vs_eager")
    if vs_c:
        parts.append(f"{vs_c} torch.compile ({_ms(by.get('torch_compile'))})")
    elif "torch_compile" in by:
        parts.append(f"torch.compile: {by['torch_compile'].get('notes') or 'not measured'}")
    if vs_e:
        parts.append(f"{vs_e} eager ({_ms(by.get('eager'))})")
    rounds = ours.get("repeats")
    tail = f", {rounds} interleaved rounds" if rounds else ""
    return ", ".join(parts) + tail


def summary_lines(rows: list[dict] | None, bundle: str | None, accepted: list[str], seconds: dict[str, float],
                  elapsed_s: float, budget_s: float | None, device: str) -> list[str]:
    """The closing lines of a run."""
    lines = []
    if rows:
        lines += result_lines(rows)
    if bundle:
        what = ", ".join(accepted) if accepted else "decode graphs only"
        lines.append(f"bundle: {bundle} ({what})")
        lines.append(f"install: kernels_runtime.apply(model, {bundle!r})  # in serving code, on the built model")
    elif not device.startswith("cuda"):
        lines.append("bundle: none (on a CPU the latency gate never accepts a patch; run on a GPU for a bundle)")
    else:
        lines.append("bundle: none (no patch passed in-model correctness and the delta gain)")
    stages = ", ".join(f"{k} {fmt_s(v)}" for k, v in seconds.items())
    budget = f" of the {fmt_s(budget_s)} budget" if budget_s else ""
    lines.append(f"time: {fmt_s(elapsed_s)}{budget} ({stages})")
    return lines
