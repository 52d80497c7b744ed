"""The sandbox every process that runs candidate code starts in (verifier worker, sm_90 compile gate, in-model
acceptance trials). Standard library only (ctypes to libc): it must run on the GPU machine, where nothing can be
installed, and on the CPU machines.

The parent starts the child with `sandboxed_popen` (a fresh interpreter, `start_new_session`, an environment built
from an allowlist, a private working directory); the child's first act is `apply()`, before any candidate code or
heavy import. Layers, in the order the child applies them (docs/threat-model.md says what each stops):

  pdeathsig   PR_SET_PDEATHSIG(SIGKILL): the child dies with its parent (set again after the uid change, which
              clears it)
  netns       unshare(CLONE_NEWNET): a network namespace holding only a down loopback (no route anywhere)
  mountns     unshare(CLONE_NEWNS): HOME-like directories (/root, $HOME) covered by an empty tmpfs, with only the
              paths Python needs bound back; the project tree and the data dirs remounted read-only
  uid         setresgid/setresuid to 65534 (nobody), supplementary groups only those owning /dev/nvidia*
  landlock    writes only inside the private dir (and to /dev/null, /dev/nvidia*, its own /proc/<pid>/task for
              CUDA's thread names), exec only of the compiler
              toolchain (gcc, as, ld, ptxas, ldconfig), reads only below the system and Python trees, no TCP, no
              signals to or abstract sockets of processes outside (ABI >= 6)
  seccomp     socket() only for AF_UNIX; no SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGKILL sent to anyone; ptrace, process_vm_*, mount, unshare, setns, setsid, setpgid, bpf, keyctl,
              perf_event_open, io_uring, module loading: EPERM
The parent adds an RSS watchdog over the child's process group (`RssWatchdog`) and kills the group on timeout.

A layer the kernel or the container refuses is skipped and reported: a WARNING line on stderr and an entry in
`layers` ("off: <why>") that the verdict carries (Verdict.sandbox).
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from llm4llm.errors import Llm4llmError  # project code without third-party imports

SANDBOX_ENV = "LLM4LLM_SANDBOX"  # the JSON config the child reads (never holds a secret)
# "1": a layer under which CUDA does not initialise is left out (loudly) instead of stopping the run. Off by
# default: without Landlock a candidate can read world-readable files, write /tmp and start programs.
ALLOW_DROP_ENV = "LLM4LLM_SANDBOX_ALLOW_DROP"
OFF_ENV = "LLM4LLM_SANDBOX_OFF"  # "1": no sandbox at all (debugging only; every verdict then says so)
NOBODY = 65534
ALL_LAYERS = ("pdeathsig", "netns", "mountns", "uid", "landlock", "seccomp")

# Variables a candidate process may see (exact names, or prefixes ending in "_"); everything else is dropped, and
# so is any of these whose name or value looks secret (llm4llm.redact decides).
ENV_ALLOW = {"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
             "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_HOME", "CUDA_PATH",
             "CUDA_LAUNCH_BLOCKING", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "CC", "CXX",
             "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF"}
ENV_ALLOW_PREFIXES = ("TRITON_", "LLM4LLM_", "TORCH_", "NCCL_DEBUG")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_SET_DUMPABLE = 1, 38, 22, 4
CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER, CLONE_NEWIPC = 0x00020000, 0x40000000, 0x10000000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = (
    1, 2, 4, 32, 4096, 8192, 16384, 1 << 18)


def _err(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


# ------------------------------------------------------------------------------------------------- the parent side

def _secret_like(name: str, value: str) -> bool:
    from llm4llm.redact import is_secret_name, secret_env_values

    return is_secret_name(name) or value in secret_env_values()


def clean_env(box: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The child's whole environment: allowlisted variables without secrets, HOME/TMPDIR/caches in the box."""
    env = {k: v for k, v in os.environ.items()
           if (k in ENV_ALLOW or k.startswith(ENV_ALLOW_PREFIXES)) and not _secret_like(k, v)}
    env.pop(SANDBOX_ENV, None)
    work = box / "work"
    env.update(HOME=str(work), TMPDIR=str(work / "tmp"), USER="nobody", LOGNAME="nobody",
               TRITON_CACHE_DIR=str(work / ".triton"), TRITON_HOME=str(work), XDG_CACHE_HOME=str(work / ".cache"),
               PYTHONDONTWRITEBYTECODE="1",
               # a stage's own lines ("accept: ...") reach the log and the terminal as printed, not when the child
               # ends: a child stopped at its limit lost them all (an acceptance stopped after 2:42 said nothing)
               PYTHONUNBUFFERED="1",
               # joblib probes a POSIX semaphore at import, which the sandbox refuses, and warns once per process
               JOBLIB_MULTIPROCESSING="0")
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    if (cc := child_compiler()) and cc != env.get("CC"):
        env["CC"] = cc  # a binary: a compiler wrapper script would need a shell, which the child may not exec
    if "TRITON_LIBCUDA_PATH" not in env and (cuda_dir := libcuda_dir()):
        env["TRITON_LIBCUDA_PATH"] = cuda_dir  # else Triton runs /sbin/ldconfig, a shell script the child may not exec
    # the interpreter's own tree first, so a venv's python resolves the same packages in the child
    env["PYTHONPATH"] = os.pathsep.join(p for p in [_project_root(), env.get("PYTHONPATH", "")] if p)
    env.update(extra or {})
    return env


