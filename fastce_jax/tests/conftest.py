"""Fixtures of the fastce_jax suite.

Without --gpu: JAX CPU arrays, and backend="kernel" runs the Pallas kernels in
interpret mode.  With --gpu (the repository conftest.py defines the flag): JAX
GPU arrays and the compiled Triton kernels, plus the tests marked `gpu`.
"""

import importlib

import jax
import numpy as np
import pytest


def pytest_addoption(parser):
    # The repository-root conftest.py normally defines --gpu first; this keeps
    # the suite usable when it is run with another rootdir.
    try:
        parser.addoption(
            "--gpu", action="store_true", default=False, help="run the fastce_jax tests on a JAX GPU device"
        )
    except ValueError:
        pass


@pytest.fixture(scope="session")
def use_gpu(request) -> bool:
    return bool(request.config.getoption("--gpu", default=False))


@pytest.fixture(scope="session")
def device(use_gpu):
    if use_gpu:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            pytest.fail("--gpu was given but JAX sees no GPU (is jax[cuda] installed?)")
        return gpus[0]
    return jax.devices("cpu")[0]


@pytest.fixture
def put(device):
    """put(numpy_array, dtype=None) -> a JAX array on the test device."""

    def _put(x, dtype=None):
        x = np.asarray(x)
        if dtype is not None:
            x = jax.numpy.asarray(x, dtype=dtype)
        return jax.device_put(x, device)

    return _put


@pytest.fixture(autouse=True)
def _gpu_only(request, use_gpu):
    if request.node.get_closest_marker("gpu") and not use_gpu:
        pytest.skip("GPU-only test: run with --gpu on a CUDA machine")


# --- shared by the jsd / linear_jsd and fused linear cross-entropy tests ----------------------------------------


@pytest.fixture(scope="module")
def jsd_sizes(request):
    """(N, V, V_t) of the jsd and linear_jsd tests: tiny on the CPU, a real vocabulary on the GPU."""
    return (48, 32771, 32800) if request.config.getoption("--gpu", default=False) else (12, 257, 263)


@pytest.fixture
def jsd_small_tiles(monkeypatch, use_gpu):
    """On the CPU, the jsd kernels' tiles of 128 columns: V = 257 spans three, the last holding one column."""
    if not use_gpu:
        jsd_launch = importlib.import_module("fastce_jax.losses.jsd.launch")
        monkeypatch.setattr(jsd_launch, "FORWARD_BLOCK", 128)
        monkeypatch.setattr(jsd_launch, "BACKWARD_BLOCK", 128)


@pytest.fixture
def float32_matmuls():
    """Matmuls at float32 precision (a GPU may use TF32 for float32 inputs): tolerances for float32 products."""
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture
def chunks_run(monkeypatch):
    """How many logits matmuls the fused linear chunk loops actually ran (engine.chunk_logits, one a chunk for the
    cross-entropy, two for linear_jsd: a runtime callback, so a chunk skipped by lax.cond adds nothing). The jit
    caches are cleared so that the traced chunk loops carry the callback."""
    engine = importlib.import_module("fastce_jax.linear.engine")
    calls = []
    original = engine.chunk_logits

    def counted(*args):
        jax.debug.callback(lambda: calls.append(1))
        return original(*args)

    monkeypatch.setattr(engine, "chunk_logits", counted)
    jax.clear_caches()
    yield calls
    jax.clear_caches()
