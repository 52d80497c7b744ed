"""Helpers shared by the Triton ops.

Two development aids here are opt-in and inert by default:
- the kernel timeline (`TIMELINE`, `timeline_rows`, `stamp`): the instrumented decode kernels take a
  `TIMELINE: tl.constexpr = False`, so they compile without the stamps; their launchers pay one dict lookup
  (`TIMELINE["buf"] is None`) until a caller (scripts/gpu/layer_bench.py --timeline) sets a buffer;
- the interpreter speed-ups (`_interp_fast`): installed only by `kernels_runtime.interp.enable_fast_interpreter()`,
  never by importing this module.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch
import triton
import triton.language as tl

# torch dtype -> Triton dtype, for the ops' dtype constexprs
_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU test path).

    Triton's interpreter evaluates bf16 `tl.dot` wrongly (numpy has no bf16; checked with triton 3.6 and 3.9), so
    kernels take an `UPCAST_DOT: tl.constexpr` that casts dot operands to fp32 only when interpreting; on the GPU
    the dot stays in bf16/fp16 on the tensor cores. The interpreter also truncates fp32 -> bf16 casts instead of
    rounding to nearest-even, so kernels whose bf16 outputs feed an ill-conditioned chain (a Mamba mixer) store
    through `cast_out(x, dtype, RNE=interpreting())`.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def rnd(x, DTYPE: tl.constexpr):
    # fp32 x rounded to DTYPE and back (a no-op for fp32): reproduces a rounding HF's torch path does. bf16 is
    # rounded to nearest-even by hand because Triton's interpreter truncates fp32 -> bf16 casts (NaN/Inf not handled).
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def gate_act(g, GELU: tl.constexpr, DTYPE: tl.constexpr):
    # a gated MLP's activation of its rounded gate g (fp32), rounded to DTYPE as the eager op: silu (LlamaMLP) or,
    # GELU, the tanh approximation (Gemma's gelu_pytorch_tanh, fp32 inside: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715
    # g^3))); tanh from exp, no libdevice)
    if GELU:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = tl.exp(-2.0 * tl.abs(z))
        return rnd(0.5 * g * (1.0 + tl.where(z >= 0, 1.0, -1.0) * (1.0 - t) / (1.0 + t)), DTYPE)
    else:
        return rnd(g * tl.sigmoid(g), DTYPE)


@triton.jit
def rms_scale(x, rstd, w, GEMMA: tl.constexpr, DTYPE: tl.constexpr):
    # HF's RMSNorm of x (fp32) from its rstd and weight w (fp32, broadcast by the caller): Llama's
    # w * (x * rstd).to(dtype), rounded again; GEMMA: Gemma's (x * rstd) * (1 + w) in fp32, rounded once
    if GEMMA:
        return rnd(x * rstd * (1.0 + w), DTYPE)
    else:
        return rnd(w * rnd(x * rstd, DTYPE), DTYPE)


@triton.jit
def cast_out(x, DTYPE: tl.constexpr, RNE: tl.constexpr):
    # fp32 x cast to an output dtype; RNE (pass interpreting()) rounds bf16 to nearest-even first, as the GPU does
    if RNE:
        x = rnd(x, DTYPE)
    return x.to(DTYPE)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    # A kernel launched with programmatic dependent launch (PDL) that has nothing to load ahead: let the next kernel
    # launch now, then wait until the previous one has finished and its writes are visible. Every PDL kernel waits
    # in every program, so a kernel's completion still implies its predecessors' (the chain stays ordered).
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def l2_prefetch(base, nbytes, part, parts, LANES: tl.constexpr):
    # Ask the L2 for program `part`'s share (of `parts` programs) of the bytes [base, base + nbytes): one bulk
    # prefetch a lane (sm_90's cp.async.bulk.prefetch.L2: the copy engine fetches, no registers, no wait). A
    # latency-bound kernel (decode attention) leaves HBM idle; it fetches the weights the next kernel streams, which
    # then reads them from L2. A hint only: nothing depends on the lines still being there. 16-byte units: `base`
    # must be 16-byte aligned (a tensor's storage is).
    share = tl.cdiv(tl.cdiv(nbytes, parts), 16 * LANES) * (16 * LANES)
    sub = share // LANES
    off = part.to(tl.int64) * share + tl.arange(0, LANES).to(tl.int64) * sub
    size = tl.minimum(tl.maximum(nbytes - off, 0), sub).to(tl.int32)
    addr = base.to(tl.pointer_type(tl.int8)).to(tl.int64) + off
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch_bytes(t: torch.Tensor | None, nbytes: int | None, op: str = "l2_prefetch") -> int:
    """The bytes of `t` a kernel prefetches into L2: all of it when nbytes is None, never past its end; 0 without t.
    `t` must be contiguous (a weight): the prefetch covers one byte range."""
    if t is None:
        return 0
    if not t.is_contiguous():
        raise ValueError(f"{op}: expected a contiguous l2_prefetch tensor (a weight)")
    total = t.numel() * t.element_size()
    return total if nbytes is None else max(0, min(int(nbytes), total))


def l2_prefetch_on(nbytes: int) -> bool:
    """Whether a kernel issues its L2 prefetches: some bytes asked for, on the GPU (the interpreter has no PTX)."""
    return nbytes > 0 and not interpreting()


def pdl_on(PDL: bool) -> bool:
    """A kernel's PDL constexpr: the interpreter has no PDL, so kernels run there with it off."""
    return bool(PDL) and not interpreting()


