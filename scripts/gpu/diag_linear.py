"""Check kernels_runtime.ops.linear against torch at the mamba-130m mixer's projection shapes (bf16, GPU)."""
import torch

from kernels_runtime.ops.linear import linear

torch.manual_seed(0)
for M, K, N in [(512, 768, 3072), (512, 1536, 80), (512, 48, 1536), (512, 1536, 768),
                (1, 768, 3072), (1, 1536, 80), (1, 48, 1536), (1, 1536, 768)]:
    x = torch.randn(1, M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    for bias in (None, b):
        out = linear(x, w, bias).float()
        r = ref if bias is not None else torch.nn.functional.linear(x.float(), w.float())
        err = (out - r).abs().max().item()
        print(f"M={M:4d} K={K:5d} N={N:5d} bias={bias is not None!s:5} max_abs_err={err:.4f} {'OK' if err < 0.1 else 'BAD'}")
