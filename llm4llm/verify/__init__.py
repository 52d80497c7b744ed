"""Verification of untrusted candidate kernels in an isolated worker process, gate by gate (see worker.py)."""
from llm4llm.verify.static_check import StaticReport, check_source
from llm4llm.verify.verdict import GateResult, Latency, Verdict
from llm4llm.verify.worker import VerifierPool, verify_candidate

__all__ = ["GateResult", "Latency", "StaticReport", "Verdict", "VerifierPool", "check_source", "verify_candidate"]