def pdl_launch(PDL: bool) -> dict:
    """The launch option of a PDL kernel (sm_90+), paired with its `pdl_on(PDL)` constexpr."""
    return {"launch_pdl": True} if pdl_on(PDL) else {}


# ---------------------------------------------------------------------------------------------- kernel timeline
# A measuring aid for chains of dependent decode kernels (PDL overlaps them, so a profiler's per-kernel durations
# do not add up to the step): while `TIMELINE["buf"]` is an int64 CUDA tensor [rows, 4], each instrumented launch
# takes the next rows, one per program, and every program writes %globaltimer (ns) when it starts, when it leaves
# PDL's wait (its start when it has none), when it ends, and its SM id. Off (the default: nothing but a measuring
# script sets `buf`) a kernel compiles without it. Sites are taken in launch order, so a step captured in a CUDA
# graph rewrites the same rows on every replay. scripts/gpu/layer_bench.py --timeline reads them.
TIMELINE: dict = {"buf": None, "next": 0, "sites": []}


def timeline_rows(name: str, programs: int) -> torch.Tensor | None:
    """The rows of the next instrumented launch (`programs` of them), or None when the timeline is off or under the
    interpreter (no %globaltimer there)."""
    buf = TIMELINE["buf"]
    if buf is None or interpreting():
        return None
    off = TIMELINE["next"]
    if off + programs > buf.shape[0]:
        raise RuntimeError(f"kernel timeline: {buf.shape[0]} rows are too few (a launch of {programs} programs at "
                           f"row {off})")
    TIMELINE["next"] = off + programs
    TIMELINE["sites"].append((name, off, programs))
    return buf[off:off + programs]


@triton.jit
def stamp(TS, pid, col, ON: tl.constexpr):
    # the timeline's column `col` of program `pid` (0 start, 1 after the wait, 2 end); at the end, also its SM
    if ON:
        tl.store(TS + pid * 4 + col, tl.extra.cuda.globaltimer())
        if col == 2:
            tl.store(TS + pid * 4 + 3, tl.extra.cuda.smid().to(tl.int64))


@triton.jit
def softplus(x):
    # torch's softplus with its default threshold (20): log1p(exp(x)), identity above it. tl has no log1p:
    # log(u) * e / (u - 1) with u = 1 + e is accurate to a few ulps where log(1 + e) loses e's low bits (x << 0;
    # enough to flip some of HF's bf16 dt roundings)
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    lp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def dt_bias_softplus(dt, dt_bias, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, DT_DTYPE: tl.constexpr):
    # Mamba's dt: HF adds the bias and applies softplus in delta's dtype
    if HAS_DT_BIAS:
        dt = rnd(dt + rnd(dt_bias, DT_DTYPE), DT_DTYPE)
    if DT_SOFTPLUS:
        dt = rnd(softplus(dt), DT_DTYPE)
    return dt


@triton.jit
def apply_epilogue(acc, EPILOGUE: tl.constexpr, ROUND_PRE: tl.constexpr, ACT_DTYPE: tl.constexpr):
    # the linear ops' activation on fp32 acc: 0 none, 1 silu, 2 gelu (erf), 3 gelu (tanh approximation)
    if ROUND_PRE:  # the pre-activation rounded to x's dtype: nn.Linear's output, then HF's activation module on it
        acc = rnd(acc, ACT_DTYPE)
    if EPILOGUE == 1:  # silu
        acc = acc * tl.sigmoid(acc)
    elif EPILOGUE == 2:  # gelu (erf)
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    elif EPILOGUE == 3:  # gelu, tanh approximation; tanh(z) = 2 * sigmoid(2z) - 1 (tl.math.tanh is not portable)
        z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * z)
    return acc


