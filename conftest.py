"""Repository-wide pytest options. `--gpu` runs the suites on CUDA devices (torch and JAX) instead of the CPU
interpreters; without it, tests marked `gpu` are skipped."""

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--gpu",
        action="store_true",
        default=False,
        help="run the kernels on the GPU (CUDA tensors / JAX GPU arrays) and the GPU-only tests",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu"):
        return
    skip = pytest.mark.skip(reason="GPU-only test: run with --gpu on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
