"""ssm_block family: a state-space model's residual block (HF's MambaBlock / Mamba2Block: residual +
mixer(norm(x.to(norm dtype))), the residual in fp32 with residual_in_fp32) rendered from its mixer's fused decode
template: the block's RMSNorm goes into the mixer's first kernel (`proj_conv`'s `norm_w`), the residual add into
out_proj's store (`linear`'s `residual`): the mixer's four launches and nothing else. The host code is
kernels_runtime.hosts.blocks (the mixer's and the block's entries around a mixer's step) and the mixer's host module
(kernels_runtime.hosts.ssm, .mamba2: the steps over the mixer's own weight and static names); the block's entry calls
the step on the `mixer.` part of its own.
"""
from __future__ import annotations

from typing import Callable

from llm4llm.search.templates.base import host_source
from llm4llm.taskspec import TaskSpec

MIXER = "mixer."

# Declared by a rendered source whose config has `state_inplace`: kernels_runtime.patch reads STATE_IN_PLACE from the
# candidate module. True: the kernels write the new states over the cache's (kernels_runtime then copies nothing and
# never falls back once the entry started); otherwise into fresh tensors, which the runtime copies into the cache.
STATE_IN_PLACE = 'STATE_IN_PLACE = CONFIG["state_inplace"]'


def host_renderer(template: str, module: str, factory: str, block: bool = False) -> Callable[[TaskSpec, dict], str]:
    """render_fn of a mixer or block template: its host factory in kernels_runtime.hosts.<module>, a block's over
    the `mixer.` part of its weights and static values, STATE_IN_PLACE declared where the config chooses it."""
    names = {"prefix": MIXER} if block else {}

    def render(spec: TaskSpec, config: dict) -> str:
        extra = STATE_IN_PLACE if "state_inplace" in config else ""
        return host_source(template, spec, config, module, factory, extra=extra, **names)

    return render


def mixer_view(spec: TaskSpec) -> TaskSpec:
    """The block's task as its mixer's template sees it: the `mixer.` weights and static values without the prefix."""
    return spec.model_copy(update={
        "family": "ssm_mixer",
        "weight_names": [w[len(MIXER):] for w in spec.weight_names if w.startswith(MIXER)],
        "static": {k[len(MIXER):]: v for k, v in spec.static.items() if k.startswith(MIXER)},
    })


def block_applies(name: str, mixer_applies: Callable[[TaskSpec], str | None]) -> Callable[[TaskSpec], str | None]:
    """applies_fn of a block template: the block's own norm and flags, then its mixer's template on mixer_view."""

    def applies(spec: TaskSpec) -> str | None:
        if "norm.weight" not in spec.weight_names:
            return f"{name}: expected the block's norm.weight, got {spec.weight_names}"
        for key, kind in (("norm.variance_epsilon", float), ("residual_in_fp32", bool)):
            if not isinstance(spec.static.get(key), kind):
                return f"{name}: expected static {key} ({kind.__name__}), got {spec.static.get(key)!r}"
        if spec.phase == "decode" and set(spec.state_names) != {"conv_state", "ssm_state"}:
            return f"{name}: expected states conv_state and ssm_state, got {spec.state_names}"
        why = mixer_applies(mixer_view(spec))
        return f"{name}: mixer: {why}" if why else None

    return applies
