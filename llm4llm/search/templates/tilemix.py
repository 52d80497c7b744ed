"""attention family, prefill, lossy: TileMix (kernels_runtime.ops.tilemix_attention) routes each 128 x 128 tile group
of the causal score matrix to a bf16 or an INT8 score path; the search picks the routing template and the INT8
coverage with the tiles. Applies only to tasks of a workload with `allow_lossy = true` and an accuracy budget;
acceptance holds every rendering to that budget in-model and walks the coverage down until it fits."""
from __future__ import annotations

from llm4llm.search.templates._linear import LINEAR_OP
from llm4llm.search.templates._linear import sm90_capable
from llm4llm.search.templates.attention import (LIN_PREFILL, LIN_PREFILL_DEFAULT, LIN_PREFILL_INACTIVE, PRELUDE,
                                                 QK_NORM_ROTARY, ROPE, ROTARY, _applies, _imports, _split_only)
from llm4llm.search.templates.base import Template, header
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
    imports = _imports(["from kernels_runtime.ops.attention_prefill import attention_prefill",
                        "from kernels_runtime.ops.tilemix_attention import tilemix_attention",
                        "from kernels_runtime.ops.tilemix_masks import build_tile_mask"])
    return header(NAME, spec, imports, config) + PRELUDE + '''
LOSSY = {"kind": "tilemix", "template": CONFIG["tm_template"], "coverage": CONFIG["tm_coverage"]}
_MASKS = {}  # the routing of a prompt length: static, built once


def _mask(S, device):
    if (S, str(device)) not in _MASKS:
        _MASKS[(S, str(device))] = build_tile_mask(CONFIG["tm_template"], CONFIG["tm_coverage"], S, device=device)
    return _MASKS[(S, str(device))]


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]  # [B, S, H]
    B, S, _ = x.shape
    D = int(_static(static, "head_dim"))
    scale = float(_static(static, "scaling"))
    q, k, v = (_proj(x, weights, n, B, S, D) for n in ("q_proj", "k_proj", "v_proj"))
    q, k = _rope(q, k, inputs, weights, static)
    if state.get("key_cache") is None:  # a prompt without a past: the kernel takes k, v through their strides
        k_all, v_all, sp = k, v, 0  # and the cache keeps them as they are (no copy into a fresh buffer)
    else:
        k_all, sp = _with_past(state.get("key_cache"), k)  # [B, Hkv, S_past + S, D]
        v_all, _ = _with_past(state.get("value_cache"), v)
    if sp == 0:  # self-attention over the prompt: routed per tile group; TileMix routes an unpadded prompt's tiles,
        # so a padded batch (HF's mask given) takes the exact kernel, each row's pad keys excluded
        kv_mask = _pad_keys(inputs, B, S)  # [B, S] or None
        if kv_mask is None:
            o = tilemix_attention(q, k_all, v_all, _mask(S, q.device), scale, TMA=CONFIG.get("tm_tma", False),
                                  **ATTN)  # [B, Hq, S, D]
        else:
            o = attention_prefill(q, k_all, v_all, scale, kv_mask=kv_mask, **ATTN)
    else:  # a prefill that extends a cache: TileMix routes one prompt's own score matrix, so the plain kernel
        o = attention_prefill(q, k_all, v_all, scale, kv_mask=_pad_keys(inputs, B, k_all.shape[2]), **ATTN)
    out = linear(o.transpose(1, 2).reshape(B, S, -1), weights["o_proj.weight"], weights.get("o_proj.bias"), **LIN)
    return {"out": out, "state_out.key_cache": k_all, "state_out.value_cache": v_all}
'''


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
