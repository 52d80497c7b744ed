"""The sandbox (llm4llm/verify/sandbox.py) holds: a process inside cannot read a file outside its dir, connect a
socket, spawn a process, see a secret, signal its parent, or write the database; on a GPU, CUDA and Triton work."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from llm4llm.verify import sandbox

PROBES = Path(__file__).parent / "sandbox_probes"


def _run(probe: str, *args: str, env: dict | None = None, timeout: float = 120.0) -> tuple[dict, str]:
    box = sandbox.make_box()
    try:
        shutil.copy(PROBES / probe, box / "ro" / probe)
        proc = sandbox.sandboxed_popen("llm4llm.verify.sandbox:run_file", box=box, args=[str(box / "ro" / probe),
                                       *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       readonly=[str(Path(a).parent) for a in args[1:2]], extra_env=env)
        out, err = proc.communicate(timeout=timeout)
        sandbox.kill_group(proc.pid)
        assert proc.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1]), err
    finally:
        sandbox.remove_box(box)


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
    d = tmp_path_factory.mktemp("victim")
    os.chmod(d, 0o755)
    secret, db = d / "secret.txt", d / "llm4llm.duckdb"
    secret.write_text("the user's private file")
    os.chmod(secret, 0o600)
    db.write_bytes(b"DUCK" * 100)
    os.environ["SANDBOXTEST_API_KEY"] = "sk-SANDBOXTESTSECRET-0123456789"
    try:
        r, err = _run("attacks.py", str(secret), str(db), str(os.getpid()))
    finally:
        os.environ.pop("SANDBOXTEST_API_KEY")
    assert db.read_bytes() == b"DUCK" * 100 and secret.read_text() == "the user's private file"
    return r, err


def test_every_layer_is_on_here(attacks):
    """On this machine (Linux, root) every layer applies; where one cannot, the run says so loudly."""
    _, err = attacks
    assert "WARNING: llm4llm sandbox" not in err, err


@pytest.mark.parametrize("attempt", [
    "read_outside", "read_etc_passwd", "list_root_home",  # files outside its dir
    "write_db", "delete_db", "write_tmp",  # the database and anything else outside its dir
    "connect_inet", "socket_inet6", "socket_netlink",  # the network
    "spawn_shell", "spawn_python", "new_session",  # processes
    "signal_parent", "signal_parent_probe", "signal_self_term", "parent_environ",  # the parent
])
def test_attack_is_denied(attacks, attempt):
    r, _ = attacks
    assert r[attempt].startswith("denied"), f"{attempt}: {r[attempt]}"


def test_no_secret_and_an_unprivileged_uid_but_its_own_dir_works(attacks):
    r, _ = attacks
    assert r["secret_in_env"] == "allowed None"
    assert r["uid"] == sandbox.NOBODY if os.geteuid() == 0 else os.geteuid()
    assert r["write_own_dir"].startswith("allowed")


def test_a_refused_layer_is_reported(tmp_path):
    """A layer that cannot apply is skipped with a WARNING line and an "off: why" entry, never silently."""
    cfg = {"layers": ["uid"], "box": str(tmp_path), "parent": os.getpid(), "needed": ["/nonexistent-dir/x"]}
    (tmp_path / "work").mkdir()
    code = ("import json,sys; from llm4llm.verify import sandbox as s; "
            f"print(json.dumps(s.apply({cfg!r})))")
    p = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    layers = json.loads(p.stdout.strip().splitlines()[-1])
    assert layers["uid"].startswith("off:") and layers["seccomp"].startswith("off:")
    assert "WARNING: llm4llm sandbox: layer uid unavailable" in p.stderr


def test_seccomp_program_is_well_formed():
    for machine in ("x86_64", "aarch64"):
        prog = sandbox.seccomp_program(machine)
        assert prog[-1] == (0x06, 0, 0, 0x7FFF0000)  # default: allow
        for i, (code, jt, jf, _) in enumerate(prog):  # every jump lands inside the program
            if code in (0x15, 0x35):
                assert i + 1 + max(jt, jf) < len(prog)


@pytest.mark.gpu
def test_cuda_and_triton_work_inside_the_sandbox():
    r, err = _run("cuda_triton.py", "x")
    assert r["ok"], err[-2000:]
    assert "WARNING: llm4llm sandbox" not in err, err


def test_a_candidate_passing_the_static_gate_is_contained(tmp_path):
    """Through the real pool, the static gate lifted (it refuses torch.cuda.os): a correct candidate that also
    reaches os and tries to run a shell, write outside its dir and read a secret passes as a kernel, and none of it
    happened."""
    from test_verify import build_rmsnorm_task, cheat_source, static_gate_lifted

    from llm4llm.verify import VerifierPool

    task_dir = build_rmsnorm_task(tmp_path / "tasks")
    marker = tmp_path / "escaped"
    os.chmod(tmp_path, 0o777)  # even a world-writable dir: Landlock allows writes only in the box
    src = cheat_source("correct_rmsnorm").replace('    return {"out": out}', f'''    o = torch.cuda.os
    o.system("touch {marker}.sh")
    try:
        fd = o.open("{marker}", o.O_WRONLY | o.O_CREAT)
        o.write(fd, o.environ.get("SANDBOXTEST_API_KEY", "none").encode())
    except OSError:
        pass
    return {{"out": out}}''')
    os.environ["SANDBOXTEST_API_KEY"] = "sk-SANDBOXTESTSECRET-0123456789"
    try:
        with VerifierPool("cpu", draws=1, spare=False) as pool, static_gate_lifted():
            v = pool.verify(task_dir, src)
    finally:
        os.environ.pop("SANDBOXTEST_API_KEY")
    assert v.passed, v.message
    assert not marker.exists() and not Path(f"{marker}.sh").exists()


def test_kernelbench_gpu_lock_reaches_a_sandboxed_child_as_an_open_descriptor(tmp_path, monkeypatch):
    """Shards of a KernelBench run serialise GPU timing on a lock file (LLM4LLM_KB_GPU_LOCK) the sandboxed worker
    cannot open by path (the H200 run of 2026-12-02 lost every candidate to `PermissionError: '/tmp/kb-gpu.lock'`):
    the parent opens it and hands the descriptor over, and the child's lock still excludes the other holders."""
    import fcntl
    import threading
    import time

    from llm4llm.kernelbench import protocol

    lock = tmp_path / "kb-gpu.lock"
    monkeypatch.setattr(protocol, "LOCK_PATH", str(lock))
    held = open(lock, "a+")
    fcntl.flock(held, fcntl.LOCK_EX)  # another shard is timing
    f = protocol.open_gpu_lock()
    box = sandbox.make_box()
    try:
        shutil.copy(PROBES / "gpu_lock.py", box / "ro" / "gpu_lock.py")
        proc = sandbox.sandboxed_popen("llm4llm.verify.sandbox:run_file", box=box, args=[str(box / "ro" / "gpu_lock.py")],
                                       pass_fds=(f.fileno(),), extra_env={protocol.LOCK_FD_ENV: str(f.fileno()),
                                                                         "LLM4LLM_KB_GPU_LOCK": str(lock)},
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        f.close()
        released = []

        def release():
            released.append(time.time())
            fcntl.flock(held, fcntl.LOCK_UN)

        threading.Timer(3.0, release).start()
        out, err = proc.communicate(timeout=120)
        sandbox.kill_group(proc.pid)
        assert proc.returncode == 0, err[-3000:]
        r = json.loads(out.strip().splitlines()[-1])
        assert r["fd"] is not None and r["at"] >= released[0]  # it waited for the other holder
    finally:
        held.close()
        sandbox.remove_box(box)
