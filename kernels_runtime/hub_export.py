"""Export a patch bundle as a Hugging Face `kernels` package (`llm4llm export BUNDLE OUT_DIR`).

The package is what `kernels` loads from a local directory (`LocalLayerRepository(repo_path=OUT_DIR,
layer_name=...)`, `get_local_kernel(OUT_DIR)`, or `LOCAL_KERNELS=repo_id=OUT_DIR`) and what a Hub kernel repo holds:

    OUT_DIR/build.toml                                  kernel-builder's config (edition 6, a torch-noarch kernel)
    OUT_DIR/README.md                                   the layers, how to map them, the patches left out and why
    OUT_DIR/build/torch-universal/metadata.json         name, id, version, backend (CUDA, with the verified
                                                        capability as its arch), digest of every file
    OUT_DIR/build/torch-universal/<name>/__init__.py    kernels_runtime/hub_layers.py, copied: the `layers` classes
    OUT_DIR/build/torch-universal/<name>/layers.json    layer name -> patches, module class, forward signature
    OUT_DIR/build/torch-universal/<name>/bundle/        the exported patches as a bundle (save_bundle)

`torch-universal` is the build variant of a pure-Python kernel: Triton compiles at run time, so one variant serves
every torch version and backend. Only patches that map onto kernelize's seam are exported: a stateless layer
(norm, MLP, activation) patched on every instance of its class. Attention, decoder layers and SSM blocks read and
write the KV/SSM cache, and decode graphs replay whole steps: those stay on `kernels_runtime.apply`, and the result
says so per patch. The layers import kernels_runtime (the kernels of a real bundle import kernels_runtime.ops), so
the serving environment needs llm4llm installed; `kernels` itself only declares the Python dependencies it knows.
"""
from __future__ import annotations

import enum
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kernels_runtime import hub_layers
from kernels_runtime.bundle import PatchBundle, PatchSpec, load_bundle, save_bundle
from kernels_runtime.families import family_of_class_name

VARIANT = "torch-universal"
LAYER_FAMILIES = ("norm", "mlp", "activation")  # stateless module layers: what kernelize replaces
_NAME = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")  # kernels' KernelName


class ExportError(ValueError):
    """A bundle or output directory that cannot be exported: one line, what was expected and what was got."""


class Outcome(enum.Enum):
    EXPORTED = "exported"
    NOT_A_LAYER = "not a layer seam"  # stateful or whole-block boundaries
    SOME_INSTANCES = "some instances"  # kernelize maps a class, not chosen instances
    NO_CLASS = "class not importable"
    PHASE_TAKEN = "phase taken"


@dataclass(frozen=True)
class PatchExport:
    patch_id: str
    outcome: Outcome
    layer: str = ""  # the kernels layer name, when exported
    reason: str = ""  # why it stays on kernels_runtime.apply


@dataclass(frozen=True)
class HubExport:
    path: Path
    name: str  # the kernel name (metadata's `name`; the package imports as name with "_" for "-")
    patches: list[PatchExport] = field(default_factory=list)

    @property
    def layers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for p in self.patches:
            if p.outcome is Outcome.EXPORTED:
                out.setdefault(p.layer, []).append(p.patch_id)
        return out


def kernel_name(bundle: PatchBundle, name: str | None) -> str:
    """A valid kernels name: `name` as given (checked), else llm4llm-<bundle name, lower-cased, dashed>."""
    if name is not None:
        if not _NAME.match(name):
            raise ExportError(f"export: expected a kernel name of lowercase letters, digits and dashes (e.g. "
                              f"my-kernels), got {name!r}")
        return name
    stem = re.sub(r"[^a-z0-9]+", "-", (bundle.name or bundle.digest()).lower()).strip("-")
    return f"llm4llm-{stem}" if stem else "llm4llm-bundle"


def _forward_params(cls: type) -> list[list[str]]:
    return [[p.name, p.kind.name] for p in inspect.signature(cls.forward).parameters.values()]


