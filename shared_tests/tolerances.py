"""The one tolerance model of the repository: how far a float32-computing implementation may be from the float64
reference (reference.py), for the loss and for the gradient, per output dtype. NumPy only, so both packages' tests
(and bench's CPU demo) use it without importing the other framework.

  |actual - exact| <= RTOL * scale + ulps * ulp_dtype(max(|actual|, |exact|)) + FLOOR
  * RTOL * scale: the float32 computation inside the kernels (scale = reference.error_scales: the magnitudes
    whose rounding error reaches the result). RTOL = 4 eps32: the CPU interpreters use under 1 eps32 * scale, the
    H200 at most 1.13 eps32 * scale over the whole shared suite (bench/results/*-h200-shared-summary.json, 16 eps32
    allowed then: 0.07 of it used) with its approximate exp/log and long float32 sums at V = 256K; the rest is room.
    The same RTOL compares the two packages with each other (same algorithm, same inputs, different elementary
    functions: on the CPU they differ by about as much as each differs from the exact value).
  * ulps * ulp of the output dtype: the gradient is rounded once from float32 to the logits' dtype: half an ulp
    from the exact value (ULPS); two correctly rounded results of slightly different float32 values may land on
    adjacent representable numbers: one ulp apart (ULPS_PAIR). The loss is float32 whatever the logits' dtype.
  * FLOOR = 2**-125: float32 results below the normal range (p_j = exp(z_j - lse) < 2**-126) may be flushed to
    zero on the GPU.
float64 inputs are computed in float64 (the packages' plain-framework references): RTOL64 replaces RTOL there, with
the ulps taken in float64.
NaN passes only where the expected value has NaN (the pattern must match exactly), infinities must match exactly.
"""

import numpy as np

MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10, "float64": 52}
MIN_EXPONENT = {"float32": -126, "bfloat16": -126, "float16": -14, "float64": -1022}
EPS32 = 2.0**-23
RTOL = 4 * EPS32
RTOL64 = 1e-12  # a float64 computation: ~4500 eps64 times the error scale, room for long float64 sums
ULPS, ULPS_PAIR = 0.5, 1.0
FLOOR = 2.0**-125


def dtype_name(dtype):
    """The dtype's name (float32, bfloat16, float16) from a name, a torch dtype, a NumPy dtype or a JAX scalar type."""
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    return text if text in MANTISSA_BITS else np.dtype(dtype).name


def reference_ulps(dtype, truncating_bf16=False):
    """Ulps of the output dtype allowed against the exact value. truncating_bf16: the converter to bfloat16 drops the
    low bits instead of rounding to nearest even (Triton's interpreter: triton/runtime/interpreter.py cast_impl
    passes rounding_mode=None to _convert_float), so the result is within 1 ulp of the exact value, not half of one.
    Still within 1 ulp of a correctly rounded result, so the pair tolerance is unchanged."""
    return 1.0 if truncating_bf16 and dtype_name(dtype) == "bfloat16" else ULPS


def ulp(values, dtype):
    """Spacing of `dtype` at |values| (subnormal spacing below the normal range)."""
    name = dtype_name(dtype)
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.maximum(np.abs(values), 2.0 ** MIN_EXPONENT[name])))
    return 2.0 ** (exponent - MANTISSA_BITS[name])


def check(actual, expected, bound, what):
    """Assert |actual - expected| <= bound elementwise, NaN only and exactly where expected has NaN, infinities
    equal. Returns (largest |actual - expected| over finite entries, largest |actual - expected| / bound)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = np.isnan(actual), np.isnan(expected)
    assert np.array_equal(nan_a, nan_e), (
        f"{what}: NaN at {np.argwhere(nan_a != nan_e)[:5].tolist()} (actual NaN count {nan_a.sum()}, "
        f"expected {nan_e.sum()})"
    )
    inf_e = np.isinf(expected)
    assert np.array_equal(np.isinf(actual), inf_e) and np.array_equal(actual[inf_e], expected[inf_e]), (
        f"{what}: infinities differ"
    )
    finite = np.isfinite(expected)
    err = np.where(finite, np.abs(actual - np.where(finite, expected, 0.0)), 0.0)
    bound = np.broadcast_to(bound, err.shape)
    over = err > bound
    if over.any():
        i = np.unravel_index(np.argmax(np.where(over, err / np.maximum(bound, 1e-300), 0.0)), err.shape)
        raise AssertionError(
            f"{what}: {int(over.sum())} of {err.size} elements out of tolerance; worst at {i}: "
            f"actual {actual[i]!r} expected {expected[i]!r} |diff| {err[i]:.3g} bound {bound[i]:.3g}"
        )
    if not err.size:
        return 0.0, 0.0
    return float(err.max()), float((err / np.maximum(bound, 1e-300)).max())


def loss_bound(ref, rtol=RTOL):
    """Tolerance on the loss of reference result `ref`: per token for "none", the upstream-weighted sum of per-token
    bounds (plus the float32 summation of N terms) for "sum" / "mean"."""
    per_token = rtol * ref.loss_scale + FLOOR
    if ref.reduction == "none":
        return per_token.reshape(np.shape(ref.loss))
    finite = np.where(np.isfinite(ref.token_loss), np.abs(ref.token_loss), 0.0)
    return np.sum(per_token * ref.upstream) + rtol * np.sum(finite * ref.upstream) + FLOOR


def grad_bound(ref, magnitude, dtype, rtol=RTOL, ulps=ULPS):
    """Tolerance on the gradient of `ref` rounded to `dtype`; magnitude: |the values compared| (the ulp is taken at
    the larger of them and the exact value)."""
    magnitude = np.maximum(np.abs(np.nan_to_num(magnitude)), np.abs(np.nan_to_num(ref.grad)))
    return rtol * ref.grad_scale + ulps * ulp(magnitude, dtype) + FLOOR


def assert_loss(actual, ref, what="loss", dtype=None):
    """The loss against the reference; returns the largest fraction of the tolerance used. dtype: the loss's own
    dtype where the caller converted it, which must be float32 (the contract's loss dtype for every logits dtype)."""
    assert dtype is None or dtype_name(dtype) == "float32", f"{what}: dtype {dtype}"
    actual = np.asarray(actual, np.float64)
    return check(actual, ref.loss, loss_bound(ref), what)[1]


def assert_grad(actual, ref, dtype, what="grad", ulps=ULPS):
    """The gradient (rounded to `dtype`) against the reference; returns the largest fraction of the tolerance used."""
    actual = np.asarray(actual, np.float64)
    return check(actual, ref.grad, grad_bound(ref, actual, dtype, ulps=ulps), what)[1]
