"""The hardware table (kernels_runtime.hardware): its lookup rule, the gates and heuristics that read it, and that
library code keeps GPU names and dated results folders out of its comments (they live in the table and in
docs/hardware.md)."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels_runtime import hardware
from kernels_runtime.hardware import TARGET, lookup

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("llm4llm", "kernels_runtime", "flows", "tasks", "storage", "deployments")


@pytest.mark.parametrize("name, capability, want", [
    ("NVIDIA H200", None, ("H200", 132, 4800.0)),
    ("NVIDIA H100 80GB HBM3", "9.0", ("H100", 132, 3350.0)),
    ("NVIDIA H100 PCIe", "9.0", ("H100 PCIe", 114, 2000.0)),  # the specific row, not the "H100" it contains
    ("NVIDIA A100-SXM4-80GB", (8, 0), ("A100-SXM4-80GB", 108, 2039.0)),
    ("Some Future GPU", "8.0", ("A100-SXM4-80GB", 108, 2039.0)),  # unknown name: the first row of its capability
    ("NVIDIA L4", "8.9", ("H200", 132, 4800.0)),  # no row of its capability: the target
    (None, None, ("H200", 132, 4800.0)),  # a CPU profile
])
def test_lookup_by_name_then_capability_then_target(name, capability, want):
    row = lookup(name, capability)
    assert (row.name, row.sm_count, row.hbm_peak_gbps) == want
    assert lookup() is TARGET and TARGET.arch == 90


def test_a_malformed_capability_is_one_clear_error():
    with pytest.raises(ValueError, match=r"capability: expected 'MAJOR.MINOR' such as '9.0', got 'sm90'"):
        lookup("x", "sm90")


def _fake_cuda(monkeypatch, name: str, clock_khz: int = 0, bus_bits: int = 0):
    props = SimpleNamespace(memory_clock_rate=clock_khz, memory_bus_width=bus_bits)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: name)


@pytest.mark.parametrize("name, want", [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H200", 4.8e12),
                                        ("Unknown GPU", 4.8e12)])
def test_floor_bandwidth_falls_back_to_the_table(monkeypatch, name, want):
    from llm4llm.verify.gates import hbm_bytes_per_s

    monkeypatch.delenv("LLM4LLM_HBM_GBPS", raising=False)
    _fake_cuda(monkeypatch, name)  # no memory clock reported: the table's peak for this device
    assert hbm_bytes_per_s(torch.device("cuda", 0)) == pytest.approx(want)


def test_floor_bandwidth_prefers_the_environment_then_the_device(monkeypatch):
    from llm4llm.verify.gates import hbm_bytes_per_s

    _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", clock_khz=2_619_000, bus_bits=5120)
    monkeypatch.delenv("LLM4LLM_HBM_GBPS", raising=False)
    assert hbm_bytes_per_s(torch.device("cuda", 0)) == pytest.approx(2 * 2_619_000e3 * 5120 / 8)
    monkeypatch.setenv("LLM4LLM_HBM_GBPS", "1000")
    assert hbm_bytes_per_s(torch.device("cuda", 0)) == pytest.approx(1e12)


def test_heuristics_take_the_targets_numbers(monkeypatch):
    from kernels_runtime.ops import attention_decode, attention_decode_static
    from llm4llm.search.templates import _linear
    from llm4llm.verify.aot import aot_arch

    assert attention_decode.TARGET_PROGRAMS == attention_decode_static.TARGET_PROGRAMS == 2 * TARGET.sm_count == 264
    assert _linear.SMS_DEFAULT == TARGET.sm_count == 132
    monkeypatch.delenv("LLM4LLM_AOT_ARCH", raising=False)
    assert aot_arch() == 90
    assert hardware.target_programs(114) == 228


def test_library_code_names_no_gpu_and_no_dated_results_folder():
    pattern = re.compile(r"docs/results/20\d\d|\b[AH]100\b|\bH200\b|\b20\d\d-\d\d-\d\d-h\d00")
    hits = []
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix not in (".py", ".sql") or path == ROOT / "kernels_runtime" / "hardware.py":
                continue
            lines = enumerate(path.read_text().splitlines(), 1)  # comments, docstrings and code alike
            hits += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in lines if pattern.search(line)]
    assert not hits, "name the GPU in kernels_runtime/hardware.py and the results folder in docs/hardware.md:\n" + \
        "\n".join(hits)
