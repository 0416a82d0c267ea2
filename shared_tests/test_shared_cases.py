"""The table of cases: each input made once in torch, the same buffer handed to JAX through DLPack, both packages'
kernels (backend="kernel") against the float64 reference and against each other."""

import pytest

from . import harness
from .cases import BIG, CASES, GPU_BIG

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_case(case, device):
    harness.run_case(case, device)


@pytest.mark.parametrize("case", BIG, ids=lambda c: c.id)
def test_chunked_vocabulary(case, device):
    harness.run_case(case, device)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_BIG, ids=lambda c: c.id)
def test_chunked_vocabulary_many_rows(case, device):
    harness.run_case(case, device)
