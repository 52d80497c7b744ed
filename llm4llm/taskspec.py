"""Task artifacts: a content-addressed directory holding a JSON spec, the reference module, and captured cases.

Layout of `<root>/<task_id>/`:
    spec.json                 TaskSpec
    module.pt                 one instance of the module (the reference callable, driven with functional_call)
    cases/<k>.safetensors     one representative call per distinct shape signature:
                              in.<name> (inputs), w.<name> (weights), state.<name> (state-in),
                              ref.<name> (reference outputs, incl. ref.state_out.<name>)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field
from safetensors.torch import load_file, save_file

SPEC_VERSION = 1


class TensorSig(BaseModel):
    shape: list[int]
    dtype: str


class CaseSig(BaseModel):
    """The shape signature of one captured call: every tensor's shape and dtype by boundary name."""

    inputs: dict[str, TensorSig]
    state: dict[str, TensorSig] = Field(default_factory=dict)
    outputs: dict[str, TensorSig] = Field(default_factory=dict)
    calls: int = 1  # how many calls of the workload had this signature

    def key(self) -> str:
        parts = [f"{k}:{v.dtype}{v.shape}" for k, v in sorted({**self.inputs, **self.state}.items())]
        return "|".join(parts)

    def shapes(self) -> tuple:
        """`key` without the dtypes: ((name, shape), ...) of every input and state tensor, by name."""
        return tuple((k, tuple(v.shape)) for k, v in sorted({**self.inputs, **self.state}.items()))


class DispatchTemplate(BaseModel):
    """How phase-specialised candidates rejoin into one patched module."""

    phase: str  # the phase this task covers
    predicate: str  # "prefill: new positions > 1" / "decode: new positions == 1 with a cache"
    sibling_tasks: list[str] = Field(default_factory=list)  # the other phase's task(s) of the same module class
    fallback: str = "original forward captured at patch time"


class TaskSpec(BaseModel):
    spec_version: int = SPEC_VERSION
    task_id: str = ""
    workload: str = ""
    run_id: str = ""
    family: str
    module_class: str  # import path, e.g. transformers.models.qwen3.modeling_qwen3.Qwen3Attention
    instances: list[str]  # module paths grouped into this task
    phase: str
    input_names: list[str]
    weight_names: list[str]
    state_names: list[str] = Field(default_factory=list)
    output_names: list[str]
    static: dict[str, Any] = Field(default_factory=dict)
    cases: list[CaseSig]  # every distinct signature observed, in the order of cases/<k>.safetensors
    dtype: str
    hardware: dict[str, Any] = Field(default_factory=dict)  # {"gpu_name", "capability", "device"}
    hotspot_score: float = 0.0
    time_ms: float = 0.0
    deployable: bool = True
    reason: str = ""
    dispatch: DispatchTemplate | None = None
    reference: str = "module.pt via torch.func.functional_call"
    recipe: dict[str, Any] = Field(default_factory=dict)  # how boundary names rebuild the forward's (args, kwargs)
    # Every distinct signature observed in the phase with its call count; `cases` holds the captured subset.
    observed: list[CaseSig] = Field(default_factory=list)
    # The workload's lossy opt-in (Workload.lossy_budget()): lossy templates apply only where it is set
    accuracy_budget: dict[str, float] | None = None
    # The cases include a declared serving regime's corners (llm4llm/regime.py): the guards admit the box between
    # them, which the verifier checked at its corners, instead of the exact signatures alone
    regime: bool = False

    def batches(self) -> list[int]:
        """The batch sizes (dim 0 of the first input) its captured cases hold, ascending."""
        name = self.input_names[0] if self.input_names else None
        return sorted({c.inputs[name].shape[0] for c in self.cases if name in c.inputs and c.inputs[name].shape})

    def content_id(self) -> str:
        """Content address: family, class, phase, names, static values and shapes; not run ids or scores."""
        payload = self.model_dump(include={"family", "module_class", "phase", "input_names", "weight_names",
                                           "state_names", "output_names", "static", "cases", "dtype", "hardware"})
        if self.accuracy_budget:  # an opted-in workload's task is another task (its templates differ); others keep ids
            payload["accuracy_budget"] = self.accuracy_budget
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return f"{self.family}-{self.phase}-{hashlib.sha256(blob).hexdigest()[:12]}"


@dataclass
class Case:
    inputs: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    ref: dict[str, torch.Tensor]  # outputs and "state_out.<name>"


@dataclass
class Task:
    spec: TaskSpec
    path: Path
    cases: list[Case] = field(default_factory=list)

    def load_module(self, map_location: str | torch.device = "cpu") -> torch.nn.Module:
        return torch.load(self.path / "module.pt", map_location=map_location, weights_only=False)

    def reference(self, map_location: str | torch.device = "cpu"):
        """The reference callable with the candidate contract: (inputs, weights, state, static) -> dict, where the
        dict holds the outputs and `state_out.<name>`. Built on kernels_runtime.boundary.call_reference."""
        from kernels_runtime.boundary import call_reference

        module = self.load_module(map_location)
        recipe = self.spec.recipe

        def ref(inputs, weights, state, static):
            return call_reference(module, weights, inputs, state, static, recipe)

        return ref


_PREFIX = {"inputs": "in.", "weights": "w.", "state": "state.", "ref": "ref."}


def _flatten_case(case: Case) -> dict[str, torch.Tensor]:
    flat = {}
    for field_name, prefix in _PREFIX.items():
        for name, t in getattr(case, field_name).items():
            flat[prefix + name] = t.detach().contiguous().cpu()
    return flat


def _unflatten_case(flat: dict[str, torch.Tensor]) -> Case:
    parts: dict[str, dict[str, torch.Tensor]] = {k: {} for k in _PREFIX}
    for key, t in flat.items():
        for field_name, prefix in _PREFIX.items():
            if key.startswith(prefix):
                parts[field_name][key[len(prefix):]] = t
                break
    return Case(**parts)


def write_task(root: Path, spec: TaskSpec, module: torch.nn.Module, cases: list[Case]) -> Path:
    """Write a task atomically (temp dir + rename) under its content id; returns the directory."""
    if len(cases) != len(spec.cases):
        raise ValueError(f"write_task: expected {len(spec.cases)} cases for the spec, got {len(cases)}")
    spec.task_id = spec.task_id or spec.content_id()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / spec.task_id
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.task_id}-", dir=root))
    try:
        (tmp / "cases").mkdir()
        for k, case in enumerate(cases):
            save_file(_flatten_case(case), str(tmp / "cases" / f"{k}.safetensors"))
        torch.save(module, tmp / "module.pt")
        (tmp / "spec.json").write_text(spec.model_dump_json(indent=2))
        (tmp / MANIFEST).write_text(json.dumps(artifact_hashes(tmp), indent=1, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


MANIFEST = "artifacts.sha256.json"  # sha256 of every other file, written with the task


# Hashing a task dir is not free: a 7B serving regime's decoder-layer task holds GBs of KV-cache cases, and every
# verification, acceptance and extraction hashed its files whole, one after another. Files are hashed in threads
# (hashlib and file reads release the GIL: ~2x on 2 cores, more on a GPU host's 16), streamed in chunks, and a file
# this process hashed before is not hashed again while its identity and times are unchanged (the `git status`
# rule: device, inode, size, mtime and ctime; a write or a replace changes them, and ctime cannot be set back short
# of the clock). Keyed by inode, so a task dir renamed into place after its writing, or hard-linked into a sandbox
# box, is still known. HASH_MEMO_MAX entries at most (a long-lived service verifies many tasks).
HASH_THREADS = 8
HASH_CHUNK = 1 << 22
HASH_MEMO_MAX = 4096
RACY_NS = 2_000_000_000
_hash_memo: dict[tuple[int, int], tuple[tuple[int, ...], str]] = {}
_hash_memo_lock = threading.Lock()  # artifact_hashes' threads read and evict it together


def _stat_key(f: Path) -> tuple[int, ...]:
    st = f.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_sha256(f: Path) -> str:
    """sha256 of one file, streamed; from this process's memo while the file's stat key is unchanged."""
    key = _stat_key(Path(f))
    with _hash_memo_lock:
        hit = _hash_memo.get(key[:2])
    if hit is not None and hit[0] == key:
        return hit[1]
    h = hashlib.sha256()
    with open(f, "rb", buffering=0) as fh:
        while chunk := fh.read(HASH_CHUNK):
            h.update(chunk)
    # not remembered if it changed while read, or if its times are too fresh to tell a rewrite in the same tick of a
    # coarse clock from the file as read (git's "racy" rule)
    if _stat_key(Path(f)) == key and time.time_ns() - max(key[3], key[4]) > RACY_NS:
        with _hash_memo_lock:
            if len(_hash_memo) >= HASH_MEMO_MAX:
                _hash_memo.pop(next(iter(_hash_memo)))
            _hash_memo[key[:2]] = (key, h.hexdigest())
    return h.hexdigest()


def artifact_hashes(path: Path) -> dict[str, str]:
    """sha256 of every file of a task dir (relative path -> hex), the manifest itself left out."""
    from concurrent.futures import ThreadPoolExecutor

    path = Path(path)
    files = [f for f in sorted(path.rglob("*")) if f.is_file() and f.name != MANIFEST]
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, os.cpu_count() or 1, len(files)))) as pool:
        digests = list(pool.map(file_sha256, files))
    return {f.relative_to(path).as_posix(): d for f, d in zip(files, digests)}


def seal_artifacts(path: Path) -> None:
    """Rewrite a task dir's manifest after its writer added a file of its own (KernelBench's `problem.py`)."""
    path = Path(path)
    (path / MANIFEST).write_text(json.dumps(artifact_hashes(path), indent=1, sort_keys=True))


def check_artifacts(path: Path, expected: dict[str, str] | None = None) -> dict[str, str]:
    """The task dir's hashes, after checking them against `expected` (else its manifest, where it has one): a task
    whose artifacts changed since they were written raises TaskError (nothing judged against it can be trusted)."""
    from llm4llm.errors import TaskError

    path = Path(path)
    now = artifact_hashes(path)
    if expected is None and (path / MANIFEST).exists():
        expected = json.loads((path / MANIFEST).read_text())
    if expected is not None and now != expected:
        changed = sorted(k for k in set(now) | set(expected) if now.get(k) != expected.get(k))
        raise TaskError(f"task {path}: artifacts changed since they were written (hash mismatch: {changed}); "
                        f"re-extract the task")
    return now


def load_spec(path: Path) -> TaskSpec:
    path = Path(path)
    spec_file = path / "spec.json"
    if not spec_file.exists():
        raise FileNotFoundError(f"task: expected {spec_file}, got no such file")
    spec = TaskSpec.model_validate_json(spec_file.read_text())
    if spec.spec_version != SPEC_VERSION:
        raise ValueError(f"task {path}: expected spec_version {SPEC_VERSION}, got {spec.spec_version}")
    return spec


def load_task(path: Path, with_cases: bool = True) -> Task:
    path = Path(path)
    spec = load_spec(path)
    task = Task(spec=spec, path=path)
    if with_cases:
        task.cases = [_unflatten_case(load_file(str(path / "cases" / f"{k}.safetensors"))) for k in range(len(spec.cases))]
    return task
