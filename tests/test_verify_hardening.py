"""The search process against hostile candidates (issue 39): whatever a candidate's source or its worker does,
`VerifierPool.verify` returns a failing verdict within the candidate's time limit, never raises, never hangs."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from llm4llm.verify import VerifierPool, check_source
from test_verify import cheat_source, shared_pool, shared_task_dir


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return shared_task_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def pool() -> VerifierPool:
    return shared_pool()


# Run in a process of its own: before the fix the parent blocked in safetensors' open of the FIFO, GIL held, so
# no thread of the test could have timed it out.
_FIFO_SCRIPT = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_verify import build_rmsnorm_task, cheat_source, static_gate_lifted
from llm4llm.verify import VerifierPool
task = build_rmsnorm_task(Path(sys.argv[2]))
with VerifierPool("cpu", timeout_s=60.0, draws=2) as pool, static_gate_lifted():
    v = pool.verify(task, cheat_source("answer_fifo"))
print(json.dumps({"passed": v.passed, "class": v.failure_class, "message": v.message}))
"""


def test_an_answer_file_replaced_by_a_fifo_is_a_failing_verdict_not_a_hang(tmp_path):
    import json
    import subprocess
    import sys

    try:
        res = subprocess.run([sys.executable, "-c", _FIFO_SCRIPT, str(Path(__file__).parent), str(tmp_path)],
                             capture_output=True, text=True, timeout=180, start_new_session=True)
    except subprocess.TimeoutExpired:
        pytest.fail("verify blocked on the worker's FIFO answer for 180s")
    assert res.returncode == 0, res.stderr[-3000:]
    v = json.loads(res.stdout.strip().splitlines()[-1])
    assert not v["passed"] and v["class"] == "worker_crash", v
    assert "not a regular file" in v["message"] and "FIFO" in v["message"], v


def test_read_answer_refuses_what_is_not_a_small_regular_file(tmp_path):
    from llm4llm.verify.answer import AnswerError, read_answer

    (tmp_path / "ok").write_bytes(b"x" * 10)
    assert read_answer(tmp_path, "ok", limit=10, deadline=time.monotonic() + 5) == b"x" * 10
    assert not (tmp_path / "ok").exists()  # read once, then removed
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "real").write_bytes(b"secret")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "dir").mkdir()
    (tmp_path / "big").write_bytes(b"x" * 11)
    (tmp_path / "late").write_bytes(b"x")
    cases = {"fifo": "FIFO", "link": "symbolic link", "dir": "directory", "big": "over the limit",
             "missing": "missing"}
    for name, why in cases.items():
        t0 = time.monotonic()
        with pytest.raises(AnswerError, match=why):
            read_answer(tmp_path, name, limit=10, deadline=time.monotonic() + 5)
        assert time.monotonic() - t0 < 2.0
    with pytest.raises(AnswerError, match="time limit"):
        read_answer(tmp_path, "late", limit=10, deadline=time.monotonic() - 1)
    assert (tmp_path / "real").read_bytes() == b"secret"  # a link is refused, its target untouched


DEEP = {
    "parentheses": "x = " + "(" * 100000 + ")" * 100000,
    "lists": "x = " + "[" * 100000 + "]" * 100000,
    "unary minus": "x = " + "-" * 100000 + "1",
    "long sum": "x = " + "+".join(["1"] * 100000),
    "attribute chain": "x = " + "a." * 100000 + "b",
    "sum the parser takes": "x = " + "+".join(["1"] * 900),  # parses; a recursive visitor would not get through it
}


@pytest.mark.parametrize("name", sorted(DEEP))
def test_a_deeply_nested_source_is_a_static_failure_not_a_recursion_error(pool, task_dir, name):
    src = cheat_source("correct_rmsnorm") + "\n" + DEEP[name] + "\n"
    assert not check_source(src).ok
    v = pool.verify(task_dir, src)
    assert not v.passed and v.failure_class == "static", (v.failure_class, v.message)


def test_a_deeply_nested_source_is_refused_by_the_kernelbench_gate_and_llm_extraction_too():
    from llm4llm.kernelbench.static import check_modelnew
    from llm4llm.llm.extract import defines

    for src in DEEP.values():
        assert not check_modelnew(src).ok
        assert not defines(src)


def test_a_source_over_the_size_limit_is_refused_before_the_worker(pool, task_dir):
    src = cheat_source("correct_rmsnorm")
    before = pool.restarts
    v = pool.verify(task_dir, src + "#" * (8 << 20) + "\n")  # a correct candidate and an 8 MB comment
    assert not v.passed and v.failure_class == "static" and "limit" in v.message, (v.failure_class, v.message)
    assert pool.restarts == before  # no worker was used (a worker serves one candidate, then is replaced)

    from llm4llm.verify.static_check import MAX_SOURCE_BYTES

    src += "#" * (MAX_SOURCE_BYTES - len(src.encode()) - 1) + "\n"
    assert len(src.encode()) == MAX_SOURCE_BYTES and check_source(src).ok  # at the limit: still a candidate
    rep = check_source(src + "# one line more\n")
    assert not rep.ok and "limit" in rep.reason
