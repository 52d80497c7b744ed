"""Patch bundles: what a user's serving code applies. Patches are data; one generic apply/revert (patch.py) reads them.

On disk a bundle is a directory:
    manifest.json           PatchBundle (format_version, created, library versions, GPU, capability and model-config
                            fingerprint verified on, patches with provenance)
    kernels/<sha256>.py     the kernel sources, content-addressed; the hash is verified on load

A kernel source defines `entry(inputs, weights, state, static) -> dict` over the boundary names of
kernels_runtime/boundary.py (outputs `out`, `out.1`, ...; state after the call under `state_out.<name>`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KERNELS_DIR = "kernels"

PatchPhase = Literal["prefill", "decode", "any"]
# One dimension of a shape guard: an exact size, None (any size), or an inclusive range [lo, hi] (hi None = unbounded).
Dim = Union[int, None, tuple[int, Union[int, None]]]


class BundleError(Exception):
    """A bundle that cannot be read: bad manifest, newer format, or a kernel whose source does not verify."""


class BundleFormatError(BundleError):
    pass


class BundleIntegrityError(BundleError):
    pass


def sha256_text(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


class Guard(BaseModel):
    """When a kernel may run. Empty fields accept anything; see guards.py for the predicates."""

    dtypes: list[str] = Field(default_factory=list)  # "float32" | "bfloat16" | "float16"; every floating input
    device_types: list[str] = Field(default_factory=list)  # "cuda" | "cpu"
    min_capability: tuple[int, int] | None = None  # CUDA compute capability, e.g. (9, 0); only checked on cuda
    shapes: dict[str, list[Dim]] = Field(default_factory=dict)  # input name -> per-dim exact / None / [lo, hi]
    contiguous: list[str] = Field(default_factory=list)  # input names that must be contiguous
    # the joint shape signatures acceptance verified (input name -> exact shape); when set, a call must match one of
    # them as a whole: per-dim ranges alone would admit unseen combinations ([1..2, 3..5, 80] admits (1, 4, 80))
    signatures: list[dict[str, list[int]]] = Field(default_factory=list)
    # the state adapter the kernel was verified with (boundary.py's names: "StaticLayer", "DynamicLayer", ...): a
    # call whose cache takes another adapter falls back. A static-cache and a dynamic-cache call can have inputs of
    # the same shapes while their state means different things (a zero-padded buffer and a device-side length, or
    # the past alone). None: a stateless kernel, or a bundle written before this field (not checked).
    state_adapter: str | None = None
    # the batch sizes (dim 0 of the inputs) a decode kernel was verified at: a serving regime's buckets
    # (kernels_runtime.buckets); a call at another batch falls back. Empty: not checked.
    batch_buckets: list[int] = Field(default_factory=list)
    # inputs a call may pass as None (absent from its inputs), each way verified: HF's attention mask, None for an
    # unpadded batch and a bool tensor for a padded one. Their shapes are checked where they are given.
    optional: list[str] = Field(default_factory=list)

    @field_validator("min_capability", mode="before")
    @classmethod
    def _capability(cls, v: Any) -> Any:
        if isinstance(v, str):  # "9.0", as the profiler records hardware
            major, _, minor = v.partition(".")
            return (int(major), int(minor or 0))
        return v


class Provenance(BaseModel):
    run_id: str = ""
    task_id: str = ""
    candidate_id: str = ""
    metrics: dict[str, Any] = Field(default_factory=dict)  # speedup, in-model error, e2e numbers, ...
    library_versions: dict[str, str] = Field(default_factory=dict)
    gpu: str = ""


class PatchSpec(BaseModel):
    """One kernel for one module class in one phase."""

    patch_id: str
    module_class: str  # import path + class name, e.g. transformers.models.llama.modeling_llama.LlamaRMSNorm
    instances: list[str] = Field(default_factory=lambda: ["*"])  # module paths or fnmatch globs ("model.layers.*.mlp")
    phase: PatchPhase = "any"
    guard: Guard = Field(default_factory=Guard)
    kernel: str  # sha256 of the source in kernels/
    entry: str = "entry"
    config: dict[str, Any] = Field(default_factory=dict)  # passed to the kernel as static["config"] when non-empty
    dispatch_template: str = ""  # groups the phase-specialised kernels of one module class; default: module_class
    # How the kernel's named outputs rebuild the forward's return value: the recipe node of
    # kernels_runtime.boundary.flatten_outputs (the task spec's recipe["outputs"]). None: a bare tensor `out`, or
    # the tuple (out, out.1, ...) when the kernel returns more.
    outputs: dict[str, Any] | None = None
    provenance: Provenance = Field(default_factory=Provenance)
    # A lossy kernel (TileMix): its routing ({"template", "coverage"}), the workload's accuracy budget it was
    # accepted under and what acceptance measured in-model ({"max_logit_deviation", "token_agreement"}).
    lossy: dict[str, Any] | None = None

    @property
    def template(self) -> str:
        return self.dispatch_template or self.module_class

    @property
    def class_name(self) -> str:
        return self.module_class.rpartition(".")[2]


class PatchBundle(BaseModel):
    format_version: int = FORMAT_VERSION
    name: str = ""
    created: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    library_versions: dict[str, str] = Field(default_factory=dict)
    gpu: str = ""
    # What the patches were verified on, checked by apply (patch.check_environment): the CUDA compute capability
    # ("9.0"; "" on the CPU) and the model config's fingerprint (config_fingerprint). Empty: not recorded (a bundle
    # written before these fields, or by hand), not checked.
    capability: str = ""
    model_fingerprint: str = ""
    patches: list[PatchSpec] = Field(default_factory=list)
    # Replay one-token decode steps from CUDA graphs when applied (kernels_runtime.graphs); acceptance sets it when
    # the patches were measured that way.
    decode_graphs: bool = False
    # With decode_graphs: generate with transformers' static KV cache (a KV-cache model's step is graphable only so).
    static_cache: bool = False
    # The decode batch buckets the bundle verified (kernels_runtime.buckets): applied, `generate` pads a batch to
    # its bucket and decode graphs are captured at those batches only. Empty: batches as they come.
    batch_buckets: list[int] = Field(default_factory=list)

    # Sources by sha256, and the per-kernel problems found on a lenient load (apply reports those patches skipped).
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)
    _kernel_errors: dict[str, str] = PrivateAttr(default_factory=dict)
    _path: Path | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _unique_ids(self) -> PatchBundle:
        ids = [p.patch_id for p in self.patches]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"bundle: expected unique patch ids, got duplicates {dup}")
        return self

    def add_kernel(self, source: str) -> str:
        """Store a kernel source; returns its sha256, the value for PatchSpec.kernel."""
        sha = sha256_text(source)
        self._sources[sha] = source
        return sha

    def add_patch(self, spec: PatchSpec, source: str | None = None) -> PatchSpec:
        if source is not None:
            spec = spec.model_copy(update={"kernel": self.add_kernel(source)})
        self.patches.append(spec)
        self._unique_ids()
        return spec

    def source(self, sha: str) -> str:
        """The verified source of a kernel; BundleError when it is missing or did not verify on load."""
        if sha in self._kernel_errors:
            raise BundleIntegrityError(self._kernel_errors[sha])
        if sha not in self._sources:
            raise BundleIntegrityError(f"kernel {sha[:12]}: expected its source in the bundle, got none")
        return self._sources[sha]

    def kernel_path(self, sha: str) -> Path | None:
        """The verified file holding a kernel's source when the bundle came from disk."""
        return self._path / KERNELS_DIR / f"{sha}.py" if self._path is not None and sha in self._sources else None

    @property
    def path(self) -> Path | None:
        return self._path

    def digest(self) -> str:
        """Identity of the bundle's content (patches and kernel hashes), not of when or where it was written."""
        payload = json.dumps([p.model_dump(mode="json") for p in self.patches], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str) -> PatchBundle:
        return cls.model_validate_json(text)


