"""Masking of secrets in anything the LLM proposer persists (transcripts, call records, error messages).

API keys live in the environment only (litellm reads them there); this is the last line of defence for text that
could echo one back: a provider error quoting the key, a user pasting one into a prompt, an exception's repr.
"""
from __future__ import annotations

import os
import re
from typing import Any

MASK = "***REDACTED***"
MIN_SECRET_CHARS = 6  # shorter env values ("1", "true") would mask ordinary words
_SECRET_ENV = re.compile(r"(_API_KEY|_APIKEY|_TOKEN|_SECRET|_SECRET_KEY|_PASSWORD|_ACCESS_KEY)$|^API_KEY$", re.I)
_TOKENS = [
    re.compile(r"\bsk-[A-Za-z0-9_\-]{6,}"),  # OpenAI, Anthropic (sk-ant-...), DeepSeek, many proxies
    re.compile(r"\bAIza[0-9A-Za-z_\-]{20,}"),  # Google
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),  # Hugging Face
    re.compile(r"\b(?:gsk|xai|pplx|nvapi|ghp|gho|github_pat)[-_][A-Za-z0-9_\-]{16,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),  # AWS access key id
]
# A label followed by a value: the label is kept, the value masked.
_LABELLED = [
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9_\-\.=]{8,}"),
    re.compile(r"(?i)((?:api[_-]?key|x-api-key|authorization)[\"']?\s*[:=]\s*[\"']?)[^\s\"',}]{6,}"),
]


def secret_env_values(env: dict[str, str] | None = None) -> list[str]:
    """Values of secret-looking environment variables (*_API_KEY, *_TOKEN, ...), longest first."""
    env = os.environ if env is None else env
    values = {v for k, v in env.items() if _SECRET_ENV.search(k) and v and len(v) >= MIN_SECRET_CHARS}
    return sorted(values, key=len, reverse=True)


def redact(text: str, env: dict[str, str] | None = None) -> str:
    """`text` with every key-like token and every secret env value replaced by a mask."""
    if not text:
        return text
    for value in secret_env_values(env):
        text = text.replace(value, MASK)
    for pat in _TOKENS:
        text = pat.sub(MASK, text)
    for pat in _LABELLED:
        text = pat.sub(lambda m: m.group(1) + MASK, text)
    return text


def redact_obj(obj: Any, env: dict[str, str] | None = None) -> Any:
    """`redact` over every string inside nested dicts/lists/tuples (keys too)."""
    if isinstance(obj, str):
        return redact(obj, env)
    if isinstance(obj, dict):
        return {redact_obj(k, env): redact_obj(v, env) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_obj(v, env) for v in obj)
    return obj
