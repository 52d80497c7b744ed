"""What every stage shares: the cache-key parts (code version, hardware fingerprint), the workload's identity, run
ids, building the model through the user's script, atomic JSON artifacts, freeing memory between stages."""
from __future__ import annotations

import gc
import hashlib
import json
import uuid
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path


PACKAGES = ("llm4llm", "kernels_runtime")


@lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the project's own source (part of every cache key: a code change re-runs the stages)."""
    root = Path(__file__).resolve().parents[2]  # the repository: llm4llm/stages/common.py
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def hardware_fingerprint(device: str) -> str:
    from llm4llm.profiler import hardware_info

    info = hardware_info(device)
    keys = ("device", "gpu_name", "capability", "torch", "triton", "transformers")
    return "|".join(str(info.get(k, "")) for k in keys)


def describe_workload(workload_path: str) -> dict:
    """Validate a workload file (raises WorkloadError) and return its identity."""
    from llm4llm.workload import load_workload

    wl = load_workload(workload_path)
    return {
        "workload_hash": wl.content_hash(),
        "name": wl.name,
        "path": str(Path(workload_path).resolve()),
        "device": wl.device,
        "config": json.loads(wl.model_dump_json()),
    }


def new_run_id(name: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{name}-{stamp}-{uuid.uuid4().hex[:6]}"


EXTRACT_DECODE_LEN = 2  # tokens decoded at a regime's extra points when the regime declares no decode lengths


def _build(workload_path: str, corners: bool = False):
    """(workload, model, run_fn). corners: run_fn runs the representative point, then every corner and batch bucket
    of the workload's serving regime (llm4llm/regime.py: Regime.points), so extraction captures each task's calls at
    those shapes too."""
    from llm4llm.workload import call_script, load_script, load_workload

    wl = load_workload(workload_path)
    script = load_script(wl)
    model = call_script(script.build, wl)
    points = [wl]
    if corners and wl.regime is not None:
        # a regime without decode lengths of its own decodes 2 tokens at each point (one decode step past the
        # prompt's: the shapes a task needs), not the workload's decode_len: 64 steps at each of 8 points made
        # qwen3-4b-serving's extraction 2.5 minutes of its 8-minute budget
        points += [wl.model_copy(update={"batch_size": b, "prompt_len": n, "decode_len": d})
                   for b, n, d in wl.regime.points(EXTRACT_DECODE_LEN)
                   if (b, n, d) != (wl.batch_size, wl.prompt_len, wl.decode_len)]
    batches = [call_script(script.inputs, w) for w in points]

    def run_fn():
        out = None
        for w, batch in zip(points, batches):
            result = call_script(script.run, model, w, batch)
            out = result if out is None else out  # the representative point's result
        return out

    return wl, model, run_fn


def _write_json(path: Path, obj) -> Path:
    """Write JSON atomically (temp file + rename): a killed stage never leaves a half-written artifact."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)
    return path


def _free() -> None:
    """Hand the GPU memory a stage's model held back to the driver. Call it after the stage dropped its references
    (`del model, run_fn`): freed tensors stay in PyTorch's cache until then, out of reach of the processes that come
    next (the verifier's worker, acceptance's child). Profile and extraction once passed their model and run_fn in
    as arguments, the caller's own names kept them alive, and the parent held a 7B model's 13.6 GB through the
    search."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass

