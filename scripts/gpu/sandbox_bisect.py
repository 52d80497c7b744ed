"""Which sandbox layer stops CUDA from initialising on the GPU machine (device call, a minute): the CUDA probe under
all layers, under all but one, and under each alone, with what the sandboxed child can open (/dev/nvidia*,
/proc/driver/nvidia, /sys) printed beside each verdict. Writes $OUT/sandbox_bisect.json."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from llm4llm.verify import sandbox  # noqa: E402

PROBE = r'''
import glob, json, os, sys
seen = {}
for p in sorted(glob.glob("/dev/nvidia*") + glob.glob("/dev/nvidia-caps/*")) + [
        "/proc/driver/nvidia/version", "/proc/driver/nvidia/params", "/proc/self/maps", "/proc/self/status",
        "/sys/bus/pci/devices", "/sys/devices/system/cpu/online", "/dev/shm", "/dev/null", "/etc/ld.so.cache"]:
    try:
        if os.path.isdir(p):
            os.listdir(p); seen[p] = "ok"
        else:
            fd = os.open(p, os.O_RDWR if p.startswith("/dev/nvidia") else os.O_RDONLY); os.close(fd); seen[p] = "ok"
    except OSError as e:
        seen[p] = f"{type(e).__name__} {e.errno}"
r = {"uid": os.getuid(), "groups": os.getgroups(), "open": {k: v for k, v in seen.items() if v != "ok"}}
try:
    import torch
    x = torch.ones(8, device="cuda"); torch.cuda.synchronize()
    r["cuda"] = "ok"
except Exception as e:
    r["cuda"] = f"{type(e).__name__}: {str(e)[-160:]}"
print(json.dumps(r))
'''


def _in_box(start) -> dict:
    """Run PROBE in a fresh box with `start(box, probe_path) -> Popen`; its JSON line, or why there is none."""
    box = sandbox.make_box()
    try:
        probe = box / "ro" / "probe.py"
        probe.write_text(PROBE)
        proc = start(box, str(probe))
        out, err = proc.communicate(timeout=90)
        sandbox.kill_group(proc.pid)
        try:
            return {**json.loads(out.strip().splitlines()[-1]), "rc": proc.returncode}
        except (ValueError, IndexError):
            return {"rc": proc.returncode, "cuda": "no output", "stderr": err[-600:]}
    finally:
        sandbox.remove_box(box)


def run(layers: tuple[str, ...]) -> dict:
    """The probe under exactly `layers` (cuda_check off: the guard would leave out the layer under study)."""
    return _in_box(lambda box, probe: sandbox.sandboxed_popen(
        "llm4llm.verify.sandbox:run_file", box=box, args=[probe], layers=layers, cuda_check=False,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


# Landlock variants (the layer that can stop CUDA's initialisation): each patches the child's sandbox module
# before it applies the layers, so one call tells which rule CUDA's initialisation needs.
LANDLOCK_VARIANTS = {
    "ll-read-all": "s.READ_ROOTS = s.READ_ROOTS + ('/',)",
    "ll-exec-all": "_e = s.exec_allowlist; s.exec_allowlist = lambda: ['/']",
    "ll-abi5": "s.landlock_abi = lambda: 5",
    "ll-abi3": "s.landlock_abi = lambda: 3",
    "ll-write-all": "from pathlib import PosixPath as P; _o = s._landlock; s._landlock = lambda box, needed, execs: "
                    "_o(type('B', (P,), {'__truediv__': lambda self, o: P('/')})('/'), needed, execs)",
}


def run_variant(patch: str) -> dict:
    """The probe under all layers, the child's sandbox module patched by `patch` before it applies them."""
    def start(box, probe):
        boot = f"import llm4llm.verify.sandbox as s; {patch}; s.boot()"
        env = sandbox.clean_env(box, {sandbox.SANDBOX_ENV: _cfg_json(box)})
        return subprocess.Popen([sys.executable, "-c", boot, probe], env=env, cwd=str(box / "work"),
                                start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    return _in_box(start)


def _cfg_json(box: Path) -> str:
    """sandboxed_popen's config for the run_file target, all layers."""
    cfg = {"target": "llm4llm.verify.sandbox:run_file", "box": str(box), "layers": list(sandbox.ALL_LAYERS),
           "parent": os.getpid(), "needed": sandbox.needed_paths(), "readonly": [], "exec": sandbox.exec_allowlist(),
           "devgids": sandbox.device_gids(), "hide": sorted({"/root", os.path.expanduser("~")} - {"/", ""})}
    return json.dumps(cfg)


def main() -> None:
    os.environ.pop(sandbox.OFF_ENV, None)
    devs = {p: f"{oct(os.stat(p).st_mode)} {os.stat(p).st_uid}:{os.stat(p).st_gid}"
            for p in sorted(map(str, Path("/dev").glob("nvidia*")))}
    res = {"devices": devs, "device_gids": sandbox.device_gids(), "runs": {}}
    all_l = sandbox.ALL_LAYERS
    plans = {"all": all_l}
    if os.environ.get("BISECT_LANDLOCK") != "only":
        plans.update({f"all-{x}": tuple(y for y in all_l if y != x) for x in all_l})
    if os.environ.get("BISECT_ONLY"):  # each layer alone too (when two layers may share the blame)
        plans.update({f"only-{x}": (x,) for x in all_l})
    for name, layers in plans.items():
        res["runs"][name] = r = run(layers)
        print(f"{name:18s} cuda={r.get('cuda')!s:60.60s} cannot-open={r.get('open')} {r.get('stderr', '')[-200:]}",
              flush=True)
    if os.environ.get("BISECT_LANDLOCK"):
        for name, patch in LANDLOCK_VARIANTS.items():
            res["runs"][name] = r = run_variant(patch)
            print(f"{name:18s} cuda={r.get('cuda')!s:60.60s} {r.get('stderr', '')[-300:]}", flush=True)
    print("devices:", devs, "gids:", res["device_gids"])
    Path(os.environ.get("OUT", "/tmp"), "sandbox_bisect.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
