"""The judge's per-call checks in the worker, in process: output ownership (fresh memory per call, no input or
weight returned as an output, state_out only in its own state buffer) and aten counting on helper threads."""
from __future__ import annotations

import threading

import torch

from llm4llm.verify.gates import AtenCounter, Draw, guard, install_thread_counting, ownership_failure, \
    torch_work_failure


def _guarded(state: bool = False):
    d = Draw((0, 0), {"x": torch.randn(3, 8)}, {"w": torch.randn(8)}, {"s": torch.randn(4)} if state else {})
    return guard(d)


def test_fresh_outputs_pass():
    g = _guarded()
    first = {"out": torch.empty(3, 8)}
    assert ownership_failure({"out": torch.empty(3, 8)}, g, [first]) is None


def test_an_input_or_weight_returned_as_output_fails():
    g = _guarded()
    assert "inputs.x" in ownership_failure({"out": g.inputs["x"]}, g, [])
    assert "weights.w" in ownership_failure({"out": g.weights["w"].view(1, 8).expand(3, 8)}, g, [])


def test_a_buffer_reused_from_an_earlier_call_fails():
    g = _guarded()
    buf = torch.empty(3, 8)
    held = [{"out": buf}, {"out": torch.empty(3, 8)}]
    why = ownership_failure({"out": buf[1:]}, g, held)
    assert "2 call(s) earlier" in why


def test_state_out_may_be_its_own_state_buffer_only():
    g = _guarded(state=True)
    assert ownership_failure({"state_out.s": g.state["s"]}, g, []) is None
    assert "state.s" in ownership_failure({"out": g.state["s"]}, g, [])


def test_torch_work_on_a_helper_thread_is_counted():
    undo = install_thread_counting()
    try:
        _count_on_helper_threads()
    finally:
        undo()  # this process runs other tests: its later threads must not carry the mode


def _count_on_helper_threads():
    x = torch.randn(16, 16)
    box = []
    with AtenCounter() as counter:
        t = threading.Thread(target=lambda: box.append(torch.mm(x, x)))
        t.start()
        t.join()
    report = counter.report()
    assert report["ops"].get("mm") == 1 and report["helper_thread_ops"] == 1
    assert "on helper threads" in torch_work_failure(report, x.numel())
    with AtenCounter() as idle:  # threads outside a judged call's window are not counted into it
        pass
    t = threading.Thread(target=lambda: torch.mm(x, x))
    t.start()
    t.join()
    assert idle.report()["ops"] == {}
