"""KernelBench problems as llm4llm tasks.

A problem file defines `Model(nn.Module)`, `get_inputs()` and `get_init_inputs()`. Its task directory (the same
content-addressed layout as every task, llm4llm/taskspec.py) holds the spec, the problem's source (`problem.py`:
the reference, and what the worker regenerates inputs and weights from under KernelBench's seeds) and one empty
case file: inputs and weights are not captured, because KernelBench defines them by seed (weights: the model built
under seed 42; inputs: `get_inputs()` under each trial's seed), and a Level 2 problem's tensors reach gigabytes.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import re
import sys
import textwrap
import uuid
from pathlib import Path
from types import ModuleType

import torch

from llm4llm.errors import Llm4llmError
from llm4llm.taskspec import CaseSig, TaskSpec, TensorSig, write_task

FAMILY = "kernelbench"
PHASE = "forward"
REFERENCE = "kernelbench"  # TaskSpec.reference of these tasks: the worker judges them by KernelBench's protocol
SEED = 42  # KernelBench's seed for weights and for the trial seeds


class ProblemError(Llm4llmError):
    pass


def problem_files(directory: Path) -> list[Path]:
    """Problem files of a directory (KernelBench names them `<id>_<Name>.py`), by id."""
    d = Path(directory)
    if not d.is_dir():
        raise ProblemError(f"kernelbench: expected a directory of problems, got {d}")
    files = [f for f in d.glob("*.py") if re.match(r"^\d+_", f.name)]
    if not files:
        raise ProblemError(f"kernelbench: expected files named <id>_<Name>.py in {d}, got none")
    return sorted(files, key=problem_id)


def problem_id(path: Path) -> int:
    return int(Path(path).name.split("_", 1)[0])


def parse_selection(text: str | None) -> set[int] | None:
    """'12,40-60' -> {12, 40, ..., 60}; None or '' -> None (all)."""
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ProblemError(f"--problems: expected ids and ranges like 12,40-60, got {part!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ProblemError(f"--problems: expected a range low-high, got {part!r}")
        out |= set(range(lo, hi + 1))
    return out


def select(directory: Path, selection: str | None) -> list[Path]:
    files = problem_files(directory)
    ids = parse_selection(selection)
    chosen = [f for f in files if ids is None or problem_id(f) in ids]
    if not chosen:
        raise ProblemError(f"--problems {selection}: no problem in {directory} has one of these ids")
    return chosen


def load_module(source: str, name: str | None = None) -> ModuleType:
    """Execute a problem's source as a fresh module backed by a file (inspect and Triton read sources); the file lives
    in the process's scratch directory (llm4llm.scratch), removed at exit."""
    from llm4llm.scratch import scratch_dir

    name = name or f"kb_problem_{hashlib.sha256(source.encode()).hexdigest()[:12]}_{uuid.uuid4().hex[:6]}"
    path = scratch_dir("kb-") / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    for attr in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(mod, attr):
            raise ProblemError(f"problem: expected `{attr}` in the source, got none")
    return mod


def set_seed(seed: int) -> None:
    """KernelBench's set_seed."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


def trial_seeds(n: int, seed: int = SEED) -> list[int]:
    """KernelBench's correctness-trial seeds: torch.manual_seed(seed), then n draws of randint(0, 2**32 - 1)."""
    g = torch.Generator().manual_seed(seed)
    return [int(torch.randint(0, 2**32 - 1, (1,), generator=g).item()) for _ in range(n)]


def build_model(mod: ModuleType, device: str | torch.device, cls_name: str = "Model",
                cls: type | None = None) -> torch.nn.Module:
    """The model as KernelBench builds it: init inputs under the seed, the model under the seed again, fp32.
    Left in training mode, as KernelBench leaves it (BatchNorm uses batch statistics, Dropout is active)."""
    set_seed(SEED)
    init = [x.to(device) if isinstance(x, torch.Tensor) else x for x in mod.get_init_inputs()]
    with torch.no_grad():
        set_seed(SEED)
        model = (cls or getattr(mod, cls_name))(*init)
    dev = torch.device(device)
    if any(t.device != dev or (t.is_floating_point() and t.dtype != torch.float32)
           for t in [*model.parameters(), *model.buffers()]):
        model = model.to(device=dev, dtype=torch.float32)
    return model


