"""Tests run on the CPU: Triton kernels run under its interpreter, Prefect on its ephemeral API in a test harness."""
import os

# Under pytest-xdist each worker's torch (and each process a test starts: verifier workers, acceptance children, a
# served run; they inherit the variable) would run one OpenMP thread per core: N workers x N threads oversubscribe
# the host, and the threads' spin-waits slowed the README's `-n 2` run on a 2-core host by ~40 % (nine of the
# slowest tests under -n 2: 393 s -> 229 s). Each worker gets its share of the cores; a run without xdist (the
# serial part, whose tests compare CPU timings) keeps torch's default.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)))

import torch  # noqa: E402

if _XDIST_WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a GPU, Triton kernels run under its interpreter; on a GPU machine the `gpu` tests run the real thing.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The CPU verifier's sm_90 compile gate costs a subprocess per candidate; off for the suite, on in its own tests
os.environ.setdefault("LLM4LLM_AOT_ARCH", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import pytest  # noqa: E402

from kernels_runtime.interp import enable_fast_interpreter  # noqa: E402

# Under the interpreter the suite runs with kernels_runtime's interpreter speed-ups (an opt-in: importing
# kernels_runtime leaves Triton untouched); tests/test_interp_fast.py compares them against Triton's own
enable_fast_interpreter()


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test harness for the whole session (starting one costs seconds)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def tiny_extracted(tmp_path_factory):
    """name -> the task dirs of examples/workloads/<name>.toml, profiled and extracted once per session on first
    use (read-only for the tests that share them). `<name>+static`: extracted with static_cache=True (KV-cache
    decode tasks on transformers' static cache, as runs with decode graphs extract them)."""
    from pathlib import Path

    from llm4llm.stages.extract import run_extract
    from llm4llm.stages.profile import run_profile

    workloads = Path(__file__).resolve().parents[1] / "examples" / "workloads"
    done: dict[str, list] = {}

    def get(name: str) -> list:
        if name not in done:
            data = tmp_path_factory.mktemp(name)
            base, _, variant = name.partition("+")
            wl = str(workloads / f"{base}.toml")
            run_extract(wl, run_profile(wl, str(data)), str(data), static_cache=variant == "static")
            done[name] = sorted(d for d in (data / "tasks").iterdir() if (d / "spec.json").exists())
        return done[name]

    return get


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    # tests/test_scale.py first: its Ray cluster, when it is a session's last user, can hang the Prefect harness's
    # teardown (docs/status.md); first, a pytest-xdist worker takes it in its first chunk
    items.sort(key=lambda item: 0 if item.nodeid.startswith("tests/test_scale.py") else 1)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
