# expect: runtime_error
# behind_static
"""SIGKILLs its own process group, hoping to be classed `oom` (a death by SIGKILL) rather than as its own fault:
the sandbox refuses the signal, so the candidate just raises."""
import torch
import triton
import triton.language as tl


@triton.jit
def _noop(x_ptr):
    pass


def entry(inputs, weights, state, static):
    x = inputs["hidden_states"]
    _noop[(1,)](x)
    torch.cuda.os.killpg(0, 9)
    return {"out": x}
