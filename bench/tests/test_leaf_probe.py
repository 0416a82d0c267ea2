"""bench.tools.leaf_probe's variants (Triton's interpreter on a CPU, the kernels with --gpu): every way of calling
the loss it times gives the non-leaf call's gradient, bitwise."""

import fastce_torch  # noqa: F401  (before the probe's triton import: selects the interpreter without CUDA)
from bench.tools.leaf_probe import check
from fastce_torch import kernels


def test_every_variant_gives_the_same_gradient():
    names = check(device="cpu" if kernels.INTERPRETED else "cuda")
    assert "leaf, backward" in names and "nonleaf, copy" in names
