"""Layer classes for Hugging Face `kernels`: `llm4llm export` copies this file as the `__init__.py` of the package it
writes (kernels_runtime/hub_export.py), next to `layers.json` and the bundle the layers run.

`kernels` takes a layer as a stateless nn.Module class (no constructor, no members beyond nn.Module's) whose
`forward` has the signature of the forward it replaces; `kernelize` binds it to every instance of a class marked
`@use_kernel_forward_from_hub(name)` (or `replace_kernel_forward_from_hub(cls, name)`). Each class built here runs
kernels_runtime's own Dispatch per instance, so a call under `kernelize` takes the same phase choice, guards and
fallback (to the forward of the instance's class) as under `kernels_runtime.apply`; the kernels come from the bundle
shipped beside this file, each verified against its sha256 when it loads. Inference only: `has_backward` is False,
so `kernelize(..., mode=Mode.TRAINING)` keeps the original forward.

Imported where it lies (kernels_runtime/, no layers.json beside it) it defines no layers.
"""
from __future__ import annotations

import inspect
import json
import types
from pathlib import Path
from typing import Any

import torch

LAYERS_FILE = "layers.json"
BUNDLE_DIR = "bundle"
_DISPATCH_ATTR = "_llm4llm_hub_dispatch"  # on each kernelized instance: its Dispatch, built on the first call
_HERE = Path(__file__).resolve().parent
_BUNDLE: list[Any] = []  # the shipped PatchBundle, loaded on the first call of any layer


def _bundle():
    if not _BUNDLE:
        from kernels_runtime.bundle import load_bundle

        _BUNDLE.append(load_bundle(_HERE / BUNDLE_DIR))
    return _BUNDLE[0]


def _signature(params: list[list[str]]) -> inspect.Signature:
    """The replaced forward's signature as layers.json records it ([name, kind] pairs): what kernels compares."""
    return inspect.Signature([inspect.Parameter(name, getattr(inspect.Parameter, kind)) for name, kind in params])


def _dispatch(module: torch.nn.Module, layer: str, patch_ids: list[str]):
    dispatch = module.__dict__.get(_DISPATCH_ATTR)
    if dispatch is None:
        from kernels_runtime.patch import layer_dispatch

        dispatch = layer_dispatch(module, _bundle(), patch_ids, path=f"{type(module).__name__} ({layer})")
        module.__dict__[_DISPATCH_ATTR] = dispatch
        module.__dict__["extra_repr"] = dispatch.extra_repr  # print(model) marks the instance, as apply does
    return dispatch


def layer_class(name: str, entry: dict[str, Any]) -> type[torch.nn.Module]:
    """One kernels layer: `entry` is its layers.json record ({"patches": [...], "forward": [[name, kind], ...]})."""
    patch_ids = list(entry["patches"])

    def forward(self, *args, **kwargs):
        return _dispatch(self, name, patch_ids)(*args, **kwargs)

    forward.__signature__ = _signature(entry["forward"])
    doc = f"llm4llm kernels for {entry.get('module_class', name)}: patches {', '.join(patch_ids)}."
    return type(name, (torch.nn.Module,), {"forward": forward, "has_backward": False, "can_torch_compile": False,
                                           "__doc__": doc, "__module__": __name__})


def _layers() -> types.SimpleNamespace:
    path = _HERE / LAYERS_FILE
    records = json.loads(path.read_text()) if path.is_file() else {}
    return types.SimpleNamespace(**{name: layer_class(name, entry) for name, entry in records.items()})


layers = _layers()
