"""PDL per call by rows (kernels_runtime.hosts.decode_layer.pdl_by_rows): a decoder layer's kernels launch with PDL at
one row, where it gains, and without it at 8 and 32 rows, where the stacked-layer bench measured it costing 4-8 %.
The interpreter has no PDL, so what is checked here is which entry a call takes; the GPU bench measures the rest."""
import torch

from kernels_runtime.hosts import decode_layer
from llm4llm.search.templates.decode_fused import pdl_rows_space


def _factory(made):
    def factory(config):
        made.append(config["pdl"])
        return lambda inputs, weights, state, static: config["pdl"]
    return decode_layer.pdl_by_rows(factory)


def _call(entry, rows):
    return entry({"hidden_states": torch.zeros(rows, 1, 4)}, {}, {}, {})


def test_pdl_runs_at_one_row_and_not_past_the_limit():
    made = []
    entry = _factory(made)({"pdl": True})
    assert made == [True, False]  # both entries made once, at the factory
    assert _call(entry, 1) is True and _call(entry, 8) is False and _call(entry, 32) is False
    wide = _factory(made)({"pdl": True, "pdl_max_m": 8})
    assert _call(wide, 8) is True and _call(wide, 16) is False


def test_a_config_without_pdl_is_one_entry():
    made = []
    entry = _factory(made)({"pdl": False})
    assert made == [False] and _call(entry, 1) is False and _call(entry, 32) is False


def test_the_layer_factories_take_pdl_by_rows_and_keep_their_names():
    for f in (decode_layer.decode_static_layer, decode_layer.decode_static_gemma2_layer):
        assert f.__name__ in ("decode_static_layer", "decode_static_gemma2_layer")
        assert f.__code__ is decode_layer.pdl_by_rows(lambda c: None).__code__  # the wrapper's


def test_the_search_may_move_the_limit_on_batched_sm90_tasks_only(monkeypatch):
    from llm4llm.search.templates import decode_fused

    monkeypatch.setattr(decode_fused, "sm90_capable", lambda spec: True)
    monkeypatch.setattr(decode_fused, "task_rows", lambda spec: 32)
    assert pdl_rows_space(None) == {"pdl_max_m": [1, decode_fused.MAX_ROWS]}
    monkeypatch.setattr(decode_fused, "task_rows", lambda spec: 1)
    assert pdl_rows_space(None) == {}
    monkeypatch.setattr(decode_fused, "task_rows", lambda spec: 32)
    monkeypatch.setattr(decode_fused, "sm90_capable", lambda spec: False)
    assert pdl_rows_space(None) == {}
