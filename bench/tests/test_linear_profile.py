"""bench.tools.linear_profile on a CPU (Triton's interpreter) or a GPU: every product of the fused loop and of the
unfused path is found and named by role from the profiler's shapes, one per chunk for the fused loop."""

import pytest
import torch

import fastce_torch  # noqa: F401  (before the tool's triton import: selects the interpreter without CUDA)
from bench import linear as linear_bench
from bench.linear_shapes import LinearShape
from bench.tools.linear_profile import ROLES, product_role, profile_shape
from fastce_torch import kernels


def test_product_roles_from_shapes():
    shape = LinearShape(96, 32, 500)
    assert product_role("aten::mm", [[24, 32], [32, 500], [24, 500]], shape) == ("logits", 24, 32, 500)
    assert product_role("aten::mm", [[24, 500], [500, 32]], shape) == ("d hidden", 24, 500, 32)
    assert product_role("aten::addmm_", [[500, 32], [500, 24], [24, 32], [], []], shape) == ("d weight", 500, 24, 32)
    assert product_role("aten::mm", [[32, 24], [24, 500]], shape) == ("d weight", 32, 24, 500)
    assert product_role("aten::mm", [[24, 32], [32, 7]], shape) is None
    assert product_role("aten::mm", [[24, 32]], shape) is None


@pytest.mark.parametrize("chunk_rows", [24, None])
def test_every_product_is_found_and_named(monkeypatch, chunk_rows):
    monkeypatch.setattr(linear_bench, "DEVICE", "cpu" if kernels.INTERPRETED else "cuda")
    shape = LinearShape(96, 32, 500, "float32")
    settings = {"backend": "kernel"} if kernels.INTERPRETED else {}  # the chunked loop on a CPU too
    if chunk_rows is not None:
        settings["chunk_rows"] = chunk_rows
    results = profile_shape(shape, calls=2, **settings)
    chunks = 1 if chunk_rows is None else 96 // chunk_rows
    for role in ROLES:
        assert results["fused"][role]["count"] == chunks, (role, results["fused"][role])
        assert results["unfused"][role]["count"] == 1, (role, results["unfused"][role])
        assert results["products"][role]["count"] == 1, (role, results["products"][role])
    assert results["fused"]["d weight"]["inner_dims"] == [96 if chunk_rows is None else chunk_rows]
    assert results["unfused"]["d weight"]["inner_dims"] == [96]
    if torch.cuda.is_available() and not kernels.INTERPRETED:
        assert all(results[name]["busy_ms"] > 0 for name in results)
