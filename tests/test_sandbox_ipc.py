"""Isolation between candidates and from the machine's other processes: SysV IPC made in one sandboxed worker is
gone for the next (an IPC namespace per worker), other users' /proc entries (the parent's command line) are hidden,
and the project's git metadata is empty inside."""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from llm4llm.verify import sandbox

PROBES = Path(__file__).parent / "sandbox_probes"


def _probe(mode: str, key: int, git: str) -> dict:
    box = sandbox.make_box()
    try:
        shutil.copy(PROBES / "ipc_proc_git.py", box / "ro" / "ipc_proc_git.py")
        proc = sandbox.sandboxed_popen("llm4llm.verify.sandbox:run_file", box=box,
                                       args=[str(box / "ro" / "ipc_proc_git.py"), mode, str(key), str(os.getpid()),
                                             git], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=120)
        sandbox.kill_group(proc.pid)
        assert proc.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])
    finally:
        sandbox.remove_box(box)


def _remove_segment(key: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(key, 0, 0)
    if shmid >= 0:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


@pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and mounts need the root start the sandbox expects")
def test_ipc_proc_and_git_are_private():
    git = sandbox.git_dirs(sandbox._project_root())
    assert git, "the project tree has git metadata to hide"
    key = 0x4C4C0000 | secrets.randbits(16)
    try:
        made = _probe("create", key, git[0])
        found = _probe("find", key, git[-1])
    finally:
        _remove_segment(key)
    assert made["shm"].startswith("created"), made
    assert found["shm"].startswith("absent"), found  # the first worker's segment did not reach the second
    for r in (made, found):
        assert r["parent_cmdline"].startswith("denied"), r
        assert r["own_cmdline"].startswith("allowed"), r
        assert r["git"] in ("allowed []", "allowed ''") or r["git"].startswith("denied"), r
