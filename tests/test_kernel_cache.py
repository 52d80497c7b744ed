"""The verifier's shared cache of the project's compiled kernels (llm4llm/verify/kernel_cache.py): only a worker
whose candidate could run nothing but the project's host code (static_check.host_only) adds to it; every new worker
starts with a copy; Triton finds a copied entry (its group file repointed from the retired worker's box)."""
from __future__ import annotations

from pathlib import Path

import pytest

from llm4llm.verify import kernel_cache
from llm4llm.verify.static_check import host_only
from llm4llm.verify.worker import VerifierPool
from tests.test_verify import build_rmsnorm_task, cheat_source

HOST = ("\"\"\"Candidate from template norm.rmsnorm_op.\"\"\"\nfrom kernels_runtime.hosts.norm import rmsnorm_op\n\n"
        "CONFIG = {'num_warps': 4}\nSTATE_IN_PLACE = CONFIG['num_warps']\n_entry = rmsnorm_op(CONFIG)\n\n\n"
        "def entry(inputs, weights, state, static):\n    return _entry(inputs, weights, state, static)\n")


def test_host_only_admits_the_templates_form_and_nothing_that_runs_code_of_its_own(tiny_extracted):
    from llm4llm.search.templates import TEMPLATES
    from llm4llm.taskspec import load_spec

    assert host_only(HOST)
    for bad in (HOST + "import os\n", HOST.replace("rmsnorm_op(CONFIG)", "rmsnorm_op(CONFIG, x=print('x'))"),
                HOST.replace("return _entry(inputs", "return _entry(static"), HOST.replace("CONFIG = {", "CONFIG = f({"),
                HOST.replace("kernels_runtime.hosts.norm", "kernels_runtime.ops.rmsnorm"),
                # a name the hosts module imported (an op, torch), not one of its factories
                HOST.replace("import rmsnorm_op", "import rmsnorm").replace("rmsnorm_op(CONFIG)", "rmsnorm(CONFIG)"),
                HOST.replace("kernels_runtime.hosts.norm", "kernels_runtime.hosts.nowhere"),
                cheat_source("correct_rmsnorm"), "def entry(:"):
        assert not host_only(bad), bad
    # every built-in template renders this form (their kernels may be shared)
    specs = [load_spec(d) for d in tiny_extracted("tiny-qwen3")]
    rendered = [t.render(s, t.default(s)) for s in specs for t in TEMPLATES if t.why_not(s) is None]
    assert rendered and all(host_only(r) for r in rendered)


def _triton_entry(cache: Path, key: str, monkeypatch) -> None:
    """One entry as Triton writes it: the files and a group file naming them by absolute path."""
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    m = FileCacheManager(key)
    paths = {name: m.put(b"\x7fELF" + name.encode(), name) for name in ("k.cubin", "k.json")}
    m.put_group("k.json", paths)


def test_a_copied_entry_is_found_by_triton_in_the_next_workers_cache(tmp_path, monkeypatch):
    from triton.runtime.cache import FileCacheManager

    worker, shared, nxt = tmp_path / "w1" / ".triton", tmp_path / "shared", tmp_path / "w2" / ".triton"
    _triton_entry(worker, "abc123", monkeypatch)
    (worker / "abc123" / "tmp.pid_1_x").mkdir()  # a temporary left by a worker stopped mid-write
    assert kernel_cache.keep(worker, shared) == 1 and kernel_cache.keep(worker, shared) == 0
    assert not list(shared.glob("abc123/tmp.pid_*"))
    assert kernel_cache.seed(shared, nxt) == 1
    import shutil

    shutil.rmtree(tmp_path / "w1")  # the first worker's box is gone
    monkeypatch.setenv("TRITON_CACHE_DIR", str(nxt))
    group = FileCacheManager("abc123").get_group("k.json")
    assert group is not None and all(Path(p).parent == nxt / "abc123" and Path(p).exists() for p in group.values())


def test_default_dir_off_on_the_cpu_and_by_env(tmp_path, monkeypatch):
    monkeypatch.delenv(kernel_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("LLM4LLM_HOME", str(tmp_path))
    assert kernel_cache.default_dir("cpu") is None
    assert kernel_cache.default_dir("cuda:0") == tmp_path / "triton-cache"
    monkeypatch.setenv(kernel_cache.CACHE_ENV, "off")
    assert kernel_cache.default_dir("cuda:0") is None


@pytest.mark.parametrize("host", [True, False], ids=["host-only candidate", "candidate with its own code"])
def test_a_worker_adds_its_kernels_only_for_a_host_only_candidate(tmp_path, host):
    """The pool's worker (sandboxed, on the CPU here) judges a candidate; what its cache then holds is kept for
    the next workers only where the candidate could run the project's code alone."""
    task = build_rmsnorm_task(tmp_path / "tasks")
    shared = tmp_path / "shared"
    pool = VerifierPool("cpu", timeout_s=120.0, draws=1, timing=False, kernel_cache=shared)
    try:
        planted = pool._w.box / "work" / ".triton" / "planted"  # as if the worker had compiled a kernel
        planted.mkdir(parents=True)
        (planted / "k.json").write_text("{}")
        source = HOST.replace("STATE_IN_PLACE = CONFIG['num_warps']\n", "") if host else cheat_source("correct_rmsnorm")
        v = pool.verify(task, source)
        assert v.passed, v.message
        assert (shared / "planted").exists() is host
        assert (pool._w.box / "work" / ".triton" / "planted").exists() is host  # the next worker starts with it
    finally:
        pool.close()


def test_a_misplaced_cache_costs_the_sharing_never_the_verdict(tmp_path, capfd):
    """A cache path that is a file (a typo in LLM4LLM_KERNEL_CACHE): workers start and judge as without one."""
    task = build_rmsnorm_task(tmp_path / "tasks")
    (tmp_path / "cache").write_text("not a directory")
    pool = VerifierPool("cpu", timeout_s=120.0, draws=1, timing=False, kernel_cache=tmp_path / "cache")
    try:
        (pool._w.box / "work" / ".triton" / "planted").mkdir(parents=True)
        v = pool.verify(task, HOST.replace("STATE_IN_PLACE = CONFIG['num_warps']\n", ""))
        assert v.passed, v.message
    finally:
        pool.close()
    assert "kernel cache" in capfd.readouterr().err



def test_whole_model_children_start_with_the_shared_kernels(tmp_path, monkeypatch):
    """Acceptance and evaluation children load bundles whose kernels the verifier's workers compiled: they start
    with a copy of the shared cache (none where it does not exist, as on the CPU), and add nothing to it."""
    import os

    from llm4llm.isolation import in_subprocess
    from llm4llm.verify.sandbox import make_box

    def in_child(fn):  # fn on the child's own Triton cache dir, inside the child
        box = make_box()
        return in_subprocess(fn, str(box / "work" / ".triton"), box=box)

    shared = tmp_path / "shared"
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(shared))
    assert in_child(os.path.isdir) is False
    _triton_entry(tmp_path / "w1" / ".triton", "abc123", monkeypatch)
    kernel_cache.keep(tmp_path / "w1" / ".triton", shared)
    assert in_child(os.listdir) == ["abc123"]
    assert sorted(p.name for p in shared.iterdir()) == ["abc123"]
    monkeypatch.setenv(kernel_cache.CACHE_ENV, "off")
    assert in_child(os.path.isdir) is False
