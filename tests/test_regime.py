"""A declared serving regime: extraction captures its corners, the verifier checks the candidate there, the guards
admit the box between them and nothing else, and every call outside falls back, counted, with a re-profiling hint."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels_runtime
from kernels_runtime.bundle import PatchBundle
from llm4llm.patchspec import task_patch_spec
from llm4llm.search.templates import TEMPLATES
from llm4llm.taskspec import load_spec
from llm4llm.workload import load_workload

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _workload(tmp_path: Path, regime: str) -> Path:
    text = (EXAMPLES / "workloads" / "tiny-falcon-mamba.toml").read_text()
    text = text.replace('"../scripts/hf_generate.py"', f'"{EXAMPLES / "scripts" / "hf_generate.py"}"')
    path = tmp_path / "w.toml"
    path.write_text(text + "\n[regime]\n" + regime)
    return path


def test_the_representative_point_must_lie_inside_the_regime(tmp_path):
    from llm4llm.errors import WorkloadError

    wl = load_workload(_workload(tmp_path, "batch_sizes = {min = 1, max = 3}\nprompt_lens = [4, 20]\n"))
    assert wl.regime.corners(wl.decode_len) == [(1, 4, 4), (1, 20, 4), (3, 4, 4), (3, 20, 4)]
    with pytest.raises(WorkloadError, match="prompt_lens: 16 outside 10..12"):
        load_workload(_workload(tmp_path, "batch_sizes = [1, 2]\nprompt_lens = {min = 10, max = 12}\n"))
    with pytest.raises(WorkloadError, match="min <= max"):
        load_workload(_workload(tmp_path, "batch_sizes = {min = 3, max = 1}\nprompt_lens = [8]\n"))


def test_a_bundle_over_a_regime_runs_its_kernels_at_another_in_regime_shape(tmp_path):
    from llm4llm.stages.extract import run_extract
    from llm4llm.stages.profile import run_profile
    from llm4llm.verify import VerifierPool
    from llm4llm.workload import call_script, load_script

    wpath = _workload(tmp_path, "batch_sizes = {min = 1, max = 3}\nprompt_lens = [4, 20]\n")
    data = tmp_path / "data"
    run_extract(str(wpath), run_profile(str(wpath), str(data)), str(data))
    dirs = [d for d in (data / "tasks").iterdir() if d.name.startswith("ssm_block")]
    bundle = PatchBundle(name="regime")
    with VerifierPool("cpu", timeout_s=300.0, draws=1) as pool:
        for d in sorted(dirs):
            spec = load_spec(d)
            batches = {c.inputs["hidden_states"].shape[0] for c in spec.cases}
            assert batches == {1, 2, 3}, spec.cases  # the corners and the bucket between: cases of the one task
            t = next(t for t in TEMPLATES if t.why_not(spec) is None)
            # any correct config will do: the prefill scan one step at a time over one channel block (d_inner 64)
            # runs several times faster under the interpreter than the default's chunked tl.associative_scan
            fast = {"scan_BLOCK_T": 0, "scan_BLOCK_D": 64} if "scan_BLOCK_T" in t.default(spec) else {}
            source = t.render(spec, {**t.default(spec), **fast})
            v = pool.verify(d, source)  # correctness at the corners (captured) and fresh draws of them
            assert v.passed, v.message
            guard = task_patch_spec(spec, "c", 1.0, "cpu").guard
            assert list(guard.shapes["hidden_states"][0]) == [1, 3]
            bundle.add_patch(task_patch_spec(spec, f"{t.name}-default", 1.0, "cpu"), source=source)

    wl = load_workload(wpath)
    script = load_script(wl)
    model = call_script(script.build, wl)
    inside = wl.model_copy(update={"batch_size": 2, "prompt_len": 7})
    batch = call_script(script.inputs, inside)
    with torch.no_grad():
        ref = model(**batch).logits
    report = kernels_runtime.apply(model, bundle, strict=True)
    with torch.no_grad():
        out = model(**batch).logits
        call_script(script.run, model, inside, batch)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert report.totals()["kernel"] > 0 and report.totals()["fallback"] == 0, str(report)

    outside = wl.model_copy(update={"batch_size": 5})
    call_script(script.run, model, outside, call_script(script.inputs, outside))
    text = str(report)
    assert report.totals()["fallback"] > 0 and "shape hidden_states: expected [1..3" in text
    assert "re-profile" in text


@pytest.mark.parametrize("regime,decoded", [("", 2), ("decode_lens = [3, 9]\n", 3)])
def test_extraction_decodes_few_tokens_at_the_regimes_extra_points(tmp_path, monkeypatch, regime, decoded):
    """Extraction runs the representative point as the workload says (its decode_len), then each corner and
    bucket with the fewest tokens the regime declares, or 2 (one decode step: the shapes a task needs) where it
    declares none, not the workload's decode_len at every point."""
    import llm4llm.stages.common as common
    import llm4llm.workload as workload_mod

    path = _workload(tmp_path, "batch_sizes = {min = 1, max = 3}\nprompt_lens = [4, 20]\n" + regime)
    runs = []
    real = workload_mod.call_script
    monkeypatch.setattr(workload_mod, "call_script", lambda fn, *a: runs.append(a[1]) if fn.__name__ == "run"
                        else real(fn, *a))
    wl, _, run_fn = common._build(str(path), corners=True)
    run_fn()
    assert (runs[0].batch_size, runs[0].prompt_len, runs[0].decode_len) == (wl.batch_size, wl.prompt_len, 4)
    assert [(w.batch_size, w.prompt_len, w.decode_len) for w in runs[1:]] == [
        (1, 4, decoded), (1, 20, decoded), (3, 4, decoded), (3, 20, decoded), (2, 4, decoded)]


def test_a_candidates_verification_limit_grows_with_the_decode_batches_its_task_holds(tiny_extracted, monkeypatch):
    """A serving regime's task holds every decode bucket, and each bucket's row tile is compiled apart: one
    candidate's limit is the settings' timeout plus PER_BATCH_S a further batch size, for the search's trials and
    the plan's template checks alike."""
    from llm4llm import isolation
    from llm4llm.config import SearchSettings
    from llm4llm.outcomes import FailureClass
    from llm4llm.stages import search as stage
    from llm4llm.taskspec import CaseSig, TaskSpec, TensorSig, load_spec
    from llm4llm.verify.verdict import Verdict

    def spec_of(*batches):
        return TaskSpec.model_construct(input_names=["hidden_states"], cases=[
            CaseSig(inputs={"hidden_states": TensorSig(shape=[b, 1, 64], dtype="bfloat16")}) for b in batches])

    assert spec_of(8, 1, 32, 1).batches() == [1, 8, 32]

    assert stage.verify_limit(spec_of(8), 120.0) == 120.0
    assert stage.verify_limit(spec_of(8, 1, 1, 32, 2, 4, 8, 16), 120.0) == 120.0 + 5 * stage.PER_BATCH_S
    limits = []

    class Pool:
        def verify(self, path, source, timeout_s=None, **kw):
            limits.append(timeout_s)
            return Verdict(source_hash="x", task_id="t", device_name="cpu").fail("static", FailureClass.STATIC, "-")

    monkeypatch.setattr(isolation, "verifier_pool", lambda *a: (Pool(), __import__("threading").Lock()))
    task = next(d for d in tiny_extracted("tiny-llama") if load_spec(d).family == "norm")
    stage.run_template_checks(str(task), None, "cpu", SearchSettings(timeout_s=50.0))
    assert limits and set(limits) == {stage.verify_limit(load_spec(task), 50.0)}
