"""The LLM proposer's configuration: a workload TOML's `[llm]` table, overridden by env, overridden by CLI flags.

API keys are deliberately not a field: litellm reads them from the provider's environment variable
(OPENAI_API_KEY, ANTHROPIC_API_KEY, HOSTED_VLLM_API_KEY, ...), so a key never sits in this object, its JSON, a log
line or a DuckDB row.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llm4llm.errors import Llm4llmError

ENV_PREFIX = "LLM4LLM_LLM_"
CORRECTIONS_ENV = "LLM4LLM_CORRECTIONS"
_PATH_FIELDS = ("corrections", "transcript_path")
_KEY_NAMES = {"api_key", "apikey", "key", "token", "secret", "password"}


class LLMConfigError(Llm4llmError):
    """An `[llm]` table, env variable or flag that cannot be used."""


class LLMConfig(BaseModel):
    """The LLM proposer's settings (an `[llm]` table, `LLM4LLM_LLM_*` variables, `--llm-*` flags)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field("", description="any litellm model string: openai/gpt-5, anthropic/claude-..., "
                                       "hosted_vllm/<name>, ollama/<name>")
    api_base: str | None = Field(None, description="the provider's base URL, e.g. http://127.0.0.1:8000/v1 for a "
                                                   "local vLLM server (empty: the provider's default)")
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="sampling temperature")
    max_tokens: int = Field(8192, gt=0, description="completion tokens per request")
    samples_per_step: int = Field(4, gt=0, description="candidates the search asks for per step when the "
                                                       "workload does not say")
    concurrency: int = Field(4, gt=0, description="simultaneous requests")
    max_total_tokens: int | None = Field(None, gt=0, description="prompt + completion tokens over the proposer's "
                                                                 "life (empty: no limit)")
    max_cost_usd: float | None = Field(None, gt=0, description="spend limit in USD by litellm's price table; "
                                                               "unknown models cost 0, their tokens still count "
                                                               "(empty: no limit)")
    timeout_s: float = Field(600.0, gt=0, description="seconds per request")
    max_retries: int = Field(4, ge=0, description="retries on 429, 5xx, timeouts and connection errors")
    backoff_s: float = Field(2.0, ge=0, description="first retry delay in seconds; doubles per attempt, up to "
                                                    "backoff_max_s")
    backoff_max_s: float = Field(60.0, ge=0, description="longest retry delay in seconds")
    seed_with_builtin: bool = Field(True, description="show the built-in family kernel in the prompt as a "
                                                      "starting point")
    hybrid_share: float = Field(0.5, ge=0.0, le=1.0, description="fraction of the search budget the LLM takes "
                                                                 "with proposer hybrid")
    corrections: str | None = Field(None, description="extra API-correction rules: a .toml or .py file (also "
                                                      "LLM4LLM_CORRECTIONS)")
    disabled_corrections: list[str] = Field(default_factory=list, description="ids of built-in correction rules "
                                                                              "to switch off")
    transcript_path: str | None = Field(None, description="JSONL file of every request and reply; may hold "
                                                          "{task_id} and {episode}")
    extra: dict[str, Any] = Field(default_factory=dict, description="passed to litellm.completion as is (top_p, "
                                                                    "reasoning_effort, ...); no credentials")

    @field_validator("extra")
    @classmethod
    def _no_keys_in_extra(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = sorted(k for k in value if k.lower() in _KEY_NAMES or k.lower().endswith("api_key"))
        if bad:
            raise ValueError(f"no credentials in the config (set the provider's env variable), got {bad}")
        return value

    def require_model(self) -> str:
        if not self.model:
            raise LLMConfigError("llm.model: expected a litellm model string such as 'openai/gpt-4o', "
                                 "'anthropic/claude-sonnet-4-5' or 'hosted_vllm/<name>', got nothing "
                                 f"(set [llm] model, {ENV_PREFIX}MODEL or --llm-model)")
        return self.model


def env_overrides(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`LLM4LLM_LLM_<FIELD>` variables as raw values (pydantic coerces "4", "true", "0.5");
    `LLM4LLM_CORRECTIONS` names the corrections file; list fields take comma-separated values."""
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    for name in LLMConfig.model_fields:
        value = env.get(ENV_PREFIX + name.upper())
        if value is None or value == "":
            continue
        if name == "disabled_corrections":
            out[name] = [v.strip() for v in value.split(",") if v.strip()]
        elif name == "extra":
            raise LLMConfigError(f"{ENV_PREFIX}EXTRA: expected it in the [llm] table (a TOML table), got an env var")
        else:
            out[name] = value
    if env.get(CORRECTIONS_ENV) and "corrections" not in out:
        out["corrections"] = env[CORRECTIONS_ENV]
    return out


def table_from_toml(path: str | Path) -> dict[str, Any]:
    """The `[llm]` table of a workload TOML ({} when absent); relative paths resolve against the file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise LLMConfigError(f"{path}: expected a readable TOML file, got {e}") from e
    table = dict(data.get("llm", {}))
    for key in list(table):
        if key.lower() in _KEY_NAMES or key.lower().endswith("api_key"):
            raise LLMConfigError(f"{path}: [llm] {key}: API keys are read from the environment only "
                                 "(OPENAI_API_KEY, ANTHROPIC_API_KEY, HOSTED_VLLM_API_KEY, ...), never from the file")
    for key in _PATH_FIELDS:
        if table.get(key) and not Path(table[key]).is_absolute():
            table[key] = str(path.parent.resolve() / table[key])
    return table


def load_llm_config(toml_path: str | Path | None = None, *, flags: Mapping[str, Any] | None = None,
                    env: Mapping[str, str] | None = None) -> LLMConfig:
    """File < env < flags. `flags` holds CLI values by field name; None values mean "not given"."""
    merged: dict[str, Any] = table_from_toml(toml_path) if toml_path else {}
    merged.update(env_overrides(env))
    merged.update({k: v for k, v in (flags or {}).items() if v is not None})
    try:
        return LLMConfig.model_validate(merged)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "llm"
        raise LLMConfigError(f"llm.{where}: {first['msg']}, got {first.get('input')!r}") from e
