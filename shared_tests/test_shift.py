"""The `shift` keyword of cross_entropy and linear_cross_entropy, in both packages, against the float64 reference.

shift=k scores position t against label t + k along labels' last (sequence) dimension. Contract: the result equals
that of the sliced call, cross_entropy(logits[..., :-k, :], labels[..., k:]) (linear: hidden[..., :-k, :]), for
value, gradient, the shape of "none" (labels[..., k:].shape), the "mean" denominator and n_items; the last k
positions of the full logits (hidden) get an exactly zero gradient. So each case is checked against the reference
of the sliced problem, and against the package's own sliced call. k >= the sequence length leaves no token.
"""

import dataclasses

import numpy as np
import pytest
import torch

from . import exchange, reference
from .harness import Case, as_f64, make_inputs, optional_jax, torch_ulps_reference
from .test_linear_cross_entropy import LinearCase, check_result, package_runner, small_chunks
from .test_linear_cross_entropy import make_inputs as make_linear_inputs
from .tolerances import ULPS_PAIR, check, grad_bound, loss_bound

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")

ALL = reference.Options(logit_softcapping=5.0, logit_scaling=0.7, label_smoothing=0.1, z_loss=1e-3)


def case(name, shift=1, **fields):
    fields.setdefault("shape", (2, 6))
    fields.setdefault("vocab", 37)
    return pytest.param(Case(name, **fields), shift, id=f"{name}-{fields.get('dtype', 'float32')}-shift{shift}")


CASES = [
    case("mean", seed=1),
    case("mean", shift=2, seed=2),
    case("sum", reduction="sum", seed=3),
    case("sum", shift=2, reduction="sum", seed=4),
    case("none", reduction="none", seed=5),
    case("none", shift=2, reduction="none", seed=6),
    case("shift-true", shift=True, reduction="none", seed=7),
    # shift pads the labels with ignore_index and runs the unsliced logits: the options meet it only through the
    # ignored rows, so every option at once (each alone is test_shared_cases.py's); the ignore indices each.
    case("all-options", opts=ALL, reduction="none", seed=12),
    case("all-options-mean", shift=2, opts=ALL, seed=13),
    case("ignore-minus-one", opts=reference.Options(ignore_index=-1), reduction="none", seed=14),
    case("ignore-real-class", ignore="class", opts=reference.Options(ignore_index=3), seed=15),
    case("all-ignored", ignore="all", seed=16),
    case("none-ignored", ignore="none", seed=17),
    case("n-items-int", n_items=5, seed=18),
    case("n-items-tensor-sum", shift=2, reduction="sum", n_items=("tensor", 3.5), seed=19),
    case("3d", shape=(2, 2, 5), reduction="none", seed=20),
    case("3d-mean", shift=2, shape=(2, 2, 5), opts=ALL, seed=21),
    case("1d", shape=(7,), seed=22),
    case("int32", label_dtype="int32", reduction="none", seed=23),
    case("int32-mean", shift=2, label_dtype="int32", seed=24),
    case("bad-labels", bad_labels=(37, -5), reduction="none", seed=25),
    case("not-inplace", inplace=False, opts=ALL, seed=26),
    case("jit", jit=True, reduction="none", seed=27),
    case("jit-mean", shift=2, jit=True, seed=28),
    case("bf16", dtype="bfloat16", opts=ALL, seed=29),
    case("f16-none", dtype="float16", reduction="none", seed=30),
    case("shift-is-length", shift=6, seed=31),
    case("shift-past-length", shift=9, reduction="none", seed=32),
    case("shift-past-length-sum", shift=9, reduction="sum", seed=33),
]


def sliced(inputs, shift):
    """The sliced problem: logits[..., :kept, :], labels[..., shift:], the upstream of "none" shaped like those."""
    kept = inputs.labels[..., shift:].shape[-1]
    return kept, inputs.logits[..., :kept, :], inputs.labels[..., shift:], inputs.upstream[..., :kept]


