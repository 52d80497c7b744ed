"""optimize's profile -> extract -> search -> accept over one workload, mixer blocks only, decode graphs on, two
end-to-end repeats (scripts/gpu/falcon_mamba.sh). A file, not `python -`: the verifier and acceptance workers are
spawned, and a spawned child re-imports its parent's main module by path (`<stdin>` has none, so a search run
from stdin is lost).

    python scripts/gpu/falcon_mamba_optimize.py WORKLOAD.toml DB [BUDGET]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> int:
    from flows.optimize import optimize_workload
    from kernels_runtime.ops._common import interpret_without_gpu

    interpret_without_gpu()  # a CPU smoke run: Triton's interpreter, as the CLI sets it

    workload, db = sys.argv[1], sys.argv[2]
    budget = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    from llm4llm.config import OptimizeConfig

    config = OptimizeConfig.model_validate({
        "stages": ["profile", "extract", "search", "accept"],
        "search": {"budget": budget, "top": 2, "families": ["ssm_block"]},
        "accept": {"repeats": 2, "noisy_rounds": 1},
        "graphs": {"decode_graphs": "on" if "cuda" in open(workload).read() else "off"}})
    out = optimize_workload(workload, config, db_path=db)
    print("ACCEPTANCE", out.get("acceptance"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
