"""One typed settings object for a closed-loop run: what `llm4llm optimize`, the `optimize-workload` flow, its
deployments (the Prefect UI's run form) and the stages below them take, instead of each setting passed by hand.

Where a run reads and writes (workload path, DuckDB file, artifact dir) is not part of it: those are the flow's own
parameters. The choices are `Literal`s (or a StrEnum of llm4llm.outcomes: DecodeTiming) so the UI offers a list and
a typo fails before anything runs; tests keep them equal to the tuples of the modules that implement them
(accept.METRIC_CHOICES, extract.TARGET_FAMILIES, ...).
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llm4llm.llm.config import LLMConfig
from llm4llm.outcomes import DecodeTiming  # noqa: F401 - how the verifier times candidates (a StrEnum), a choice here
from llm4llm.planner import DEFAULT_TIME_BUDGET_S, MAX_TRIALS
from llm4llm.scale import ScaleOut

Stage = Literal["profile", "extract", "search", "accept", "evaluate"]
STAGES: tuple[str, ...] = ("profile", "extract", "search", "accept", "evaluate")
SearchMode = Literal["episodic", "sample", "iter"]
ProposerKind = Literal["library", "llm", "hybrid"]
Family = Literal["norm", "mlp", "attention", "ssm_mixer", "ssm_block", "recurrent_block", "rotary", "conv",
                 "decoder_layer", "lm_head"]
Metric = Literal["auto", "logits_rel_l2_floor", "logits_rel_l2", "logits_max_abs"]
GraphChoice = Literal["auto", "on", "off"]
Variant = Literal["eager", "patched", "torch_compile", "eager_graphs", "patched_graphs", "liger"]
# What started a run (`runs.kind`): a deployment's schedule, a person in the UI, a config change, the command line
RunKind = Literal["nightly", "manual", "on-change", "cli"]
RUN_KINDS: tuple[str, ...] = ("nightly", "manual", "on-change", "cli")


def kind_of_deployment(deployment_name: str | None) -> RunKind:
    """The kind of a run that a deployment of this name started (deployments.serve and deployments.deploy name them
    `nightly-<workload>`, `manual[-<queue>]`, `on-change[-<queue>]`); "manual" for any other deployment, "cli" for a
    run that no deployment started."""
    if not deployment_name:
        return "cli"
    for kind in ("nightly", "on-change"):
        if deployment_name == kind or deployment_name.startswith(kind + "-"):
            return kind  # type: ignore[return-value]
    return "manual"


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SearchSettings(_Settings):
    """How candidates are proposed and how many are verified per task."""

    mode: SearchMode = Field("episodic", description="episodic (episodes with restart, the default), sample "
                                                     "(independent samples) or iter (one refinement chain)")
    budget: int | None = Field(None, ge=1, description="verified trials per task (empty: the plan's, by expected "
                                                        f"saving within the time budget; at most {MAX_TRIALS})")
    proposer: ProposerKind = Field("library", description="library: built-in Triton families (no API key); llm: "
                                                          "any litellm model (see `llm`); hybrid: both share the "
                                                          "budget")
    top: int | None = Field(None, ge=1, description="search the N hottest deployable tasks that a template covers "
                                                     "(empty: the plan's targets, by expected end-to-end saving: a "
                                                     "module searched whole stands for the modules inside it, a task "
                                                     "that cannot save delta is left out)")
    families: list[Family] | None = Field(None, description="search only tasks of these families (taken before "
                                                            "`top`); empty: every family")
    phases: list[Literal["prefill", "decode"]] | None = Field(
        None, description="search only tasks of these phases (taken before `top`; e.g. decode alone when the "
                          "decode steps are what the deployment spends); empty: both")
    timeout_s: float = Field(120.0, gt=0, description="wall-clock limit per verified candidate, in seconds")
    rounds: int = Field(1, ge=1, description="search + acceptance rounds: a task rejected in the model is searched "
                                             "again from its experience (the rejection included)")
    min_score: float = Field(0.0, ge=0, description="extraction skips modules whose hotspot score is below this")
    warm_start: bool = Field(True, description="start each task's search from its stored experience (earlier "
                                               "searches and acceptance rejections of the same task)")
    seed: int = Field(0, ge=0, description="seed of the built-in proposer")
    decode_timing: DecodeTiming = Field(DecodeTiming.LAUNCH,
                                        description="launch: candidates timed back to back | graph: decode "
                                                    "candidates by GPU time under CUDA-graph replay | "
                                                    "graph_prefill: prefill candidates too. `optimize` sets it from "
                                                    "the run's graph plan (the model is timed as it will run)")

    def trials(self) -> int:
        """Verified trials per task when nothing plans them: `budget`, else the planner's cap."""
        return self.budget if self.budget is not None else MAX_TRIALS


