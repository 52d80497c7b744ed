"""Module families: what kind of computation a module instance is, from its class name and structure.

Families are the unit the rest of the system reasons about (boundaries, templates, tolerances of a task). The rules
are generic patterns over class names and module types, ordered from the most specific to the least; none of them
names one architecture only.
"""
from __future__ import annotations

import re

from torch import nn

FAMILIES = (
    "model", "decoder_layer", "ssm_block", "attention", "mlp", "ssm_mixer", "recurrent_block", "norm", "rotary", "conv",
    "embedding", "lm_head", "linear", "activation", "other",
)

# (family, pattern over the lower-cased class name), first match wins.
_NAME_RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("recurrent_block", re.compile(r"recurrentblock$|rglru$|rg_lru|recurrentlayer$")),
    ("ssm_mixer", re.compile(r"mixer$")),
    ("rotary", re.compile(r"rotary|rope")),
    ("norm", re.compile(r"norm")),
    ("attention", re.compile(r"attention|attn$")),
    ("mlp", re.compile(r"mlp$|feedforward$|ffn$|\bff$|sparsemoeblock$|moe$")),
    ("decoder_layer", re.compile(r"decoderlayer$|encoderlayer$|block$|layer$")),
    ("activation", re.compile(r"activation$|gelu|silu|swish|relu|tanh$|sigmoid$|softplus$")),
    ("embedding", re.compile(r"embedding")),
)

_NORM_TYPES = tuple(t for t in (nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", None)) if t is not None)


def family_of(module: nn.Module, *, name: str = "", root: nn.Module | None = None) -> str:
    """The family of `module`; `name` (its path under `root`) and `root` (the top-level model) refine `lm_head`
    (the output projection over the vocabulary) and `model` (the top level)."""
    cls = type(module)
    if root is not None and module is root:
        return "model"
    if any(base.__name__.endswith("PreTrainedModel") for base in cls.__mro__):
        return "model"  # the top-level model and its backbone (LlamaModel, MambaModel, ...)
    if isinstance(module, nn.Linear) and _is_output_projection(module, name, root):
        return "lm_head"
    if isinstance(module, _NORM_TYPES):
        return "norm"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear):
        return "linear"
    if cls.__module__.startswith("torch.nn.modules.activation"):
        return "activation"
    lowered = cls.__name__.lower()
    for family, pattern in _NAME_RULES:
        if pattern.search(lowered):
            if family == "decoder_layer" and not _has_children(module):
                continue  # a leaf named "...Layer" is not a decoder layer
            return _ssm_block_or(module, family)
    if _is_gradient_checkpointing_layer(cls):
        return _ssm_block_or(module, "decoder_layer")
    return "other"


def family_of_class_name(class_name: str) -> str:
    """The family the name rules give a class name alone (no instance at hand: a bundle's `module_class`). Coarser
    than family_of: a leaf class named "...Layer" reads as a decoder layer, and torch.nn types other than norms fall
    to "other"."""
    lowered = class_name.rpartition(".")[2].lower()
    for family, pattern in _NAME_RULES:
        if pattern.search(lowered):
            return family
    return "other"


def _ssm_block_or(module: nn.Module, family: str) -> str:
    """`ssm_block`: a decoder layer whose own children are one state-space mixer and its norm (Mamba's and
    Mamba2's residual blocks: norm -> mixer -> residual add). Unlike other decoder layers it is a kernel target:
    small enough to capture whole, and fusing the norm, the casts and the residual add into the mixer's kernels
    removes launches from every decode step."""
    if family != "decoder_layer":
        return family
    kids = [family_of(c) for c in module.children()]
    return "ssm_block" if kids.count("ssm_mixer") == 1 and kids.count("norm") == 1 and len(kids) == 2 else family


def _is_output_projection(module: nn.Linear, name: str, root: nn.Module | None) -> bool:
    if root is not None:
        get_output = getattr(root, "get_output_embeddings", None)
        if callable(get_output):
            try:
                if get_output() is module:
                    return True
            except (NotImplementedError, AttributeError):
                pass
        vocab = _vocab_size(root)
        if vocab is not None and module.out_features == vocab and name.count(".") == 0:
            return True
    return name.rsplit(".", 1)[-1] in ("lm_head", "output", "embed_out")


def _vocab_size(root: nn.Module) -> int | None:
    config = getattr(root, "config", None)
    if config is None:
        return None
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    return getattr(text, "vocab_size", None)


def _has_children(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _is_gradient_checkpointing_layer(cls: type) -> bool:
    return any(base.__name__ == "GradientCheckpointingLayer" for base in cls.__mro__)


def is_container(family: str) -> bool:
    """Families that compose others (their time is their children's; an ssm_block is a kernel target all the same:
    fusing its children is the point)."""
    return family in ("model", "decoder_layer", "ssm_block")