def library_versions() -> dict[str, str]:
    """Versions of the libraries a kernel's behaviour depends on (those installed; none imported eagerly)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "triton", "transformers", "llm4llm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


# Config keys that name, date or label a checkpoint rather than shape its computation (and, like every "_" key,
# transformers' bookkeeping); the dtype is left to the guards, which check it per call.
_CONFIG_NOISE = ("transformers_version", "architectures", "torch_dtype", "dtype", "use_cache", "id2label",
                 "label2id")


def config_fingerprint(config: Any) -> str:
    """A short hash of a model config (a transformers PretrainedConfig, or anything with `to_dict()`, or a dict):
    equal for two configs that build the same computation, whatever checkpoint name or library version wrote them."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    kept = {k: v for k, v in raw.items() if k not in _CONFIG_NOISE and not k.startswith("_")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save_bundle(bundle: PatchBundle, directory: str | os.PathLike) -> Path:
    """Write manifest.json + kernels/<sha256>.py atomically (temp dir + rename). Returns the directory."""
    for spec in bundle.patches:
        bundle.source(spec.kernel)  # every referenced kernel must be present and verified
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        (tmp / KERNELS_DIR).mkdir()
        for sha in sorted({p.kernel for p in bundle.patches}):
            (tmp / KERNELS_DIR / f"{sha}.py").write_text(bundle.source(sha))
        (tmp / MANIFEST).write_text(bundle.to_json())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    bundle._path = final
    return final


