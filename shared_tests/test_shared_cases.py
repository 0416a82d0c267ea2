"""The table of cases: each input made once in torch, the same buffer handed to JAX through DLPack, both packages'
kernels (backend="kernel") against the float64 reference and against each other."""

import pytest
from fastce_torch import kernels as torch_kernels

from . import harness
from .cases import BIG, CASES, GPU_BIG
from .harness import Case
from .reference import Options

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


@pytest.mark.xfail(torch_kernels.INTERPRETED, strict=True, raises=AssertionError, reason=(
    "Triton's interpreter types a Python float scalar outside float32's normal range (here label_smoothing=1e-40) "
    "as float64 (triton/language/semantic.py to_tensor), the backward's arithmetic becomes float64, and the "
    "float64 -> bfloat16 store is a plain numpy astype(uint16) (interpreter.py cast_impl): fastce_torch's bf16 "
    "gradient comes out all zeros. Compiled kernels take float arguments as fp32. fastce_torch could flush "
    "options below 2**-126 to 0 on the host."))
def test_option_below_float32_normal_range(device):
    harness.run_case(Case("tiny-smoothing", shape=(2,), vocab=5, dtype="bfloat16", ignore="none",
                          opts=Options(label_smoothing=1e-40), seed=50), device)
