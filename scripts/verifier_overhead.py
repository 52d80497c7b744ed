"""Verifier overhead per candidate on the CPU: wall time of `VerifierPool.verify` for the correct RMSNorm candidate
(tests/cheats/correct_rmsnorm.py) on the tiny two-shape RMSNorm task of tests/test_verify.py, 5 draws, one warm pool
whose spare worker has finished importing (the judge, not the import, is timed). Plain judging, then with the timed
calls rehearsed (`rehearse_timing`). Prints one JSON line of seconds per run.

    PYTHONPATH=. python scripts/verifier_overhead.py 3      # from the repository root
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("LLM4LLM_AOT_ARCH", "0")
sys.path.insert(0, "tests")

from llm4llm.verify import VerifierPool  # noqa: E402
from test_verify import CHEATS, build_rmsnorm_task  # noqa: E402

SETTLE_S = 4.0  # for the spare worker to import torch and Triton before the next candidate


def main(runs: int) -> dict[str, list[float]]:
    task = build_rmsnorm_task(Path(tempfile.mkdtemp()))
    src = (CHEATS / "correct_rmsnorm.py").read_text()
    out = {}
    for rehearse in (False, True):
        with VerifierPool("cpu", timeout_s=300.0, draws=5) as pool:
            pool.verify(task, src, rehearse_timing=rehearse)
            times = []
            for _ in range(runs):
                time.sleep(SETTLE_S)
                t0 = time.perf_counter()
                v = pool.verify(task, src, rehearse_timing=rehearse)
                times.append(round(time.perf_counter() - t0, 3))
                assert v.passed, v.message
        out["rehearsed" if rehearse else "judged"] = times
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)))
