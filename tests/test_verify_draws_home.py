"""Draws kept on the host when a task's draws would crowd the GPU (llm4llm.verify.gates.draws_home) and copied over
for each call (llm4llm.verify.judge.resident): a Llama-2-7B serving regime's decode layer once held 78 GB in the
verifying parent, so that the worker beside it failed to load its first draw. The copy itself is exercised here with
the meta device as the GPU stand-in (its tensors carry shape and dtype, no data)."""
from types import SimpleNamespace

import pytest
import torch

from llm4llm.verify import gates
from llm4llm.verify.judge import Draw, resident


# sizes scaled down 1024x (KiB for MiB, an 80 MiB "GPU" for 80 GB): the same arithmetic, no GBs allocated
GPU_BYTES = 80 << 20


def _task(*state_kb: int, ref: bool = False):
    """One case a size: its state `kb` KiB; with `ref`, the reference outputs a static cache's layer records (a
    hidden-state row and the state-out, the state's shape, one position a row written)."""
    def case(kb):
        state = {"past_k": torch.zeros(kb << 9, dtype=torch.bfloat16)}
        written = state["past_k"].clone()
        written[::64] = 1.0  # a position a row
        refs = {"out": torch.empty(4, 8), "state_out.past_k": written}
        return SimpleNamespace(inputs={"x": torch.empty(4, 8)}, weights={}, state=state, ref=refs if ref else {})
    return SimpleNamespace(cases=[case(kb) for kb in state_kb])


def test_draws_stay_on_the_gpu_unless_they_would_crowd_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=GPU_BYTES))
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    # qwen3-4b at batch 1: a few MB a case; 9 draws in parent and worker with whole references: far under the share
    assert gates.draws_home(_task(4, 4), gpu, 8) == [gpu, gpu]
    # a 1.1 GB KV cache a case (Llama-2-7B at batch 32 x 2048), 9 draws, their references whole: the host
    assert gates.draws_home(_task(1100, 1100), gpu, 8) == [cpu, cpu]
    assert gates.draws_home(_task(1100, 4), cpu, 8) == [cpu, cpu]  # the CPU: where it is


def test_a_state_out_kept_as_a_delta_costs_nothing_beside_its_draw():
    """A static cache's state-out has its state's shape: judge.DeltaRef keeps it as the few positions written, so
    a case needs its draws twice (parent and worker) and only its other outputs' references."""
    small = 4 * 8 * 4
    whole, delta = _task(1100).cases[0], _task(1100, ref=True).cases[0]
    data = 1100 << 10
    assert gates.case_need(whole, 4) == 5 * (2 * (data + small) + 3 * (data + small))
    assert gates.case_need(delta, 4) == 5 * (2 * (data + small) + 3 * small)
    rolled = _task(1100, ref=True).cases[0]  # a cache that rolls each step (a full sliding window): whole
    rolled.ref["state_out.past_k"] = torch.ones_like(rolled.state["past_k"])
    assert gates.case_need(rolled, 4) == gates.case_need(whole, 4)


