"""bench.tools.readme_memory on the CPU with tiny shapes (its own process: the kernels' CPU launchers need
TRITON_INTERPRET=1 before triton is first imported). The memory column is CUDA-only; on the CPU the run checks that
the three forms agree and which of them hands the gradient back in the logits' own buffer."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_readme_memory_runs(dtype, tmp_path, request):
    """On the CPU (interpreted kernels) without --gpu; on CUDA, with the memory column, under --gpu."""
    gpu = request.config.getoption("--gpu")
    out = tmp_path / "memory.json"
    env = {**os.environ, "TRITON_INTERPRET": "0" if gpu else "1", "PYTHONPATH": ROOT}
    device, (batch, seq, vocab) = ("cuda", (2, 129, 8192)) if gpu else ("cpu", (2, 7, 40))
    shape = f"{batch}x{seq}x{vocab}"
    command = [sys.executable, "-m", "bench.tools.readme_memory", "--device", device, "--shape", shape]
    command += ["--dtype", dtype, "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["shape"] == dict(batch=batch, seq=seq, vocab=vocab) and result["dtype"] == dtype
    rows = {row["form"]: row for row in result["rows"]}
    assert list(rows) == ["slice", "shift", "padded labels"]
    if gpu:  # the slice copies the logits for its gradient; the other two forms do not
        assert rows["slice"]["peak_extra_bytes"] > max(rows[f]["peak_extra_bytes"] for f in ("shift", "padded labels"))
    else:
        assert all(row["peak_extra_bytes"] is None for row in rows.values())  # CUDA only
    # The slice's backward builds a new logits-sized gradient; the other two write it into the logits.
    assert [rows[form]["grad_in_logits_buffer"] for form in rows] == [False, True, True]
    lines = done.stdout.splitlines()
    assert lines[2].startswith("slice") and lines[3].startswith("shift") and ("n/a" in lines[2]) != gpu
