"""Attention of architectures beyond Llama/Qwen3 in the built-in attention templates: partial rotary (StableLM
`partial_rotary_factor`, GPT-NeoX `rotary_pct`: cos/sin narrower than the head) in the rotary and static-decode ops,
fused q/k/v projections (Phi-3's `qkv_proj` as [q | k | v] blocks, GPT-NeoX's `query_key_value` per head
[q_h, k_h, v_h], with its bias) as the `qkv_layout` option of attention.prefill_flash / decode_splitkv /
decode_static, chosen by the applicability check (llm4llm/search/applicability.py) by running it on the task's
captured calls, and the sliding window (Mistral, Gemma-2) in prefill and in the sliding cache's state.

Op level: against HF's own `apply_rotary_pos_emb` and float64 references on fresh random inputs. Model level: tiny
seeded transformers models are profiled and extracted; the check must judge the template applicable (pinned to the
layout that matches) and a trial of its pinned default must pass the verifier's gates with a fresh draw."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels_runtime.ops.rotary import qk_norm_rotary, qk_norm_rotary_ref, rotary, rotary_ref
from kernels_runtime.tolerances import assert_close

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "scripts" / "hf_generate.py"


# ---- partial rotary, op level ------------------------------------------------------------------------------------

def _qk_cos_sin(B, Hq, Hkv, S, D, R, dtype):
    q = torch.randn(B, S, Hq, D, dtype=dtype).transpose(1, 2)  # HF's transposed projection views
    k = torch.randn(B, S, Hkv, D, dtype=dtype).transpose(1, 2)
    pos = torch.arange(S, dtype=torch.float32)[None, :, None] + torch.randint(0, 50, (B, 1, 1))
    inv_freq = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float32) / R)
    emb = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)  # [B, S, R]
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(2, 4, 2, 11, 16, 8), (1, 3, 1, 5, 24, 6)])
def test_partial_rotary_matches_hf_and_float64(dtype, shape):
    from transformers.models.stablelm.modeling_stablelm import apply_rotary_pos_emb

    q, k, cos, sin = _qk_cos_sin(*shape, dtype)
    R = shape[-1]
    qo, ko = rotary(q, k, cos, sin, BLOCK_H=2)
    # HF's StableLM slices the rotated part, applies rotary to it and concatenates the rest
    qh, kh = apply_rotary_pos_emb(q[..., :R], k[..., :R], cos, sin)
    assert_close(qo, torch.cat([qh, q[..., R:]], -1), dtype, name="q vs HF")
    assert_close(ko, torch.cat([kh, k[..., R:]], -1), dtype, name="k vs HF")
    q64, k64 = rotary_ref(q.double(), k.double(), cos.double(), sin.double())
    assert_close(qo, q64.to(dtype), dtype, name="q vs float64")
    assert_close(ko, k64.to(dtype), dtype, name="k vs float64")
    assert torch.equal(qo[..., R:], q[..., R:]) and torch.equal(ko[..., R:], k[..., R:])  # passed through bitwise


def test_partial_rotary_with_qk_norm_matches_float64():
    q, k, cos, sin = _qk_cos_sin(2, 4, 2, 7, 24, 10, torch.float32)
    q, k = q * 3, k * 3
    qw, kw = torch.randn(24), torch.randn(24)
    qo, ko = qk_norm_rotary(q, k, cos, sin, qw, kw, 1e-6, BLOCK_H=4)
    qr, kr = qk_norm_rotary_ref(q.double(), k.double(), cos.double(), sin.double(), qw.double(), kw.double(), 1e-6)
    assert_close(qo, qr.float(), torch.float32, name="q")
    assert_close(ko, kr.float(), torch.float32, name="k")


def test_partial_rotary_rejects_bad_widths():
    q, k, cos, sin = _qk_cos_sin(1, 2, 1, 4, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="R even"):
        rotary(q, k, cos[..., :7], sin[..., :7])
    wide = torch.cat([cos, cos, cos], -1)  # 24 > 16
    with pytest.raises(ValueError, match="R even"):
        rotary(q, k, wide, wide)


@pytest.mark.parametrize("norm", [False, True])
def test_static_decode_partial_rotary_matches_float64(norm):
    """attention_decode_static (the static-cache decode kernel) with cos/sin of R = 6 < D = 16 columns: the output vs
    float64, the cache written with the partially rotated k at the position and nothing else changed."""
    from kernels_runtime.ops.attention_decode_static import attention_decode_static, attention_decode_static_ref

    B, Hq, Hkv, S, D, R, pos = 2, 4, 2, 19, 16, 6, 11
    ang = torch.randn(B, 1, R // 2) * 3
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    w = (lambda: torch.rand(D) + 0.5) if norm else (lambda: None)
    c = dict(q=torch.randn(B, Hq, 1, D), k=torch.randn(B, Hkv, 1, D), v=torch.randn(B, Hkv, 1, D),
             k_cache=torch.randn(B, Hkv, S, D), v_cache=torch.randn(B, Hkv, S, D), cos=cos, sin=sin,
             q_norm_weight=w(), k_norm_weight=w())
    wide = {n: t.double() if isinstance(t, torch.Tensor) else t for n, t in c.items()}
    out64, k64, v64, _ = attention_decode_static_ref(**wide, cache_len=torch.tensor(pos), scale=0.3)
    kc, vc, n = c["k_cache"].clone(), c["v_cache"].clone(), torch.tensor(pos)
    out = attention_decode_static(**{**c, "k_cache": kc, "v_cache": vc}, cache_len=n, scale=0.3, BLOCK_N=16)
    assert_close(out, out64.float(), torch.float32, name="out vs float64")
    assert_close(kc, k64.float(), torch.float32, name="k_cache vs float64")
    assert torch.equal(vc, v64.float()) and int(n) == pos + 1
    if not norm:  # the columns past R pass through unrotated
        assert torch.equal(kc[:, :, pos, R:], c["k"][:, :, 0, R:])


# ---- sliding-window prefill, op level -----------------------------------------------------------------------------

@pytest.mark.parametrize("S_q,S_kv,window", [(37, 37, 5), (21, 24, 16), (9, 9, 1), (13, 13, 40)])
def test_prefill_sliding_window_matches_float64(S_q, S_kv, window):
    """Windows narrower than a tile, across tiles (16-row tiles: whole KV tiles below the window are skipped), of
    one key, and wider than the sequence; a prefill that extends a cache (S_kv > S_q); grouped-query heads."""
    from kernels_runtime.ops.attention_prefill import attention_prefill, attention_prefill_ref

    q = torch.randn(2, 4, S_q, 16)
    k, v = torch.randn(2, 2, S_kv, 16), torch.randn(2, 2, S_kv, 16)
    out = attention_prefill(q, k, v, 0.3, sliding_window=window, BLOCK_M=16, BLOCK_N=16)
    ref = attention_prefill_ref(q.double(), k.double(), v.double(), 0.3, sliding_window=window)
    assert_close(out, ref.float(), torch.float32, name="out vs float64")
    if window >= S_kv:  # a window that holds everything is plain causal attention
        assert_close(out, attention_prefill_ref(q, k, v, 0.3), torch.float32, name="out vs causal")


# ---- scope: which layouts a task's weights allow, what the templates leave to others ------------------------------

def _spec(weights: list[str], adapter: str = "DynamicLayer", phase: str = "prefill"):
    from llm4llm.taskspec import TaskSpec

    return TaskSpec.model_validate(dict(
        task_id="t", workload="w", run_id="r", family="attention", module_class="m.Attention", instances=["a"],
        phase=phase, input_names=["hidden_states", "position_embeddings.0", "position_embeddings.1"],
        weight_names=weights, state_names=[], output_names=["out"], dtype="float32", cases=[],
        recipe={"state": {"adapter": adapter}}))


def test_qkv_layouts_follow_the_weights_and_the_check_tries_each():
    from llm4llm.search.templates import TEMPLATES

    by_name = {t.name: t for t in TEMPLATES}
    prefill, decode = by_name["attention.prefill_flash"], by_name["attention.decode_splitkv"]
    llama = _spec(["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"])
    assert prefill.why_not(llama) is None and prefill.space(llama)["qkv_layout"] == ["split"]
    assert prefill.variants(llama) == []  # one layout: the check runs the default only, as before
    for weights in (["qkv_proj.weight", "o_proj.weight"],
                    ["query_key_value.weight", "query_key_value.bias", "dense.weight", "dense.bias"]):
        fused = _spec(weights, phase="decode")
        assert decode.why_not(fused) is None, decode.why_not(fused)
        assert decode.default(fused)["qkv_layout"] == "blocks" and decode.variants(fused) == [{"qkv_layout": "heads"}]
        static = _spec(weights, adapter="StaticLayer", phase="decode")
        assert by_name["attention.decode_static"].why_not(static) is None  # the static cache: the same option
        assert by_name["attention.decode_static"].variants(static) == [{"qkv_layout": "heads"}]
        assert "expected q_proj/k_proj/v_proj/o_proj" in by_name["attention.prefill_tilemix"].applies_fn(fused)
    qk_ln = _spec(["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_layernorm.weight",
                   "k_layernorm.weight"])  # StableLM / Phi with qk_layernorm: LayerNorms the templates do not apply
    assert "does not read: ['q_layernorm.weight', 'k_layernorm.weight']" in prefill.why_not(qk_ln)
    assert "expected q_proj/k_proj/v_proj or a fused" in prefill.why_not(_spec(["c_attn.weight", "c_proj.weight"]))


def test_logit_soft_capping_follows_the_attention_implementation():
    """Gemma-2's attn_logit_softcapping is applied by transformers' eager (and flash/flex) attention, not by its SDPA
    path: the templates without a soft-cap take only the SDPA module, decode_static caps only where the module does."""
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.search.templates.attention import module_softcap

    prefill = {t.name: t for t in TEMPLATES}["attention.prefill_flash"]
    weights = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
    for impl, cap in (("eager", 50.0), ("flash_attention_2", 50.0), ("sdpa", None), ("paged|sdpa", None)):
        spec = _spec(weights)
        spec.static = {"attn_logit_softcapping": 50.0, "attn_implementation": impl}
        assert module_softcap(spec.static) == cap
        assert (prefill.why_not(spec) is None) == (cap is None), prefill.why_not(spec)
    static_t = {t.name: t for t in TEMPLATES}["attention.decode_static"]
    spec = _spec(weights, adapter="StaticLayer", phase="decode")
    from kernels_runtime.hosts.attention_common import softcap

    # the candidate's own rule, as the worker runs it: its host module's
    assert "from kernels_runtime.hosts.attention import decode_static" in static_t.render(spec, static_t.default(spec))
    for impl, cap in (("eager", 50.0), ("sdpa", None), (None, 50.0)):
        assert softcap({"config.attn_logit_softcapping": 50.0, "attn_implementation": impl}) == cap


# ---- tiny models through extraction, the applicability check and one trial ---------------------------------------

# model_type: (config, the qkv_layout the check must pin)
MODELS = {
    # partial rotary (a quarter of the head), q_proj/k_proj/v_proj/o_proj
    "stablelm": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                      intermediate_size=64, partial_rotary_factor=0.25), "split"),
    # fused qkv_proj as [q | k | v] blocks, grouped-query (4 query heads over 2 kv heads)
    "phi3": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64), "blocks"),
    # fused query_key_value per head [q_h, k_h, v_h] with its bias, partial rotary, `dense`
    "gpt_neox": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      rotary_pct=0.5), "heads"),
    # sliding window 4 < the prompt (6): the window mask in prefill, the cache keeping the last 3 positions
    "mistral": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, sliding_window=4), "split"),
    # layer 0 sliding (window 4), layer 1 full attention: two tasks per phase (under SDPA, HF's Gemma-2 attention
    # applies no logit soft-capping: transformers' sdpa_attention_forward ignores `softcap`)
    "gemma2": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    intermediate_size=64, sliding_window=4), "split"),
}
PHASE_TEMPLATE = {"prefill": "attention.prefill_flash", "decode": "attention.decode_splitkv",
                  "decode+static": "attention.decode_static"}
# the prefill of each, the decode of those whose decode path differs (fused layouts, partial rotary, the sliding
# cache), the decode on transformers' static cache (decode graphs) of the fused per-head layout with partial rotary;
# every extra case costs the interpreter seconds
CASES = [(m, "prefill") for m in MODELS] + [(m, "decode") for m in ("stablelm", "gpt_neox", "mistral")] + \
    [("gpt_neox", "decode+static")]


def _attention_tasks(model_type: str, cfg: dict, out: Path, static_cache: bool = False) -> list:
    """The model's attention tasks: a seeded tiny model, profiled and extracted in-process (prompt 6, 2 new
    tokens: one decode step) as the pipeline does through the workload script; static_cache: decode tasks on
    transformers' static KV cache, as runs with decode graphs extract them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llm4llm.extract import extract_tasks
    from llm4llm.profiler import profile_model

    config = AutoConfig.for_model(model_type, vocab_size=128, max_position_embeddings=64, eos_token_id=None,
                                  bos_token_id=None, pad_token_id=0, **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                  min_new_tokens=2, do_sample=False, pad_token_id=0)

    profile = profile_model(model, run, device="cpu")
    specs = extract_tasks(model, run, profile, out, workload_name=f"tiny-{model_type}", families=["attention"],
                          static_cache=static_cache)
    return [(s, out / s.task_id) for s in specs if s.deployable]


