"""A sandbox layer under which CUDA does not initialise is left out, named, for the run. On the H200 (2026-12-02)
Landlock stopped cuInit ("Error 304: OS call failed") and every verifier worker died while starting, so a GPU
optimize with the default (sandboxed) settings verified nothing. There is no GPU here: the probe is a stand-in
that fails while Landlock is on, and the real child reports what the parent chose."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from llm4llm.verify import sandbox


def _run_probe(source: str, **kw) -> tuple[str, str]:
    """(stdout, stderr) of `source` run as a file inside a fresh sandbox box."""
    box = sandbox.make_box()
    try:
        (box / "ro" / "probe.py").write_text(source)
        proc = sandbox.sandboxed_popen("llm4llm.verify.sandbox:run_file", box=box, args=[str(box / "ro" / "probe.py")],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        out, err = proc.communicate(timeout=120)
        sandbox.kill_group(proc.pid)
        return out, err
    finally:
        sandbox.remove_box(box)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(sandbox, "_CUDA_DROPPED", None)
    monkeypatch.delenv(sandbox.OFF_ENV, raising=False)
    monkeypatch.setattr(sandbox, "cuda_init_error", lambda: None)  # the parent sees a working driver


def test_the_layer_that_stops_cuda_is_named_and_the_run_refused_by_default(fresh, monkeypatch):
    """Fail closed: without the opt-in, a layer that stops CUDA is an error naming it and both switches."""
    monkeypatch.setattr(sandbox, "_cuda_probe", lambda layers: "cuInit returned 304" if "landlock" in layers else None)
    with pytest.raises(sandbox.SandboxCudaError, match="under the landlock layer.*LLM4LLM_SANDBOX_ALLOW_DROP=1"):
        sandbox.cuda_dropped_layers()


def test_with_the_opt_in_the_layer_that_stops_cuda_is_dropped_and_reported(fresh, monkeypatch):
    monkeypatch.setenv(sandbox.ALLOW_DROP_ENV, "1")
    tried = []

    def probe(layers):
        tried.append(layers)
        return "cuInit returned 304" if "landlock" in layers else None

    monkeypatch.setattr(sandbox, "_cuda_probe", probe)
    dropped = sandbox.cuda_dropped_layers()
    assert list(dropped) == ["landlock"] and "cuInit returned 304" in dropped["landlock"]
    assert tried == [sandbox.ALL_LAYERS, tuple(x for x in sandbox.ALL_LAYERS if x != "landlock")]
    assert sandbox.cuda_dropped_layers() is dropped and len(tried) == 2  # probed once per process

    out, err = _run_probe("import json, os; print(os.environ['LLM4LLM_SANDBOX_LAYERS'])")
    layers = json.loads(out.strip().splitlines()[-1])
    assert layers["landlock"].startswith("off: CUDA does not initialise under it on this host")
    assert "sandbox: layer landlock" in err  # the WARNING line
    assert not any("CUDA" in v for k, v in layers.items() if k != "landlock")  # the others as this host allows


def test_no_single_layer_explains_it_is_one_clear_error(fresh, monkeypatch):
    monkeypatch.setenv(sandbox.ALLOW_DROP_ENV, "1")
    monkeypatch.setattr(sandbox, "_cuda_probe", lambda layers: "cuInit returned 304")
    with pytest.raises(sandbox.SandboxCudaError, match="LLM4LLM_SANDBOX_OFF=1"):
        sandbox.cuda_dropped_layers()


def test_no_cuda_means_no_probe(monkeypatch):
    monkeypatch.setattr(sandbox, "_CUDA_DROPPED", None)
    monkeypatch.setattr(sandbox, "_libcuda", lambda: None)
    monkeypatch.setattr(sandbox, "_cuda_probe", lambda layers: pytest.fail("probed without CUDA"))
    assert sandbox.cuda_dropped_layers() == {}


def test_the_probe_child_runs_under_every_layer():
    """The real probe child (cuInit through ctypes) starts and answers under all layers; without a driver it says
    so in its one line rather than crashing (a crash would come back as a traceback tail)."""
    err = sandbox._cuda_probe(sandbox.ALL_LAYERS)
    if sandbox._libcuda() is None:
        assert err == "libcuda.so.1 not found"
    else:  # a host with the driver: cuInit's answer (0 on a GPU machine where the sandbox lets CUDA through)
        assert err is None or err.startswith("cuInit returned")


def test_a_sandboxed_thread_can_name_itself_as_cuinit_does():
    """Landlock grants writes to the child's own /proc/<pid>/task (CUDA's cuInit writes each thread's comm and
    returns 304 when it cannot), threads started after the sandbox included; the rest of /proc stays read-only."""
    out, _ = _run_probe((Path(__file__).parent / "sandbox_probes" / "thread_comm.py").read_text(), cuda_check=False)
    r = json.loads(out.strip().splitlines()[-1])
    if not r["landlock"].startswith("on"):
        pytest.skip(f"Landlock is not available here: {r['landlock']}")
    assert r["main"] == "main" and r["worker"] == "worker", r
    assert r["oom_score_adj"].startswith("denied"), r



def test_libcuda_dir_is_read_from_ldconfig_then_ld_library_path(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libcuda.so.1").write_bytes(b"")
    out = (f"\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6\n"
           f"\tlibcuda.so.1 (libc6,x86-64) => {lib}/libcuda.so.1\n")
    assert sandbox.parse_libcuda_dir(out) == str(lib)
    assert sandbox.parse_libcuda_dir("\tlibcuda.so.1 (libc6,x86-64) => /nonexistent/libcuda.so.1\n") is None
    assert sandbox.parse_libcuda_dir("", f"/nonexistent:{lib}") == str(lib)


def test_the_child_is_told_where_libcuda_is_and_triton_asks_no_program(monkeypatch, tmp_path):
    """On the H200 /sbin/ldconfig is a shell script: under Landlock the child may not run it, and Triton's driver
    (which runs `/sbin/ldconfig -p` to find libcuda unless TRITON_LIBCUDA_PATH is set) died with PermissionError
    before the first kernel of every candidate. The parent finds the directory and the child's environment says it."""
    lib = tmp_path / "cuda"
    lib.mkdir()
    monkeypatch.setattr(sandbox, "libcuda_dir", lambda: str(lib))
    monkeypatch.delenv("TRITON_LIBCUDA_PATH", raising=False)
    probe = ("import json, os, subprocess\n"
             "calls = []\n"
             "real = subprocess.check_output\n"
             "subprocess.check_output = lambda *a, **k: calls.append(a) or real(*a, **k)\n"
             "from triton.backends.nvidia import driver\n"
             "print(json.dumps({'env': os.environ.get('TRITON_LIBCUDA_PATH'), 'dirs': driver.libcuda_dirs(),"
             " 'calls': len(calls)}))\n")
    out, err = _run_probe(probe, cuda_check=False)
    r = json.loads(out.strip().splitlines()[-1])
    assert r == {"env": str(lib), "dirs": [str(lib)], "calls": 0}, (r, err[-2000:])