def load_bundle(directory: str | os.PathLike, *, strict: bool = True) -> PatchBundle:
    """Read a bundle and verify every kernel's sha256.

    strict (the default): a missing or tampered kernel raises BundleIntegrityError. strict=False records the problem
    per kernel instead; apply() then skips the patches using it (or raises for patches the user asked for by name).
    A manifest of a newer format always raises BundleFormatError.
    """
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise BundleFormatError(f"bundle {directory}: expected {MANIFEST}, got no such file")
    try:
        raw = json.loads(manifest.read_text())
    except json.JSONDecodeError as e:
        raise BundleFormatError(f"bundle {directory}: expected JSON in {MANIFEST}, got {e}") from e
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if not isinstance(version, int):
        raise BundleFormatError(f"bundle {directory}: expected an integer format_version, got {version!r}")
    if version > FORMAT_VERSION:
        raise BundleFormatError(
            f"bundle {directory}: format_version {version} is newer than this kernels_runtime reads "
            f"(<= {FORMAT_VERSION}); upgrade llm4llm/kernels_runtime to apply it"
        )
    bundle = PatchBundle.model_validate(raw)
    bundle._path = directory
    for sha in sorted({p.kernel for p in bundle.patches}):
        error = _read_kernel(bundle, directory, sha)
        if error and strict:
            raise BundleIntegrityError(f"bundle {directory}: {error}")
        if error:
            bundle._kernel_errors[sha] = error
    return bundle


def _read_kernel(bundle: PatchBundle, directory: Path, sha: str) -> str | None:
    path = directory / KERNELS_DIR / f"{sha}.py"
    if not path.is_file():
        return f"kernel {sha[:12]}: expected source file {KERNELS_DIR}/{sha}.py, got no such file"
    source = path.read_text()
    got = sha256_text(source)
    if got != sha:
        return f"kernel {sha[:12]}: hash mismatch in {KERNELS_DIR}/{sha}.py: expected sha256 {sha}, got {got}"
    bundle._sources[sha] = source
    return None


__all__ = [
    "FORMAT_VERSION", "BundleError", "BundleFormatError", "BundleIntegrityError", "Guard", "PatchBundle",
    "PatchSpec", "Provenance", "config_fingerprint", "library_versions", "load_bundle", "save_bundle", "sha256_text",
]