_CC: list[str | None] = []


def _is_binary(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def child_compiler() -> str | None:
    """The C compiler the child's Triton is to use for its launcher: the one Triton would pick (CC, then gcc, then
    clang) when that is a binary, else the first binary gcc/cc/clang on PATH or in /usr/bin. A wrapper script
    (such as an /opt/gcc/bin/gcc that execs the real one) cannot run in the child: Landlock lets it exec only the
    toolchain's binaries, never a shell."""
    if not _CC:
        names = [os.environ.get("CC", ""), "gcc", "clang", "cc", "/usr/bin/gcc", "/usr/bin/cc", "/usr/bin/clang"]
        found = [p for p in (_which(n) if n and not os.path.isabs(n) else (os.path.realpath(n) if n else None)
                             for n in names) if p and os.path.exists(p)]
        _CC.append(next((p for p in found if _is_binary(p)), None))
    return _CC[0]


_LIBCUDA: list[str | None] = []


def libcuda_dir() -> str | None:
    """The directory of libcuda.so.1, found the way Triton finds it (`ldconfig -p`, then LD_LIBRARY_PATH), once
    per process in the parent. On Debian and Ubuntu /sbin/ldconfig is a shell script, which Landlock keeps the
    child from running (Triton's driver then fails with PermissionError), so the child is told the answer."""
    if not _LIBCUDA:
        out = ""
        for prog in ("/sbin/ldconfig", "/sbin/ldconfig.real", "ldconfig"):
            try:
                out = subprocess.run([prog, "-p"], capture_output=True, text=True, timeout=20).stdout
                break
            except (OSError, subprocess.SubprocessError):
                continue
        _LIBCUDA.append(parse_libcuda_dir(out, os.environ.get("LD_LIBRARY_PATH", "")))
    return _LIBCUDA[0]


def parse_libcuda_dir(ldconfig_p: str, ld_library_path: str = "") -> str | None:
    locs = [ln.split()[-1] for ln in ldconfig_p.splitlines() if "libcuda.so.1" in ln and "=>" in ln]
    dirs = [os.path.dirname(p) for p in locs if os.path.exists(p)]
    dirs += [d for d in ld_library_path.split(os.pathsep) if d and os.path.exists(os.path.join(d, "libcuda.so.1"))]
    return dirs[0] if dirs else None


def _project_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def make_box(prefix: str = "llm4llm-sbx-") -> Path:
    """A private directory: box/ (root-owned, 0711), box/work (the child's, 0700, its cwd and only writable place),
    box/ro (root-owned, read-only: the task artifacts the child may read)."""
    box = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(box, 0o711)
    work, ro = box / "work", box / "ro"
    work.mkdir(mode=0o700)
    (work / "tmp").mkdir(mode=0o700)
    ro.mkdir(mode=0o755)
    if os.geteuid() == 0:
        for p in (work, work / "tmp"):
            os.chown(p, NOBODY, NOBODY)
    return box


def _link_or_copy(src: str, dst: str) -> str:
    """A hard link where src and dst share a filesystem (no bytes move: a 7B serving regime's decoder-layer task is
    GBs of KV-cache cases, copied once per verified candidate), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def copy_readonly(src: Path, dst: Path) -> Path:
    """A task's artifact dir in the box, owned by this (parent) user, files 0444 and dirs 0555. As root (the child
    then runs as nobody, which can neither write nor chmod root's 0444 files) the files are hard-linked where they
    share a filesystem with the box, and the originals turn 0444 too (task artifacts are written once; re-extraction
    replaces the whole dir); else, or across filesystems, copied (a child of the same user could chmod a link and
    write through it into the original)."""
    shutil.copytree(src, dst, symlinks=False, copy_function=_link_or_copy if os.geteuid() == 0 else shutil.copy2)
    for root, dirs, files in os.walk(dst):
        for f in files:
            p = os.path.join(root, f)
            if os.stat(p).st_mode & 0o777 != 0o444:  # a chmod moves the inode's ctime even to the same mode
                os.chmod(p, 0o444)
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o555)
    os.chmod(dst, 0o555)
    return dst


def remove_box(box: Path) -> None:
    def unlock(func, path, _exc):
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass

    shutil.rmtree(box, onerror=unlock)


def sandbox_disabled() -> bool:
    return os.environ.get(OFF_ENV, "") == "1"


def sandboxed_popen(target: str, *, box: Path, pass_fds: tuple[int, ...] = (), args: list[str] | None = None,
                    readonly: list[str] | None = None, extra_env: dict[str, str] | None = None,
                    layers: tuple[str, ...] = ALL_LAYERS, extra_needed: list[str] | None = None,
                    wrapper: list[str] | None = None, cuda_check: bool = True, **popen_kw) -> subprocess.Popen:
    """Start `python -c <boot>` that applies the sandbox then calls `target` ("module:function", with `args` as
    sys.argv[1:]). The child is its own session (process group = its pid: kill the group with `kill_group`).
    On a host with CUDA, a layer under which the driver does not initialise is left out (`cuda_dropped_layers`)."""
    dropped = cuda_dropped_layers() if cuda_check and not sandbox_disabled() else {}
    layers = tuple(x for x in layers if x not in dropped)
    cfg = {"target": target, "box": str(box), "layers": [] if sandbox_disabled() else list(layers),
           "dropped": dropped,
           "parent": 0 if wrapper else os.getpid(),
           "needed": sorted(set(needed_paths()) | {os.path.realpath(p) for p in extra_needed or [] if os.path.exists(p)}), "readonly": readonly or [],
           "exec": exec_allowlist(), "devgids": device_gids(),
           "hide": sorted({"/root", os.path.expanduser("~")} - {"/", ""}),
           "cover": git_dirs(_project_root())}
    env = clean_env(box, {**(extra_env or {}), SANDBOX_ENV: json.dumps(cfg)})
    boot = "from llm4llm.verify.sandbox import boot; boot()"
    return subprocess.Popen([*(wrapper or []), sys.executable, "-c", boot, *(args or [])], env=env, cwd=str(box / "work"),
                            pass_fds=pass_fds, start_new_session=True, close_fds=True, **popen_kw)


_CUDA_DROPPED: dict[str, str] | None = None
# the layers tried away one at a time when CUDA fails under all of them, likeliest first (Landlock alone can stop
# cuInit: "Error 304: OS call failed or operation not supported on this OS")
_CUDA_SUSPECTS = ("landlock", "seccomp", "uid", "mountns", "netns")


class SandboxCudaError(Llm4llmError):
    """CUDA initialises on this host but under no sandbox this module can build."""


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def cuda_init_error() -> str | None:
    """None when the CUDA driver initialises in this process (cuInit), else its error."""
    lib = _libcuda()
    if lib is None:
        return "libcuda.so.1 not found"
    rc = lib.cuInit(0)
    return None if rc == 0 else f"cuInit returned {rc}"


def _cuda_probe(layers: tuple[str, ...]) -> str | None:
    """None when cuInit succeeds in a child sandboxed with `layers`, else why not."""
    box = make_box("llm4llm-cudaprobe-")
    try:
        proc = sandboxed_popen("llm4llm.verify.sandbox:cuda_probe_main", box=box, layers=layers, cuda_check=False,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            kill_group(proc.pid)
        return None if proc.returncode == 0 else (out.strip() or err.strip()[-200:] or f"exit {proc.returncode}")
    finally:
        remove_box(box)


def cuda_dropped_layers() -> dict[str, str]:
    """Whether CUDA initialises inside the sandbox on this host (probed once per process: cuInit in a child under
    every layer). {} on a host without CUDA or where it does. Where it does not, the one layer whose absence lets it
    through is named in a SandboxCudaError (fail closed); with LLM4LLM_SANDBOX_ALLOW_DROP=1 it is left out instead,
    returned as {layer: why}: a WARNING line and an "off: ..." entry in every verdict's `sandbox`. No single layer
    explaining it is a SandboxCudaError either way."""
    global _CUDA_DROPPED
    if _CUDA_DROPPED is not None:
        return _CUDA_DROPPED
    if os.environ.get("LLM4LLM_SANDBOX_CUDA_PROBE", "1") == "0" or cuda_init_error() is not None:
        _CUDA_DROPPED = {}
        return _CUDA_DROPPED
    err = _cuda_probe(ALL_LAYERS)
    if err is None:
        _CUDA_DROPPED = {}
        return _CUDA_DROPPED
    for layer in _CUDA_SUSPECTS:
        if _cuda_probe(tuple(x for x in ALL_LAYERS if x != layer)) is None:
            if os.environ.get(ALLOW_DROP_ENV, "") != "1":
                raise SandboxCudaError(
                    f"sandbox: CUDA does not initialise under the {layer} layer on this host ({err[:160]}); "
                    f"{ALLOW_DROP_ENV}=1 runs candidates without that layer, {OFF_ENV}=1 without any (debugging)")
            why = f"CUDA does not initialise under it on this host ({err[:160]}); left out for this run"
            print(f"WARNING: llm4llm sandbox: layer {layer} {why}", file=sys.stderr, flush=True)
            _CUDA_DROPPED = {layer: why}
            return _CUDA_DROPPED
    raise SandboxCudaError(f"sandbox: CUDA does not initialise in the sandbox on this host ({err[:200]}), with any "
                           f"one layer left out either; {OFF_ENV}=1 runs candidates unsandboxed (debugging only)")


def cuda_probe_main() -> int:
    """Child side of `_cuda_probe`: exit 0 when cuInit succeeds under the applied layers."""
    err = cuda_init_error()
    print(err or "ok")
    return 0 if err is None else 3


def kill_group(pid: int | None) -> None:
    """SIGKILL the child's whole process group (it is a session leader; grandchildren inherit its group)."""
    if not pid:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def proc_stats():
    """(pid, the fields of /proc/<pid>/stat after the command name: state, ppid, pgrp, ...) of every process."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                yield int(d), f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (parents before their children)."""
    children: dict[int, list[int]] = {}
    for p, fields in proc_stats():
        children.setdefault(int(fields[1]), []).append(p)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every process in group `pgid` (from /proc)."""
    total, page = 0, os.sysconf("SC_PAGE_SIZE")
    for p, fields in proc_stats():
        if int(fields[2]) != pgid:
            continue
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
    return total


def default_mem_limit() -> int:
    """LLM4LLM_SANDBOX_MEM_MB, else half of this machine's physical memory."""
    mb = os.environ.get("LLM4LLM_SANDBOX_MEM_MB")
    if mb:
        return int(float(mb) * (1 << 20))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class RssWatchdog(threading.Thread):
    """Kills the group when its summed RSS passes `limit` bytes (CUDA maps far more virtual memory than it uses, so
    RLIMIT_AS would break it; RSS is what exhausts the machine)."""

    def __init__(self, pgid: int, limit: int, every_s: float = 0.25):
        super().__init__(daemon=True, name=f"llm4llm-rss-{pgid}")
        self.pgid, self.limit, self.every_s = pgid, limit, every_s
        self.tripped: int | None = None  # the RSS seen when it fired
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.every_s):
            rss = group_rss_bytes(self.pgid)
            if rss > self.limit:
                self.tripped = rss
                kill_group(self.pgid)
                return

    def stop(self) -> None:
        self._stop.set()


