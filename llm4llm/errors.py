"""The errors llm4llm raises on purpose. Each renders as one clear message: what was expected, what was got."""
from __future__ import annotations


class Llm4llmError(Exception):
    """Base of every error llm4llm raises on purpose (anything else is a bug)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class WorkloadError(Llm4llmError):
    """A workload TOML that cannot be used: missing file, bad syntax, a missing or invalid field, a missing script,
    an unknown model type, a missing checkpoint, or a device this machine lacks."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None):
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.field = field


class ScriptError(Llm4llmError):
    """The user's inference script failed (on import or inside `build` / `inputs` / `run`), or breaks the contract.

    `traceback_text` is the script's own traceback, as Python formats it."""

    def __init__(self, message: str, *, script: str | None = None, traceback_text: str = ""):
        head = f"inference script {script}: {message}" if script else message
        body = f"\n\nThe script's traceback:\n{traceback_text.rstrip()}" if traceback_text else ""
        super().__init__(head + body)
        self.script = script
        self.traceback_text = traceback_text


class DeviceError(Llm4llmError):
    """The device cannot do what was asked: CUDA requested but absent, or out of memory."""


class TaskError(Llm4llmError):
    """A task artifact directory that cannot be written, read or used."""
