"""linear_jsd's precision keywords (logits_dtype="float32", accumulate_in_float32): the checks both packages'
test_linear_jsd_precision.py apply to their gradients, as float64 NumPy arrays against the float64 reference
(reference_distill.linear_jsd). NumPy only, so that either package's tests run without the other framework."""

import numpy as np


def check_float32_logits(grads, bf16_grads, exact):
    """d hidden and d weight (float64 NumPy) from float32 logits within 1e-2 (max relative) of the float64 reference
    `exact`, and those from bf16 logits more than twice as far: fails if float32 logits were ignored."""
    for name, got, worse, want in zip(("hidden", "weight"), grads, bf16_grads, (exact.grad_hidden, exact.grad_weight)):
        scale = np.abs(want).max()
        f32_error, bf16_error = np.abs(got - want).max() / scale, np.abs(worse - want).max() / scale
        assert f32_error < 1e-2, f"d {name}: {f32_error:.2e} from float64 with float32 logits"
        assert bf16_error > 2 * f32_error, f"d {name}: bf16 logits {bf16_error:.2e}, float32 {f32_error:.2e}"


def check_float32_accumulation(one_chunk, accumulated, want):
    """bf16 d weight (float64 NumPy) over many chunks with the float32 accumulator: within a bf16 ulp of one chunk's
    product (both rounded once; rounding every chunk, the default, is not: 213 of the 2048 entries of fastce_torch's
    case are further) and within the products' rounding (rms) of the float64 reference `want`."""
    ulp = 2.0**-7 * np.abs(one_chunk)
    assert np.all(np.abs(accumulated - one_chunk) <= ulp), "float32 accumulation rounded more than once"
    rms = lambda x: np.sqrt(np.mean(x**2))  # noqa: E731
    assert rms(accumulated - want) < 6e-3 * rms(want)