def needed_paths() -> list[str]:
    """What the child must read: the interpreter's trees, sys.path, the project."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))), _project_root()}
    paths |= {p for p in sys.path if p and os.path.isdir(p)}
    paths |= {os.path.realpath(p) for p in list(paths)}
    return sorted(p for p in paths if os.path.exists(p))


def _which(name: str) -> str | None:
    p = shutil.which(name)
    return os.path.realpath(p) if p else None


_EXEC_CACHE: list[str] | None = None
NVCC_TOOLS = ("nvcc", "ptxas", "fatbinary", "nvlink", "cudafe++", "bin2c")


def exec_allowlist() -> list[str]:
    """Programs the child may exec: the C toolchain Triton's launcher build uses, ldconfig (Triton looks for
    libcuda with it), Triton's bundled CUDA tools, the CUDA toolkit's compiler (nvcc and its tools) and the dynamic
    loader. Never a shell, never Python."""
    global _EXEC_CACHE
    if _EXEC_CACHE is not None:
        return _EXEC_CACHE
    progs = set()
    for name in ("cc", "gcc", "clang", os.environ.get("CC", ""), child_compiler() or ""):
        p = _which(name) if name else None
        if p:
            progs.add(p)
            for tool in ("cc1", "as", "ld", "collect2", "lto-wrapper", "ld.bfd", "ld.gold"):
                try:
                    out = subprocess.run([p, f"-print-prog-name={tool}"], capture_output=True, text=True,
                                         timeout=10).stdout.strip()
                except (OSError, subprocess.SubprocessError):
                    continue
                q = out if os.path.isabs(out) else _which(out)
                if q and os.path.exists(q):
                    progs.add(os.path.realpath(q))
    for name in ("as", "ld", "ldconfig", "/sbin/ldconfig", "ldconfig.real", "/sbin/ldconfig.real"):
        p = os.path.realpath(name) if os.path.isabs(name) and os.path.exists(name) else _which(name)
        if p:
            progs.add(p)
    for loader in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1", "/lib/ld-linux-x86-64.so.2"):
        if os.path.exists(loader):
            progs.add(os.path.realpath(loader))
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
        if spec and spec.origin:
            b = Path(spec.origin).parent / "backends" / "nvidia" / "bin"
            if b.is_dir():
                progs.add(str(b.resolve()))
    except (ImportError, ValueError):
        pass
    # CUDA's compiler driver and the tools a compile runs (torch.compile's inductor runs nvcc in the evaluate
    # step's child, beside the bundle's kernels), each by name like the C toolchain above: not the whole toolkit
    # bin (profilers, debuggers)
    nvcc = _which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc:
        bin_dir = Path(os.path.realpath(nvcc)).parent
        for tool in [bin_dir / t for t in NVCC_TOOLS] + [bin_dir.parent / "nvvm" / "bin" / "cicc"]:
            if tool.is_file():
                progs.add(str(tool.resolve()))
    try:  # torch's own ptxas (torch/bin): inductor points Triton at it when it compiles a graph
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec and spec.origin and (Path(spec.origin).parent / "bin" / "ptxas").is_file():
            progs.add(str((Path(spec.origin).parent / "bin" / "ptxas").resolve()))
    except (ImportError, ValueError):
        pass
    for env_tool in ("TRITON_PTXAS_PATH", "TRITON_CUOBJDUMP_PATH", "TRITON_NVDISASM_PATH"):
        if os.environ.get(env_tool):
            progs.add(os.path.realpath(os.environ[env_tool]))
    _EXEC_CACHE = sorted(progs)
    return _EXEC_CACHE


def device_gids() -> list[int]:
    gids = set()
    for d in Path("/dev").glob("nvidia*"):
        try:
            gids.add(d.stat().st_gid)
        except OSError:
            pass
    return sorted(g for g in gids if g != 0)


# -------------------------------------------------------------------------------------------------- the child side

LAYERS: dict[str, str] = {}  # layer -> "on" | "off: why", filled by apply()


def _warn(layer: str, why: str) -> None:
    LAYERS[layer] = f"off: {why}"
    print(f"WARNING: llm4llm sandbox: layer {layer} unavailable: {why}", file=sys.stderr, flush=True)


def boot() -> None:
    """The child's entry point: apply the sandbox from $LLM4LLM_SANDBOX, then call the target."""
    cfg = json.loads(os.environ.pop(SANDBOX_ENV))
    apply(cfg)
    os.environ["LLM4LLM_SANDBOX_LAYERS"] = json.dumps(LAYERS)
    mod, _, fn = cfg["target"].partition(":")
    import importlib

    sys.argv = [cfg["target"], *sys.argv[1:]]
    rc = getattr(importlib.import_module(mod), fn)()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(rc or 0))


