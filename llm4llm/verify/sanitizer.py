"""Optional memcheck gate: re-run one captured case of a candidate under `compute-sanitizer --tool memcheck` in a
subprocess (CUDA only). Catches out-of-bounds reads and writes that canaries miss. Slow (the sanitizer serialises
and instruments every launch), so it is off by default."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from llm4llm.verify.verdict import GateResult

ERROR_EXIT = 86


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        cand = Path(root) / "bin" / "compute-sanitizer"
        if root and cand.exists():
            return str(cand)
    return None


def memcheck_gate(task_dir: str, source: str, device: str, timeout_s: float = 600.0) -> GateResult:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return GateResult(name="memcheck", passed=True, detail="skipped: no GPU")
    tool = find_sanitizer()
    if tool is None:
        return GateResult(name="memcheck", passed=True, detail="skipped: compute-sanitizer not found")
    from llm4llm.verify.sandbox import kill_group, make_box, remove_box, sandboxed_popen

    # the candidate runs under the sanitizer: the sanitizer starts the sandboxed interpreter, which locks itself in
    box = make_box("llm4llm-memcheck-")
    try:
        src = box / "ro" / "candidate_source.py"
        src.write_text(source)
        proc = sandboxed_popen("llm4llm.verify.sanitizer:sandbox_main", box=box,
                               args=[str(task_dir), str(src), device], extra_needed=[str(task_dir)],
                               wrapper=[tool, "--tool", "memcheck", "--error-exitcode", str(ERROR_EXIT)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.communicate()
            return GateResult(name="memcheck", passed=True, detail=f"skipped: memcheck over {timeout_s:.0f}s")
        kill_group(proc.pid)
        p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        remove_box(box)
    if p.returncode == 0:
        return GateResult(name="memcheck", passed=True, detail="compute-sanitizer memcheck: no errors")
    return GateResult(name="memcheck", passed=False,
                      detail=f"compute-sanitizer memcheck (exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")


def _main(task_dir: str, source_path: str, device: str) -> None:
    import torch

    from llm4llm.taskspec import load_task
    from llm4llm.verify.candidate import load_candidate

    task = load_task(Path(task_dir))
    case = task.cases[0]
    mod = load_candidate(Path(source_path).read_text(), Path(tempfile.mkdtemp()), "llm4llm_memcheck_candidate")
    dev = torch.device(device)
    to_dev = lambda d: {n: t.to(dev) for n, t in d.items()}  # noqa: E731
    mod.entry(to_dev(case.inputs), to_dev(case.weights), to_dev(case.state), dict(task.spec.static))
    torch.cuda.synchronize(dev)


def sandbox_main() -> int:
    _main(*sys.argv[1:4])
    return 0


if __name__ == "__main__":
    _main(*sys.argv[1:4])
