"""The static gate against routes out of the allowed modules: modules an allowed module imported for itself
(`torch.cuda.os`, `triton.runtime.cache.os`, `torch.cuda.threading`), reached through a resolved chain, an import,
or a local alias; frames (whose globals are the harness's); and rebinding what imported modules hold."""
from __future__ import annotations

from pathlib import Path

import pytest

from llm4llm.verify.static_check import check_source

BASE = (Path(__file__).parent / "cheats" / "correct_rmsnorm.py").read_text()


@pytest.mark.parametrize("extra, why", [
    ("o = torch.cuda.os", "attribute 'os'"),
    ("t = torch.cuda.threading.Thread", "torch.cuda.threading (module threading)"),
    ("t = torch.cuda.threading", "attribute 'threading'"),
    ("m = triton.runtime\nc = m.cache.os", "attribute 'os'"),  # a local the checker cannot resolve
    ("m = torch.cuda\nf = m.operator.attrgetter('os')", "attribute 'operator'"),
    ("def f():\n    g = (i for i in ())\n    return g.gi_frame.f_back.f_globals", "attribute 'f_globals'"),
    ("torch.cuda.Event = object", "assigning torch.cuda.Event"),
    ("triton.runtime.jit.JITFunction.run = None", "assigning triton.runtime.jit.JITFunction.run"),
    ("del torch.cuda.synchronize", "assigning torch.cuda.synchronize"),
])
def test_route_out_is_refused(extra, why):
    r = check_source(BASE + "\n" + extra + "\n", ("LlamaRMSNorm",))
    assert not r.ok and why in r.reason, r.reason


def test_allowed_chains_and_local_attributes_still_pass():
    extra = ("_C = triton.language.core\nclass Box:\n    pass\nb = Box()\nb.os_count = 1\nb.value = 2\n"
             "s = torch.cuda.synchronize\n")
    assert check_source(BASE + "\n" + extra, ("LlamaRMSNorm",)).ok
