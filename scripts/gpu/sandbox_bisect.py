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


def run(layers: tuple[str, ...]) -> dict:
    box = sandbox.make_box()
    try:
        (box / "ro" / "probe.py").write_text(PROBE)
        proc = sandbox.sandboxed_popen("llm4llm.verify.sandbox:run_file", box=box, args=[str(box / "ro" / "probe.py")],
                                       layers=layers, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=90)
        sandbox.kill_group(proc.pid)
        try:
            return {**json.loads(out.strip().splitlines()[-1]), "rc": proc.returncode}
        except (ValueError, IndexError):
            return {"rc": proc.returncode, "cuda": "no output", "stderr": err[-600:]}
    finally:
        sandbox.remove_box(box)


def main() -> None:
    os.environ.pop(sandbox.OFF_ENV, None)
    devs = {p: f"{oct(os.stat(p).st_mode)} {os.stat(p).st_uid}:{os.stat(p).st_gid}"
            for p in sorted(map(str, Path("/dev").glob("nvidia*")))}
    res = {"devices": devs, "device_gids": sandbox.device_gids(), "runs": {}}
    all_l = sandbox.ALL_LAYERS
    plans = {"all": all_l, **{f"all-{x}": tuple(y for y in all_l if y != x) for x in all_l}}
    if os.environ.get("BISECT_ONLY"):  # each layer alone too (when two layers may share the blame)
        plans.update({f"only-{x}": (x,) for x in all_l})
    for name, layers in plans.items():
        res["runs"][name] = r = run(layers)
        print(f"{name:18s} cuda={r.get('cuda')!s:60.60s} cannot-open={r.get('open')} {r.get('stderr', '')[-200:]}",
              flush=True)
    print("devices:", devs, "gids:", res["device_gids"])
    Path(os.environ.get("OUT", "/tmp"), "sandbox_bisect.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
