"""linear_cross_entropy with a vocabulary-sharded LM head in both packages, on the same case of
test_linear_cross_entropy.py (its inputs, float64 reference and tolerances): fastce_torch through process_group=
over two gloo ranks (fastce_torch/tests/linear_parallel_check.py), fastce_jax under jit with the weight sharded over
the vocabulary and the rows over the other axis of a 2x2 mesh of host devices, either way round
(fastce_jax/tests/test_sharding.py).
Each package's own tests cover every case and layout; this checks that both sharded paths give the contract's
numbers for the same inputs. CPU only (the two-GPU variants are the packages' gpu-marked tests)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = "mean-bias,none-all-options"
pytestmark = pytest.mark.slow  # gloo process groups and a 4-device JAX child: minutes


def _env(**extra):
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(autouse=True)
def _cpu_only(request):
    if request.config.getoption("--gpu"):
        pytest.skip("CPU processes; on GPUs the packages' two-GPU tests run instead")


def test_torch_process_group_two_ranks():
    pytest.importorskip("fastce_torch")
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"),
        *("fastce_torch.tests.linear_parallel_check", "--mode=tp", "--backend=kernel", f"--only={CASES}"),
    ]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "linear-parallel tp kernel: ok" in done.stdout, done.stdout[-3000:]


def test_jax_2d_mesh_four_host_devices():
    pytest.importorskip("fastce_jax")
    selection = " or ".join(f"(2d and {name})" for name in CASES.split(","))
    command = [
        *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "fastce_jax/tests/test_sharding.py"),
        *("-k", f"linear_sharded_weight and ({selection})"),
    ]
    env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout[-3000:]  # 2d and 2d-swapped