def _verify(task_dir: Path, source: str, draws: int):
    # the verifier's gates in this process (the sandboxed worker's start costs ~10 s a candidate under the
    # interpreter); the check passes draws=0 as llm4llm.stages.search.run_template_checks does
    from llm4llm.verify.gates import run_gates

    return run_gates(str(task_dir), source, device="cpu", draws=draws, timing=False)[0]


@pytest.fixture(scope="module")
def attention_tasks(tmp_path_factory):
    """(model_type, static_cache) -> its deployable attention tasks, extracted once on first use."""
    done: dict[tuple, list] = {}

    def get(model_type: str, static_cache: bool = False) -> list:
        if (model_type, static_cache) not in done:
            done[(model_type, static_cache)] = _attention_tasks(
                model_type, MODELS[model_type][0], tmp_path_factory.mktemp(model_type), static_cache)
        return done[(model_type, static_cache)]

    return get


@pytest.mark.parametrize("model_type,phase", CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_attention_template_applies_and_a_trial_passes(attention_tasks, model_type, phase):
    from llm4llm.search.applicability import applicable_templates, check_templates
    from llm4llm.search.templates import TEMPLATES

    name, layout = PHASE_TEMPLATE[phase], MODELS[model_type][1]
    static = phase.endswith("+static")
    found = attention_tasks(model_type, static)
    tasks = [(s, d) for s, d in found if s.phase == phase.removesuffix("+static")]
    assert len(tasks) == (2 if model_type == "gemma2" else 1), [s.task_id for s, _ in found]
    template = next(t for t in TEMPLATES if t.name == name)
    for spec, task_dir in tasks:
        checks = check_templates(task_dir, spec, [template], lambda path, source: _verify(path, source, draws=0))
        assert [(c.applicable, c.stage, c.failure_class) for c in checks] == [(True, "computation", None)], checks
        assert checks[0].pinned == {"qkv_layout": layout}, checks
        (pinned,) = applicable_templates([template], checks)
        v = _verify(task_dir, pinned.render(spec, pinned.default(spec)), draws=1)  # a trial: a fresh draw as well
        assert v.passed, f"{name} on {spec.task_id}: {v.failure_class}: {v.message}"
        assert [g.name for g in v.gates if not g.passed] == [] and v.max_abs_err is not None and v.max_abs_err < 1e-4


def test_prefill_flash_takes_the_tma_kernel_for_a_prompt_without_a_past(monkeypatch):
    """attention.prefill_flash's default attends a 16-bit prompt without a past or a window with
    attention_prefill_tma (TileMix's kernel with no INT8 tile, K/V by TMA on sm_90+): bit for bit attention_prefill
    at the same tiles under the interpreter, and exact, so acceptance does not take it for a lossy candidate; a
    past, a window, fp32 or flash_kernel = "pointer" go to attention_prefill."""
    import kernels_runtime.ops.attention_prefill as attention_prefill_ops
    from kernels_runtime.hosts.attention import flash_attend
    from kernels_runtime.ops.attention_prefill import attention_prefill
    from llm4llm.accept import Proposal, lossy_of
    from llm4llm.search.templates import TEMPLATES

    prefill = {t.name: t for t in TEMPLATES}["attention.prefill_flash"]
    spec = _spec(["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"])
    assert prefill.default(spec)["flash_kernel"] == "tma" and prefill.space(spec)["flash_kernel"] == ["tma", "pointer"]
    # a task profiled before sm_90: no TMA, and tiles whose buffers fit its shared memory (both templates)
    older = spec.model_copy(update={"hardware": {"capability": "8.0"}})
    assert {k: v for k, v in prefill.default(older).items() if k.startswith(("attn_", "flash"))} == {
        "flash_kernel": "pointer", "attn_BLOCK_M": 64, "attn_BLOCK_N": 64, "attn_num_warps": 4, "attn_num_stages": 2}
    tilemix = {t.name: t for t in TEMPLATES}["attention.prefill_tilemix"]
    assert tilemix.default_fn(older)["tm_tma"] is False and tilemix.default_fn(older)["attn_BLOCK_N"] == 64
    assert tilemix.default_fn(spec)["tm_tma"] is True
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 40, 32, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
    tiles = {"attn_BLOCK_M": 64, "attn_BLOCK_N": 32, "attn_num_warps": 4, "attn_num_stages": 2}
    for kernel in ("tma", "pointer"):
        config = {**prefill.default(spec), **tiles, "flash_kernel": kernel}
        source = prefill.render(spec, config)
        assert lossy_of(Proposal("", "c", source, 1.0, config, prefill.name)) is None
        ns: dict = {}
        exec(source, ns)
        calls = []
        real = attention_prefill_ops.attention_prefill_tma  # the host's factory imports it when the config says tma
        monkeypatch.setattr(attention_prefill_ops, "attention_prefill_tma",
                            lambda *a, **kw: calls.append(kw) or real(*a, **kw))
        attend = flash_attend(ns["CONFIG"])  # the rendered entry's attention, built as its factory builds it
        plain = attention_prefill(q, k, v, 0.17, BLOCK_M=64, BLOCK_N=32)
        assert torch.equal(attend(q, k, v, 0.17, None), plain)
        assert len(calls) == (kernel == "tma")
        calls.clear()
        attend(q, k, v, 0.17, 8)  # a window
        attend(q.float(), k.float(), v.float(), 0.17, None)  # fp32
        kp, vp = (torch.cat([torch.randn(1, 2, 3, 32).to(torch.bfloat16), t], 2) for t in (k, v))
        attend(q, kp, vp, 0.17, None)  # a prompt after 3 cached positions
        assert calls == []
        monkeypatch.undo()
    from kernels_runtime.ops.attention_prefill import attention_prefill_tma

    with pytest.raises(ValueError, match="without a past"):
        attention_prefill_tma(q, kp, vp)
