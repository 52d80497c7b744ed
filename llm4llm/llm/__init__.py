"""The LLM proposer (any litellm model) and its API-correction layer.

    from llm4llm.llm import LLMConfig, LLMProposer, HybridProposer, load_llm_config
    proposer = LLMProposer(load_llm_config("workload.toml", flags={"model": "openai/gpt-4o"}), on_call=db_write)

Importing this package does not import litellm; the first request does.
"""
from llm4llm.llm.config import LLMConfig, LLMConfigError, load_llm_config
from llm4llm.llm.corrections import BUILTIN_RULES, Rule, apply_corrections, load_rules_file, rule_set
from llm4llm.llm.extract import ExtractionError, extract_code
from llm4llm.llm.proposer import HybridProposer, LLMCall, LLMProposer
from llm4llm.redact import redact, redact_obj

__all__ = ["LLMConfig", "LLMConfigError", "load_llm_config", "BUILTIN_RULES", "Rule", "apply_corrections",
           "load_rules_file", "rule_set", "ExtractionError", "extract_code", "HybridProposer", "LLMCall",
           "LLMProposer", "redact", "redact_obj"]