def run_torch(case, logits, labels, upstream, n_items, **extra):
    leaf = logits.detach().requires_grad_()
    x = leaf.clone() if case.inplace else leaf  # a non-leaf: the in-place backward writes into its buffer
    loss = fastce_torch.cross_entropy(
        x,
        labels,
        reduction=case.reduction,
        n_items=n_items,
        backend="kernel",
        inplace_backward=case.inplace,
        **case.opts.as_kwargs(),
        **extra,
    )
    loss.backward(upstream if case.reduction == "none" else None)
    return loss.detach(), leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def run_jax(case, logits, labels, upstream, n_items, **extra):
    import jax

    fastce_jax = optional_jax()
    y = exchange.labels_to_jax(labels)
    if isinstance(n_items, torch.Tensor):
        n_items = exchange.to_jax(n_items) if n_items.is_floating_point() else exchange.labels_to_jax(n_items)

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

    loss, vjp = jax.vjp(jax.jit(loss_fn) if case.jit else loss_fn, exchange.to_jax(logits.contiguous()))
    (grad,) = vjp(exchange.to_jax(upstream.contiguous()) if case.reduction == "none" else jax.numpy.ones_like(loss))
    return exchange.to_torch(loss), exchange.to_torch(grad)


@pytest.mark.parametrize("package", ["torch", "jax"])
@pytest.mark.parametrize("case,shift", CASES)
def test_shift_equals_the_sliced_call(case, shift, package, device):
    if package == "jax" and optional_jax() is None:
        pytest.skip("fastce_jax is not importable")
    run = {"torch": run_torch, "jax": run_jax}[package]
    inputs = make_inputs(case, device)
    kept, x, y, upstream = sliced(inputs, shift)
    ref = reference.cross_entropy(
        x.detach().cpu().double().numpy(),
        y.cpu().numpy(),
        reduction=case.reduction,
        n_items=float(inputs.n_items) if torch.is_tensor(inputs.n_items) else inputs.n_items,
        upstream=upstream.cpu().numpy(),
        opts=case.opts,
    )
    loss, grad = run(case, inputs.logits, inputs.labels, upstream, inputs.n_items, shift=shift)
    assert loss.dtype == torch.float32 and tuple(loss.shape) == tuple(np.shape(ref.loss))
    assert grad.dtype == inputs.logits.dtype and grad.shape == inputs.logits.shape
    # The positions past the kept part have no label: exactly zero, as the sliced call's padded gradient.
    assert not grad[..., kept:, :].any(), "the unlabelled last positions got a gradient"
    grad = grad[..., :kept, :]
    ulps = torch_ulps_reference(inputs, case) if package == "torch" else 0.5
    check(as_f64(loss), ref.loss, loss_bound(ref), f"{package} loss vs reference")
    check(as_f64(grad), ref.grad, grad_bound(ref, as_f64(grad), case.dtype, ulps=ulps), f"{package} grad vs reference")
    # And against the same package's sliced call (within the pair tolerance: the reductions may sum in another order).
    sliced_loss, sliced_grad = run(case, x, y, upstream, inputs.n_items)
    assert sliced_loss.shape == loss.shape
    check(as_f64(loss), as_f64(sliced_loss), loss_bound(ref), f"{package} loss vs its sliced call")
    both = np.maximum(np.abs(as_f64(grad)), np.abs(as_f64(sliced_grad)))
    check(
        as_f64(grad),
        as_f64(sliced_grad),
        grad_bound(ref, both, case.dtype, ulps=ULPS_PAIR),
        f"{package} grad vs its sliced call",
    )


