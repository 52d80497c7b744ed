"""How far an fp32 GEMM and its row sums land from fp64 on this GPU, under the KernelBench mode's settings (TF32
off) and with TF32 on, at problem 14's shapes: the scale the 1e-4 tolerance is judged against (GPU only)."""
import torch

torch.manual_seed(42)
W = torch.nn.Linear(8192, 8192, bias=False).weight.detach().cuda()
x = torch.rand(1024, 8192, device="cuda")
ref = (x.double() @ W.double().T)
for tf32 in (False, True):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    h = x @ W.T
    s = h.sum(1, keepdim=True)
    tol = 1e-4 + 1e-4 * ref.sum(1, keepdim=True).abs()
    print(f"tf32={tf32}: gemm max abs err {(h.double() - ref).abs().max().item():.3g}, row-sum max abs err "
          f"{(s.double() - ref.sum(1, keepdim=True)).abs().max().item():.3g}, "
          f"rows over 1e-4 tol {int(((s.double() - ref.sum(1, keepdim=True)).abs() > tol).sum())}")