def test_a_c_extension_builds_and_loads_inside_the_sandbox_as_tritons_launcher_does():
    """Triton compiles its launcher and driver utils with the host's C compiler at the first launch of a kernel
    signature, so the sandbox must let exactly that toolchain run (and read Python's headers), never a shell."""
    import shutil as _sh

    if not (_sh.which("gcc") or _sh.which("clang")):
        pytest.skip("no C compiler on this host")
    out, err = _run_probe((Path(__file__).parent / "sandbox_probes" / "c_extension.py").read_text(), cuda_check=False)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["cc_rc"] == 0 and r.get("answer") == 42, (r, err[-2000:])
    assert r["shell"].startswith("denied"), r


def test_a_compiler_wrapper_script_is_passed_over_for_the_binary(monkeypatch, tmp_path):
    """On the H200 `gcc` on PATH is /opt/gcc/bin/gcc, which the sandboxed child could not exec (PermissionError at
    Triton's first build). The parent picks a compiler binary and tells the child (CC), so a wrapper script in front
    of PATH still leaves the C extension buildable, and the shell stays refused."""
    import shutil as _sh

    real = _sh.which("gcc") or _sh.which("clang")
    if not real:
        pytest.skip("no C compiler on this host")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "gcc").write_text(f"#!/bin/sh\nexec {real} \"$@\"\n")
    (bindir / "gcc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{__import__('os').environ['PATH']}")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(sandbox, "_CC", [])
    monkeypatch.setattr(sandbox, "_EXEC_CACHE", None)
    cc = sandbox.child_compiler()
    assert cc and sandbox._is_binary(cc), cc
    probe = (Path(__file__).parent / "sandbox_probes" / "c_extension.py").read_text()
    probe = probe.replace('cc = os.environ.get("CC") or', 'print("CC", os.environ.get("CC"))\ncc = os.environ.get("CC") or')
    out, err = _run_probe(probe, cuda_check=False)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["cc_rc"] == 0 and r.get("answer") == 42, (r, err[-2000:])
    assert f"CC {cc}" in out and r["shell"].startswith("denied"), (out, r)


def test_cuda_compiler_and_its_tools_may_run_in_the_child(monkeypatch, tmp_path):
    """torch.compile's inductor runs nvcc in the evaluate step's sandboxed child (the H200: "Permission denied:
    'nvcc'", so the torch.compile baseline failed): the toolkit's bin and nvvm/bin are on the exec allowlist."""
    cuda = tmp_path / "cuda"
    for d in ("bin", "nvvm/bin"):
        (cuda / d).mkdir(parents=True)
    for tool in ("bin/nvcc", "bin/ptxas", "bin/cudafe++", "nvvm/bin/cicc", "bin/cuda-gdb", "bin/nsys"):
        (cuda / tool).write_bytes(b"\x7fELF")
        (cuda / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{cuda / 'bin'}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(sandbox, "_EXEC_CACHE", None)
    allowed = sandbox.exec_allowlist()
    for tool in ("bin/nvcc", "bin/ptxas", "bin/cudafe++", "nvvm/bin/cicc"):
        assert str((cuda / tool).resolve()) in allowed, tool
    # the compile's tools by name, not the toolkit's bin: its debugger and profiler stay out
    assert not any(a.startswith(str(cuda.resolve())) and a.endswith(("cuda-gdb", "nsys", "/bin")) for a in allowed)
    # inductor's ptxas (torch/bin/ptxas, where the wheel ships one: the H200's said "Permission denied"); the rest of
    # torch/bin (test binaries, torch_shm_manager) stays out
    import importlib.util
    from types import SimpleNamespace

    fake = tmp_path / "torch"
    (fake / "bin").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    for name in ("ptxas", "torch_shm_manager"):
        (fake / "bin" / name).write_bytes(b"\x7fELF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(origin=str(fake / "__init__.py"))
                        if name == "torch" else real(name, *a))
    monkeypatch.setattr(sandbox, "_EXEC_CACHE", None)
    allowed = sandbox.exec_allowlist()
    assert str((fake / "bin" / "ptxas").resolve()) in allowed
    assert not any(a.startswith(str(fake.resolve() / "bin" / "torch_shm")) or a == str(fake.resolve() / "bin")
                   for a in allowed)
    monkeypatch.setattr(sandbox, "_EXEC_CACHE", None)
