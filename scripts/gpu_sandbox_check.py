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
