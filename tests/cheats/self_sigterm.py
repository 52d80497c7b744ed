# expect: runtime_error
# behind_static
"""Sends SIGTERM to its own process (to be classed `interrupted`, the user's own stop, which the search forgives):
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
    torch.cuda.os.kill(torch.cuda.os.getpid(), 15)
    return {"out": x}
