"""bench.tools.vocab_parallel_combine_probe: its two kernels (Triton's interpreter on a CPU, the GPU under --gpu)
give the package's vocab-parallel combine on every case, and they compile for sm_90."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = [sys.executable, "-m", "bench.tools.vocab_parallel_combine_probe"]


def _run(*args, compile_only=False):
    # Without CUDA, importing fastce_torch selects Triton's interpreter; with it (pytest --gpu), real kernels on NCCL.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if compile_only:
        env["TRITON_INTERPRET"] = "0"
    return subprocess.run([*TOOL, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_kernel_path_equals_the_package_path_on_every_case():
    from bench.tools.vocab_parallel_combine_probe import CASES

    result = _run()  # a one-rank group (gloo on a CPU, NCCL on a GPU) in its own process
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "kernel path == package path" in line]
    assert len(lines) == len(CASES)


def test_kernels_compile_for_sm90():
    result = _run("--compile-only", compile_only=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("compiled for sm_90") == 3
