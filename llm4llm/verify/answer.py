"""Reading a worker's answer file in the parent: a regular file only, with a size limit and within the candidate's
time limit.

The worker writes each call's tensors to a file in its private dir and the parent reads it back. The worker runs the
candidate's code, so that file is the candidate's to replace: a FIFO would block the parent's read forever, a
symbolic link would have the parent read a file of its choosing, a huge file would take the search process to
gigabytes. So the parent opens it without following links and without blocking, refuses anything but a regular
file, reads at most `limit` bytes and stops at the deadline; the file is removed once read.
"""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path

# The largest answer the parent reads: a call's outputs and canaried buffers (weights over
# gates.WEIGHT_BUFFER_LIMIT stay in the worker) or the sampled timed outputs; more is refused, not read.
MAX_ANSWER_BYTES = 2 << 30
_CHUNK = 16 << 20


class AnswerError(Exception):
    """The worker's answer could not be read safely (the candidate process's doing)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def _open(work: Path, name: str) -> int:
    """An fd for `name` in `work`, neither following a link nor blocking on a FIFO."""
    try:
        st = os.lstat(work / name)
    except FileNotFoundError:
        raise AnswerError(f"the worker's answer {name} is missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise AnswerError(f"the worker's answer {name} is not a regular file ({_kind(st.st_mode)}): refused unread")
    try:
        dfd = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as e:  # swapped between the lstat and the open (a link: ELOOP)
        raise AnswerError(f"the worker's answer {name} could not be opened: {e}") from None


def read_answer(work: Path, name: str, limit: int = MAX_ANSWER_BYTES, deadline: float | None = None) -> bytes:
    """The bytes of the regular file `work/name` (at most `limit`, read before `deadline`, a time.monotonic()
    value), then the file removed. Raises AnswerError with the reason."""
    try:
        fd = _open(Path(work), name)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # swapped between the lstat and the open
                raise AnswerError(f"the worker's answer {name} is not a regular file ({_kind(st.st_mode)})")
            if st.st_size > limit:
                raise AnswerError(f"the worker's answer {name} is {st.st_size} bytes, over the limit of {limit}")
            chunks, got = [], 0
            while True:
                if deadline is not None and time.monotonic() > deadline:
                    raise AnswerError(f"the worker's answer {name}: not read within the candidate's time limit")
                chunk = os.read(fd, min(_CHUNK, limit + 1 - got))
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
                got += len(chunk)
                if got > limit:  # grew while read
                    raise AnswerError(f"the worker's answer {name} is over the limit of {limit} bytes")
        finally:
            os.close(fd)
    finally:
        try:
            os.unlink(Path(work) / name)
        except OSError:  # missing, or a directory: the worker's dir goes with the worker
            pass


# ------------------------------------------------------------------------------------------ delta-coded tensors
# A judged call's answer holds the state buffers the candidate updated in place: a decode step writes one position
# of a static KV cache, and at batch 32 with a 2k cache the full buffers are hundreds of MB a call, written, read and
# copied back to the device by every judged call (most of a serving task's verification time). Where both sides hold
# the tensor's pristine value (a buffer before the call: the draw, which each side makes from the same seed, inside
# its canary margins), the worker sends only the elements whose bits changed, `delta.<key>.idx` (int64, flat) and
# `delta.<key>.val`, and the parent rebuilds the tensor from its own pristine copy. Lossless and bit-exact (NaN and
# -0.0 included); a tensor that changed in more than DELTA_MAX_FRACTION of its elements goes whole.
DELTA_MAX_FRACTION = 0.25
_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _as_bits(t):
    import torch

    t = t.detach().contiguous().reshape(-1)
    return t.view(getattr(torch, _INT_OF_SIZE[t.element_size()])) if t.element_size() in _INT_OF_SIZE else None


def changed_elements(t, base):
    """The flat int64 indices where `t`'s bits differ from `base`'s (same shape and dtype), on t's device; None
    where they do not match, or where more than DELTA_MAX_FRACTION of the elements changed (sent or kept whole)."""
    if base is None or base.shape != t.shape or base.dtype != t.dtype or not t.numel():
        return None
    a, b = _as_bits(t), _as_bits(base)
    if a is None or b is None:
        return None
    idx = (a != b.to(a.device)).nonzero().reshape(-1)
    return idx if idx.numel() <= DELTA_MAX_FRACTION * t.numel() else None


def delta_encode(tensors: dict, bases: dict) -> dict:
    """`tensors` (device tensors by answer key) with each one that has a base of its shape and dtype replaced by
    its changed elements where they are few; the rest as given. Host tensors out."""
    out = {}
    for key, t in tensors.items():
        base = bases.get(key)
        idx = changed_elements(t, base() if callable(base) else base)
        if idx is not None:
            out[f"delta.{key}.idx"] = idx.cpu()
            out[f"delta.{key}.val"] = t.detach().contiguous().reshape(-1)[idx].cpu()
        else:
            out[key] = t.detach().to("cpu", copy=True).contiguous()
    return out


def delta_decode(saved: dict, bases: dict, device) -> dict:
    """The answer's tensors with every `delta.<key>.*` pair rebuilt on `device` from `bases[key]` (a tensor or a
    callable giving one). Raises AnswerError on a pair that does not fit its base (the candidate process's doing)."""
    import torch

    out = {k: v for k, v in saved.items() if not k.startswith("delta.")}
    keys = {k[len("delta."):].rsplit(".", 1)[0] for k in saved if k.startswith("delta.")}
    for key in keys:
        idx, val, base = saved.get(f"delta.{key}.idx"), saved.get(f"delta.{key}.val"), bases.get(key)
        base = base() if callable(base) else base
        if base is None or key in out:
            raise AnswerError(f"answer: {key!r} is delta-coded but has no base here, or is also sent whole")
        if idx is None or val is None or idx.dtype != torch.int64 or idx.dim() != 1 or val.dim() != 1 \
                or val.numel() != idx.numel() or val.dtype != base.dtype:
            raise AnswerError(f"answer: the delta of {key!r} is malformed")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= base.numel()):
            raise AnswerError(f"answer: the delta of {key!r} indexes outside its {base.numel()} elements")
        flat = base.detach().to(device, copy=True).contiguous().reshape(-1)
        flat[idx.to(device)] = val.to(device)
        out[key] = flat.view(base.shape)
    return out
