"""Workloads: a validated TOML config plus the user's inference script (`build`, `inputs`, `run`).

`load_workload(path)` turns every bad input into one `WorkloadError` that names the field, what was expected and
what was got. `load_script(workload)` imports the script; `call_script(fn, ...)` runs one of its functions so that
an exception inside the user's code surfaces as a `ScriptError` carrying the script's own traceback.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import difflib
import hashlib
import importlib.util
import json
import os
import re
import signal
import sys
import threading
import time
import tomllib
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Literal

import torch
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from llm4llm.errors import DeviceError, Llm4llmError, ScriptError, WorkloadError
from llm4llm.regime import Regime

SCRIPT_FUNCTIONS = ("build", "inputs", "run")
# A workload's name: a slug (no '/', no '..', no leading '.'), short enough for any file system's names.
MAX_NAME_LEN = 100
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelSpec(BaseModel):
    """Which model the script builds: `model_type` + `config` (seeded random weights) or a local `checkpoint`."""

    model_config = ConfigDict(extra="forbid")

    model_type: str | None = None
    checkpoint: Path | None = None
    config: dict[str, Any] = Field(default_factory=dict)  # validated after model_type and checkpoint

    @field_validator("model_type")
    @classmethod
    def _known_model_type(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from transformers import CONFIG_MAPPING

        if value not in CONFIG_MAPPING:
            close = difflib.get_close_matches(value, list(CONFIG_MAPPING.keys()), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"a transformers model_type such as llama, qwen3, mamba{hint}, got {value!r}")
        return value

    @field_validator("config")
    @classmethod
    def _valid_config(cls, value: dict, info: ValidationInfo) -> dict:
        model_type = info.data.get("model_type")
        if model_type is not None and info.data.get("checkpoint") is None:
            _check_config(model_type, value)
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.checkpoint is None and self.model_type is None:
            raise ValueError("model_type (random weights from a config) or checkpoint (a local directory), got neither")
        if self.checkpoint is not None and self.config:
            raise ValueError(f"no [model.config] beside a checkpoint (its config.json rules), "
                             f"got {sorted(self.config)}")
        return self


class PhaseWeights(BaseModel):
    """The user's weights of the two phases in the deployment (normalised before use)."""

    model_config = ConfigDict(extra="forbid")

    prefill: float = Field(ge=0)
    decode: float = Field(ge=0)

    @model_validator(mode="after")
    def _positive_sum(self) -> PhaseWeights:
        if self.prefill + self.decode <= 0:
            raise ValueError(f"prefill + decode > 0, got {self.prefill} + {self.decode}")
        return self

    def normalised(self) -> dict[str, float]:
        total = self.prefill + self.decode
        return {"prefill": self.prefill / total, "decode": self.decode / total}


class AccuracyBudget(BaseModel):
    """How far a lossy kernel (allow_lossy) may move the model, measured in-model against its unpatched run:
    `max_logit_deviation` bounds every generation step's teacher-forced logits rel-L2, `min_token_agreement` the
    fraction of free-running greedy tokens that stay the same. At least one; both when both are given."""

    model_config = ConfigDict(extra="forbid")

    max_logit_deviation: float | None = Field(default=None, gt=0, le=1)
    min_token_agreement: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _one_bound(self) -> AccuracyBudget:
        if self.max_logit_deviation is None and self.min_token_agreement is None:
            raise ValueError("max_logit_deviation (a rel-L2 in (0, 1]) or min_token_agreement (a fraction in (0, 1]), "
                             "got neither")
        return self


