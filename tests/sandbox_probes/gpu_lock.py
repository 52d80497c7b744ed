# Takes KernelBench's GPU lock inside the sandbox (through the descriptor the parent handed over) and says when.
import json
import time

from llm4llm.kernelbench.protocol import gpu_lock

with gpu_lock() as g:
    print(json.dumps({"at": time.time(), "fd": g.fd}), flush=True)
