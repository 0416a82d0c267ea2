import pytest
import torch


@pytest.fixture(scope="session")
def device(request):
    """Where the kernels run: CUDA with --gpu, otherwise the CPU through Triton's interpreter."""
    if request.config.getoption("--gpu"):
        if not torch.cuda.is_available():
            pytest.fail("--gpu given but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the package allocates with torch.empty / empty_like starts as NaN, so an element a kernel
    forgets to write shows up as NaN instead of a lucky zero."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2**30))

    def nan_empty_like(*args, **kwargs):
        out = empty_like(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)