class Workload(BaseModel):
    """One inference workload: the model, the script that runs it, the shapes, the device and dtype."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    script: Path  # absolute once loaded by load_workload (the TOML holds it relative to itself)
    model: ModelSpec
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    batch_size: StrictInt = Field(default=1, gt=0)
    prompt_len: StrictInt = Field(gt=0)
    decode_len: StrictInt = Field(gt=0)
    seed: StrictInt = Field(default=0, ge=0)
    phase_weights: PhaseWeights | None = None
    llm: dict[str, Any] | None = None  # the [llm] table: validated by llm4llm.llm.config when the LLM proposer runs
    regime: Regime | None = None  # the serving regime (llm4llm/regime.py); the fields above are its representative point

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        # the name becomes a directory and file names under the data directory: a path separator, "..", a leading
        # dot or a very long name would place a run elsewhere, hide it, or fail deep inside a stage (issue 39)
        if len(value) > MAX_NAME_LEN or not _NAME.fullmatch(value) or ".." in value:
            shown = repr(value) if len(value) <= 60 else f"{value[:40]!r}... ({len(value)} characters)"
            raise ValueError(f"a name of at most {MAX_NAME_LEN} letters, digits, '-', '_' or '.' (not starting with "
                             f"'.', no '..'), got {shown}")
        return value

    @model_validator(mode="after")
    def _point_in_regime(self) -> "Workload":
        why = self.regime.contains(self.batch_size, self.prompt_len, self.decode_len) if self.regime else None
        if why:
            raise ValueError(f"regime: expected batch_size, prompt_len, decode_len inside it, got {why}")
        return self

    # One call of the script's build / inputs / run longer than this stops the process that made it (and every
    # process it started) with one error line: a run() that never returns must not hang a run or a served worker.
    script_timeout_s: float = Field(default=1800.0, ge=0)  # 0: no limit
    # While one call of the script runs longer than this, a line on stderr every this many seconds says which
    # stage and function it is in and for how long (a run() that never returns is otherwise silent until the limit)
    script_heartbeat_s: float = Field(default=30.0, ge=0)  # 0: none

    # Lossy kernels (TileMix's INT8 attention tiles) are searched and deployed only with this opt-in and a budget
    allow_lossy: bool = False
    accuracy_budget: AccuracyBudget | None = None

    @model_validator(mode="after")
    def _lossy_opt_in(self) -> Workload:
        if self.allow_lossy and self.accuracy_budget is None:
            raise ValueError("an [accuracy_budget] table (max_logit_deviation and/or min_token_agreement) beside "
                             "allow_lossy = true, got none")
        if self.accuracy_budget is not None and not self.allow_lossy:
            raise ValueError("allow_lossy = true beside an [accuracy_budget] (the budget only applies to lossy "
                             "kernels, which are off without the opt-in), got allow_lossy = false")
        return self

    def lossy_budget(self) -> dict[str, float] | None:
        """The accuracy budget as data (for task specs and bundles), None without the opt-in."""
        if not self.allow_lossy or self.accuracy_budget is None:
            return None
        return self.accuracy_budget.model_dump(exclude_none=True)

    _toml_path: Path | None = PrivateAttr(default=None)
    _toml_text: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _fits_the_positions(self) -> "Workload":
        limit = max_positions(self.model) if getattr(self, "model", None) is not None else None
        if limit is not None and self.prompt_len + self.decode_len > limit:
            raise ValueError(f"prompt_len + decode_len within the model's max_position_embeddings ({limit}), got "
                             f"{self.prompt_len} + {self.decode_len} = {self.prompt_len + self.decode_len}")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def toml_path(self) -> Path | None:
        return self._toml_path

    def content_hash(self) -> str:
        """sha256 of the parsed TOML (not its text: a comment, whitespace or key order changes nothing the run
        depends on) and the script's bytes, first 16 hex digits."""
        parsed = (json.dumps(tomllib.loads(self._toml_text), sort_keys=True, default=str)
                  if self._toml_text is not None else self.model_dump_json())
        digest = hashlib.sha256()
        digest.update(parsed.encode())
        digest.update(b"\0")
        digest.update(Path(self.script).read_bytes() if Path(self.script).is_file() else b"")
        return digest.hexdigest()[:16]


