"""Masking of secrets in anything the LLM proposer persists (transcripts, call records, error messages), and the
test of which variables are secret that the sandbox uses to keep them from a candidate's environment (at the core's
top, so the verifier does not import the LLM package that imports it).

API keys live in the environment only (litellm reads them there); this is the last line of defence for text that
could echo one back: a provider error quoting the key, a user pasting one into a prompt, an exception's repr.
"""
from __future__ import annotations

import os
import re
from typing import Any

MASK = "***REDACTED***"
MIN_SECRET_CHARS = 6  # shorter env values ("1", "true") would mask ordinary words
_SECRET_ENV = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?|AUTH)$"
                         r"|^(API_KEY|TOKEN|SECRET|PASSWORD)$|(_KEY|_PAT|_SESSION)$", re.I)
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


def is_secret_name(name: str) -> bool:
    """Does an environment variable's name say it holds a secret (*_API_KEY, *_TOKEN, *_PASSWORD, ...)?"""
    return bool(_SECRET_ENV.search(name))


def secret_env_values(env: dict[str, str] | None = None) -> list[str]:
    """Values of secret-looking environment variables (*_API_KEY, *_TOKEN, ...), longest first."""
    env = os.environ if env is None else env
    values = {v for k, v in env.items() if _SECRET_ENV.search(k) and v and len(v) >= MIN_SECRET_CHARS}
    return sorted(values, key=len, reverse=True)


_SEPARATORS = r"[\s\-_.,:;|/+*'\"`~]*"  # what a transformed secret may be split or joined with


def _encodings(value: str) -> set[str]:
    """The common encodings of a secret, each matched literally (base64 of every alignment, hex, url-encoding,
    rot13, reversal, case folding is applied by the pattern)."""
    import base64
    import codecs
    import urllib.parse

    raw = value.encode()
    out = {value, value[::-1], urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value),
           codecs.encode(value, "rot13"), raw.hex(), raw[::-1].hex()}
    for enc in (base64.b64encode, base64.urlsafe_b64encode, base64.b32encode, base64.b85encode):
        full = enc(raw).decode()
        out |= {full, full.rstrip("=")}
    # a secret embedded in a longer string is base64-encoded at one of three alignments: the stable middle of each
    for shift in (1, 2):
        b = base64.b64encode(b"\0" * shift + raw).decode().rstrip("=")
        mid = b[4:-4]  # the characters that depend only on the secret's bytes
        if len(mid) >= MIN_SECRET_CHARS:
            out.add(mid)
    full = base64.b64encode(raw).decode().rstrip("=")
    if len(full) > 8:
        out.add(full[:-3])
    out.add(str(list(raw)))  # a list of byte values
    out.add(" ".join(str(b) for b in raw))
    return {e for e in out if len(e) >= MIN_SECRET_CHARS}


def _pattern(token: str) -> re.Pattern:
    """`token` with any run of separators (or none) allowed between its characters, case-insensitive."""
    return re.compile(_SEPARATORS.join(re.escape(c) for c in token), re.I)


_PATTERNS: dict[str, list[re.Pattern]] = {}


def _secret_patterns(value: str) -> list[re.Pattern]:
    if value not in _PATTERNS:
        _PATTERNS[value] = [_pattern(e) for e in sorted(_encodings(value), key=len, reverse=True)]
    return _PATTERNS[value]


def redact(text: str, env: dict[str, str] | None = None) -> str:
    """`text` with every key-like token and every secret env value replaced by a mask: the value itself and its
    common encodings (base64, base32, base85, hex, url-encoding, rot13, reversed, byte lists), also when split by
    separators or in another case."""
    if not text:
        return text
    for value in secret_env_values(env):
        text = text.replace(value, MASK)
        for pat in _secret_patterns(value):
            text = pat.sub(MASK, text)
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
