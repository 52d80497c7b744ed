"""attention family, prefill, lossy: TileMix (kernels_runtime.ops.tilemix_attention) routes each 128 x 128 tile group
of the causal score matrix to a bf16 or an INT8 score path; the search picks the routing template and the INT8
coverage with the tiles. Applies only to tasks of a workload with `allow_lossy = true` and an accuracy budget;
acceptance holds every rendering to that budget in-model and walks the coverage down until it fits."""
from __future__ import annotations

from llm4llm.search.templates._linear import LINEAR_OP
from llm4llm.search.templates._linear import sm90_capable
from llm4llm.search.templates.attention import (LIN_PREFILL, LIN_PREFILL_DEFAULT, LIN_PREFILL_INACTIVE,
                                                 QK_NORM_ROTARY, ROPE, ROTARY, _applies, _split_only)
from llm4llm.search.templates.base import Template, host_source
from llm4llm.taskspec import TaskSpec

TILEMIX_OP = ("kernels_runtime.ops.tilemix_attention", "tilemix_attention")
NAME = "attention.prefill_tilemix"
# coverage ascending: the library proposer's neighbours are adjacent; acceptance descends from the proposed value
COVERAGES = [0.25, 0.5, 0.75, 0.9, 1.0]
TM = {"tm_template": ["sink_local", "bigbird", "row_random"], "tm_coverage": COVERAGES,
      "attn_BLOCK_M": [64, 128], "attn_BLOCK_N": [64, 128], "attn_num_warps": [4, 8], "attn_num_stages": [2, 3],
      # the fully visible K/V tiles by TMA descriptors (sm_90+; the pointer path elsewhere, the same bits)
      "tm_tma": [True, False]}


def _applies_tilemix(spec: TaskSpec) -> str | None:
    why = _applies(spec) or _split_only(spec, NAME)
    if why:
        return why
    if spec.static.get("sliding_window") or ((spec.recipe or {}).get("state") or {}).get("sliding_window"):
        return f"{NAME}: sliding-window attention is out of scope"
    if spec.dtype not in ("bfloat16", "float16"):
        return f"{NAME}: INT8 tiles beside a 16-bit path, expected a bfloat16/float16 task, got {spec.dtype}"
    return None


def _render(spec: TaskSpec, config: dict) -> str:
    # LOSSY: the routing the candidate declares, read from the source (verify.gates.lossy_of_source) and the module
    lossy = 'LOSSY = {"kind": "tilemix", "template": CONFIG["tm_template"], "coverage": CONFIG["tm_coverage"]}'
    return host_source(NAME, spec, config, "tilemix", "prefill_tilemix", extra=lossy)


def _tiles_default(spec: TaskSpec) -> dict:
    """TMA at 128 x 128 in 3 stages on sm_90+ (and a CPU task): the fastest point measured (1.482x / 1.559x SDPA flash
    at 75 %, 16k / 32k tokens, batch 8); before sm_90 the pointer path's 128 x 64 tiles (three-stage 128 x 128 buffers
    would not fit shared memory there)."""
    tma = sm90_capable(spec)
    return {"tm_tma": tma, "attn_BLOCK_M": 128, "attn_BLOCK_N": 128 if tma else 64, "attn_num_warps": 8,
            "attn_num_stages": 3}


TEMPLATES = [
    Template(name=NAME, family="attention", phases=("prefill",), lossy=True,
             requires=(LINEAR_OP, ROTARY, QK_NORM_ROTARY, TILEMIX_OP),
             space_fn=lambda spec: {**LIN_PREFILL, **ROPE, **TM}, render_fn=_render, applies_fn=_applies_tilemix,
             inactive=LIN_PREFILL_INACTIVE,
             default_fn=lambda spec: {**LIN_PREFILL_DEFAULT, "rope_BLOCK_H": 4, "rope_num_warps": 2,
                                      "tm_template": "sink_local", "tm_coverage": 0.75, **_tiles_default(spec)}),
]