def load_workload(path: str | Path, *, check_device: bool = True) -> Workload:
    """Read and validate a workload TOML. `check_device=False` skips the "is that GPU here" check."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise WorkloadError(f"expected a workload TOML file, got {'a directory' if path.is_dir() else 'no such file'}",
                            path=where)
    text = path.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"expected valid TOML, got a syntax error: {exc}", path=where) from None
    base = path.resolve().parent
    data = _resolve_paths(data, base)
    try:
        workload = Workload.model_validate(data)
    except ValidationError as exc:
        field, message = _describe(exc)
        raise WorkloadError(message, path=where, field=field) from None
    _check_files(workload, where)
    if check_device:
        problem = device_problem(workload.device)
        if problem:
            raise WorkloadError(f"field `device`: {problem}", path=where, field="device")
    workload._toml_path = path.resolve()
    workload._toml_text = text
    return workload


def device_problem(device: str) -> str | None:
    """Why `device` cannot be used on this machine, or None."""
    if not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return f"expected a machine with CUDA for device {device!r}, got torch.cuda.is_available() == False"
    index = int(device.split(":")[1]) if ":" in device else 0
    count = torch.cuda.device_count()
    if index >= count:
        return f"expected a CUDA device index below {count}, got {device!r}"
    return None


def load_script(workload: Workload) -> ModuleType:
    """Import the workload's inference script and check that it defines `build`, `inputs` and `run`."""
    script = Path(workload.script).resolve()
    if not script.is_file():
        raise ScriptError("expected an existing Python file, got no such file", script=str(script))
    name = "llm4llm_script_" + hashlib.sha256(str(script).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, script)
    if spec is None or spec.loader is None:
        raise ScriptError("expected an importable Python file (.py)", script=str(script))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so that classes defined in the script can be pickled and inspected
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise ScriptError(f"importing it raised {type(exc).__name__}: {exc}", script=str(script),
                          traceback_text=_user_traceback(exc)) from exc
    missing = [fn for fn in SCRIPT_FUNCTIONS if not callable(getattr(module, fn, None))]
    if missing:
        raise ScriptError(f"expected functions {', '.join(SCRIPT_FUNCTIONS)}, got none named {', '.join(missing)}",
                          script=str(script))
    return module


SCRIPT_TIMEOUT_EXIT = 3  # the exit status of a process stopped by the script time limit


def _script_timed_out(what: str, limit_s: float) -> None:
    """The time limit's end: one error line, every process this one started killed (Prefect's temporary server,
    workers, whatever the script spawned), then this process exits. Only processes below this one are killed, so a
    Prefect worker that started this flow run is not touched (tested through the CLI, not with a served run)."""
    sys.stderr.write(f"error: the workload script's {what} did not return within {limit_s:.0f} s "
                     f"(script_timeout_s in the workload TOML); stopped with every process it started\n")
    sys.stderr.flush()
    from llm4llm.verify.sandbox import descendants

    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(SCRIPT_TIMEOUT_EXIT)


def _time_limit(args: tuple) -> float:
    wl = next((a for a in args if isinstance(a, Workload)), None)
    return float(wl.script_timeout_s) if wl is not None else 0.0


# The stage whose script calls are running (profile, extract, accept, evaluate), for the heartbeat's line
SCRIPT_STAGE: contextvars.ContextVar[str] = contextvars.ContextVar("llm4llm_script_stage", default="")


@contextlib.contextmanager
def script_stage(name: str):
    token = SCRIPT_STAGE.set(name)
    try:
        yield
    finally:
        SCRIPT_STAGE.reset(token)


