"""bench.tools.overhead on a CPU: the entry-point profile mode runs and names where each call's host time goes."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_profile_entry_points_runs_on_a_cpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    command = [sys.executable, "-m", "bench.tools.overhead", "--device", "cpu", "--calls", "3", "--repeat", "1"]
    result = subprocess.run(
        [*command, "--profile-entry-points"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # Both calls timed beside their plain-torch equivalents, each then profiled by cProfile and torch.profiler.
    assert "linear_cross_entropy fwd+bwd (64x64x1000)" in out and "F.linear + F.cross_entropy fwd+bwd" in out
    for name in ("linear_cross_entropy fwd+bwd (64x64x1000)", "F.linear + F.cross_entropy fwd+bwd"):
        assert f"--- profile: {name}, 3 calls; cProfile by own time ---" in out
        assert f"--- profile: {name}, 3 calls; torch.profiler by self CPU time ---" in out
    # The vocab-parallel call on a one-rank gloo group (torch's CPU builds have gloo).
    assert "vocab-parallel cross_entropy fwd+bwd (64x1000, 1 rank), gloo" in out and "skipped" not in out
    assert "--- profile: vocab-parallel cross_entropy fwd+bwd (64x1000, 1 rank), gloo, 3 calls; cProfile" in out
    # Part 1 (the launch-path rows) does not run in this mode.
    assert "kernels.forward, Triton's launch stubbed" not in out