LINEAR_CASES = [
    LinearCase("mean", shape=(2, 6), bias=True, shift=1),
    LinearCase("sum-n_items", shape=(2, 6), reduction="sum", n_items=4, scalar_upstream=1.3, shift=2),
    LinearCase("none", shape=(2, 6), reduction="none", shift=1),
    LinearCase("none-shift2-3d", shape=(2, 2, 5), reduction="none", bias=True, shift=2),
    LinearCase("all-options", shape=(2, 6), opts=reference.Options(-1, 5.0, 0.8, 0.2, 1e-4), shift=2),
    LinearCase("int32-mean", shape=(2, 6), label_dtype="int32", shift=1),
    LinearCase("1d-none", shape=(9,), reduction="none", shift=True),
    LinearCase("shift-past-length", shape=(2, 3), shift=5),
]


@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: f"{c.id}-shift{c.shift}")
def test_linear_shift_equals_the_sliced_call(case, package, device):
    runner = package_runner(package)
    case, chunks = small_chunks(case)
    hidden, weight, bias, labels, upstream, n_items = make_linear_inputs(case, device)
    kept = labels[..., case.shift :].shape[-1]
    if case.reduction == "none":
        upstream = upstream[..., :kept]
    loss, grads = runner(case, (hidden, weight, bias, labels, upstream, n_items))
    assert not grads[0][..., kept:, :].any(), "the unlabelled last positions got a hidden gradient"
    grads = [grads[0][..., :kept, :], *grads[1:]]
    sliced_inputs = (hidden[..., :kept, :], weight, bias, labels[..., case.shift :], upstream, n_items)
    sliced_case = dataclasses.replace(case, shape=tuple(labels[..., case.shift :].shape), shift=0)
    check_result(sliced_case, sliced_inputs, (loss, grads), chunks)


BAD_SHIFTS = [
    pytest.param(-1, ValueError, id="negative"),
    pytest.param(1.0, TypeError, id="float"),
    pytest.param("1", TypeError, id="str"),
    pytest.param(None, TypeError, id="None"),
]


def calls(device):
    """(name, call(shift, labels)) for both functions of both packages on small inputs; labels (2, 4) or 0-d."""
    gen = torch.Generator().manual_seed(0)
    logits, hidden, weight = (torch.randn(s, generator=gen).to(device) for s in ((2, 4, 9), (2, 4, 3), (9, 3)))

    def lead(tensor, labels):  # the inputs matching labels' shape
        return (tensor if labels.dim() else tensor[0, 0]).contiguous()

    out = [
        ("torch ce", lambda k, y: fastce_torch.cross_entropy(lead(logits, y), y, shift=k)),
        ("torch linear", lambda k, y: fastce_torch.linear_cross_entropy(lead(hidden, y), weight, y, shift=k)),
    ]
    fastce_jax = optional_jax()
    if fastce_jax is not None:
        to_jax, lab = exchange.to_jax, exchange.labels_to_jax
        out += [
            ("jax ce", lambda k, y: fastce_jax.cross_entropy(to_jax(lead(logits, y)), lab(y), shift=k)),
            (
                "jax linear",
                lambda k, y: fastce_jax.linear_cross_entropy(to_jax(lead(hidden, y)), to_jax(weight), lab(y), shift=k),
            ),
        ]
    return out


@pytest.mark.parametrize("shift,error", BAD_SHIFTS)
def test_bad_shift_raises_the_same_error_everywhere(shift, error, device):
    labels = torch.randint(0, 9, (2, 4)).to(device)
    for name, call in calls(device):
        with pytest.raises(error, match="shift must be"):
            call(shift, labels)
            pytest.fail(f"{name}: shift={shift!r} was accepted")


def test_shift_needs_a_sequence_dimension(device):
    labels = torch.tensor(3).to(device)  # 0-d labels: logits (V,)
    for name, call in calls(device):
        with pytest.raises(ValueError, match="shift needs"):
            call(1, labels)
        assert np.isfinite(float(call(0, labels))), name  # shift=0 is the plain call


def test_shift_false_and_zero_are_the_plain_call(device):
    labels = torch.randint(0, 9, (2, 4)).to(device)
    for name, call in calls(device):
        plain = float(call(0, labels))
        assert float(call(False, labels)) == plain, name
        assert float(call(True, labels)) == float(call(1, labels)), name