class _Heartbeat(threading.Thread):
    """Every `every_s` while one script call runs: one line on stderr with the stage, the call, the elapsed time,
    the limit that will stop it, and where the calling thread is now (its innermost frames): a slow call says what
    it is doing (compiling, capturing a graph, waiting on the GPU) in the log it leaves, even when it is killed."""

    def __init__(self, what: str, every_s: float, limit_s: float):
        super().__init__(daemon=True, name="llm4llm-script-heartbeat")
        self.what, self.every_s, self.limit_s = what, every_s, limit_s
        self.stage = SCRIPT_STAGE.get()
        self.caller = threading.get_ident()
        self.stopped = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        where = f"{self.stage}: " if self.stage else ""
        limit = (f"stopped at {self.limit_s:.0f} s (script_timeout_s)" if self.limit_s > 0
                 else "no time limit (script_timeout_s = 0)")
        while not self.stopped.wait(self.every_s):
            now = where_now(self.caller)
            sys.stderr.write(f"llm4llm: {where}the workload script's {self.what} still running after "
                             f"{time.monotonic() - self.t0:.0f} s; {limit}{'; now in ' + now if now else ''}\n")
            sys.stderr.flush()

    def stop(self) -> None:
        self.stopped.set()


def where_now(thread_id: int, frames: int = 6) -> str:
    """The innermost `frames` frames of a running thread, innermost first, as `file:line function` joined by
    ' < ' (file names without their directories); '' once the thread has ended."""
    import traceback

    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    stack = traceback.extract_stack(frame)[-frames:]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))


def call_script(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call a function of the user's script: its exceptions become ScriptError (with its traceback), running out
    of GPU memory becomes DeviceError, a call longer than the workload's script_timeout_s ends the process
    (`_script_timed_out`)."""
    limit = _time_limit(args)
    timer = threading.Timer(limit, _script_timed_out, (f"{_qualname(fn)}()", limit)) if limit > 0 else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    wl = next((a for a in args if isinstance(a, Workload)), None)
    beat = _Heartbeat(f"{_qualname(fn)}()", wl.script_heartbeat_s, limit) if wl and wl.script_heartbeat_s else None
    if beat is not None:
        beat.start()
    try:
        return fn(*args, **kwargs)
    except torch.cuda.OutOfMemoryError as exc:
        raise DeviceError(f"out of GPU memory in {_qualname(fn)}(): {exc}. Expected the workload to fit; try a "
                          f"smaller batch_size / prompt_len or a GPU with more free memory") from exc
    except Llm4llmError:
        raise
    except Exception as exc:
        if not torch.cuda.is_available() and _mentions_cuda(exc):
            raise DeviceError(f"{_qualname(fn)}() needs CUDA, but this machine has none "
                              f"(torch.cuda.is_available() == False): {type(exc).__name__}: {exc}") from exc
        raise ScriptError(f"{_qualname(fn)}() raised {type(exc).__name__}: {exc}", script=_script_of(fn),
                          traceback_text=_user_traceback(exc)) from exc
    finally:
        if timer is not None:
            timer.cancel()
        if beat is not None:
            beat.stop()


def config_fields(model_type: str) -> set[str]:
    """The fields a transformers config class knows: its defaults, its attribute aliases, its __init__ parameters
    and the PretrainedConfig base's."""
    import inspect

    from transformers import AutoConfig, PretrainedConfig

    cls = type(AutoConfig.for_model(model_type))
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    for c in (cls, PretrainedConfig):
        known |= {n for n in inspect.signature(c.__init__).parameters if n not in ("self", "kwargs")}
    return known


def _kept_as_is(model_type: str, key: str, value: Any) -> bool:
    """A key the config class does not consume (legacy aliases such as rope_theta are folded into other fields):
    transformers stores it verbatim, the sign of a field it does not know."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a one-field config trips checks against the other fields' defaults
    try:
        return key in AutoConfig.for_model(model_type, **{key: copy.deepcopy(value)}).to_dict()
    except Exception:  # noqa: BLE001 - the full config check below reports it
        return False
    finally:
        hf_logging.set_verbosity(before)


def _check_config(model_type: str | None, config: dict) -> None:
    import difflib

    from transformers import AutoConfig

    known = config_fields(model_type)
    for key in config:  # transformers keeps unknown keys as attributes: a typo would be silently ignored
        if key not in known and _kept_as_is(model_type, key, config[key]):
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"a field of {model_type}'s config, got unknown field {key!r}{hint}")
    try:
        AutoConfig.for_model(model_type, **copy.deepcopy(config))
    except Exception as exc:  # transformers validates field types and architecture constraints
        detail = " ".join(str(exc).split())
        raise ValueError(f"a valid {model_type} config, got {type(exc).__name__}: {detail}") from None


def max_positions(model: "ModelSpec") -> int | None:
    """max_position_embeddings of the model's config (random-weight models; None where it has none)."""
    if model.model_type is None:
        return None
    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.for_model(model.model_type, **copy.deepcopy(model.config)),
                       "max_position_embeddings", None)
    except Exception:  # noqa: BLE001 - an invalid config has its own error
        return None