def apply(cfg: dict[str, Any]) -> dict[str, str]:
    want = set(cfg.get("layers", ()))
    box = Path(cfg["box"])
    LAYERS.clear()
    if not want:
        for layer in ALL_LAYERS:
            _warn(layer, f"sandbox turned off ({OFF_ENV}=1)")
        return LAYERS
    parent = int(cfg["parent"])
    if "pdeathsig" in want:
        _pdeathsig(parent)
    root = os.geteuid() == 0
    if "netns" in want:
        _try("netns", _net_ipc_ns)
    if "mountns" in want:
        _try("mountns", lambda: _mount_ns(box, cfg["needed"], cfg.get("readonly", []), cfg.get("hide", ["/root"]),
                                          cfg.get("cover", [])))
    if "uid" in want:
        if not root:
            _warn("uid", f"not started as root (uid {os.geteuid()}): runs as that uid")
        else:
            _try("uid", lambda: _drop_uid(cfg["needed"], cfg.get("devgids", [])))
        if "pdeathsig" in want:
            _pdeathsig(parent)  # a credential change clears it
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if "landlock" in want:
        _try("landlock", lambda: _landlock(box, cfg["needed"], cfg.get("exec", [])))
    if "seccomp" in want:
        _try("seccomp", _seccomp)
    for layer in ALL_LAYERS:
        if layer not in want:
            _warn(layer, cfg.get("dropped", {}).get(layer, "not requested for this process"))
    os.chdir(box / "work")
    os.umask(0o077)
    return LAYERS


