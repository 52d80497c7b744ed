"""Modules executed from source leave no directory per load behind (llm4llm.scratch): one per process and prefix,
removed at exit."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_loaded_problems_share_one_scratch_dir_that_is_gone_at_exit(tmp_path):
    code = textwrap.dedent("""
        import sys
        from llm4llm.kernelbench.problem import load_module
        src = "import torch\\nclass Model(torch.nn.Module):\\n    pass\\n" \\
              "def get_inputs():\\n    return []\\ndef get_init_inputs():\\n    return []\\n"
        files = {load_module(src).__file__ for _ in range(5)}
        dirs = {f.rsplit("/", 1)[0] for f in files}
        assert len(files) == 5 and len(dirs) == 1, (files, dirs)
        print(dirs.pop())
    """)
    env = {"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    made = out.stdout.strip().splitlines()[-1]
    assert made.startswith(str(tmp_path / "kb-"))
    assert list(tmp_path.iterdir()) == []  # removed when the process ended
