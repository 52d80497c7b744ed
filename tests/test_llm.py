"""The LLM proposer through litellm's real HTTP path against a scripted local OpenAI-compatible server: retries on
429, timeouts, extraction failures as recorded failed trials, API corrections applied and recorded, token counts,
budget stop, the prompt's content, no key in anything persisted, and one episodic search end to end on a tiny
RMSNorm task (Triton under its interpreter, the real spawned verifier)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-table fetch from GitHub on import

sys.path.insert(0, str(Path(__file__).parent))
import llm_server as srv  # noqa: E402

from llm4llm.llm import LLMCall, LLMConfig, LLMConfigError, LLMProposer, load_llm_config  # noqa: E402
from llm4llm.llm.corrections import TANH_HELPER  # noqa: E402
from llm4llm.search.types import Candidate, Experience, Feedback, FailureRule  # noqa: E402
from llm4llm.taskspec import CaseSig, TaskSpec, TensorSig  # noqa: E402
from llm4llm.verify.static_check import check_source  # noqa: E402

KEY = "sk-test-9f8e7d6c5b4a39281706abcdef"  # what a real OpenAI key looks like to the redactor
SHAPES = [(2, 3, 80), (1, 5, 80)]


@pytest.fixture(autouse=True)
def _api_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)


def rmsnorm_spec() -> TaskSpec:
    sig = lambda s: TensorSig(shape=list(s), dtype="float32")  # noqa: E731
    return TaskSpec(task_id="norm-prefill-test", family="norm", phase="prefill",
                    module_class="transformers.models.llama.modeling_llama.LlamaRMSNorm", instances=["model.norm"],
                    input_names=["hidden_states"], weight_names=["weight"], output_names=["out"],
                    static={"variance_epsilon": 1e-6}, dtype="float32", hardware={"gpu_name": "NVIDIA H200"},
                    cases=[CaseSig(inputs={"hidden_states": sig(s)}, outputs={"out": sig(s)}, calls=3) for s in SHAPES])


def proposer(llm: srv.ScriptedLLM, tmp_path: Path, **kw) -> LLMProposer:
    cfg = dict(model="openai/test-model", api_base=llm.base_url, concurrency=1, timeout_s=10, max_retries=2,
               backoff_s=0.01, seed_with_builtin=False, transcript_path=str(tmp_path / "transcript.jsonl"))
    cfg.update(kw)
    calls: list[LLMCall] = []
    p = LLMProposer(LLMConfig(**cfg), on_call=calls.append)
    p.seen_by_callback = calls
    return p


def transcript(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "transcript.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------ through the HTTP path

def test_good_answer_becomes_a_candidate_with_tokens_recorded(tmp_path):
    with srv.ScriptedLLM([srv.good()]) as llm:
        p = proposer(llm, tmp_path)
        [c] = p.propose(rmsnorm_spec(), [], [], 1)
    assert c.source == srv.GOOD_SOURCE
    assert c.proposer == "llm" and c.template == "llm" and c.config["api_corrections"] == []
    assert check_source(c.source, ("LlamaRMSNorm",)).ok
    [call] = p.calls
    assert (call.status, call.attempt, call.prompt_tokens, call.completion_tokens) == ("ok", 0, 100, 50)
    assert call.candidate_id == c.id and call.model == "openai/test-model" and call.latency_ms > 0
    assert call.cost_usd is None  # litellm has no price for test-model
    assert p.seen_by_callback == p.calls and p.tokens_used == 150
    body = llm.requests[0]["body"]
    assert body["model"] == "test-model" and body["max_tokens"] == 8192


def test_retries_a_429_then_succeeds(tmp_path):
    with srv.ScriptedLLM([srv.rate_limited(), srv.server_error(), srv.good()]) as llm:
        p = proposer(llm, tmp_path)
        [c] = p.propose(rmsnorm_spec(), [], [], 1)
    assert c.source == srv.GOOD_SOURCE
    assert [(k.status, k.attempt) for k in p.calls] == [("rate_limited", 0), ("server_error", 1), ("ok", 2)]
    assert "Rate limit reached" in p.calls[0].error
    assert len(llm.requests) == 3  # litellm and the OpenAI SDK do not retry on their own


def test_exhausted_retries_become_a_failed_trial(tmp_path):
    with srv.ScriptedLLM([srv.rate_limited()] * 2) as llm:
        p = proposer(llm, tmp_path, max_retries=1)
        [c] = p.propose(rmsnorm_spec(), [], [], 1)
    assert c.config["error_kind"] == "api_error" and "RateLimitError" in c.config["error"]
    assert not check_source(c.source).ok  # no entry: the static gate records the failed trial


def _warm(tmp_path: Path) -> None:
    """litellm's first call in a process pays its import and client set-up (about 8 s on a 2-core host): made here,
    outside the timed window of the wall-clock tests, which may be the first of their process to call it (the
    README's `-m serial` part)."""
    d = tmp_path / "warm"
    d.mkdir()
    with srv.ScriptedLLM([srv.good()]) as llm:
        [c] = proposer(llm, d).propose(rmsnorm_spec(), [], [], 1)
    assert c.source == srv.GOOD_SOURCE


@pytest.mark.serial  # wall-clock bounds
def test_a_reply_slower_than_the_timeout_is_retried(tmp_path):
    _warm(tmp_path)
    with srv.ScriptedLLM([srv.slow(8.0), srv.good()]) as llm:
        p = proposer(llm, tmp_path, timeout_s=0.5, max_retries=1)
        t0 = time.perf_counter()
        [c] = p.propose(rmsnorm_spec(), [], [], 1)
        elapsed = time.perf_counter() - t0
    assert [k.status for k in p.calls] == ["timeout", "ok"]
    assert c.source == srv.GOOD_SOURCE and elapsed < 6.0  # the client gave up long before the 8 s reply


def test_timeout_without_retries_is_a_failed_trial_not_a_crash(tmp_path):
    with srv.ScriptedLLM([srv.slow(5.0)]) as llm:
        p = proposer(llm, tmp_path, timeout_s=0.5, max_retries=0)
        [c] = p.propose(rmsnorm_spec(), [], [], 1)
    assert p.calls[0].status == "timeout" and c.config["error_kind"] == "api_error"


def test_unusable_answers_are_recorded_failed_trials(tmp_path):
    with srv.ScriptedLLM([srv.no_code(), srv.truncated(), srv.Reply(""), srv.compile_error()]) as llm:
        p = proposer(llm, tmp_path)
        cands = p.propose(rmsnorm_spec(), [], [], 4)
    kinds = [c.config.get("error_kind") for c in cands]
    assert kinds == ["no_code", "truncated", "empty", None]
    assert len({c.id for c in cands}) == 4  # distinct ids: the search verifies (records) each one
    for c in cands[:3]:
        assert "def entry" not in c.source and c.config["error"].startswith(c.config["error_kind"])
        assert not check_source(c.source).ok
    assert p.calls[1].finish_reason == "length" and p.calls[1].completion_tokens == 4096
    assert cands[3].source == srv.COMPILE_ERROR_SOURCE  # compiles or not, that is the verifier's call


def test_api_corrections_are_applied_and_recorded(tmp_path):
    with srv.ScriptedLLM([srv.old_api()]) as llm:
        p = proposer(llm, tmp_path)
        [c] = p.propose(rmsnorm_spec(), [], [], 1)
    assert c.config["api_corrections"] == ["tl-math-tanh"]
    assert "tl.math.tanh" not in c.source and f"def {TANH_HELPER}(" in c.source
    assert p.originals[c.id] == srv.OLD_API_SOURCE
    assert c.config["original_sha"] != c.id
    response = [r for r in transcript(tmp_path) if r["kind"] == "response"][0]
    assert "tl.math.tanh" in response["response"]["text"]  # the uncorrected answer stays in the transcript


def test_token_budget_stops_cleanly(tmp_path):
    with srv.ScriptedLLM([srv.good(), srv.wrong_numerics(), srv.good()]) as llm:
        p = proposer(llm, tmp_path, max_total_tokens=250)
        assert len(p.propose(rmsnorm_spec(), [], [], 1)) == 1  # 150 tokens
        assert len(p.propose(rmsnorm_spec(), [], [], 1)) == 1  # 300: over, but it was under when sent
        assert p.propose(rmsnorm_spec(), [], [], 2) == []
    assert len(llm.requests) == 2 and p.exhausted.startswith("token budget spent")


def test_cost_budget_stops_cleanly(tmp_path):
    with srv.ScriptedLLM([srv.good(prompt_tokens=10_000, completion_tokens=2_000)]) as llm:
        p = proposer(llm, tmp_path, max_cost_usd=0.01, model="openai/gpt-4o")
        [c] = p.propose(rmsnorm_spec(), [], [], 1)
        assert p.calls[0].cost_usd and p.calls[0].cost_usd > 0.01  # litellm's price table knows gpt-4o
        assert p.propose(rmsnorm_spec(), [], [], 1) == []
    assert p.exhausted.startswith("cost budget spent")


@pytest.mark.serial
def test_samples_run_concurrently(tmp_path):
    _warm(tmp_path)
    with srv.ScriptedLLM([srv.slow(1.0) for _ in range(4)]) as llm:
        p = proposer(llm, tmp_path, concurrency=4)
        t0 = time.perf_counter()
        cands = p.propose(rmsnorm_spec(), [], [], 4)
        elapsed = time.perf_counter() - t0
    assert len(cands) == 4 and elapsed < 3.5  # one at a time would take 4 x 1 s


def test_bad_credentials_fail_loudly(tmp_path):
    with srv.ScriptedLLM([srv.Reply(status=401, error={"message": "Incorrect API key", "type": "invalid_request"})]) \
            as llm:
        p = proposer(llm, tmp_path)
        with pytest.raises(LLMConfigError, match="AuthenticationError"):
            p.propose(rmsnorm_spec(), [], [], 1)


def test_prompt_holds_task_experience_feedback_and_previous_attempt(tmp_path):
    spec = rmsnorm_spec()
    exp = Experience(task_id=spec.task_id, family="norm", phase="prefill", episode=0, trials=3, passed=0,
                     rules=[FailureRule(template="llm", key="BLOCK", values=[4096], failure_class="compile",
                                        signature="out of resources: shared memory")],
                     notes=["ended by stuck: compile"])
    with srv.ScriptedLLM([srv.wrong_numerics(), srv.good()]) as llm:
        p = proposer(llm, tmp_path)
        [first] = p.propose(spec, [exp], [], 1)
        fb = Feedback(candidate_id=first.id, template="llm", config=first.config, passed=False,
                      failure_class="wrong_output", message="out: max abs err 3.2 over atol=0.0001 rtol=0.0001",
                      max_abs_err=3.2)
        [second] = p.propose(spec, [exp], [fb], 1)
    system, user = (m["content"] for m in llm.requests[1]["body"]["messages"])
    assert "def entry(inputs: dict, weights: dict, state: dict, static: dict)" in system
    assert "triton.language" in system and "kernels_runtime.ops" in system
    for text in ("float32[2, 3, 80]", "float32[1, 5, 80]", "phase: prefill", "q_len == 1", "NVIDIA H200",
                 "atol=0.0001", "'variance_epsilon': 1e-06", "class LlamaRMSNorm", "hidden_states.pow(2)",
                 "avoid llm BLOCK in [4096]", "out of resources", "FAILED [wrong_output]", "max_abs_err=3.2",
                 "max abs err 3.2", "Your previous attempt", "eps + 1.0"):
        assert text in user, text
    assert second.parent == first.id
    assert "Your previous attempt" not in llm.requests[0]["body"]["messages"][1]["content"]


def test_builtin_seed_goes_into_the_first_prompt(tmp_path):
    class Seed:
        name = "library"

        def propose(self, task, experience, feedback, n):
            return [Candidate(source="# SEED KERNEL\n" + srv.GOOD_SOURCE, template="rmsnorm_rows",
                              config={"BLOCK": 128})]

    with srv.ScriptedLLM([srv.good()]) as llm:
        p = proposer(llm, tmp_path, seed_with_builtin=True)
        p.builtin = Seed()
        [c] = p.propose(rmsnorm_spec(), [], [], 1)
    user = llm.requests[0]["body"]["messages"][1]["content"]
    assert "# SEED KERNEL" in user and "rmsnorm_rows" in user
    assert c.parent is not None


def test_no_api_key_in_anything_persisted(tmp_path):
    leaky = srv.Reply(srv.fenced(srv.GOOD_SOURCE, plan=f"Using key {KEY} and Bearer {KEY[3:]}"))
    with srv.ScriptedLLM([srv.rate_limited(), leaky, srv.no_code()]) as llm:
        p = proposer(llm, tmp_path)
        cands = p.propose(rmsnorm_spec(), [], [], 2)
    assert llm.requests[0]["headers"]["authorization"] == f"Bearer {KEY}"  # litellm read it from the env
    persisted = [(tmp_path / "transcript.jsonl").read_text(), json.dumps([c.to_row() for c in p.calls]),
                 json.dumps([c.model_dump() for c in cands]), p.config.model_dump_json()]
    for text in persisted:
        assert KEY not in text and KEY[3:] not in text
    assert "***REDACTED***" in persisted[0]
    assert "api_key" not in LLMConfig.model_fields


def test_on_call_writes_llm_calls_rows_to_duckdb(tmp_path):
    from storage.db import Database
    from storage.repo import record_llm_call

    db = Database(tmp_path / "l.duckdb")
    with srv.ScriptedLLM([srv.rate_limited(), srv.good()]) as llm:
        p = proposer(llm, tmp_path)
        p.on_call = lambda call: record_llm_call(db, call.db_row(search_id="s1"))
        p.propose(rmsnorm_spec(), [], [], 1)
    rows = db.query("SELECT status, attempt, prompt_tokens, completion_tokens, search_id, error FROM llm_calls "
                    "ORDER BY attempt")
    assert [r[:5] for r in rows] == [("rate_limited", 0, 0, 0, "s1"), ("ok", 1, 100, 50, "s1")]
    assert "Rate limit" in rows[0][5] and rows[1][5] is None


# --------------------------------------------------------------------------------------------- config, hybrid

def test_config_precedence_flags_over_env_over_file(tmp_path, monkeypatch):
    toml = tmp_path / "w.toml"
    toml.write_text('name = "w"\n[llm]\nmodel = "anthropic/claude-x"\ntemperature = 0.2\nconcurrency = 2\n'
                    'corrections = "fixes.toml"\n')
    monkeypatch.setenv("LLM4LLM_LLM_MODEL", "hosted_vllm/qwen")
    monkeypatch.setenv("LLM4LLM_LLM_CONCURRENCY", "8")
    monkeypatch.setenv("LLM4LLM_LLM_API_BASE", "http://127.0.0.1:8000/v1")
    cfg = load_llm_config(toml, flags={"model": "openai/gpt-4o", "temperature": None})
    assert (cfg.model, cfg.temperature, cfg.concurrency) == ("openai/gpt-4o", 0.2, 8)
    assert cfg.api_base == "http://127.0.0.1:8000/v1" and cfg.corrections == str(tmp_path / "fixes.toml")
    toml.write_text('[llm]\nmodel = "openai/x"\napi_key = "sk-nope-123456789"\n')
    with pytest.raises(LLMConfigError, match="environment only"):
        load_llm_config(toml)
    monkeypatch.setenv("LLM4LLM_LLM_HYBRID_SHARE", "1.5")
    with pytest.raises(LLMConfigError, match="hybrid_share"):
        load_llm_config(None)
    with pytest.raises(LLMConfigError, match="expected a litellm model string"):
        LLMProposer(LLMConfig())


def test_user_corrections_file_from_env(tmp_path, monkeypatch):
    rules = tmp_path / "fixes.toml"
    rules.write_text('[[rule]]\nid = "local-fast-exp"\ndescription = "our build lacks fast_exp"\n'
                     'triton = ">=3.0"\npattern = \'tl\\.fast_exp\\(\'\nreplacement = "tl.exp("\n')
    monkeypatch.setenv("LLM4LLM_CORRECTIONS", str(rules))
    answer = srv.GOOD_SOURCE.replace("tl.sqrt(", "tl.fast_exp(")
    with srv.ScriptedLLM([srv.Reply(srv.fenced(answer))]) as llm:
        p = LLMProposer(load_llm_config(None, flags={"model": "openai/test-model", "api_base": llm.base_url,
                                                     "seed_with_builtin": False}))
        [c] = p.propose(rmsnorm_spec(), [], [], 1)
    assert c.config["api_corrections"] == ["local-fast-exp"] and "tl.fast_exp" not in c.source


def test_hybrid_splits_the_budget_and_covers_an_exhausted_llm(tmp_path):
    from llm4llm.llm import HybridProposer

    class Library:
        name = "library"
        k = 0

        def propose(self, task, experience, feedback, n):
            out = []
            for _ in range(n):
                self.k += 1
                out.append(Candidate(source=f"# lib {self.k}\n", template="t", config={"k": self.k},
                                     proposer="library"))
            return out

    with srv.ScriptedLLM([srv.good(), srv.wrong_numerics(), srv.old_api()]) as llm:
        p = proposer(llm, tmp_path, max_total_tokens=300)
        h = HybridProposer(p, Library(), share=0.5)
        who = [c.proposer for _ in range(4) for c in h.propose(rmsnorm_spec(), [], [], 1)]
        assert sorted(who) == ["library", "library", "llm", "llm"]  # one at a time, alternating
        rest = h.propose(rmsnorm_spec(), [], [], 4)  # the LLM's 300 tokens are spent: the library takes all
    assert [c.proposer for c in rest] == ["library"] * 4 and p.exhausted


# ------------------------------------------------------------------------------------------ the episodic loop

def build_rmsnorm_task(root: Path) -> Path:
    """transformers' LlamaRMSNorm(80) with a non-trivial weight, one captured case per shape in SHAPES."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from llm4llm.taskspec import Case, write_task

    torch.manual_seed(0)
    module = LlamaRMSNorm(80, eps=1e-6).eval()
    with torch.no_grad():
        module.weight.copy_(1.0 + 0.5 * torch.randn(80))
    cases = []
    for shape in SHAPES:
        x = torch.randn(shape) * 3.0
        with torch.no_grad():
            cases.append(Case(inputs={"hidden_states": x}, weights={"weight": module.weight.detach().clone()},
                              state={}, ref={"out": module(x)}))
    spec = rmsnorm_spec()
    spec.task_id, spec.hardware = "", {}
    return write_task(root, spec, module, cases)


@pytest.mark.timeout(120)
def test_episodic_search_through_http_finds_the_good_kernel(tmp_path):
    from llm4llm.config import SearchSettings
    from llm4llm.search.episode import run_search
    from llm4llm.verify import VerifierPool

    task_dir = build_rmsnorm_task(tmp_path / "tasks")
    script = [srv.compile_error(), srv.wrong_numerics(), srv.old_api(), srv.good()]
    with srv.ScriptedLLM(script) as llm, VerifierPool("cpu", timeout_s=120.0, draws=2) as pool:
        p = proposer(llm, tmp_path, concurrency=2)
        result = run_search(task_dir, p, pool.verify, SearchSettings(mode="episodic", budget=4), samples_per_step=2,
                            episode_len=4, archive_dir=tmp_path / "archive")
    assert result.trials_used == 4 and len(p.calls) == 4
    by_class = sorted(t.feedback.failure_class or "passed" for t in result.trials)
    assert by_class == ["compile", "passed", "passed", "wrong_output"], [t.feedback for t in result.trials]
    passed = {t.candidate.source for t in result.trials if t.feedback.passed}
    assert srv.GOOD_SOURCE in passed
    corrected = [t.candidate for t in result.trials if t.candidate.config.get("api_corrections")]
    assert len(corrected) == 1 and corrected[0].config["api_corrections"] == ["tl-math-tanh"]
    second_prompt = llm.requests[2]["body"]["messages"][1]["content"]
    assert "FAILED [compile]" in second_prompt and "FAILED [wrong_output]" in second_prompt
    assert "Your previous attempt" in second_prompt
