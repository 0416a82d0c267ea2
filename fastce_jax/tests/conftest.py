"""Fixtures of the fastce_jax suite.

Without --gpu: JAX CPU arrays, and backend="kernel" runs the Pallas kernels in
interpret mode.  With --gpu (the repository conftest.py defines the flag): JAX
GPU arrays and the compiled Triton kernels, plus the tests marked `gpu`.
"""

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
