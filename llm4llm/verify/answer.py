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
