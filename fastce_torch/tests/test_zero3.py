"""patch_transformers(fused_linear=True) under a real DeepSpeed ZeRO-3 engine (zero3_check: two gloo ranks on the CPU;
--gpu: one rank on a GPU with NCCL): the loss, every gradient and the parameters after a step equal the stock
model's, for a plain head, tied embeddings and a PEFT LoRA head; a LoRA head marked a ZeRO-3 leaf is refused."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("deepspeed")

from .zero3_check import DEFAULT_RUNS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow  # DeepSpeed engines in child processes: started first under pytest-xdist


def test_zero3_fused_loss_matches_stock(request):
    gpu = request.config.getoption("--gpu")
    n_ranks = 1 if gpu else 2
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n_ranks}"]
    command += ["-m", "fastce_torch.tests.zero3_check", *(["--device=cuda"] if gpu else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    # The ranks' lines may interleave: each result is matched on its own.
    results = re.findall(r"zero3 \S+ \S+ rank \d+: (?:ok|FAIL[^\n]*?)(?=zero3 |\n|$)", done.stdout)
    assert done.returncode == 0, "\n".join(results + [done.stderr[-3000:]])
    assert sum(r.endswith(": ok") for r in results) == len(DEFAULT_RUNS.split(",")) * n_ranks, "\n".join(results)