@triton.jit
def gemv_store(acc, acc_u, b_ptr, r_ptr, y_ptr, row, rn, N, stride_rm, stride_ym, stride_yn,
               HAS_BIAS: tl.constexpr, GATED: tl.constexpr, EPILOGUE: tl.constexpr, ROUND_PRE: tl.constexpr,
               HAS_RES: tl.constexpr, ACT_DTYPE: tl.constexpr, RNE: tl.constexpr):
    # y[row, rn] = epilogue(acc + bias) (* acc_u) (+ residual), rounded to y's dtype: the tail of the GEMV paths
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    acc = apply_epilogue(acc, EPILOGUE, ROUND_PRE, ACT_DTYPE)
    if GATED:
        acc = acc * acc_u
    if HAS_RES:  # out rounded to x's dtype first (nn.Linear's output), then the residual added in fp32
        acc = rnd(acc, ACT_DTYPE) + tl.load(r_ptr + row * stride_rm + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + rn * stride_yn, cast_out(acc, y_ptr.dtype.element_ty, RNE), mask=rn < N)


# ----------------------------------------------------------------------------------------------------------------
# Cached launches: bind the compiled kernel once per specialization, then call its launcher directly.
#
# `jit_fn[grid](...)` runs Triton's binder, cache-key computation and global-value checks on every call, more host
# time than a torch op takes; a decode step issues hundreds. `launch` keys
# the compiled kernel by what Triton specializes on (tensor dtypes and 16-byte alignment, ints equal to 1 or
# divisible by 16 and their width, the constexprs and launch options) and calls `CompiledKernel.run` with every
# signature argument in order, as `JITFunction.run` does (Triton 3.6-3.9). The first call of a key, the interpreter,
# or LLM4LLM_CACHED_LAUNCH=0 take Triton's own path.

_LAUNCHERS: dict[tuple, Any] = {}
_CACHED_LAUNCH = {"on": os.environ.get("LLM4LLM_CACHED_LAUNCH", "1") != "0"}
# Called with the launch's arguments on every cached launch. The cached path skips `JITFunction.run`, which the
# verifier wraps to count launches: without this its `launches_triton` gate would fail every candidate whose
# kernels launch through `launch` ("no_triton") after the first call of a key. Empty when serving.
LAUNCH_OBSERVERS: list[Callable[[tuple], None]] = []


def _on_gpu(args: tuple) -> bool:
    return isinstance(args[0], torch.Tensor) and args[0].is_cuda


def _spec_of(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -2**31 <= a < 2**31
    if isinstance(a, float):
        return float
    return type(a), a


def _param_defaults(jit_fn) -> list[tuple[str, Any]]:
    out = []
    for p in jit_fn.signature.parameters.values():
        out.append((p.name, p.default))
    return out


def compiled_launches() -> int:
    """How many (kernel, specialization) launchers `launch` holds (diagnostics: it grows by one per new one)."""
    return len(_LAUNCHERS)


def launch(jit_fn, grid: tuple, args: tuple, constexprs: dict, **options):
    """jit_fn[grid](*args, **constexprs, **options), through the cached compiled kernel after the first call."""
    if not _CACHED_LAUNCH["on"] or interpreting() or not _on_gpu(args):
        return jit_fn[grid](*args, **constexprs, **options)  # (off the GPU: the sm_90 compile check records launches)
    from triton import knobs

    key = (jit_fn, tuple(_spec_of(a) for a in args), tuple(constexprs.items()), tuple(options.items()),
           torch.cuda.current_device())
    hit = _LAUNCHERS.get(key)
    if hit is None:
        kernel = jit_fn[grid](*args, **constexprs, **options)
        if kernel is not None and hasattr(kernel, "result"):
            kernel = kernel.result()
        params = _param_defaults(jit_fn)
        names = [n for n, _ in params]
        tail = [constexprs[n] if n in constexprs else d for n, d in params[len(args):]]
        if kernel is not None and len(names) == len(args) + len(tail) and all(
                n in constexprs or d is not inspect.Parameter.empty for (n, d) in params[len(args):]):
            _LAUNCHERS[key] = (kernel, tuple(tail))
        return kernel
    kernel, tail = hit
    for observe in LAUNCH_OBSERVERS:
        observe(args)
    g = tuple(grid) + (1, 1)
    stream = torch.cuda.current_stream().cuda_stream
    rt = knobs.runtime  # the hooks and launch metadata exactly as JITFunction.run passes them
    try:
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *args, *tail), rt.launch_enter_hook, rt.launch_exit_hook,
                   *args, *tail)
    except TypeError:  # another Triton's launcher convention: its own path from now on
        _CACHED_LAUNCH["on"] = False
        return jit_fn[grid](*args, **constexprs, **options)
    return kernel

