"""Run inside the sandbox by tests/test_sandbox_ipc.py. argv: MODE ("create" or "find"), the SysV key, the parent's
pid, the project's git metadata path. "create" makes a SysV shared memory segment under the key and leaves it;
"find" looks for it. Both try the parent's command line and the git metadata. Prints one JSON line."""
import ctypes
import json
import os
import sys

mode, key, parent, git = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
libc = ctypes.CDLL(None, use_errno=True)
IPC_CREAT = 0o1000
r = {}
if mode == "create":
    shmid = libc.shmget(key, 4096, IPC_CREAT | 0o666)
    r["shm"] = f"created {shmid}" if shmid >= 0 else f"refused errno {ctypes.get_errno()}"
else:
    shmid = libc.shmget(key, 0, 0)
    r["shm"] = f"found {shmid}" if shmid >= 0 else f"absent errno {ctypes.get_errno()}"


def t(name, fn):
    try:
        r[name] = "allowed " + repr(fn())[:80]
    except Exception as e:  # noqa: BLE001
        r[name] = f"denied {type(e).__name__}: {e}"[:160]


t("parent_cmdline", lambda: open(f"/proc/{parent}/cmdline", "rb").read())
t("own_cmdline", lambda: open("/proc/self/cmdline", "rb").read())
t("git", lambda: os.listdir(git) if os.path.isdir(git) else open(git).read())
print(json.dumps(r))
