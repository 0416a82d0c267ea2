"""One case -> inputs made once in torch -> fastce_torch, fastce_jax (same buffer via DLPack) and the float64
reference -> three comparisons (torch vs reference, jax vs reference, torch vs jax).

Tolerances come from the arithmetic (see reference.error_scales):
  |actual - exact| <= RTOL * scale + ULPS * ulp_dtype(max(|actual|, |exact|)) + FLOOR
  * RTOL * scale: the float32 computation inside the kernels (scale ~ the magnitudes whose rounding error
    reaches the result). RTOL_REFERENCE = 16 eps32: the CPU interpreters use under 1 eps32 * scale, the rest is
    room for the GPU's approximate exp/log (ex2.approx, lg2.approx) and long float32 sums at V = 256K.
    RTOL_PAIR = 8 eps32 is tighter: same algorithm (same tiles, chunking and accumulation order), same inputs. Not
    tighter still, because the elementary functions differ (Triton tl.exp / a hand-written tanh in fastce_torch,
    XLA's or libdevice's exp and tanh in fastce_jax): on the CPU the two packages differ by about as much as each
    differs from the exact value (~1 eps32 * scale), so a pair tolerance far below the reference one would only
    measure the libraries' exp.
  * ULPS * ulp of the output dtype: the gradient is rounded once from float32 to the logits' dtype: half an ulp
    from the exact value, and two correctly rounded results of slightly different float32 values may land on
    adjacent representable numbers: one ulp apart.
  * FLOOR = 2**-125: float32 results below the normal range (p_j = exp(z_j - lse) < 2**-126) may be flushed to
    zero on the GPU.
NaN passes only where the reference has NaN (the pattern must match exactly), infinities must match exactly.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from . import exchange, reference, summary

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}
MIN_EXPONENT = {"float32": -126, "bfloat16": -126, "float16": -14}
EPS32 = 2.0**-23
RTOL_REFERENCE = 16 * EPS32
RTOL_PAIR = 8 * EPS32
ULPS_REFERENCE, ULPS_PAIR = 0.5, 1.0
FLOOR = 2.0**-125


@dataclass(frozen=True)
class Case:
    """One problem. Labels are drawn in [0, V) and then edited by `ignore` and `bad_labels`."""

    name: str
    shape: tuple = (8,)  # leading shape of logits; labels have this shape
    vocab: int = 1000
    dtype: str = "float32"
    label_dtype: str = "int64"
    reduction: str = "mean"
    n_items: object = None  # None, a Python number, or ("tensor", value): a 0-d torch tensor
    opts: reference.Options = field(default_factory=reference.Options)
    ignore: str = "some"  # "none", "some" (~1 in 4), "all", "class" (ignore_index = a real class)
    bad_labels: tuple = ()  # values placed in the first rows: out-of-range labels (NaN by contract)
    neg_inf: str = ""  # "tail": last V/8 columns -inf (vocab padding), "scatter": ~10% at random
    nonfinite_rows: bool = False  # row 0 holds a NaN, row 1 a +inf, row 2 (ignored) a NaN
    row_pad: int = 0  # > 0: rows are a view of a (.., V + row_pad) buffer (strided rows)
    std: float = 2.0  # logit scale
    offset: float = 0.0  # added to every logit (lse far from 0)
    inplace: bool = True  # torch: logits are a non-leaf (in-place backward); jax: inplace_backward
    jit: bool = False  # jax: the loss under jax.jit (the backward then runs as a jitted transpose)
    seed: int = 0

    @property
    def id(self):
        return f"{self.name}-{self.dtype}"


@dataclass
class Inputs:
    logits: torch.Tensor  # (..., V) in the case's dtype, on the device; maybe a strided view
    labels: torch.Tensor  # (...) int32 / int64
    upstream: torch.Tensor  # (...) float32 cotangent for reduction "none"
    n_items: object  # None, a number or a 0-d tensor


def make_inputs(case, device):
    """Fresh random inputs (a seeded generator on the CPU, then moved: the same numbers on every device)."""
    gen = torch.Generator().manual_seed(case.seed)
    vocab, shape = case.vocab, tuple(case.shape)
    n = math.prod(shape)
    width = vocab + case.row_pad
    full = torch.randn((*shape, width), generator=gen, dtype=torch.float64) * case.std + case.offset
    if case.row_pad:
        # The columns past V are NaN: a kernel that reads beyond its row returns NaN, which no comparison accepts.
        full[..., vocab:] = float("nan")
    x = full[..., :vocab].reshape(n, vocab)  # a view: edits below land in `full`
    assert n == 0 or x.data_ptr() == full.data_ptr() and x._base is not None

    labels = torch.randint(0, vocab, (n,), generator=gen)
    finite_cols = vocab
    if case.neg_inf == "tail":
        finite_cols = max(1, vocab - max(1, vocab // 8))
        x[:, finite_cols:] = float("-inf")
        labels = torch.randint(0, finite_cols, (n,), generator=gen)
    elif case.neg_inf == "scatter":
        x[torch.rand((n, vocab), generator=gen) < 0.1] = float("-inf")
    if case.neg_inf and n:
        # A label on a -inf logit would make the loss +inf: keep the label's own logit finite.
        rows = torch.arange(n)
        x[rows, labels] = torch.randn(n, generator=gen, dtype=torch.float64) * case.std + case.offset

    ignore_index = case.opts.ignore_index
    if case.ignore == "some" and n:
        mask = torch.rand(n, generator=gen) < 0.25
        mask[0] = n > 1  # at least one ignored and one counted token whenever there are two
        mask[-1] = False
        labels[mask] = ignore_index
    elif case.ignore == "all":
        labels[:] = ignore_index
    elif case.ignore == "class":
        # ignore_index is a real class here: force a few labels onto it, they must be ignored, not scored
        labels[::3] = ignore_index
    for i, value in enumerate(case.bad_labels if n else ()):
        labels[i % n] = value
    if case.nonfinite_rows:
        assert n >= 3 and not case.bad_labels
        x[0, vocab // 2] = float("nan")
        x[1, vocab // 3] = float("inf")
        x[2, vocab // 4] = float("nan")
        labels[0] = 0 if ignore_index != 0 else 1
        labels[1] = 0 if ignore_index != 0 else 1
        labels[2] = ignore_index  # an ignored row's NaN must not leak anywhere

    label_dtype = {"int64": torch.int64, "int32": torch.int32}[case.label_dtype]
    dtype = TORCH_DTYPES[case.dtype]
    logits = full.to(dtype).to(device)
    if case.row_pad:
        logits = logits[..., :vocab]
        assert not logits.is_contiguous() or n <= 1
    labels = labels.reshape(shape).to(label_dtype).to(device)
    upstream = (torch.randn(shape, generator=gen, dtype=torch.float32)).to(device)
    n_items = case.n_items
    if isinstance(n_items, tuple):
        n_items = torch.tensor(n_items[1], device=device)
    return Inputs(logits, labels, upstream, n_items)


def run_reference(case, inputs):
    x = inputs.logits.detach().to("cpu", torch.float64).numpy()  # exactly the values the kernels read
    y = inputs.labels.cpu().numpy()
    n_items = inputs.n_items
    if isinstance(n_items, torch.Tensor):
        n_items = n_items.item()
    return reference.cross_entropy(
        x, y, reduction=case.reduction, n_items=n_items, upstream=inputs.upstream.cpu().numpy(), opts=case.opts
    )


def run_torch(case, inputs, **extra):
    import fastce_torch

    # A leaf sharing the logits' storage (detach() shares it): torch never overwrites leaves.
    leaf = inputs.logits.detach().requires_grad_()
    # With in-place backward the kernels write the gradient into a non-leaf's buffer (here a copy); the leaf's
    # .grad then arrives through clone's backward.
    x = leaf.clone() if case.inplace else leaf
    loss = fastce_torch.cross_entropy(
        x,
        inputs.labels,
        reduction=case.reduction,
        n_items=inputs.n_items,
        backend="kernel",
        inplace_backward=case.inplace,
        **case.opts.as_kwargs(),
        **extra,
    )
    assert loss.dtype == torch.float32
    if case.reduction == "none":
        loss.backward(inputs.upstream)
    else:
        loss.backward()
    grad = leaf.grad
    if grad is None:  # no element reached the loss (zero tokens): the gradient is zero by definition
        grad = torch.zeros_like(leaf)
    return loss.detach(), grad


def run_jax(case, inputs):
    """fastce_jax on the very same buffer (zero-copy through DLPack where the layout allows), gradient back to
    torch through DLPack."""
    import jax

    import fastce_jax

    x = exchange.to_jax(inputs.logits)
    if inputs.logits.is_contiguous() and inputs.logits.numel():
        # Contiguous, fresh (aligned) tensor: the exchange must not have copied.
        assert exchange.same_buffer(x, inputs.logits), "DLPack import copied a contiguous tensor"
    y = exchange.labels_to_jax(inputs.labels)
    n_items = inputs.n_items
    if isinstance(n_items, torch.Tensor):
        n_items = exchange.labels_to_jax(n_items) if not n_items.is_floating_point() else exchange.to_jax(n_items)

    def loss_fn(a):
        return fastce_jax.cross_entropy(
            a,
            y,
            reduction=case.reduction,
            n_items=n_items,
            backend="kernel",
            inplace_backward=case.inplace,
            **case.opts.as_kwargs(),
        )

    loss, vjp = jax.vjp(jax.jit(loss_fn) if case.jit else loss_fn, x)
    cotangent = exchange.to_jax(inputs.upstream) if case.reduction == "none" else jax.numpy.ones_like(loss)
    (grad,) = vjp(cotangent)
    assert loss.dtype == jax.numpy.float32 and grad.dtype == x.dtype and grad.shape == x.shape
    if inputs.logits.is_cuda:
        assert all(d.platform == "gpu" for d in grad.devices()), "jax ran off the GPU"
    return exchange.to_torch(loss), exchange.to_torch(grad)


def ulp(values, dtype):
    """Spacing of `dtype` at |values| (subnormal spacing below the normal range)."""
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.maximum(np.abs(values), 2.0 ** MIN_EXPONENT[dtype])))
    return 2.0 ** (exponent - MANTISSA_BITS[dtype])


def as_f64(tensor):
    return (
        tensor.detach()
        .to("cpu", torch.float32 if tensor.dtype == torch.bfloat16 else tensor.dtype)
        .numpy()
        .astype(np.float64)
    )


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
            f"actual {actual[i]!r} expected {expected[i]!r} |diff| {err[i]:.3g} bound "
            f"{bound[i]:.3g}"
        )
    if not err.size:
        return 0.0, 0.0
    return float(err.max()), float((err / np.maximum(bound, 1e-300)).max())


def loss_bound(case, ref, rtol):
    """Tolerance on the loss: per token for "none", the upstream-weighted sum of per-token bounds (plus the
    float32 summation of N terms) for "sum"/"mean"."""
    per_token = rtol * ref.loss_scale + FLOOR
    if case.reduction == "none":
        return per_token.reshape(ref.loss.shape)
    finite = np.where(np.isfinite(ref.token_loss), np.abs(ref.token_loss), 0.0)
    return np.sum(per_token * ref.upstream) + rtol * np.sum(finite * ref.upstream) + FLOOR


def grad_bound(case, ref, actual_grad, rtol, ulps):
    magnitude = np.maximum(np.abs(np.nan_to_num(actual_grad)), np.abs(np.nan_to_num(ref.grad)))
    return rtol * ref.grad_scale + ulps * ulp(magnitude, case.dtype) + FLOOR


def torch_ulps_reference(inputs, case):
    """Triton's interpreter converts float32 to bfloat16 by truncation (triton/runtime/interpreter.py: cast_impl
    passes rounding_mode=None to _convert_float, which then drops the low bits), not round-to-nearest-even as the
    GPU does: on the CPU a torch bfloat16 gradient is within 1 ulp of the exact value, not half of one. Still within
    1 ulp of JAX's correctly rounded value, so the pair tolerance is unchanged."""
    from fastce_torch import kernels

    if case.dtype == "bfloat16" and kernels.INTERPRETED and not inputs.logits.is_cuda:
        return 1.0
    return ULPS_REFERENCE