def _module_class(spec: PatchSpec) -> type | str:
    """The patch's module class, or why it cannot be imported here (its forward signature is what kernels checks)."""
    module_name, _, cls_name = spec.module_class.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError, ValueError) as e:
        return f"cannot import {spec.module_class} to read its forward signature ({type(e).__name__}: {e})"


def _decide(spec: PatchSpec, taken: dict[tuple[str, str], str]) -> tuple[PatchExport, type | None]:
    family = family_of_class_name(spec.class_name)
    if family not in LAYER_FAMILIES or spec.guard.state_adapter is not None:
        what = f"{family} boundary" + (f" with {spec.guard.state_adapter} state" if spec.guard.state_adapter else "")
        return PatchExport(spec.patch_id, Outcome.NOT_A_LAYER, reason=f"{what}: kernelize replaces stateless layers "
                           f"({', '.join(LAYER_FAMILIES)}); stays on kernels_runtime.apply"), None
    if spec.instances != ["*"]:
        return PatchExport(spec.patch_id, Outcome.SOME_INSTANCES, reason=f"targets instances {spec.instances}: "
                           "kernelize maps every instance of a class; stays on kernels_runtime.apply"), None
    cls = _module_class(spec)
    if isinstance(cls, str):
        return PatchExport(spec.patch_id, Outcome.NO_CLASS, reason=cls), None
    layer = getattr(cls, "kernel_layer_name", None) or cls.__name__
    other = taken.get((layer, spec.phase))
    if other is not None:
        return PatchExport(spec.patch_id, Outcome.PHASE_TAKEN, layer, f"layer {layer} already runs patch {other} "
                           f"in phase {spec.phase}; stays on kernels_runtime.apply"), None
    taken[(layer, spec.phase)] = spec.patch_id
    return PatchExport(spec.patch_id, Outcome.EXPORTED, layer), cls


def _layers_json(bundle: PatchBundle, decisions: list[tuple[PatchExport, type | None]]) -> dict:
    specs = {p.patch_id: p for p in bundle.patches}
    records: dict[str, dict] = {}
    for d, cls in decisions:
        if d.outcome is not Outcome.EXPORTED:
            continue
        rec = records.setdefault(d.layer, {"module_class": specs[d.patch_id].module_class,
                                           "forward": _forward_params(cls), "patches": []})
        rec["patches"].append(d.patch_id)
    return records


def _metadata(name: str, sub: PatchBundle, variant: Path) -> dict:
    from kernels._rust import Digest, DigestAlgorithm

    archs = [sub.capability] if sub.capability else []
    backend = {"type": "cuda", **({"archs": archs} if archs else {})}
    digest = Digest.hash_variant(DigestAlgorithm.SHA256, variant)
    # kernels keeps one module per id in a process and refuses another build under a loaded id: the id names the
    # files (the layers and their names too), not only the bundle's patches
    build = hashlib.sha256(json.dumps(digest.files, sort_keys=True).encode()).hexdigest()[:16]
    return {"name": name, "id": f"{name.replace('-', '_')}_{build}", "version": 1, "license": "Apache-2.0",
            "python-depends": [], "backend": backend, "digest": {"algorithm": "sha256", "files": digest.files}}


def _build_toml(name: str) -> str:
    return (f'[general]\nname = "{name}"\nedition = 6\nversion = 1\nlicense = "Apache-2.0"\nbackends = ["cuda"]\n'
            "\n[torch-noarch]\n")


