"""One device call's worth of proof that the sandbox runs on the GPU machine: the layers it got, CUDA and Triton in
it, and a real verifier run (correct candidate timed; torch-computing and zeros cheats rejected). Writes
$OUT/sandbox_gpu.json and prints a short table."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
try:
    import pytest  # noqa: F401
except ImportError:  # the GPU machine has no pytest: the test modules only need their decorators to exist
    import types

    class _Deco:
        def __getattr__(self, name):
            return lambda *a, **k: (lambda f: f) if not (len(a) == 1 and callable(a[0]) and not k) else a[0]

    stub = types.ModuleType("pytest")
    stub.fixture, stub.mark, stub.param = _Deco().fixture, _Deco(), lambda *a, **k: a
    sys.modules["pytest"] = stub

import torch  # noqa: E402

from llm4llm.verify import VerifierPool  # noqa: E402
from test_verify import build_rmsnorm_task  # noqa: E402

out_dir = Path(os.environ.get("OUT", "/tmp"))
root = Path(__file__).resolve().parents[1]
cheats = root / "tests" / "cheats"
task_dir = build_rmsnorm_task(Path("/tmp/llm4llm-gpu-tasks"))
res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
import triton  # noqa: E402

res["triton"] = triton.__version__
# the sandbox test's probes, as tests/test_sandbox.py runs them
import test_sandbox  # noqa: E402

vict = Path("/tmp/llm4llm-victim")
vict.mkdir(exist_ok=True)
os.chmod(vict, 0o755)
(vict / "secret.txt").write_text("private")
os.chmod(vict / "secret.txt", 0o600)
(vict / "llm4llm.duckdb").write_bytes(b"DUCK" * 100)
os.environ["SANDBOXTEST_API_KEY"] = "sk-SANDBOXTESTSECRET-0123456789"
t = time.monotonic()
attacks, err = test_sandbox._run("attacks.py", str(vict / "secret.txt"), str(vict / "llm4llm.duckdb"), str(os.getpid()))
os.environ.pop("SANDBOXTEST_API_KEY")
res["attacks"] = attacks
res["attacks_warnings"] = [ln for ln in err.splitlines() if "WARNING" in ln]
res["db_intact"] = (vict / "llm4llm.duckdb").read_bytes() == b"DUCK" * 100
try:
    res["cuda_probe"], cerr = test_sandbox._run("cuda_triton.py", "x")
    res["cuda_probe_warnings"] = [ln for ln in cerr.splitlines() if "WARNING" in ln]
except BaseException as e:  # noqa: BLE001 - recorded: this is what the call is for
    res["cuda_probe"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-3000:]}"}
res["probes_s"] = round(time.monotonic() - t, 1)
(out_dir / "sandbox_gpu.json").write_text(json.dumps(res, indent=1))
bad = [k for k, v in attacks.items() if isinstance(v, str) and v.startswith("allowed") and k not in
       ("write_own_dir", "secret_in_env")]
print("attacks allowed (should be none):", bad, "| secret seen:", attacks.get("secret_in_env"), "| uid", attacks["uid"],
      "| db intact:", res["db_intact"])
print("cuda probe in sandbox:", res["cuda_probe"], res.get("cuda_probe_warnings"))
print("warnings:", res["attacks_warnings"])
t0 = time.monotonic()
with VerifierPool("cuda", timeout_s=120.0, draws=5) as pool:
    for name in ("correct_rmsnorm", "torch_compute_dummy_launch", "zeros"):
        t = time.monotonic()
        v = pool.verify(task_dir, (cheats / f"{name}.py").read_text())
        res[name] = {"passed": v.passed, "failure_class": v.failure_class, "message": v.message[:600],
                     "sandbox": v.sandbox, "speedup_in_context": v.speedup_in_context,
                     "candidate_cold": v.candidate_cold.model_dump() if v.candidate_cold else None,
                     "reference_cold": v.reference_cold.model_dump() if v.reference_cold else None,
                     "gates": [(g.name, g.passed) for g in v.gates], "s": round(time.monotonic() - t, 1)}
res["verify_total_s"] = round(time.monotonic() - t0, 1)
(out_dir / "sandbox_gpu.json").write_text(json.dumps(res, indent=1))
for k in ("correct_rmsnorm", "torch_compute_dummy_launch", "zeros"):
    r = res[k]
    print(f"{k:28s} passed={r['passed']!s:5s} class={r['failure_class']!s:14s} speedup={r['speedup_in_context']} "
          f"{r['s']}s")
print("sandbox layers:", json.dumps(res["correct_rmsnorm"]["sandbox"]))
