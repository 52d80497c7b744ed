"""evaluate --bundle runs the bundle's (candidate) code in its sandboxed child from a read-only copy in the child's
private dir: a bundle store the sandbox's uid cannot enter (LLM4LLM_HOME under a 0700 dir, as on the H200, where
the child then ran without its uid layer) costs no layer."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "workloads"


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid layer drops privileges only when started as root")
def test_bundle_under_a_private_dir_keeps_every_sandbox_layer(tmp_path, capfd):
    from kernels_runtime.bundle import PatchBundle, save_bundle
    from llm4llm.config import EvaluateSettings
    from llm4llm.stages.evaluate import evaluate_recorded
    from storage.store import Store

    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    path = save_bundle(PatchBundle(name="empty"), private / "bundles" / "b")
    out = evaluate_recorded(str(EXAMPLES / "tiny-llama.toml"), Store(str(tmp_path / "db.duckdb")),
                            EvaluateSettings(repeats=1, variants=["patched"]), bundle=str(path), run_id="r-box")
    assert [r.variant for r in out.rows] == ["patched"]
    err = capfd.readouterr().err
    assert "layer uid unavailable" not in err and "could not reach" not in err, err[-2000:]
    assert Path(path).exists()  # the store itself is untouched
