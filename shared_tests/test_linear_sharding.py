"""linear_cross_entropy with a vocabulary-sharded LM head in both packages, on the same cases of
test_linear_cross_entropy.py (its inputs, float64 reference and tolerances): fastce_torch through process_group= over
gloo ranks (fastce_torch/tests/test_linear_sharding.py runs fastce_torch/tests/linear_parallel_check.py), fastce_jax
under jit with the weight sharded over the vocabulary and the rows over the other axis of a 2x2 mesh of host devices,
either way round (fastce_jax/tests/test_sharding.py, in its 4-device child).

Those two runs are the check: launching them again from here ran the same processes on the same cases a second time.
What stays here is cheap: that both packages' sharded tests still select the cases named below, so that both sharded
paths keep being held to the contract's numbers for the same inputs.
"""

import importlib

import pytest

from . import test_linear_cross_entropy as lin

CASES = ("mean-bias", "none-all-options")


def test_both_packages_shard_the_same_cases():
    known = {case.name for case in lin.CASES}
    assert set(CASES) <= known, set(CASES) - known
    torch_tests = importlib.import_module("fastce_torch.tests.test_linear_sharding")
    torch_kernel_cases = torch_tests.KERNEL_CASES.removeprefix("--only=").split(",")
    assert set(CASES) <= set(torch_kernel_cases), torch_tests.KERNEL_CASES
    pytest.importorskip("jax")
    jax_tests = importlib.import_module("fastce_jax.tests.test_sharding")
    assert set(CASES) <= set(jax_tests.LINEAR_CASES), jax_tests.LINEAR_CASES
    assert {"2d", "2d-swapped"} <= set(jax_tests.LINEAR_LAYOUTS), list(jax_tests.LINEAR_LAYOUTS)