class AcceptSettings(_Settings):
    """Deployment-time acceptance: in-model correctness, then an end-to-end gain of at least delta."""

    delta: float = Field(0.02, ge=0, lt=1, description="minimum end-to-end gain (fraction of the latency) for a "
                                                       "patch to be accepted")
    metric: Metric = Field("auto", description="in-model correctness metric; auto: logits_rel_l2_floor for 16-bit "
                                               "models, logits_rel_l2 for fp32")
    repeats: int = Field(5, ge=1, description="end-to-end runs per latency measurement")
    tol_factor: float = Field(3.0, gt=0, description="fixed rel-L2 limit = factor x the dtype's rtol")
    # 2, not 1: the patched and the unpatched model are two equally valid roundings, each about one floor from fp32,
    # so about sqrt(2) floors apart, while a bug lands far outside (docs/results/acceptance-defaults.md)
    floor_factor: float = Field(2.0, gt=0, description="logits_rel_l2_floor: per-step limit = max(fixed limit, "
                                                       "factor x the model's own 16-bit-vs-fp32 noise floor)")
    # each in-model trial costs several end-to-end runs, and a candidate no faster on its task is not expected to
    # gain end to end (docs/results/acceptance-defaults.md); the CPU has no timings: every candidate is tried there
    min_task_speedup: float = Field(1.0, ge=0, description="on the GPU, a candidate no faster than this in its task "
                                                           "is rejected without an in-model trial (0: try all)")
    # a drift larger than any real gain must not reject every patch (docs/results/acceptance-defaults.md)
    noisy_rounds: int = Field(2, ge=0, le=10, description="when the baseline drifts by more than delta around a "
                                                          "trial, this many more (trial, baseline) pairs decide on "
                                                          "the median bracketed gain (0: the drift is the bar)")
    # back-to-back measurements read the host's drift as a gain or a loss
    interleave_rounds: int = Field(7, ge=0, le=50, description="GPU: the trial and the current bundle are timed "
                                                               "alternately in this many rounds, each on its own "
                                                               "weight-sharing model copy, and the median per-round "
                                                               "gain decides (0: the bracketed gate above)")
    check_tokens: bool = Field(False, description="greedy-token agreement too, after the logits (meaningful with "
                                                  "real weights only: on random weights near-flat logits flip "
                                                  "tokens on rounding-level differences)")

    @field_validator("tol_factor", "floor_factor", "min_task_speedup")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"expected a finite number, got {v!r}")
        return v

    def resolved_metric(self, dtype) -> str:
        """The metric in force for a model of this torch dtype: `auto` is logits_rel_l2 for fp32 (and fp64),
        logits_rel_l2_floor for 16-bit models."""
        import torch

        if self.metric != "auto":
            return self.metric
        return "logits_rel_l2" if dtype in (torch.float32, torch.float64) else "logits_rel_l2_floor"


class GraphSettings(_Settings):
    """CUDA-graph replay of the decode (and, for Mamba/Mamba2, the prompt) forward."""

    decode_graphs: GraphChoice = Field("auto", description="auto: on where every decode state sits at static "
                                                           "addresses (Mamba/Mamba2 caches, the static KV cache, "
                                                           "state adapters); on; off. GPU only")


