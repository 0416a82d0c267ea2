"""bench.tools.overhead on a CPU: it writes its rows and summary as strict JSON, linear_cross_entropy timed."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastce_torch.core.launch import INTERPRETED

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    not INTERPRETED,
    reason="the tool on a CPU runs the kernels in Triton's interpreter, which needs the CPU stack (numpy < 2.4); on a "
    "GPU, run_h200.sh's host stage writes this JSON",
)
def test_json_on_a_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    path = tmp_path / "overhead.json"
    command = [sys.executable, "-m", "bench.tools.overhead", "--device", "cpu", "--calls", "2", "--repeat", "1"]
    result = subprocess.run(
        [*command, "--json", str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in strict JSON"))
    assert written["device"] == "cpu" and written["commit"] and written["date"]
    assert "device_times" not in written  # the part 2 of earlier runs (settled: bench/NOTES.md)
    summary = written["summary"]
    # Measured on any machine: the total, the autograd baselines, the allocations; the launch rows need the cache
    # (CUDA), so their figures and what depends on them are null here, never NaN.
    for key in ("total_us", "leaf_backward_us", "autograd_function_us", "allocations_us"):
        assert math.isfinite(summary[key]) and summary[key] > 0, key
    assert summary["launches_us"] is None and summary["floor_us"] is None
    assert summary["total_us"] == written["rows_us"]["cross_entropy forward+backward"]
    # linear_cross_entropy beside the plain-torch calls it replaces.
    for name in ("linear_cross_entropy fwd+bwd (64x64x1000)", "  F.linear + F.cross_entropy fwd+bwd"):
        assert written["rows_us"][name] > 0, name
    # fastce's own share is what the other parts leave of the total: unknown without the launches' figure.
    assert math.isfinite(summary["device_thread_excess_us"]) and summary["fastce_python_us"] is None