def compare(case, inputs, torch_out, jax_out, ref):
    """The three-way comparison; records the differences for the session summary."""
    t_loss, t_grad = as_f64(torch_out[0]), as_f64(torch_out[1])
    assert torch_out[1].dtype == inputs.logits.dtype and torch_out[1].shape == inputs.logits.shape
    stats = {}
    _, stats["torch_ref_loss_tol_used"] = check(
        t_loss, ref.loss, loss_bound(case, ref, RTOL_REFERENCE), "torch loss vs reference"
    )
    _, stats["torch_ref_grad_tol_used"] = check(
        t_grad,
        ref.grad,
        grad_bound(case, ref, t_grad, RTOL_REFERENCE, torch_ulps_reference(inputs, case)),
        "torch grad vs reference",
    )
    if jax_out is None:
        return
    j_loss, j_grad = as_f64(jax_out[0]), as_f64(jax_out[1])
    assert jax_out[1].dtype == inputs.logits.dtype and jax_out[1].shape == inputs.logits.shape
    _, stats["jax_ref_loss_tol_used"] = check(
        j_loss, ref.loss, loss_bound(case, ref, RTOL_REFERENCE), "jax loss vs reference"
    )
    _, stats["jax_ref_grad_tol_used"] = check(
        j_grad, ref.grad, grad_bound(case, ref, j_grad, RTOL_REFERENCE, ULPS_REFERENCE), "jax grad vs reference"
    )
    # torch vs jax: the scales still come from the reference (they are magnitudes, not values).
    stats["loss_abs_diff"], stats["pair_loss_tol_used"] = check(
        t_loss, j_loss, loss_bound(case, ref, RTOL_PAIR), "torch loss vs jax loss"
    )
    both = np.maximum(np.abs(np.nan_to_num(t_grad)), np.abs(np.nan_to_num(j_grad)))
    stats["grad_abs_diff"], stats["pair_grad_tol_used"] = check(
        t_grad, j_grad, grad_bound(case, ref, both, RTOL_PAIR, ULPS_PAIR), "torch grad vs jax grad"
    )
    # In ulps of the dtype, over the elements that matter: |gradient| >= 1% of the row's largest gradient term
    # (before the softcap factor). Elsewhere cancellation (p_j - eps/V, or 1 - tanh^2 where softcapping
    # saturates) makes an ulp count meaningless although the absolute difference is tiny.
    row_max = np.max(ref.grad_terms, axis=-1, keepdims=True) if ref.grad.size else ref.grad_terms
    big = np.isfinite(t_grad) & np.isfinite(j_grad) & (np.abs(np.nan_to_num(ref.grad)) >= 0.01 * row_max) & (both > 0)
    stats["grad_diff_ulps"] = (
        float((np.abs(t_grad - j_grad)[big] / ulp(both[big], case.dtype)).max()) if big.any() else 0.0
    )
    summary.record(case.dtype, "cuda" if inputs.logits.is_cuda else "cpu", stats)


def bits(tensor):
    """The tensor's bit pattern (NaN == NaN), to check that a buffer was not written."""
    ints = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return tensor.detach().contiguous().view(ints)


def optional_jax():
    """fastce_jax, or None when it cannot be imported (the jax side is then skipped, the torch side still runs)."""
    try:
        import fastce_jax
    except ImportError:
        return None
    return fastce_jax


def run_case(case, device):
    inputs = make_inputs(case, device)
    snapshot = inputs.logits.clone()
    ref = run_reference(case, inputs)
    torch_out = run_torch(case, inputs)
    jax_module = optional_jax()
    jax_out = run_jax(case, inputs) if jax_module is not None else None
    # The buffer both frameworks read (zero-copy in JAX) is never written by either backward.
    assert torch.equal(bits(inputs.logits), bits(snapshot)), "a backward wrote into the shared input buffer"
    compare(case, inputs, torch_out, jax_out, ref)
    if jax_module is None:
        pytest.skip("fastce_jax is not importable: torch side checked, jax side skipped")
