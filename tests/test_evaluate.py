"""Interleaved end-to-end evaluation: weight-sharing variant copies, rotated rounds, ratios paired round by round."""
import time
from pathlib import Path

import pytest
import torch

from llm4llm import evaluate as ev

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_clone_sharing_weights_shares_tensors_and_not_modules():
    model = _tiny_llama()
    twin = ev.clone_sharing_weights(model)
    for (n, p), (n2, p2) in zip(model.named_parameters(), twin.named_parameters()):
        assert n == n2 and p is p2
    assert all(a is b for a, b in zip(model.buffers(), twin.buffers()))
    assert twin.model.layers[0] is not model.model.layers[0]
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        ref = model(ids).logits
        twin.model.norm.forward = lambda x: torch.zeros_like(x)  # a "patch" on the copy only
        assert torch.equal(model(ids).logits, ref)
        assert not torch.equal(twin(ids).logits, ref)


def test_quantiles_and_paired_ratios():
    assert ev.quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert ev.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.2) == pytest.approx(1.8)
    med, p20, p80 = ev.paired_ratios([10.0, 20.0, 40.0], [5.0, 10.0, 20.0])
    assert (med, p20, p80) == (2.0, 2.0, 2.0)  # the same ratio in every round, however much both drifted
    assert ev.paired_ratios([1.0], [0.0]) is None


PREAMBLE = '''
import time
import torch

CALLS = []
CLOCK = [0]


def build(workload):
    return torch.nn.Linear(4, 4)


def inputs(workload):
    return torch.zeros(1, 4)
'''


def _workload(tmp_path, script: str) -> str:
    """A tiny-llama workload whose script is `script` (written beside it); its path."""
    (tmp_path / "s.py").write_text(script)
    toml = (EXAMPLES / "workloads" / "tiny-llama.toml").read_text().replace('"../scripts/hf_generate.py"', '"s.py"')
    (tmp_path / "wl.toml").write_text(toml)
    return str(tmp_path / "wl.toml")


SCRIPT = PREAMBLE + '''

def run(model, workload, inputs):
    CLOCK[0] += 1
    CALLS.append((getattr(model, "tag", "?"), workload.decode_len))
    drift = 1.0 + 0.1 * CLOCK[0]  # the host gets slower call by call
    time.sleep(0.004 * getattr(model, "cost", 1.0) * drift * (1 if workload.decode_len == 1 else 3))
'''


def test_rounds_rotate_the_order_and_pair_the_ratio_against_drift(tmp_path, monkeypatch):
    """Three variants, one twice as fast as eager, on a host that slows down with every call: round after round the
    first variant changes, and the ratio taken per round stays at 2 while eager's own runs drift far apart."""
    wl_path = _workload(tmp_path, SCRIPT)

    def setup(variant, model, clean, wl, script, bundle):
        m = clean() if variant != "eager" else model
        m.tag, m.cost = variant, {"eager": 2.0, "patched": 1.0, "liger": 2.0}[variant]
        setup.script = script
        return ev._Slot(variant, m)

    monkeypatch.setattr(ev, "_setup", setup)
    rows = ev.evaluate_workload(wl_path, variants=("eager", "patched", "liger"), repeats=5,
                                results_path=str(tmp_path / "rows.jsonl"))
    calls = setup.script.CALLS
    full = [tag for tag, n in calls if n == 4]
    # round 0: each variant warmed up (two full runs) then timed once, in the given order; rounds 1-4 rotate
    assert full[:9] == ["eager"] * 3 + ["patched"] * 3 + ["liger"] * 3
    rounds = [full[9 + 3 * r: 12 + 3 * r] for r in range(4)]
    assert [r[0] for r in rounds] == ["patched", "liger", "eager", "patched"]
    assert all(sorted(r) == ["eager", "liger", "patched"] for r in rounds)
    eager, patched, liger = rows
    assert len(eager.total_samples_ms) == len(patched.total_samples_ms) == 5 and len(patched.prefill_samples_ms) == 5
    assert max(eager.total_samples_ms) / min(eager.total_samples_ms) > 1.3  # the drift is there
    assert 1.7 < patched.vs_eager_p20 <= patched.vs_eager <= patched.vs_eager_p80 < 2.4
    assert 0.8 < liger.vs_eager < 1.25 and eager.vs_eager is None
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 5  # every variant's row again after each round: a stopped run keeps its rounds


CPU_SCRIPT = PREAMBLE + '''

def run(model, workload, inputs):
    CLOCK[0] += 1
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.004 * model.cost:  # the variant's own host work: CPU time
        pass
    time.sleep(0.02 * (CLOCK[0] % 5))  # the host taking the thread away for a while: wall time only
'''