def _readme(result: HubExport, records: dict, bundle: PatchBundle) -> str:
    lines = [f"# {result.name}", "", f"Kernels exported by llm4llm from bundle `{bundle.name}` "
             f"(verified on {bundle.gpu or 'an unrecorded device'}"
             + (f", capability {bundle.capability}" if bundle.capability else "") + ").", "",
             "Load through Hugging Face `kernels` (the serving environment needs llm4llm's `kernels_runtime`); a "
             "class that does not carry its layer name yet (transformers marks its layers only for kernels < 0.17) "
             "is marked with `replace_kernel_forward_from_hub`:", "",
             "```python", "import importlib", "from pathlib import Path", "from kernels import LocalLayerRepository, "
             "Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping", ""]
    for layer, rec in records.items():
        module, _, cls = rec["module_class"].rpartition(".")
        lines.append(f'replace_kernel_forward_from_hub(getattr(importlib.import_module("{module}"), "{cls}"), '
                     f'"{layer}")')
    lines += ["", "mapping = {"]
    for layer in records:
        lines.append(f'    "{layer}": {{"cuda": LocalLayerRepository(Path("{result.path}"), layer_name="{layer}")}},')
    lines += ["}", "with use_kernel_mapping(mapping):", "    model = kernelize(model, mode=Mode.INFERENCE)", "```", "",
              "| layer | module class | patches |", "|---|---|---|"]
    lines += [f"| {k} | `{v['module_class']}` | {', '.join(v['patches'])} |" for k, v in records.items()]
    left = [p for p in result.patches if p.outcome is not Outcome.EXPORTED]
    if left or bundle.decode_graphs:
        lines += ["", "Not exported (apply the bundle with `kernels_runtime.apply` for these):", ""]
        lines += [f"- `{p.patch_id}`: {p.reason}" for p in left]
        if bundle.decode_graphs:
            lines.append("- decode CUDA graphs: replayed whole steps are not a layer; kernels_runtime.apply only")
    return "\n".join(lines) + "\n"


def _target(out_dir: Path) -> Path:
    earlier = (out_dir / "build.toml").exists()
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not earlier)):
        raise ExportError(f"export: expected a new or empty directory (or an earlier export) at {out_dir}, got one "
                          "holding other files")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"export: cannot create {out_dir.parent}: {e.strerror or e}") from None
    return out_dir


def export_bundle(bundle: PatchBundle | str | os.PathLike, out_dir: str | os.PathLike, *,
                  name: str | None = None) -> HubExport:
    """Write `bundle` as a kernels package at `out_dir` (replacing an earlier export there, atomically); returns what
    was exported per patch. ExportError when nothing maps onto a kernels layer or the directory cannot be written."""
    if not isinstance(bundle, PatchBundle):
        bundle = load_bundle(bundle)
    name = kernel_name(bundle, name)
    final = _target(Path(out_dir))
    taken: dict[tuple[str, str], str] = {}
    decisions = [_decide(spec, taken) for spec in bundle.patches]
    if not any(d.outcome is Outcome.EXPORTED for d, _ in decisions):
        why = "; ".join(f"{d.patch_id}: {d.reason}" for d, _ in decisions[:3]) or "the bundle has no patches"
        raise ExportError(f"export: expected a patch on a kernels layer seam (norm, MLP, activation), got none ({why})")
    records = _layers_json(bundle, decisions)
    exported = [p for p in bundle.patches if any(p.patch_id in r["patches"] for r in records.values())]
    sub = bundle.model_copy(update={"patches": exported, "decode_graphs": False, "static_cache": False})
    sub._sources = {p.kernel: bundle.source(p.kernel) for p in exported}
    result = HubExport(final.resolve(), name, [d for d, _ in decisions])
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        variant = tmp / "build" / VARIANT
        package = variant / name.replace("-", "_")
        save_bundle(sub, package / hub_layers.BUNDLE_DIR)
        shutil.copyfile(hub_layers.__file__, package / "__init__.py")
        (package / hub_layers.LAYERS_FILE).write_text(json.dumps(records, indent=2) + "\n")
        (variant / "metadata.json").write_text(json.dumps(_metadata(name, sub, variant), indent=2) + "\n")
        (tmp / "build.toml").write_text(_build_toml(name))
        (tmp / "README.md").write_text(_readme(result, records, bundle))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