class EvaluateSettings(_Settings):
    """The end-to-end comparison after acceptance."""

    variants: list[Variant] | None = Field(None, description="variants in the order measured; empty: eager, "
                                                             "patched, torch_compile (with decode graphs also "
                                                             "eager_graphs, patched_graphs)")
    repeats: int = Field(7, ge=1, description="interleaved rounds: one timed run of every variant per round, the "
                                              "order rotated, ratios paired round by round")
    max_s: float | None = Field(None, gt=0, description="time budget (s) for the interleaved rounds: a round starts "
                                                        "only if one more still fits at the slowest round's pace, "
                                                        "and the last one taken still measures the decode step; "
                                                        "none: all `repeats` rounds")
    batch_sizes: list[int] | None = Field(None, description="decode batches to measure at (none: the workload's "
                                                            "batch_size and, with a [regime], its largest batch too)")
    prompt_lens: list[int] | None = Field(None, description="prompt lengths to measure at (none: the workload's "
                                                            "prompt_len)")

    @field_validator("batch_sizes", "prompt_lens")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(x < 1 for x in v)):
            raise ValueError(f"expected positive integers, got {v}")
        return v


class OptimizeConfig(_Settings):
    """Every setting of one closed-loop run of a workload (profile -> extract -> search -> accept -> evaluate)."""

    stages: list[Stage] = Field(default_factory=lambda: list(STAGES),
                                description="stages to run, a prefix of profile, extract, search, accept, evaluate")
    time_budget_s: float | None = Field(DEFAULT_TIME_BUDGET_S, gt=0,
                                        description="wall-clock seconds for the whole run (empty: none): the plan "
                                                    "splits what profiling and extraction leave between the search "
                                                    "(by expected saving), acceptance and evaluation")
    refresh: bool = Field(False, description="ignore cached profile and extraction results")
    search: SearchSettings = Field(default_factory=SearchSettings, description="candidate search")
    accept: AcceptSettings = Field(default_factory=AcceptSettings, description="deployment-time acceptance")
    graphs: GraphSettings = Field(default_factory=GraphSettings, description="CUDA-graph replay")
    evaluate: EvaluateSettings = Field(default_factory=EvaluateSettings, description="end-to-end evaluation")
    scale: ScaleOut = Field(default_factory=ScaleOut, description="where the searches run: locally (the default) "
                                                                  "or fanned out over a Ray cluster")
    llm: LLMConfig | None = Field(None, description="the LLM proposer's settings (proposer llm or hybrid); API "
                                                    "keys come from the provider's environment variable, never "
                                                    "from here")


def setting_paths(model: type[BaseModel] = OptimizeConfig, prefix: str = "") -> list[str]:
    """Every setting of a run by its dotted path (`search.budget`, `accept.delta`, ...): what `--set` takes."""
    out = []
    for name, f in model.model_fields.items():
        sub = f.annotation if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel) else None
        out += setting_paths(sub, f"{prefix}{name}.") if sub is not None else [prefix + name]
    return out


def apply_sets(values: dict, sets: list[str]) -> dict:
    """`values` (an OptimizeConfig's fields, nested by section) with each `PATH=VALUE` of `sets` written in, in
    order; VALUE is read as JSON where it parses (30, 0.01, true, [1, 8, 32], null), else kept as text. A path that
    is not a setting is a ValueError naming the closest ones."""
    import difflib
    import json

    known = setting_paths()
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in values.items()}
    for item in sets:
        path, eq, text = item.partition("=")
        path = path.strip()
        if not eq or path not in known:
            near = difflib.get_close_matches(path, known, n=3) or known[:6]
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE with a known setting (did you mean "
                             f"{', '.join(near)}?)")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        *sections, key = path.split(".")
        node = out
        for s in sections:
            node = node.setdefault(s, {})
        node[key] = value
    return out


def setting_default(path: str):
    """The default of the setting at a dotted path (`accept.delta` -> 0.02), as its settings class declares it."""
    model: type[BaseModel] = OptimizeConfig
    *sections, key = path.split(".")
    for s in sections:
        model = model.model_fields[s].annotation
    f = model.model_fields[key]
    return f.default_factory() if f.default_factory is not None else f.default
