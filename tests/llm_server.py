"""A scripted OpenAI-compatible chat server on 127.0.0.1 for the LLM proposer's tests.

`ScriptedLLM` serves POST /v1/chat/completions (and /chat/completions) from a queue of `Reply`s, in arrival order,
and records every request (path, headers, JSON body) so tests can assert what the proposer sent. The canned
answers cover what a real model does: a correct kernel, one that fails to compile, wrong numerics, a 429, a reply
slower than the client's timeout, prose without code, and an answer cut by max_tokens.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

RMSNORM_KERNEL = '''import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    # Pointers
    x_ptr, w_ptr, out_ptr,
    # Matrix dimensions
    n_cols, eps,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + EPS_TERM)
    y = (x * rstd).to(w.dtype) * w
    tl.store(out_ptr + row * n_cols + offs, y, mask=mask)


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]  # [B, S, H]
    w = weights["weight"]  # [H]
    out = torch.empty_like(x)
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    _rmsnorm_kernel[(n_rows,)](x, w, out, n_cols, static["variance_epsilon"], BLOCK=triton.next_power_of_2(n_cols))
    return {"out": out}
'''
GOOD_SOURCE = RMSNORM_KERNEL.replace("EPS_TERM", "eps")
# Calls a function Triton does not have (and no correction rule knows): fails at the first launch.
COMPILE_ERROR_SOURCE = RMSNORM_KERNEL.replace("EPS_TERM", "eps").replace("1.0 / tl.sqrt(", "tl.fast_rsqrt_nope(")
WRONG_SOURCE = RMSNORM_KERNEL.replace("EPS_TERM", "eps + 1.0")  # eps off by one: clearly wrong numbers
# Correct, but written against an old Triton: tl.math.tanh (gone since 3.0) in a term that is exactly zero.
OLD_API_SOURCE = RMSNORM_KERNEL.replace("EPS_TERM", "eps").replace(
    "    y = (x * rstd)", "    x = x + 0.0 * tl.math.tanh(x)\n    y = (x * rstd)")


def fenced(source: str, plan: str = "Plan: one program per row, fp32 accumulation.") -> str:
    return f"{plan}\n\n```python\n{source}```\n\nThis handles every observed shape."


@dataclass
class Reply:
    content: str | None = None
    finish_reason: str = "stop"
    status: int = 200
    delay_s: float = 0.0
    prompt_tokens: int = 100
    completion_tokens: int = 50
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


def good(**kw) -> Reply:
    return Reply(fenced(GOOD_SOURCE), **kw)


def compile_error(**kw) -> Reply:
    return Reply(fenced(COMPILE_ERROR_SOURCE), **kw)


def wrong_numerics(**kw) -> Reply:
    return Reply(fenced(WRONG_SOURCE), **kw)


def old_api(**kw) -> Reply:
    return Reply(fenced(OLD_API_SOURCE), **kw)


def rate_limited() -> Reply:
    return Reply(status=429, headers={"retry-after": "0"},
                 error={"message": "Rate limit reached for test-model", "type": "rate_limit_error",
                        "code": "rate_limit_exceeded"})


def server_error() -> Reply:
    return Reply(status=503, error={"message": "overloaded", "type": "server_error", "code": None})


def slow(delay_s: float) -> Reply:
    return Reply(fenced(GOOD_SOURCE), delay_s=delay_s)


def no_code() -> Reply:
    return Reply("I cannot write this kernel without more information about the hardware.")


def truncated() -> Reply:
    return Reply("Plan: tile rows.\n\n```python\nimport torch\nimport triton\n\n@triton.jit\ndef _k(x_ptr,",
                 finish_reason="length", completion_tokens=4096)


class ScriptedLLM:
    """`with ScriptedLLM([good(), no_code()]) as llm:` ... `llm.base_url`, `llm.requests`. When the script runs
    out, `default` answers (a no-code reply unless given)."""

    def __init__(self, script: list[Reply] | None = None, default: Reply | None = None):
        self.script = list(script or [])
        self.default = default or no_code()
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="scripted-llm", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def push(self, *replies: Reply) -> None:
        with self.lock:
            self.script.extend(replies)

    def __enter__(self) -> "ScriptedLLM":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next(self, body: dict, headers: dict, path: str) -> Reply:
        with self.lock:
            self.requests.append({"path": path, "headers": headers, "body": body})
            return self.script.pop(0) if self.script else self.default

    def _handler(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                reply = owner._next(body, {k.lower(): v for k, v in self.headers.items()}, self.path)
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                if reply.status != 200:
                    self._send(reply.status, {"error": reply.error or {"message": "error"}}, reply.headers)
                    return
                self._send(200, {
                    "id": f"chatcmpl-{len(owner.requests)}", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", "test-model"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.content},
                                 "finish_reason": reply.finish_reason}],
                    "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                              "total_tokens": reply.prompt_tokens + reply.completion_tokens},
                }, reply.headers)

            def _send(self, status: int, payload: dict, headers: dict | None = None):
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

        return Handler
