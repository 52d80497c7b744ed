"""The Prefect UI's run form of the flow deployments: it is built from the flow's parameter schema (and the
deployment's parameters), so every field needs a description and the settings a filled-in default."""
from __future__ import annotations

import pytest
from prefect.utilities.callables import parameter_schema

from flows.nightly import nightly_workload
from flows.optimize import optimize_workload
from flows.profiling import profile_workload
from llm4llm.config import OptimizeConfig

FLOWS = {"optimize": optimize_workload, "nightly": nightly_workload, "profile": profile_workload}


def _undescribed(schema: dict) -> list[str]:
    """Dotted names of the properties, at every level (the flow's parameters, every model's fields), that carry no
    description."""
    missing = [name for name, prop in schema["properties"].items() if not prop.get("description")]
    for model, definition in schema.get("definitions", {}).items():
        if not definition.get("description"):
            missing.append(model)
        missing += [f"{model}.{name}" for name, prop in definition.get("properties", {}).items()
                    if not prop.get("description")]
    return missing


@pytest.mark.parametrize("name", sorted(FLOWS))
def test_every_property_at_every_level_has_a_description(name):
    schema = parameter_schema(FLOWS[name].fn).model_dump()
    if name != "profile":
        assert {"OptimizeConfig", "SearchSettings", "LLMConfig", "ScaleOut"} <= set(schema["definitions"])
    assert _undescribed(schema) == []


@pytest.mark.parametrize("name", ["optimize", "nightly"])
def test_the_config_opens_with_its_defaults(name):
    config = parameter_schema(FLOWS[name].fn).model_dump()["properties"]["config"]
    assert config["default"] is not None
    assert "anyOf" not in config  # one type: the form shows the fields, not a choice between a model and None
    assert OptimizeConfig.model_validate(config["default"]) == OptimizeConfig()