def _try(layer: str, fn) -> None:
    try:
        note = fn()
        LAYERS[layer] = "on" + (f" ({note})" if note else "")
    except Exception as e:  # noqa: BLE001 - a refused layer is reported, never fatal
        _warn(layer, f"{type(e).__name__}: {e}")


def _pdeathsig(parent: int) -> None:
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        _warn("pdeathsig", str(_err("prctl(PR_SET_PDEATHSIG)")))
        return
    LAYERS["pdeathsig"] = "on" if parent else "on (the direct parent is a wrapper tool)"
    if parent and os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def _unshare(flags: int, what: str) -> None:
    if _libc.unshare(flags) != 0:
        raise _err(what)


def _net_ipc_ns() -> str:
    """A network namespace and, with it, an IPC namespace: SysV shared memory, semaphores and message queues (and
    POSIX message queues) a candidate creates die with its worker instead of reaching the next candidate's."""
    if _libc.unshare(CLONE_NEWNET | CLONE_NEWIPC) == 0:
        return "with its own IPC namespace"
    _unshare(CLONE_NEWNET, "unshare(CLONE_NEWNET)")
    return f"IPC namespace shared: {_err('unshare(CLONE_NEWIPC)')}"


def git_dirs(root: str) -> list[str]:
    """The git metadata of the project tree at `root`: its `.git` (a directory, or a worktree's file) and, for a
    worktree, the repository's own git dir the file points to (config, remotes, every branch's objects)."""
    dot = os.path.join(root, ".git")
    if os.path.isdir(dot):
        return [dot]
    if not os.path.isfile(dot):
        return []
    out = [dot]
    try:
        line = Path(dot).read_text(errors="replace").strip()
    except OSError:
        return out
    if line.startswith("gitdir:"):
        gd = os.path.realpath(os.path.join(root, line.removeprefix("gitdir:").strip()))
        common = os.path.dirname(os.path.dirname(gd)) if os.path.basename(os.path.dirname(gd)) == "worktrees" else gd
        out += [p for p in (common,) if os.path.isdir(p)]
    return out


