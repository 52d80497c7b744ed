"""A task dir's integrity hashes and its read-only copy in a sandbox box (llm4llm/taskspec.py, verify/sandbox.py):
hashed in threads and remembered per file while its stat key holds, yet every change is still caught; hard-linked
into the box as root (no bytes copied), copied otherwise."""
from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from llm4llm import taskspec
from llm4llm.errors import TaskError
from llm4llm.verify import sandbox


def _task_dir(root):
    d = root / "task"
    (d / "cases").mkdir(parents=True)
    for k in range(5):
        (d / "cases" / f"{k}.safetensors").write_bytes(os.urandom(1000 + 4096 * k))
    (d / "spec.json").write_text('{"x": 1}')
    (d / taskspec.MANIFEST).write_text(__import__("json").dumps(taskspec.artifact_hashes(d)))
    return d


def test_hashes_are_each_files_sha256_in_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(taskspec, "HASH_CHUNK", 1024)  # several chunks a file
    d = _task_dir(tmp_path)
    want = {f.relative_to(d).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(d.rglob("*")) if f.is_file() and f.name != taskspec.MANIFEST}
    assert taskspec.artifact_hashes(d) == want and len(want) == 6


def test_a_remembered_hash_is_reused_and_every_change_is_still_caught(tmp_path, monkeypatch):
    d = _task_dir(tmp_path)
    taskspec.check_artifacts(d)  # hashed; not remembered: written less than RACY_NS ago
    monkeypatch.setattr(taskspec, "RACY_NS", -1)  # as if written long ago
    taskspec.check_artifacts(d)  # hashed; remembered
    reads = []
    real_open = open

    def counting_open(path, *a, **k):
        reads.append(str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(taskspec, "open", counting_open, raising=False)
    taskspec.check_artifacts(d)
    assert reads == []  # unchanged files: not read again
    monkeypatch.setattr(taskspec, "RACY_NS", 2_000_000_000)
    case = d / "cases" / "2.safetensors"
    blob = bytearray(case.read_bytes())
    blob[100] ^= 0xFF
    case.write_bytes(bytes(blob))  # same size, in place: mtime and ctime move
    with pytest.raises(TaskError, match=r"hash mismatch: \['cases/2.safetensors'\]"):
        taskspec.check_artifacts(d)
    case.write_bytes(bytes(blob[:100]) + bytes([blob[100] ^ 0xFF]) + bytes(blob[101:]))  # the original bytes back
    taskspec.check_artifacts(d)
    other = d / "cases" / "3.safetensors"
    repl = tmp_path / "repl"
    repl.write_bytes(os.urandom(other.stat().st_size))
    os.utime(repl, ns=(other.stat().st_atime_ns, other.stat().st_mtime_ns))  # the same size and mtime, a new inode
    os.replace(repl, other)
    with pytest.raises(TaskError, match=r"cases/3.safetensors"):
        taskspec.check_artifacts(d)


@pytest.mark.parametrize("root,link_ok", [(True, True), (True, False), (False, True)])
def test_the_box_copy_is_linked_as_root_and_copied_otherwise(tmp_path, monkeypatch, root, link_ok):
    d = _task_dir(tmp_path)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0 if root else 1000)
    if not link_ok:
        def no_link(src, dst):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(sandbox.os, "link", no_link)
    box = tmp_path / "box"
    box.mkdir()
    out = sandbox.copy_readonly(d, box / "ro")
    try:
        for f in sorted(d.rglob("*")):
            if f.is_file():
                g = out / f.relative_to(d)
                assert g.read_bytes() == f.read_bytes() and g.stat().st_mode & 0o777 == 0o444
                assert (g.stat().st_ino == f.stat().st_ino) == (root and link_ok)
        assert out.stat().st_mode & 0o777 == 0o555
        taskspec.check_artifacts(d)  # the originals are intact (and 0444 where linked)
    finally:
        for p in [out, *out.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        shutil.rmtree(box)
