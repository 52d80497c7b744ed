"""Run inside the sandbox: what CUDA's cuInit does to name its threads (write /proc/<pid>/task/<tid>/comm), from
the main thread and from a thread started after the sandbox was applied; and a write elsewhere in /proc."""
import json
import os
import threading

res = {}


def name_self(key):
    tid = threading.get_native_id()
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(key[:15])
        with open(f"/proc/self/task/{tid}/comm") as f:
            res[key] = f.read().strip()
    except OSError as e:
        res[key] = f"denied {type(e).__name__} {e.errno}"


name_self("main")
t = threading.Thread(target=name_self, args=("worker",))
t.start()
t.join()
try:
    with open("/proc/self/oom_score_adj", "w") as f:  # outside the task directory
        f.write("1000")
    res["oom_score_adj"] = "allowed"
except OSError as e:
    res["oom_score_adj"] = f"denied {type(e).__name__} {e.errno}"
res["landlock"] = json.loads(os.environ.get("LLM4LLM_SANDBOX_LAYERS", "{}")).get("landlock", "")
print(json.dumps(res))
