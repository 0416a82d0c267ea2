"""Helpers shared by the Pallas kernels of every loss (losses/*/forward.py, backward.py) and their launchers
(losses/*/launch.py): cdiv and next_pow2 for grids and padded loads, dz_dx (the transform's derivative written with z
only), INT32_MAX (the argmax partials' filler). The transform itself is core/reference.py's, traced as it is."""

from __future__ import annotations

from .options import Options

__all__ = ["INT32_MAX", "next_pow2", "cdiv", "dz_dx"]

INT32_MAX = 2**31 - 1  # the argmax partials' filler: larger than any column


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a, b):
    """Ceiling division of ints or int32 scalars (traced inside kernels)."""
    return (a + b - 1) // b


def dz_dx(z, options: Options):
    """dz/dx written with z only, so the backward needs no second tanh (None when z = x)."""
    d = None
    if options.logit_softcapping > 0.0:
        t = z * (1.0 / options.logit_softcapping)
        d = 1.0 - t * t
    if options.logit_scaling != 0.0:
        d = options.logit_scaling if d is None else d * options.logit_scaling
    return d
