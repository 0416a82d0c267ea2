import pytest
import torch

from . import checks


@pytest.fixture(scope="session")
def device(request):
    """Where the kernels run: CUDA with --gpu, otherwise the CPU through Triton's interpreter."""
    if request.config.getoption("--gpu"):
        if not torch.cuda.is_available():
            pytest.fail("--gpu given but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture
def poisoned():
    """Every buffer the package allocates with torch.empty / empty_like starts as NaN (checks.poisoned_allocations)."""
    with checks.poisoned_allocations():
        yield