def test_a_regimes_small_cases_stay_on_the_gpu_and_its_largest_go_to_the_host(monkeypatch):
    """A serving regime's corners (batch 1 to 32): the smallest first while they fit the share, so only the largest
    corners pay a copy a call. Their references whole: 25 x a case's bytes at 4 draws; as deltas: 10 x."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=GPU_BYTES))
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    mb = [256, 34, 1100, 68, 540, 136, 34, 272]  # batch 8, 1, 32, 2, 16, 4, 1, 8 at 2049 positions (/1024)
    homes = gates.draws_home(_task(*mb), gpu, 4)
    assert [h.type for h in homes] == ["cuda", "cuda", "cpu", "cuda", "cpu", "cuda", "cuda", "cuda"]
    room = gates.HOST_DRAWS_SHARE * GPU_BYTES
    need = [gates.case_need(c, 4) for c in _task(*mb).cases]
    kept = sum(n for n, h in zip(need, homes) if h == gpu)
    assert kept <= room < kept + min(n for n, h in zip(need, homes) if h == cpu)
    # the same corners with their static caches' state-out as deltas: every one on the GPU
    assert gates.draws_home(_task(*mb, ref=True), gpu, 4) == [gpu] * len(mb)
    draws = gates.make_draws(_task(*mb[:2]), cpu, 1, 0, home=[torch.device("meta"), cpu])
    assert [d.state["past_k"].device.type for d in draws] == ["meta", "meta", "cpu", "cpu"]


def test_make_draws_puts_every_draw_where_it_is_told():
    task = SimpleNamespace(cases=[SimpleNamespace(inputs={"x": torch.randn(3, 4)}, weights={"w": torch.randn(4)},
                                                  state={"s": torch.randn(2)})])
    draws = gates.make_draws(task, torch.device("cpu"), 2, 0, home=torch.device("meta"))
    assert len(draws) == 3 and all(t.device.type == "meta" for d in draws for part in (d.inputs, d.state, d.weights)
                                   for t in part.values())
    draws = gates.make_draws(task, torch.device("cpu"), 2, 0)
    assert len(draws) == 3 and all(t.device.type == "cpu" for d in draws for part in (d.inputs, d.state, d.weights)
                                   for t in part.values())
    assert not torch.equal(draws[1].inputs["x"], draws[0].inputs["x"])  # fresh draws, on the host


def test_a_host_draw_is_on_the_device_for_the_block_and_back_after_it_with_what_it_computed():
    x, w, s = torch.randn(3, 4), torch.randn(4), torch.randn(2)
    d = Draw((0, 1), {"x": x}, {"w": w}, {"s": s})
    with resident(d, torch.device("meta")):
        assert d.inputs["x"].device.type == d.weights["w"].device.type == d.state["s"].device.type == "meta"
        d.ref = {"out": torch.ones(3)}  # what fill_reference computes there
    assert d.inputs["x"] is x and d.weights["w"] is w and d.state["s"] is s  # the host tensors themselves
    assert d.ref["out"].device.type == "cpu" and d.ref32 is None
    with resident(d, torch.device("meta")):  # judged later: its reference goes over too
        assert d.ref["out"].device.type == "meta"
    assert d.ref["out"].device.type == "cpu"


def test_a_draw_already_on_the_device_is_used_as_it_is():
    x = torch.randn(3)
    d = Draw((0, 0), {"x": x}, {}, {})
    with resident(d, torch.device("cpu")) as same:
        assert same.inputs["x"] is x


@pytest.mark.gpu
def test_on_the_gpu_the_parent_and_the_worker_draw_the_same_and_a_host_home_keeps_them_there():
    """The parent and its worker each make the draws (the parent's references must be of the worker's calls): drawn
    on the GPU from the same seed they are equal, whether kept there or on the host."""
    cuda = torch.device("cuda")
    task = SimpleNamespace(cases=[SimpleNamespace(inputs={"x": torch.randn(64, 128)}, weights={"w": torch.randn(128)},
                                                  state={"k_cache": torch.randn(4, 2, 256, 64).bfloat16()})])
    on_gpu = gates.make_draws(task, cuda, 3, 7)
    on_host = gates.make_draws(task, cuda, 3, 7, home=torch.device("cpu"))
    for a, b in zip(on_gpu, on_host):
        assert a.inputs["x"].is_cuda and b.inputs["x"].device.type == "cpu"
        assert torch.equal(a.inputs["x"].cpu(), b.inputs["x"]) and torch.equal(a.state["k_cache"].cpu(),
                                                                                b.state["k_cache"])
    assert not torch.equal(on_gpu[1].state["k_cache"], on_gpu[2].state["k_cache"])


def test_cuda_and_cuda_0_are_one_device_so_a_draw_there_is_not_copied(monkeypatch):
    """The worker's device is `cuda` while its tensors say `cuda:0`: no copy, no host round trip for such a draw."""
    from llm4llm.verify.judge import same_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert same_device(torch.device("cuda:0"), torch.device("cuda"))
    assert not same_device(torch.device("cuda:1"), torch.device("cuda"))
    assert not same_device(torch.device("cpu"), torch.device("cuda"))
    assert same_device(torch.device("cpu"), torch.device("cpu"))
