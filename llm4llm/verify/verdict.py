"""The verifier's typed result, where the verifier's modules name it: GateResult, Latency and Verdict live in
llm4llm.verdict, below both the verifier and the search (llm4llm.verify imports llm4llm.search's templates, and a
search's Trial keeps its Verdict typed, so the type sits under both)."""
from __future__ import annotations

from llm4llm.verdict import NO_GPU, GateResult, Latency, Verdict, source_hash

__all__ = ["NO_GPU", "GateResult", "Latency", "Verdict", "source_hash"]
