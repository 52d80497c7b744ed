"""Profile and extraction run in the flow's own process: when each ends, its model must be gone before the GPU's
cache is emptied, or the memory stays with the parent, out of reach of the verifier's worker and acceptance's child
(a Llama-2-7B serving run held 13.6 GB after extraction, then died of OOM in acceptance's model build)."""
import weakref
from pathlib import Path

import torch

from llm4llm.stages import common, extract, profile

TINY = Path(__file__).resolve().parents[1] / "examples" / "workloads" / "tiny-llama.toml"


def _watch(monkeypatch):
    """Record, at each emptying of the (pretend) GPU cache, whether the stage's model was still alive."""
    built, alive = [], []
    real_build = common._build

    def build(*a, **kw):
        wl, model, run_fn = real_build(*a, **kw)
        built.append(weakref.ref(model))
        return wl, model, run_fn

    monkeypatch.setattr(profile, "_build", build)
    monkeypatch.setattr(extract, "_build", build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive.append(built[-1]() is not None))
    return alive


def test_profile_and_extraction_drop_their_model_before_emptying_the_cache(monkeypatch, tmp_path):
    alive = _watch(monkeypatch)
    path = profile.run_profile(str(TINY), str(tmp_path))
    assert alive == [False]
    extract.run_extract(str(TINY), path, str(tmp_path))
    assert alive == [False, False]