def _resolve_paths(data: dict, base: Path) -> dict:
    """Make `script` and `model.checkpoint` absolute, relative to the TOML's directory."""
    data = dict(data)
    if isinstance(data.get("script"), str):
        data["script"] = str((base / Path(data["script"]).expanduser()).resolve())
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("checkpoint"), str):
        data["model"] = {**model, "checkpoint": str((base / Path(model["checkpoint"]).expanduser()).resolve())}
    return data


def _check_files(workload: Workload, where: str) -> None:
    if not workload.script.is_file():
        raise WorkloadError(f"field `script`: expected an existing Python file, got no such file {workload.script}",
                            path=where, field="script")
    checkpoint = workload.model.checkpoint
    if checkpoint is not None and not (checkpoint / "config.json").is_file():
        got = "a directory without config.json" if checkpoint.is_dir() else "no such directory"
        raise WorkloadError(f"field `model.checkpoint`: expected a local checkpoint directory with config.json, "
                            f"got {got}: {checkpoint}", path=where, field="model.checkpoint")


_NESTED = {"model": ModelSpec, "phase_weights": PhaseWeights, "accuracy_budget": AccuracyBudget}


def _describe(exc: ValidationError) -> tuple[str, str]:
    """(first field, one message) for a pydantic ValidationError: each problem as `field: expected ..., got ...`."""
    lines, fields = [], []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"]) or "(top level)"
        fields.append(field)
        lines.append(f"field `{field}`: {_expected_got(err)}")
    message = lines[0] if len(lines) == 1 else f"{len(lines)} problems:\n  " + "\n  ".join(lines)
    return fields[0], message


def _expected_got(err: dict) -> str:
    kind, msg, got = err["type"], err["msg"], err.get("input")
    if kind == "missing":
        return "a value (the field is required), got nothing"
    if kind == "extra_forbidden":
        parent = _NESTED.get(str(err["loc"][0])) if len(err["loc"]) > 1 else Workload
        known = ", ".join(parent.model_fields) if parent else "a known field"
        return f"one of the known fields ({known}), got an unknown field"
    if kind == "value_error":
        return "expected " + msg.removeprefix("Value error, ")
    if msg.startswith("Input should be "):
        return f"expected {msg.removeprefix('Input should be ')}, got {got!r}"
    if kind == "string_pattern_mismatch":
        return f"expected cpu, cuda or cuda:N, got {got!r}"
    return f"expected a valid value ({msg}), got {got!r}"


def _mentions_cuda(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "cuda" in text or "nvidia" in text


def _qualname(fn: Callable) -> str:
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


def _script_of(fn: Callable) -> str | None:
    code = getattr(fn, "__code__", None)
    return code.co_filename if code is not None else None


def _user_traceback(exc: BaseException) -> str:
    """The exception's traceback without llm4llm's own frames and importlib's machinery."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen importlib")):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))
