"""Repository-wide pytest options. `--gpu` runs the suites on CUDA devices (torch and JAX) instead of the CPU
interpreters; without it, tests marked `gpu` are skipped."""

import sys

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--gpu",
        action="store_true",
        default=False,
        help="run the kernels on the GPU (CUDA tensors / JAX GPU arrays) and the GPU-only tests",
    )


def pytest_collection_modifyitems(config, items):
    if getattr(config, "workerinput", None) is not None:
        # A pytest-xdist worker (CI: -n 2 --dist load --maxschedchunk 1, each worker takes the next test when it is
        # free): the tests marked `slow` (minutes of child processes or compiling) first, so that they start at once
        # on both workers and the many short tests fill in around them instead of waiting behind one at the end.
        # A stable sort: every worker collects the same order, which xdist requires.
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if config.getoption("--gpu"):
        return
    skip = pytest.mark.skip(reason="GPU-only test: run with --gpu on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # Every test module is imported (fastce_torch among them chose Triton's interpreter before triton's import):
    # Triton's interpreter then skips re-patching triton.language at each helper call inside a launch
    # (shared_tests/interpreter_patching.py), a fifth of an interpreted kernel test's CPU time.
    if "triton" in sys.modules:
        from shared_tests import interpreter_patching

        interpreter_patching.install()
