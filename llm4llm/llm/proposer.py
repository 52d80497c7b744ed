"""The LLM proposer: candidates from any litellm model, and the hybrid of it with the built-in library.

`LLMProposer.propose` sends one request per sample (a thread pool, `concurrency` at a time), retries transient
failures (429, 5xx, timeouts, connection errors) with exponential backoff, extracts the code, applies the
API-correction layer and returns Candidates. It never raises for a bad answer: an empty, truncated or code-less
answer, or a request that failed every retry, becomes a candidate whose source has no `entry` (a comment naming the
error, so its id is unique) and whose `config["error"]` says why; the verifier records it as a failed static trial.

Budgets (tokens, dollars) are checked before every request; once spent, `propose` returns [] and sets `exhausted`,
which the search treats as the end of its budget. In-flight requests finish, so a budget can be overshot by at most
`concurrency` responses.

Every attempt is an `LLMCall` (`proposer.calls`, and `on_call(call)` so the flow writes `llm_calls` rows); prompts
and responses go, redacted, to a JSONL transcript. API keys stay in the environment where litellm reads them.
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from llm4llm.llm.config import LLMConfig, LLMConfigError
from llm4llm.llm.corrections import Rule, apply_corrections, rule_set
from llm4llm.llm.extract import ENTRY, ExtractionError, Target, defines, extract_code
from llm4llm.llm.prompt import PromptParts, build_messages
from llm4llm.redact import redact, redact_obj
from llm4llm.search.types import Candidate, Experience, Feedback, source_id
from llm4llm.taskkind import kind_of
from llm4llm.taskspec import TaskSpec

TEMPLATE = "llm"
OnCall = Callable[["LLMCall"], None]


def _target(task: TaskSpec) -> Target:
    """What a candidate's source defines: its task kind's (KernelBench's `ModelNew`), else a model task's `entry`."""
    kind = kind_of(task)
    return kind.target if kind is not None else ENTRY


@dataclass
class LLMCall:
    """One request attempt. `status`: ok | rate_limited | timeout | server_error | connection_error | error |
    fatal (authentication, permission, unknown model: raised as LLMConfigError after the record)."""

    call_id: str
    model: str
    task_id: str
    episode: int
    sample: int
    attempt: int  # 0 for the first try of a sample
    status: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None  # None when litellm has no price for the model
    latency_ms: float = 0.0
    finish_reason: str | None = None
    error: str = ""  # redacted
    candidate_id: str | None = None  # the candidate this answer became (ok attempts only)
    started_at: float = 0.0  # unix seconds

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    def db_row(self, search_id: str | None = None) -> dict[str, Any]:
        """The `llm_calls` table's columns (storage/migrations/001_init.sql), the error text redacted again (an
        extraction error may quote the answer): nothing key-like reaches DuckDB."""
        return {"call_id": self.call_id, "search_id": search_id, "task_id": self.task_id, "model": self.model,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cost_usd": self.cost_usd, "latency_ms": self.latency_ms, "status": self.status,
                "error": redact(self.error) if self.error else None, "attempt": self.attempt}


@dataclass
class _Usage:
    tokens: int = 0
    cost_usd: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _litellm():
    # The pinned package's own price table: importing litellm otherwise fetches one from GitHub (slow, and offline
    # machines wait on retries). Set LITELLM_LOCAL_MODEL_COST_MAP=False to fetch the latest.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True  # its "Give Feedback / Get Help" banner on every exception
    return litellm


def _classify(e: BaseException) -> tuple[str, bool]:
    """(status, retryable) of a litellm exception."""
    lm = _litellm()
    if isinstance(e, lm.Timeout):
        return "timeout", True
    if isinstance(e, lm.RateLimitError):
        return "rate_limited", True
    if isinstance(e, (lm.ServiceUnavailableError, lm.InternalServerError)):
        return "server_error", True
    if isinstance(e, lm.APIConnectionError):
        return "connection_error", True
    if isinstance(e, (lm.AuthenticationError, lm.PermissionDeniedError, lm.NotFoundError)):
        return "fatal", False
    status = getattr(e, "status_code", None)
    if isinstance(status, int) and status >= 500:
        return "server_error", True
    return "error", False


class LLMProposer:
    """Candidates from an LLM through litellm. `builtin`: a proposer whose first candidate seeds the prompt
    (default: the LibraryProposer when `seed_with_builtin`)."""

    name = "llm"

    def __init__(self, config: LLMConfig, *, on_call: OnCall | None = None, builtin: Any = None,
                 rules: list[Rule] | None = None, transcript_path: str | Path | None = None):
        config.require_model()
        self.config = config
        self.on_call = on_call
        self.builtin = builtin
        self.rules = rules if rules is not None else rule_set(config.corrections, config.disabled_corrections)
        self.transcript_path = str(transcript_path or config.transcript_path or "") or None
        self.calls: list[LLMCall] = []
        self.exhausted: str | None = None  # why the budget stopped the proposer
        self.notes: list[str] = []  # quiet fallbacks taken (no seed, ...)
        self.originals: dict[str, str] = {}  # candidate id -> source before API corrections (when they applied)
        self._usage = _Usage()
        self._lock = threading.Lock()
        self._sources: dict[str, str] = {}
        self._seeds: dict[str, Candidate | None] = {}

    # --- search hooks ---------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """A new search starts: forget seeds (budgets and call records are for the proposer's life)."""
        self._seeds.clear()

    def remember(self, candidates: list[Candidate]) -> None:
        """Sources of candidates proposed elsewhere (hybrid), so feedback about them can show their code."""
        for c in candidates:
            self._sources[c.id] = c.source

    @property
    def tokens_used(self) -> int:
        return self._usage.tokens

    @property
    def cost_used(self) -> float:
        return self._usage.cost_usd

    # --- the Proposer protocol ------------------------------------------------------------------------------------

    def propose(self, task: TaskSpec, experience: list[Experience], feedback: list[Feedback], n: int) -> list[Candidate]:
        if n <= 0 or self._budget_spent():
            return []
        _litellm()  # import once, outside the timed requests and the worker threads
        parts = self._parts(task, feedback)
        messages = build_messages(task, experience, feedback, parts)
        episode, iteration = len(experience), len(feedback)
        prompt_id = uuid.uuid4().hex[:12]
        self._transcribe({"kind": "prompt", "prompt_id": prompt_id, "task_id": task.task_id, "episode": episode,
                          "iteration": iteration, "model": self.config.model, "n": n, "messages": messages})
        parent = parts.previous_id or parts.seed_id
        with ThreadPoolExecutor(max_workers=min(self.config.concurrency, n), thread_name_prefix="llm") as pool:
            futures = [pool.submit(self._sample, task, messages, prompt_id, episode, iteration, k, parent)
                       for k in range(n)]
            results = [f.result() for f in futures]
        out = [c for c in results if c is not None]
        self.remember(out)
        return out

    # --- one sample -----------------------------------------------------------------------------------------------

    def _sample(self, task: TaskSpec, messages: list[dict], prompt_id: str, episode: int, iteration: int, k: int,
                parent: str | None) -> Candidate | None:
        cfg = self.config
        last_error = ""
        for attempt in range(cfg.max_retries + 1):
            if self._budget_spent():
                return None
            call = LLMCall(call_id=uuid.uuid4().hex[:16], model=cfg.model, task_id=task.task_id, episode=episode,
                           sample=k, attempt=attempt, status="ok", started_at=time.time())
            t0 = time.perf_counter()
            try:
                resp = _litellm().completion(**self._request(messages))
            except Exception as e:  # every failure is a record; fatal ones are re-raised below
                call.latency_ms = (time.perf_counter() - t0) * 1e3
                call.status, retryable = _classify(e)
                call.error = redact(f"{type(e).__name__}: {e}")[:2000]
                self._record(call, prompt_id, None)
                if call.status == "fatal":
                    raise LLMConfigError(f"llm {cfg.model}: {call.error}") from None
                last_error = call.error
                if not retryable or attempt == cfg.max_retries:
                    break
                time.sleep(self._backoff(attempt))
                continue
            call.latency_ms = (time.perf_counter() - t0) * 1e3
            text, finish = self._read(resp, call)
            cand = self._candidate(task, text, finish, call, episode, iteration, parent)
            call.candidate_id = cand.id
            self._record(call, prompt_id, {"text": text, "finish_reason": finish})
            return cand
        return self._failed(task, "api_error", f"no answer after {attempt + 1} attempt(s): {last_error}",
                            call.call_id, episode, iteration, parent)

    def _request(self, messages: list[dict]) -> dict[str, Any]:
        cfg = self.config
        req = dict(model=cfg.model, messages=messages, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                   timeout=cfg.timeout_s, num_retries=0, max_retries=0, drop_params=True)
        if cfg.api_base:
            req["api_base"] = cfg.api_base
        req.update(cfg.extra)
        return req

    def _read(self, resp: Any, call: LLMCall) -> tuple[str, str | None]:
        choices = getattr(resp, "choices", None) or []
        text = (choices[0].message.content or "") if choices else ""  # no choices reads as an empty answer
        usage = getattr(resp, "usage", None)
        call.prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
        call.completion_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
        call.finish_reason = choices[0].finish_reason if choices else None
        try:
            call.cost_usd = float(_litellm().completion_cost(completion_response=resp))
        except Exception:  # litellm raises for models missing from its price table
            call.cost_usd = None
        with self._usage.lock:
            self._usage.tokens += call.prompt_tokens + call.completion_tokens
            self._usage.cost_usd += call.cost_usd or 0.0
        return text, call.finish_reason

    def _candidate(self, task: TaskSpec, text: str, finish: str | None, call: LLMCall, episode: int,
                   iteration: int, parent: str | None) -> Candidate:
        try:
            code = extract_code(text, finish, _target(task)).code
        except ExtractionError as e:
            call.error = e.message
            return self._failed(task, e.kind, e.message, call.call_id, episode, iteration, parent)
        fixed = apply_corrections(code, self.rules)
        config: dict[str, Any] = {"llm_call": call.call_id, "api_corrections": fixed.applied}
        if fixed.applied:
            config["original_sha"] = source_id(code)
        if fixed.errors:
            config["api_correction_errors"] = fixed.errors
        cand = Candidate(source=fixed.source, config=config, template=TEMPLATE, proposer=self.name, parent=parent,
                         episode=episode, iteration=iteration)
        if fixed.applied:
            with self._lock:
                self.originals[cand.id] = code
        return cand

    def _failed(self, task: TaskSpec, kind: str, message: str, call_id: str, episode: int, iteration: int,
                parent: str | None) -> Candidate:
        # A comment-only source: no `entry` (nor `ModelNew`), so the static gate fails it, and a unique id, so the
        # search verifies (records) each failure instead of deduplicating them all into one empty source.
        message = redact(message)
        source = f"# llm4llm: no candidate from the LLM ({kind}): {message.splitlines()[0] if message else ''}\n" \
                 f"# llm call {call_id}\n"
        return Candidate(source=source, config={"llm_call": call_id, "error": f"{kind}: {message}", "error_kind": kind},
                         template=TEMPLATE, proposer=self.name, parent=parent, episode=episode, iteration=iteration)

    # --- prompt parts ---------------------------------------------------------------------------------------------

    def _parts(self, task: TaskSpec, feedback: list[Feedback]) -> PromptParts:
        parts = PromptParts()
        if kind_of(task) is not None:  # a real candidate (a ModelNew), not a failure placeholder naming it
            known = [f for f in feedback if defines(self._sources.get(f.candidate_id, ""), _target(task))]
        else:
            known = [f for f in feedback if "def entry" in self._sources.get(f.candidate_id, "")]
        if known:
            parts.previous_id = known[-1].candidate_id
            parts.previous_source = self._sources[parts.previous_id]
        passed = [f for f in known if f.passed and f.candidate_id != parts.previous_id]
        if passed:
            best = max(passed, key=lambda f: f.utility)
            parts.seed_source, parts.seed_id = self._sources[best.candidate_id], best.candidate_id
            parts.seed_label = f"best passing candidate this episode, utility {best.utility:.3g}"
        elif not feedback and self.config.seed_with_builtin:
            seed = self._seed(task)
            if seed is not None:
                parts.seed_source, parts.seed_id = seed.source, seed.id
                parts.seed_label = f"built-in template {seed.template} {json.dumps(seed.config, sort_keys=True)}"
        return parts

    def _seed(self, task: TaskSpec) -> Candidate | None:
        if task.task_id in self._seeds:
            return self._seeds[task.task_id]
        seed = None
        try:
            builtin = self.builtin
            if builtin is None:
                from llm4llm.search.builtin import LibraryProposer

                builtin = LibraryProposer()
            got = builtin.propose(task, [], [], 1)
            seed = got[0] if got else None
            if seed is None:
                self.notes.append(f"{task.task_id}: no built-in template for family {task.family}; no seed kernel")
        except Exception as e:  # an automatic choice: fall back quietly (no seed) and say so
            self.notes.append(f"{task.task_id}: built-in seed unavailable: {e!r}")
        self._seeds[task.task_id] = seed
        if seed is not None:
            self._sources[seed.id] = seed.source
        return seed

    # --- budgets, records, transcripts ----------------------------------------------------------------------------

    def _budget_spent(self) -> bool:
        cfg, u = self.config, self._usage
        with u.lock:
            if cfg.max_total_tokens is not None and u.tokens >= cfg.max_total_tokens:
                self.exhausted = f"token budget spent: {u.tokens} >= {cfg.max_total_tokens}"
            elif cfg.max_cost_usd is not None and u.cost_usd >= cfg.max_cost_usd:
                self.exhausted = f"cost budget spent: ${u.cost_usd:.4f} >= ${cfg.max_cost_usd}"
        return self.exhausted is not None

    def _backoff(self, attempt: int) -> float:
        cfg = self.config
        return min(cfg.backoff_max_s, cfg.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)

    def _record(self, call: LLMCall, prompt_id: str, response: dict | None) -> None:
        with self._lock:
            self.calls.append(call)
            self._transcribe({"kind": "response", "prompt_id": prompt_id, **call.to_row(),
                              "response": response}, locked=True)
            if self.on_call:
                self.on_call(call)

    def _transcribe(self, record: dict[str, Any], locked: bool = False) -> None:
        if not self.transcript_path:
            return
        path = Path(self.transcript_path.format(task_id=record.get("task_id", ""), episode=record.get("episode", 0)))
        line = json.dumps(redact_obj(record), default=str) + "\n"
        if locked:
            self._append(path, line)
        else:
            with self._lock:
                self._append(path, line)

    @staticmethod
    def _append(path: Path, line: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(line)


class HybridProposer:
    """The LLM and the built-in library splitting each request: the LLM takes `share` of all candidates asked for
    over the search (a running split, so share 0.5 alternates when the search asks for one at a time). When the
    LLM's budget is spent or the library runs dry, the other takes the remainder."""

    name = "hybrid"

    def __init__(self, llm: LLMProposer, builtin: Any, share: float | None = None):
        self.llm, self.builtin = llm, builtin
        self.share = llm.config.hybrid_share if share is None else share
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"hybrid share: expected 0..1, got {self.share}")
        self._asked = 0
        self._to_llm = 0

    # The LLM's records and budget state, read and set through the hybrid (the search flow sets `on_call` and
    # `transcript_path` on whichever proposer it built).
    @property
    def on_call(self) -> OnCall | None:
        return self.llm.on_call

    @on_call.setter
    def on_call(self, fn: OnCall | None) -> None:
        self.llm.on_call = fn

    @property
    def transcript_path(self) -> str | None:
        return self.llm.transcript_path

    @transcript_path.setter
    def transcript_path(self, path: str | Path | None) -> None:
        self.llm.transcript_path = str(path) if path else None

    @property
    def config(self) -> LLMConfig:
        return self.llm.config

    @property
    def calls(self) -> list[LLMCall]:
        return self.llm.calls

    def reset(self) -> None:
        self._asked = self._to_llm = 0
        for p in (self.llm, self.builtin):
            if hasattr(p, "reset"):
                p.reset()

    def propose(self, task: TaskSpec, experience: list[Experience], feedback: list[Feedback], n: int) -> list[Candidate]:
        if n <= 0:
            return []
        n_llm = max(0, min(n, round((self._asked + n) * self.share) - self._to_llm))
        self._asked += n
        out: list[Candidate] = []
        if n - n_llm:
            lib = self.builtin.propose(task, experience, feedback, n - n_llm)
            self.llm.remember(lib)
            out += lib
            n_llm = n - len(out)  # the library ran dry: the LLM takes the rest
        if n_llm:
            got = self.llm.propose(task, experience, feedback, n_llm)
            self._to_llm += len(got)
            out += got
            if len(got) < n_llm:  # the LLM's budget is spent: the library takes the rest
                lib = self.builtin.propose(task, experience, feedback, n_llm - len(got))
                self.llm.remember(lib)
                out += lib
        return out