def inputs_for(mod: ModuleType, seed: int, device: str | torch.device) -> list:
    set_seed(seed)
    return [x.to(device=device, dtype=torch.float32) if isinstance(x, torch.Tensor) and x.is_floating_point()
            else (x.to(device) if isinstance(x, torch.Tensor) else x) for x in mod.get_inputs()]


def _fake_signature(mod: ModuleType) -> tuple[list[TensorSig], list[str], list[str], list[TensorSig]]:
    """Input and weight signatures and the output's, from a trace under fake tensors (no memory, no compute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = build_model(mod, "cpu")
        inputs = inputs_for(mod, SEED, "cpu")
        out = model(*inputs)
        params = dict(model.state_dict(keep_vars=True))
        sigs = [TensorSig(shape=list(x.shape), dtype=str(x.dtype).replace("torch.", "")) for x in inputs]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        osigs = [TensorSig(shape=list(o.shape), dtype=str(o.dtype).replace("torch.", "")) for o in outs]
    names = list(inspect.signature(mod.Model.forward).parameters)[1:][:len(sigs)]
    names = [n if n.isidentifier() else f"x{i}" for i, n in enumerate(names)] + \
        [f"x{i}" for i in range(len(names), len(sigs))]
    return sigs, names, list(params), osigs


def make_task(path: Path, root: Path, hardware: dict | None = None) -> Path:
    """Write the task directory of one problem file; returns it."""
    path = Path(path)
    source = path.read_text()
    mod = load_module(source)
    sigs, names, weights, osigs = _fake_signature(mod)
    spec = TaskSpec(
        family=FAMILY, module_class=f"kernelbench.{path.stem}", instances=[path.stem], phase=PHASE,
        input_names=names, weight_names=weights, output_names=[f"out{i}" if i else "out" for i in range(len(osigs))],
        static={"problem": path.name, "problem_sha": hashlib.sha256(source.encode()).hexdigest()[:16],
                "seed": SEED, "source": source},
        cases=[CaseSig(inputs=dict(zip(names, sigs)), outputs={"out": osigs[0]})],
        dtype="float32", hardware=hardware or {}, reference=REFERENCE,
    )
    from llm4llm.taskspec import Case, seal_artifacts

    task_dir = write_task(Path(root), spec, torch.nn.Identity(), [Case({}, {}, {}, {})])
    (task_dir / "problem.py").write_text(source)
    seal_artifacts(task_dir)  # problem.py is an artifact the hash check covers too
    return task_dir


def init_source(source: str) -> str:
    """The problem's `Model.__init__`, as `ModelNew`'s: the same constructor builds the same parameters in the
    same order, so KernelBench's seeded construction gives both models identical weights."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Model":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    seg = ast.get_source_segment(source, item)
                    seg = textwrap.dedent(seg)
                    seg = re.sub(r"super\(\s*Model\s*,\s*self\s*\)", "super()", seg)
                    return textwrap.indent(seg, "    ")
    raise ProblemError("problem: expected `class Model` with an `__init__`")


def tensor_attributes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Plain tensor attributes of the model's modules (`self.c = torch.randn(...)`): neither parameters nor
    buffers, yet read by forward like them."""
    return {f"{prefix}{'.' if prefix else ''}{k}": v for prefix, m in model.named_modules()
            for k, v in vars(m).items() if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)}


def capture(source: str):
    """The forward as an aten graph (make_fx under fake tensors) with its parameter names, in placeholder order:
    parameters, buffers, then plain tensor attributes (their placeholders marked with codegen.ATTRIBUTE_META, since
    `.to(device)` leaves them where they are); the graph's own constants stay get_attr nodes."""
    from torch._decomp import core_aten_decompositions
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from llm4llm.kernelbench.codegen import ATTRIBUTE_META

    mod = load_module(source)
    with FakeTensorMode():
        model = build_model(mod, "cpu")
        inputs = inputs_for(mod, SEED, "cpu")
        params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        attrs = tensor_attributes(model)

        def fn(p, *args):
            return torch.func.functional_call(model, p, args)

        gm = make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")({**params, **attrs},
                                                                                              *inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders[len(params):len(params) + len(attrs)]:
        n.meta[ATTRIBUTE_META] = True
    return gm, [*params, *attrs], len(inputs), [tuple(x.shape) for x in inputs]