@pytest.mark.serial  # wall-clock spread: another worker's load evens it out
def test_cpu_ratio_sees_the_variants_own_host_cost_through_the_hosts_contention(tmp_path, monkeypatch):
    """A variant that does twice eager's host work, on a host that deschedules the thread for 0-80 ms a run: the
    wall-clock ratio spreads with the contention, the ratio on the main thread's CPU time stays near 2."""
    wl_path = _workload(tmp_path, CPU_SCRIPT)

    def setup(variant, model, clean, wl, script, bundle):
        m = clean() if variant != "eager" else model
        m.cost = {"eager": 2.0, "patched": 1.0}[variant]
        return ev._Slot(variant, m)

    monkeypatch.setattr(ev, "_setup", setup)
    eager, patched = ev.evaluate_workload(wl_path, variants=("eager", "patched"), repeats=6)
    assert len(patched.cpu_samples_ms) == len(patched.total_samples_ms) == 6
    assert patched.vs_eager_p80 - patched.vs_eager_p20 > 0.5  # the wall ratio carries the contention
    assert 1.6 < patched.vs_eager_cpu_p20 <= patched.vs_eager_cpu <= patched.vs_eager_cpu_p80 < 2.5
    row = patched.to_row()
    assert row["cpu_samples_ms"] == patched.cpu_samples_ms and eager.vs_eager_cpu is None
    assert ev.table_rows([row])[0]["vs_eager_cpu"].startswith(f"{patched.vs_eager_cpu:.2f}x (")


def test_a_time_budget_ends_the_rounds_early_and_the_last_one_still_records_the_step(tmp_path, monkeypatch):
    """max_s: a slow host gets fewer rounds, not a run killed before the floor and the step time; the round that
    records the decode steps is the last one run, and every variant has one timed run per round."""
    wl_path = _workload(tmp_path, SCRIPT)

    def setup(variant, model, clean, wl, script, bundle):
        m = clean() if variant != "eager" else model
        m.tag, m.cost = variant, {"eager": 2.0, "patched": 1.0}[variant]
        return ev._Slot(variant, m)

    recorded = []
    monkeypatch.setattr(ev, "_setup", setup)
    monkeypatch.setattr(ev, "_record_steps", lambda order: recorded.append([len(s.totals) for s in order]))
    t0 = time.perf_counter()
    eager, patched = ev.evaluate_workload(wl_path, variants=("eager", "patched"), repeats=400, max_s=0.5)
    took = time.perf_counter() - t0
    n = len(eager.total_samples_ms)
    assert 2 < n < 400 and len(patched.total_samples_ms) == n and eager.repeats == n
    assert recorded == [[n - 1, n - 1]]  # asked for just before the last round, once
    assert patched.vs_eager is not None and took < 30
    one, _ = ev.evaluate_workload(wl_path, variants=("eager", "patched"), repeats=3)
    assert len(one.total_samples_ms) == 3 and recorded[-1] == [2, 2]  # without a budget: every round, the last records


def test_table_rows_show_ratios_with_their_spread():
    row = ev.E2EResult(variant="patched", prefill_ms=1.0, decode_ms_per_token=2.0, total_ms=10.0, tokens_per_s=5.0,
                       vs_eager=1.5, vs_eager_p20=1.4, vs_eager_p80=1.6, total_samples_ms=[9.0, 11.0]).to_row()
    shown = ev.table_rows([row])[0]
    assert shown["vs_eager"] == "1.50x (1.40-1.60)" and shown["vs_compile"] == "" and shown["total_range_ms"] == "9.0-11.0"


def test_liger_swaps_its_module_globals_only_around_its_own_runs():
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    model = _tiny_llama()
    rope, mlp_forward = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaMLP.forward
    slot = ev._liger_slot(ev.clone_sharing_weights(model), None)
    try:
        assert modeling_llama.apply_rotary_pos_emb is rope and modeling_llama.LlamaMLP.forward is mlp_forward
        slot.enter()
        assert modeling_llama.apply_rotary_pos_emb is not rope
        slot.exit()
        assert modeling_llama.apply_rotary_pos_emb is rope
        assert type(slot.model.model.norm).forward is not type(model.model.norm).forward or \
            slot.model.model.norm.forward.__func__ is not type(model.model.norm).forward
        assert "forward" not in vars(model.model.norm)  # the original model is untouched
        assert "apply_rotary_pos_emb" in slot.notes()
    finally:
        slot.exit()


def test_unknown_variant_and_bad_rounds_fail_before_building():
    with pytest.raises(ValueError, match="variant"):
        ev.evaluate_workload(str(EXAMPLES / "workloads" / "tiny-llama.toml"), variants=("eager", "bogus"))
    with pytest.raises(ValueError, match="round"):
        ev.evaluate_workload(str(EXAMPLES / "workloads" / "tiny-llama.toml"), repeats=0)
