"""One case -> inputs made once in torch -> fastce_torch, fastce_jax (same buffer via DLPack) and the float64
reference -> three comparisons (torch vs reference, jax vs reference, torch vs jax).

Tolerances: tolerances.py (the repository's one model), reference and pair comparisons alike.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from . import reference, summary
from .tolerances import ULPS_PAIR, check, grad_bound, loss_bound, reference_ulps, ulp

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


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
    assert loss.dtype == (torch.float64 if inputs.logits.dtype == torch.float64 else torch.float32)
    if case.reduction == "none":
        loss.backward(inputs.upstream)
    else:
        loss.backward()
    grad = leaf.grad
    if grad is None:  # no element reached the loss (zero tokens): the gradient is zero by definition
        grad = torch.zeros_like(leaf)
    return loss.detach(), grad


def run_jax(case, inputs, **extra):
    """fastce_jax on the very same buffer (zero-copy through DLPack where the layout allows), gradient back to
    torch through DLPack. extra: more keywords for the call, torch tensors among them handed over through DLPack."""
    import jax

    import fastce_jax

    from . import exchange  # imports jax: here, so that without jax the torch side still runs (optional_jax)

    x = exchange.to_jax(inputs.logits)
    if inputs.logits.is_contiguous() and inputs.logits.numel():
        # Contiguous, fresh (aligned) tensor: the exchange must not have copied.
        assert exchange.same_buffer(x, inputs.logits), "DLPack import copied a contiguous tensor"
    y = exchange.labels_to_jax(inputs.labels)
    n_items = inputs.n_items
    if isinstance(n_items, torch.Tensor):
        n_items = exchange.labels_to_jax(n_items) if not n_items.is_floating_point() else exchange.to_jax(n_items)
    extra = {k: exchange.to_jax(v) if isinstance(v, torch.Tensor) else v for k, v in extra.items()}

    def loss_fn(a):
        return fastce_jax.cross_entropy(
            a,
            y,
            reduction=case.reduction,
            n_items=n_items,
            backend="kernel",
            inplace_backward=case.inplace,
            **case.opts.as_kwargs(),
            **extra,
        )

    loss, vjp = jax.vjp(jax.jit(loss_fn) if case.jit else loss_fn, x)
    cotangent = exchange.to_jax(inputs.upstream) if case.reduction == "none" else jax.numpy.ones_like(loss)
    (grad,) = vjp(cotangent)
    assert loss.dtype == jax.numpy.float32 and grad.dtype == x.dtype and grad.shape == x.shape
    if inputs.logits.is_cuda:
        assert all(d.platform == "gpu" for d in grad.devices()), "jax ran off the GPU"
    return exchange.to_torch(loss), exchange.to_torch(grad)


def as_f64(tensor):
    return (
        tensor.detach()
        .to("cpu", torch.float32 if tensor.dtype == torch.bfloat16 else tensor.dtype)
        .numpy()
        .astype(np.float64)
    )


def torch_ulps_reference(inputs, case):
    """Triton's interpreter truncates to bfloat16 (tolerances.reference_ulps); the GPU rounds to nearest even."""
    from fastce_torch.core.launch import INTERPRETED

    return reference_ulps(case.dtype, truncating_bf16=INTERPRETED and not inputs.logits.is_cuda)


def compare(case, inputs, torch_out, jax_out, ref):
    """The three-way comparison; records the differences for the session summary."""
    t_loss, t_grad = as_f64(torch_out[0]), as_f64(torch_out[1])
    assert torch_out[1].dtype == inputs.logits.dtype and torch_out[1].shape == inputs.logits.shape
    stats = {}
    _, stats["torch_ref_loss_tol_used"] = check(t_loss, ref.loss, loss_bound(ref), "torch loss vs reference")
    _, stats["torch_ref_grad_tol_used"] = check(
        t_grad,
        ref.grad,
        grad_bound(ref, t_grad, case.dtype, ulps=torch_ulps_reference(inputs, case)),
        "torch grad vs reference",
    )
    if jax_out is None:
        return
    j_loss, j_grad = as_f64(jax_out[0]), as_f64(jax_out[1])
    assert jax_out[1].dtype == inputs.logits.dtype and jax_out[1].shape == inputs.logits.shape
    _, stats["jax_ref_loss_tol_used"] = check(j_loss, ref.loss, loss_bound(ref), "jax loss vs reference")
    _, stats["jax_ref_grad_tol_used"] = check(
        j_grad, ref.grad, grad_bound(ref, j_grad, case.dtype), "jax grad vs reference"
    )
    # torch vs jax: the scales still come from the reference (they are magnitudes, not values).
    stats["loss_abs_diff"], stats["pair_loss_tol_used"] = check(
        t_loss, j_loss, loss_bound(ref), "torch loss vs jax loss"
    )
    both = np.maximum(np.abs(np.nan_to_num(t_grad)), np.abs(np.nan_to_num(j_grad)))
    stats["grad_abs_diff"], stats["pair_grad_tol_used"] = check(
        t_grad, j_grad, grad_bound(ref, both, case.dtype, ulps=ULPS_PAIR), "torch grad vs jax grad"
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
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
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
