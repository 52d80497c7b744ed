"""OptimizeConfig: one typed settings object for the CLI, the flow and the deployments' UI form."""
from __future__ import annotations

import enum
import typing

import pytest
from pydantic import ValidationError

from llm4llm import config as C


def _choices(tp) -> tuple:
    """A Literal's values, or a StrEnum's (llm4llm.outcomes), as a tuple of strings."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tuple(m.value for m in tp)
    return typing.get_args(tp)


def test_choices_are_the_implementing_modules_own():
    from llm4llm.accept import METRIC_CHOICES
    from llm4llm.evaluate import ALL_VARIANTS
    from llm4llm.extract import TARGET_FAMILIES
    from llm4llm.graph_plan import GRAPH_CHOICES
    from llm4llm.search.episode import Mode

    assert _choices(C.Metric) == METRIC_CHOICES
    assert set(_choices(C.Variant)) == set(ALL_VARIANTS)
    assert _choices(C.Family) == TARGET_FAMILIES
    assert _choices(C.GraphChoice) == GRAPH_CHOICES
    assert _choices(C.Stage) == C.STAGES
    assert _choices(C.SearchMode) == _choices(Mode)
    assert _choices(C.ProposerKind) == ("library", "llm", "hybrid")
    from llm4llm.verify.worker import DECODE_TIMINGS

    assert _choices(C.DecodeTiming) == DECODE_TIMINGS


def test_every_field_has_a_description():
    def walk(model, where):
        for name, f in model.model_fields.items():
            if model.__module__ != C.__name__:
                continue
            assert f.description, f"{where}.{name} has no description"
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, C._Settings):
                walk(ann, f"{where}.{name}")

    walk(C.OptimizeConfig, "OptimizeConfig")
    assert {"search", "accept", "graphs", "evaluate", "llm"} <= set(C.OptimizeConfig.model_fields)


def test_acceptance_takes_the_settings_and_round_trips():
    """Acceptance has one settings type, AcceptSettings (its defaults are the stage's); the run's graph plan is
    passed beside it, not folded into a second settings class."""
    import inspect

    from llm4llm import accept as acc

    cfg = C.OptimizeConfig()
    assert not hasattr(acc, "AcceptConfig") and acc.AcceptSettings is C.AcceptSettings
    params = inspect.signature(acc.accept).parameters
    assert params["cfg"].annotation in ("AcceptSettings | None", C.AcceptSettings | None)
    assert set(C.AcceptSettings.model_fields) & {"decode_graphs", "static_cache"} == set()
    assert acc.GraphPlan() == acc.GraphPlan(decode_graphs=False, static_cache=False)
    assert C.OptimizeConfig.model_validate(cfg.model_dump()) == cfg
    assert C.OptimizeConfig.model_validate_json(cfg.model_dump_json()) == cfg


@pytest.mark.parametrize("values,where", [
    ({"search": {"proposer": "lib"}}, ("search", "proposer")),
    ({"search": {"mode": "greedy"}}, ("search", "mode")),
    ({"accept": {"metric": "l2"}}, ("accept", "metric")),
    ({"accept": {"noisy_rounds": 11}}, ("accept", "noisy_rounds")),
    ({"accept": {"tol_factor": float("inf")}}, ("accept", "tol_factor")),
    ({"stages": ["profile", "serve"]}, ("stages", 1)),
    ({"graphs": {"decode_graphs": "yes"}}, ("graphs", "decode_graphs")),
    ({"search": {"budgett": 3}}, ("search", "budgett")),
    ({"evaluate": {"max_s": 0}}, ("evaluate", "max_s")),
])
def test_bad_values_fail_with_their_field(values, where):
    with pytest.raises(ValidationError) as info:
        C.OptimizeConfig.model_validate(values)
    assert info.value.errors()[0]["loc"] == where


def test_flow_parameter_schema_is_the_typed_form():
    """The deployments' run form: one `config` parameter whose nested fields carry choices and descriptions."""
    from prefect.utilities.callables import parameter_schema

    from flows.optimize import optimize_workload

    schema = parameter_schema(optimize_workload.fn).model_dump_for_openapi()
    assert set(schema["properties"]) == {"workload_path", "config", "db_path", "data_dir", "kind"}
    defs = schema["definitions"]
    search = defs["SearchSettings"]["properties"]
    assert search["proposer"]["enum"] == ["library", "llm", "hybrid"] and search["proposer"]["description"]
    assert defs["AcceptSettings"]["properties"]["metric"]["enum"][0] == "auto"


def test_every_setting_is_reachable_by_its_path_and_set_writes_it_typed():
    """`--set PATH=VALUE` (llm4llm.config.apply_sets): every nested setting has a dotted path; values parse as
    JSON where they can (numbers, lists, booleans), else stay text; the result validates as the config."""
    from llm4llm.config import OptimizeConfig, apply_sets, setting_paths

    paths = setting_paths()
    assert {"search.budget", "accept.delta", "evaluate.batch_sizes", "graphs.decode_graphs", "time_budget_s"} <= set(paths)
    values = apply_sets({"search": {"mode": "episodic"}}, ["search.budget=30", "accept.delta=0.01",
                                                           "evaluate.batch_sizes=[1,8,32]", "search.mode=sample"])
    cfg = OptimizeConfig.model_validate(values)
    assert (cfg.search.budget, cfg.accept.delta, cfg.evaluate.batch_sizes, cfg.search.mode) == (30, 0.01, [1, 8, 32],
                                                                                                  "sample")
    with pytest.raises(ValueError, match="did you mean accept.delta"):
        apply_sets({}, ["accept.detla=0.1"])


def test_the_optimize_flags_take_their_defaults_from_the_config():
    """Each optimize flag that maps onto a setting shows the config's default: the CLI restates none of them."""
    import typer.main

    from cli.main import app
    from llm4llm.config import setting_default

    params = {p.name: p.default for p in typer.main.get_command(app).commands["optimize"].params}
    flags = {"delta": "accept.delta", "accept_metric": "accept.metric", "accept_tol_factor": "accept.tol_factor",
             "accept_floor_factor": "accept.floor_factor", "accept_min_task_speedup": "accept.min_task_speedup",
             "accept_noisy_rounds": "accept.noisy_rounds", "accept_interleave_rounds": "accept.interleave_rounds",
             "decode_graphs": "graphs.decode_graphs", "min_score": "search.min_score", "rounds": "search.rounds",
             "mode": "search.mode", "proposer": "search.proposer"}
    for flag, path in flags.items():
        assert params[flag] == setting_default(path), flag
    assert setting_default("accept.delta") == 0.02 and setting_default("stages")[0] == "profile"