def _cover(path: str) -> None:
    """Make `path` empty and read-only in this mount namespace: a directory under an empty tmpfs, a file under
    /dev/null."""
    if os.path.isdir(path):
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=0555,size=4k")
    elif os.path.isfile(path):
        _mount("/dev/null", path, None, MS_BIND)
        _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def _private_proc() -> None:
    """A procfs of its own with hidepid=invisible: once the uid drops, other users' processes (the parent, the
    user's shells and their command lines) are not listed or readable; the worker's own entries stay, as CUDA
    needs them."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | (1 << 3), "hidepid=invisible")  # 1 << 3: MS_NOEXEC


def _mount(src, target, fstype, flags, data=None) -> None:
    enc = lambda s: s.encode() if isinstance(s, str) else s  # noqa: E731
    if _libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise _err(f"mount({src}, {target}, {fstype})")


def _other_can_enter(path: str) -> bool:
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


def _mount_ns(box: Path, needed: list[str], readonly: list[str], hide: list[str], cover: list[str] = ()) -> str:
    """Hide HOME-like dirs behind an empty tmpfs (binding back only what Python needs below them), make the
    project tree and data dirs read-only, empty the paths in `cover` (the project's git metadata), and mount a
    procfs that lists only the worker's own uid's processes, in a private mount namespace."""
    _unshare(CLONE_NEWNS, "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    notes = []
    for top in sorted(h for h in hide if os.path.isdir(h) and not str(box).startswith(h + "/")):
        keep = sorted({os.sep.join(Path(p).parts[:len(Path(top).parts) + 1]).replace("//", "/")
                       for p in needed if p.startswith(top + "/")})
        if any(p == top for p in needed):
            notes.append(f"{top} kept (needed itself)")
            continue
        staged = []
        for i, k in enumerate(keep):
            st = box / f".stage{i}"
            st.mkdir(mode=0o700, exist_ok=True)
            _mount(k, str(st), None, MS_BIND | MS_REC)
            staged.append((st, k))
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for st, k in staged:
            os.makedirs(k, mode=0o755, exist_ok=True)
            _mount(str(st), k, None, MS_MOVE)
            st.rmdir()
        notes.append(f"{top} hidden" + (f" except {', '.join(keep)}" if keep else ""))
    for p in readonly:
        if os.path.exists(p) and not str(box).startswith(p.rstrip("/") + "/"):
            _mount(p, p, None, MS_BIND | MS_REC)
            _mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
            notes.append(f"{p} read-only")
    for p in cover:
        if os.path.exists(p) and not str(box).startswith(p.rstrip("/") + "/"):
            _cover(p)
            notes.append(f"{p} empty")
    try:
        _private_proc()
        notes.append("/proc: other users' processes hidden")
    except OSError as e:  # an older kernel or a container that refuses a new procfs: the rest still holds
        notes.append(f"/proc shared ({e})")
    return "; ".join(notes)


def _drop_uid(needed: list[str], devgids: list[int]) -> str:
    blocked = [p for p in needed if not all(_other_can_enter(str(a)) for a in [Path(p), *Path(p).parents])]
    if blocked:
        raise PermissionError(f"uid {NOBODY} could not reach {blocked[0]} (a parent dir without o+x)")
    os.setgroups(devgids)
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    return f"uid/gid {NOBODY}" + (f", groups {devgids}" if devgids else "")


# Landlock (linux/landlock.h)
_LL = dict(EXECUTE=1 << 0, WRITE_FILE=1 << 1, READ_FILE=1 << 2, READ_DIR=1 << 3, REMOVE_DIR=1 << 4,
           REMOVE_FILE=1 << 5, MAKE_CHAR=1 << 6, MAKE_DIR=1 << 7, MAKE_REG=1 << 8, MAKE_SOCK=1 << 9,
           MAKE_FIFO=1 << 10, MAKE_BLOCK=1 << 11, MAKE_SYM=1 << 12, REFER=1 << 13, TRUNCATE=1 << 14)
_NR_LL_CREATE, _NR_LL_ADD, _NR_LL_RESTRICT = 444, 445, 446  # the same on x86_64 and aarch64
_FILE_RIGHTS = _LL["EXECUTE"] | _LL["WRITE_FILE"] | _LL["READ_FILE"] | _LL["TRUNCATE"]
READ_ROOTS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/opt", "/proc", "/sys", "/dev",
              "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives",
              "/etc/nsswitch.conf", "/usr/local/cuda", "/run/nvidia-persistenced")


def landlock_abi() -> int:
    r = _libc.syscall(_NR_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return int(r) if r > 0 else 0


def _landlock(box: Path, needed: list[str], execs: list[str]) -> str:
    abi = landlock_abi()
    if abi < 1:
        raise OSError(errno.ENOSYS, "Landlock not supported by this kernel (or disabled)")
    write = sum(v for k, v in _LL.items() if k not in ("EXECUTE", "READ_FILE", "READ_DIR"))
    if abi < 2:
        write &= ~_LL["REFER"]
    if abi < 3:
        write &= ~_LL["TRUNCATE"]
    read = _LL["READ_FILE"] | _LL["READ_DIR"]
    handled = write | read | _LL["EXECUTE"]
    attr = struct.pack("=QQQ", handled, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)  # no TCP; scoped signals+unix
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    buf = ctypes.create_string_buffer(attr[:size], size)
    fd = _libc.syscall(_NR_LL_CREATE, buf, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise _err("landlock_create_ruleset")
    fd = int(fd)
    try:
        def allow(path: str, access: int) -> None:
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                return
            try:
                if not os.path.isdir(path):
                    access &= _FILE_RIGHTS
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access & handled, pfd), 12)
                if _libc.syscall(_NR_LL_ADD, ctypes.c_int(fd), ctypes.c_int(1), rule, ctypes.c_uint32(0)) != 0:
                    raise _err(f"landlock_add_rule({path})")
            finally:
                os.close(pfd)

        for p in (*READ_ROOTS, *needed):
            allow(p, read)
        # CUDA's cuInit names its threads through /proc/<pid>/task/<tid>/comm and fails with error 304 when it
        # cannot (NVIDIA/OpenShell#1486). The rule is made here, in the child, so
        # it binds to this process's own task directory: threads created later sit beneath it, nothing else of
        # /proc becomes writable.
        task = f"/proc/{os.getpid()}/task"
        allow(task, read | _LL["WRITE_FILE"] | _LL["TRUNCATE"])  # fopen(path, "w") truncates
        allow(str(box / "ro"), read)
        allow(str(box / "work"), read | write)
        for dev in ("/dev/null", "/dev/zero", "/dev/full", "/dev/urandom", "/dev/random", "/dev/tty",
                    *map(str, Path("/dev").glob("nvidia*"))):
            allow(dev, read | _LL["WRITE_FILE"])
        for p in execs:
            allow(p, read | _LL["EXECUTE"])
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise _err("prctl(PR_SET_NO_NEW_PRIVS)")
        if _libc.syscall(_NR_LL_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise _err("landlock_restrict_self")
    finally:
        os.close(fd)
    return f"ABI {abi}" + ("" if abi >= 6 else ": signals and abstract sockets not scoped (ABI < 6)")


# seccomp: a classic-BPF filter over (arch, nr, args[0])
_ARCH = {"x86_64": (0xC000003E, {"socket": 41, "ptrace": 101, "mount": 165, "umount2": 166, "unshare": 272,
                                  "setns": 308, "bpf": 321, "keyctl": 250, "add_key": 248, "request_key": 249,
                                  "perf_event_open": 298, "process_vm_readv": 310, "process_vm_writev": 311,
                                  "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                                  "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246,
                                  "reboot": 169, "pivot_root": 155, "chroot": 161, "open_by_handle_at": 304,
                                  "userfaultfd": 323, "setsid": 112, "setpgid": 109, "swapon": 167,
                                  "swapoff": 168, "fsopen": 430, "fsmount": 432, "move_mount": 429,
                                  "open_tree": 428}),
         "aarch64": (0xC00000B7, {"socket": 198, "ptrace": 117, "mount": 40, "umount2": 39, "unshare": 97,
                                   "setns": 268, "bpf": 280, "keyctl": 219, "add_key": 217, "request_key": 218,
                                   "perf_event_open": 241, "process_vm_readv": 270, "process_vm_writev": 271,
                                   "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                                   "init_module": 105, "finit_module": 273, "delete_module": 106,
                                   "kexec_load": 104, "reboot": 142, "pivot_root": 41, "chroot": 51,
                                   "open_by_handle_at": 265, "userfaultfd": 282, "setsid": 157, "setpgid": 154,
                                   "swapon": 224, "swapoff": 225, "fsopen": 430, "fsmount": 432,
                                   "move_mount": 429, "open_tree": 428})}
# (syscall, index of its signal argument): a candidate may not send the signals that mean "stopped from outside", so
# a worker that dies of one was stopped from outside (the verdict's `interrupted`), never by the candidate itself
_SIGNALLERS = {"x86_64": {62: 1, 200: 1, 234: 2, 129: 1, 297: 2, 424: 1},
               "aarch64": {129: 1, 130: 1, 131: 2, 138: 1, 240: 2, 424: 1}}
OUTSIDE_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGKILL, signal.SIGTERM)
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_ABS_W, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    arch, nrs = _ARCH[machine]
    prog = [(_LD_ABS_W, 0, 0, 4), (_JEQ_K, 1, 0, arch), (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),
            (_LD_ABS_W, 0, 0, 0)]
    if machine == "x86_64":  # the x32 ABI's numbers alias the filtered ones
        prog += [(_JGE_K, 0, 1, 0x40000000), (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM)]
    for name, nr in nrs.items():
        if name != "socket":
            prog += [(_JEQ_K, 0, 1, nr), (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM)]
    for nr, arg in _SIGNALLERS[machine].items():
        block = [(_LD_ABS_W, 0, 0, 16 + 8 * arg)]
        for sig in OUTSIDE_SIGNALS:
            block += [(_JEQ_K, 0, 1, int(sig)), (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM)]
        block.append((_RET_K, 0, 0, _RET_ALLOW))
        prog += [(_JEQ_K, 0, len(block), nr), *block]
    prog += [(_JEQ_K, 0, 3, nrs["socket"]), (_LD_ABS_W, 0, 0, 16), (_JEQ_K, 1, 0, 1),  # args[0] == AF_UNIX
             (_RET_K, 0, 0, _RET_ERRNO | errno.EAFNOSUPPORT), (_RET_K, 0, 0, _RET_ALLOW)]
    return prog


def _seccomp() -> str:
    machine = os.uname().machine
    if machine not in _ARCH:
        raise OSError(errno.ENOSYS, f"no syscall table for {machine}")
    prog = seccomp_program(machine)
    filt = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    fbuf = ctypes.create_string_buffer(filt, len(filt))
    fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(fbuf))  # struct sock_fprog (padded to 16)
    pbuf = ctypes.create_string_buffer(fprog, len(fprog))
    if _libc.prctl(PR_SET_SECCOMP, 2, ctypes.addressof(pbuf), 0, 0) != 0:  # SECCOMP_MODE_FILTER
        raise _err("prctl(PR_SET_SECCOMP)")
    return f"{len(prog)} instructions"


def layers_from_env() -> dict[str, str]:
    """In a sandboxed child: what apply() reported."""
    try:
        return json.loads(os.environ.get("LLM4LLM_SANDBOX_LAYERS", "{}"))
    except ValueError:
        return {}


def layer_summary(layers: dict[str, str]) -> str:
    off = {k: v for k, v in layers.items() if not v.startswith("on")}
    return "all layers on" if not off else "; ".join(f"{k} {v}" for k, v in off.items())


# ------------------------------------------------------------------------- a function call in the sandbox (pickle)

_SAFE_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "str", "bytes", "bytearray", "int", "float",
                  "complex", "bool", "slice", "range", "object"}
_SAFE_GLOBALS = {("collections", "OrderedDict"), ("copyreg", "_reconstructor"), ("datetime", "datetime"),
                 ("datetime", "date"), ("datetime", "timedelta"), ("pathlib", "PosixPath"),
                 ("pathlib", "PurePosixPath"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                 ("numpy._core.multiarray", "scalar")}


class SafeUnpickler:
    """Unpickles what a sandboxed child returned, allowing only plain containers, exception classes and the classes
    (never functions) of llm4llm and kernels_runtime: unpickling is code execution, and the child ran candidates."""

    @staticmethod
    def loads(data: bytes) -> Any:
        import builtins
        import io
        import pickle

        class _U(pickle.Unpickler):
            def find_class(self, module, name):
                if module == "builtins":
                    obj = getattr(builtins, name, None)
                    if name in _SAFE_BUILTINS or (isinstance(obj, type) and issubclass(obj, BaseException)):
                        return obj
                elif (module, name) in _SAFE_GLOBALS:
                    return super().find_class(module, name)
                elif module.split(".")[0] in ("llm4llm", "kernels_runtime", "pydantic", "pydantic_core") \
                        and "." not in name:
                    obj = super().find_class(module, name)
                    if isinstance(obj, type) and not module.startswith(("llm4llm.verify.sandbox",
                                                                        "llm4llm.verify.worker")):
                        return obj
                raise pickle.UnpicklingError(f"sandbox result: {module}.{name} is not allowed")

        return _U(io.BytesIO(data)).load()


def call_main() -> int:
    """Target of `sandboxed_call`: run the pickled call in ro/call.pkl, pickle ("ok", result) or ("err", exc, tb)
    into work/result.pkl."""
    import pickle
    import traceback

    box = Path(os.getcwd()).parent
    fn, args, kwargs = pickle.loads((box / "ro" / "call.pkl").read_bytes())
    try:
        out = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        out = ("err", e, "".join(traceback.format_exception(e))[-8000:])
    try:
        data = pickle.dumps(out)
    except Exception as e:  # noqa: BLE001 - an unpicklable exception still says what it was
        data = pickle.dumps(("err", RuntimeError(f"{type(out[1]).__name__}: {out[1]}"), ""))
        del e
    tmp = Path("result.pkl.tmp")
    tmp.write_bytes(data)
    tmp.replace("result.pkl")
    return 0


def run_file() -> int:
    """A target for probes and tests: exec the Python file sys.argv[1] (inside the box) as __main__."""
    import runpy

    runpy.run_path(sys.argv[1], run_name="__main__")
    return 0


__all__ = ["ALL_LAYERS", "RssWatchdog", "apply", "boot", "clean_env", "copy_readonly", "default_mem_limit",
           "cuda_dropped_layers", "kill_group", "landlock_abi", "layer_summary", "layers_from_env", "make_box", "remove_box",
           "sandboxed_popen", "seccomp_program"]
