"""The redactor masks a secret env value in plain text and in its common encodings."""
import base64
import codecs
import urllib.parse

import pytest

from llm4llm.redact import MASK, redact

KEY = "sk-proj-Zq81mVt0dLr4Xy7NwPb2"
ENV = {"OPENAI_API_KEY": KEY, "HOME": "/root"}


@pytest.mark.parametrize("encode", [
    lambda k: k, lambda k: k[::-1], lambda k: k.upper(), lambda k: "-".join(k), lambda k: " ".join(k),
    lambda k: base64.b64encode(k.encode()).decode(), lambda k: base64.urlsafe_b64encode(k.encode()).decode(),
    lambda k: base64.b64encode(b"x=" + k.encode()).decode(), lambda k: base64.b32encode(k.encode()).decode(),
    lambda k: k.encode().hex(), lambda k: k.encode().hex().upper(), lambda k: urllib.parse.quote(k, safe=""),
    lambda k: codecs.encode(k, "rot13"), lambda k: str(list(k.encode())),
], ids=["plain", "reversed", "upper", "dashes", "spaces", "b64", "b64url", "b64-offset", "b32", "hex", "HEX",
        "url", "rot13", "bytes"])
def test_encoded_secret_is_masked(encode):
    text = f"RuntimeError: output name {encode(KEY)} was unexpected"
    out = redact(text, ENV)
    assert MASK in out and encode(KEY) not in out
    assert KEY[4:16] not in out


def test_ordinary_text_is_untouched():
    text = "hidden_states: expected (2, 3, 80), got (1, 4, 80); /root/x"
    assert redact(text, ENV) == text
