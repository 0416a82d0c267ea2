"""Class weights (`weight=` of cross_entropy, `class_weight=` of linear_cross_entropy, torch's
`CrossEntropyLoss(weight=)`) in both packages, against the float64 reference (reference.py, `weight`) and against
torch.nn.functional.cross_entropy(weight=..., label_smoothing=...) in float64; fastce_jax also against optax (which
has no class-weight argument: its cross-entropy of the weighted smoothed targets w_c q_c is the same loss).

Semantics (CONTRACT.md, "Class weights"): per token (1 - eps) w[y] (lse - z_y) + (eps / V) sum_c w_c (lse - z_c)
+ w[y] z_loss lse^2, "mean" divided by sum_t w[y_t] over the non-ignored tokens, n_items replacing that divisor.
Tolerances: the shared model (tolerances.py) with the reference's weighted error scales.
"""

import dataclasses
import functools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from . import exchange, reference
from .harness import Case, as_f64, make_inputs, optional_jax
from .tolerances import assert_grad, assert_loss, check, loss_bound

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")

PACKAGES = ["torch", "jax"]
SMOOTH = reference.Options(label_smoothing=0.2)
ALL = reference.Options(logit_softcapping=5.0, logit_scaling=0.7, label_smoothing=0.1, z_loss=1e-3)
Z = reference.Options(z_loss=1e-2)


def class_weights(vocab, seed, zero_columns=()):
    """Fresh weights in [-0.5, 2) (negative weights are allowed, as in torch), some columns exactly 0."""
    gen = torch.Generator().manual_seed(1000 + seed)
    w = torch.rand(vocab, generator=gen, dtype=torch.float64) * 2.5 - 0.5
    for c in zero_columns:
        w[c] = 0.0
    return w.to(torch.float32)


def case(name, **fields):
    fields.setdefault("shape", (9,))
    fields.setdefault("vocab", 37)
    return pytest.param(Case(name, **fields), id=f"{name}-{fields.get('dtype', 'float32')}")


CASES = [
    case("mean", seed=1),
    case("sum", reduction="sum", seed=2),
    case("none", reduction="none", seed=3),
    case("smoothing-mean", opts=SMOOTH, seed=4),
    case("smoothing-sum", opts=SMOOTH, reduction="sum", seed=5),
    case("smoothing-none", opts=SMOOTH, reduction="none", seed=6),
    case("z-loss-mean", opts=Z, offset=4.0, seed=7),
    case("softcap", opts=reference.Options(logit_softcapping=5.0), reduction="none", seed=8),
    case("all-options-mean", opts=ALL, seed=9),
    case("all-options-none", opts=ALL, reduction="none", seed=10),
    case("n-items", opts=SMOOTH, n_items=5, seed=11),
    case("n-items-tensor-sum", reduction="sum", n_items=("tensor", 3.5), seed=12),
    case("all-ignored", ignore="all", seed=13),
    case("ignore-real-class", ignore="class", opts=reference.Options(ignore_index=3, label_smoothing=0.1), seed=14),
    case("bad-labels", bad_labels=(37, -5), reduction="none", opts=SMOOTH, seed=15),
    case("neg-inf-tail", neg_inf="tail", opts=SMOOTH, reduction="none", seed=16),
    case("3d", shape=(2, 3, 4), opts=SMOOTH, seed=17),
    case("bf16", dtype="bfloat16", opts=SMOOTH, seed=18),
    case("float64", dtype="float64", opts=ALL, seed=19),  # the plain-framework path, whatever the backend
]


def jax_or_skip():
    fastce_jax = optional_jax()
    if fastce_jax is None:
        pytest.skip("fastce_jax is not importable")
    return fastce_jax


def weights_for(case):
    # Vocabulary padding at -inf gets weight 0 (the realistic use): a class of weight 0 takes no part, so the
    # smoothing term stays finite there.
    pad = range(case.vocab - max(1, case.vocab // 8), case.vocab) if case.neg_inf == "tail" else (case.vocab // 2,)
    return class_weights(case.vocab, case.seed, pad)


def expected(case, inputs, weight):
    return reference.expected(
        as_f64(inputs.logits),
        inputs.labels.cpu().numpy(),
        reduction=case.reduction,
        n_items=inputs.n_items,
        upstream=inputs.upstream.cpu().numpy() if case.reduction == "none" else None,
        weight=weight.numpy().astype(np.float64),
        **case.opts.as_kwargs(),
    )


def run_package(package, case, inputs, weight, **extra):
    """(loss, d loss / d logits) of the package's cross_entropy with class weights, kernels forced, in place."""
    kwargs = dict(reduction=case.reduction, n_items=inputs.n_items, backend="kernel", **case.opts.as_kwargs())
    kwargs.update(extra)
    if package == "torch":
        leaf = inputs.logits.detach().clone().requires_grad_()
        logits = leaf + 0  # a non-leaf: the default in-place backward
        loss = fastce_torch.cross_entropy(logits, inputs.labels, weight=weight.to(logits.device), **kwargs)
        loss.backward(inputs.upstream if case.reduction == "none" else None)
        return as_f64(loss), as_f64(leaf.grad)
    fastce_jax = jax_or_skip()
    import jax

    x, y = exchange.to_jax(inputs.logits), exchange.labels_to_jax(inputs.labels)
    n_items = inputs.n_items
    if isinstance(n_items, torch.Tensor):
        n_items = exchange.to_jax(n_items)
    kwargs["n_items"] = n_items
    w = exchange.to_jax(weight.to(inputs.logits.device))
    loss, vjp = jax.vjp(lambda v: fastce_jax.cross_entropy(v, y, weight=w, **kwargs), x)
    cotangent = exchange.to_jax(inputs.upstream) if case.reduction == "none" else jax.numpy.ones((), loss.dtype)
    return np.asarray(loss, np.float64), np.asarray(vjp(cotangent.astype(loss.dtype))[0].astype(np.float32), np.float64)


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("case", CASES)
def test_cross_entropy_against_reference(case, package, device):
    inputs = make_inputs(case, device)
    weight = weights_for(case)
    ref = expected(case, inputs, weight)
    loss, grad = run_package(package, case, inputs, weight)
    assert_loss(loss, ref, f"{package} loss")
    ulps = 1.0 if case.dtype == "bfloat16" else 0.5  # Triton's interpreter truncates to bfloat16
    assert_grad(grad, ref, case.dtype, f"{package} grad", ulps=ulps)


def torch_weighted(x, labels, weight, reduction, label_smoothing, ignore_index=-100, n_items=None):
    """torch.nn.functional.cross_entropy(weight=) in float64; n_items as fastce reads it (sum / n_items)."""
    if n_items is not None:
        total = torch.nn.functional.cross_entropy(
            x, labels, weight=weight, reduction="sum", label_smoothing=label_smoothing, ignore_index=ignore_index
        )
        return total / float(n_items)
    return torch.nn.functional.cross_entropy(
        x, labels, weight=weight, reduction=reduction, label_smoothing=label_smoothing, ignore_index=ignore_index
    )


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("n_items", [None, 7.0])
def test_reference_is_torch_semantics(reduction, label_smoothing, n_items):
    """The float64 reference's weighted loss and gradient are F.cross_entropy(weight=, label_smoothing=)'s, for
    every reduction, ignored rows included (torch's "mean" divides by sum_t w[y_t] over the non-ignored rows)."""
    if n_items is not None and reduction == "none":
        pytest.skip("n_items does not apply to 'none'")
    gen = torch.Generator().manual_seed(7)
    n, vocab = 11, 13
    x = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[[1, 4]] = -100
    weight = torch.rand(vocab, generator=gen, dtype=torch.float64) * 2.5 - 0.5
    x.requires_grad_()
    expected_loss = torch_weighted(x, labels, weight, reduction, label_smoothing, n_items=n_items)
    upstream = torch.randn(n, generator=gen, dtype=torch.float64) if reduction == "none" else None
    (expected_grad,) = torch.autograd.grad(expected_loss, x, upstream)
    ref = reference.cross_entropy(
        x.detach().numpy(),
        labels.numpy(),
        reduction=reduction,
        n_items=n_items,
        upstream=None if upstream is None else upstream.numpy(),
        opts=reference.Options(label_smoothing=label_smoothing),
        weight=weight.numpy(),
    )
    np.testing.assert_allclose(ref.loss, expected_loss.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref.grad, expected_grad.numpy(), rtol=1e-12, atol=1e-12)


def test_reference_z_loss_is_weighted_by_the_label():
    """The decision CONTRACT.md documents: the z-loss term of a row is weighted by w[y] like its label term, so
    "mean" stays a weighted mean (uniform weights change nothing, as in torch)."""
    gen = np.random.default_rng(3)
    x = gen.normal(size=(6, 9)) * 2
    labels = gen.integers(0, 9, 6)
    labels[2] = -100
    weight = gen.uniform(-0.5, 2.0, 9)
    zl = 1e-2
    with_z = reference.cross_entropy(x, labels, reduction="sum", opts=reference.Options(z_loss=zl), weight=weight)
    without = reference.cross_entropy(x, labels, reduction="sum", weight=weight)
    lse = reference.logsumexp_rows(x)
    kept = labels != -100
    np.testing.assert_allclose(
        with_z.loss - without.loss, np.sum((weight[np.where(kept, labels, 0)] * zl * lse * lse)[kept]), rtol=1e-12
    )
    uniform = reference.cross_entropy(x, labels, opts=reference.Options(z_loss=zl), weight=np.full(9, 3.0))
    plain = reference.cross_entropy(x, labels, opts=reference.Options(z_loss=zl))
    np.testing.assert_allclose(uniform.loss, plain.loss, rtol=1e-12)
    np.testing.assert_allclose(uniform.grad, plain.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize(
    "case",
    [
        case("torch-mean", seed=30),
        case("torch-smoothing-mean", opts=SMOOTH, seed=31),
        case("torch-smoothing-none", opts=SMOOTH, reduction="none", seed=32),
        case("torch-sum", reduction="sum", opts=reference.Options(label_smoothing=0.05), seed=33),
        case("torch-n-items", n_items=4, opts=SMOOTH, seed=34),
    ],
)
def test_cross_entropy_against_torch(case, package, device):
    """The kernels against F.cross_entropy(weight=, label_smoothing=) computed in float64 on the same values."""
    inputs = make_inputs(case, device)
    weight = weights_for(case)
    x = torch.tensor(as_f64(inputs.logits), requires_grad=True)
    labels = inputs.labels.cpu()
    loss64 = torch_weighted(
        x, labels, weight.double(), case.reduction, case.opts.label_smoothing, n_items=inputs.n_items
    )
    loss64.backward(inputs.upstream.cpu().double() if case.reduction == "none" else None)
    ref = expected(case, inputs, weight)  # its error scales give the tolerance
    loss, grad = run_package(package, case, inputs, weight)
    check(loss, loss64.detach().numpy(), loss_bound(ref), f"{package} loss vs torch")
    assert_grad(grad, dataclass_with_grad(ref, x.grad.numpy()), case.dtype, f"{package} grad vs torch")


def dataclass_with_grad(ref, grad):
    return dataclasses.replace(ref, grad=grad)


def small_vocab_chunks(package, monkeypatch):
    """Tiles of 16 and chunks of 32 columns: a row of V = 300 is 10 chunks, the last one partial. Patched in each
    package's losses/cross_entropy/launch.py, where the launchers look them up: fastce_torch's launch.forward_config (it
    caches per argument set), fastce_jax's tile constants (read at each call, part of its jit key). Returns that launch
    module, whose forward_config gives the patched tiles."""
    if package == "torch":
        from fastce_torch.losses.cross_entropy import launch

        monkeypatch.setattr(launch, "forward_config", functools.partial(launch.forward_config, block=16, chunk=32))
    else:
        jax_or_skip()
        from fastce_jax.losses.cross_entropy import launch

        monkeypatch.setattr(launch, "FORWARD_BLOCK", 16)
        monkeypatch.setattr(launch, "CHUNK", 32)
        monkeypatch.setattr(launch, "BACKWARD_BLOCK", 64)
    assert launch.forward_config(300)[2] == 10, launch.forward_config(300)
    return launch


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize(
    "case",
    [
        case("chunks-smoothing-mean", vocab=300, opts=SMOOTH, seed=40),
        case("chunks-all-none", vocab=300, opts=ALL, reduction="none", neg_inf="tail", seed=41),
        case("chunks-sum", vocab=300, reduction="sum", seed=42),
    ],
)
def test_several_vocab_chunks(case, package, device, monkeypatch):
    small_vocab_chunks(package, monkeypatch)
    inputs = make_inputs(case, device)
    weight = weights_for(case)
    ref = expected(case, inputs, weight)
    loss, grad = run_package(package, case, inputs, weight)
    assert_loss(loss, ref, f"{package} loss")
    assert_grad(grad, ref, case.dtype, f"{package} grad")


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_extra_outputs(package, reduction, device):
    """z_loss is the loss's weighted term; lse, accuracy and entropy do not depend on the weights."""
    case_ = Case("outputs", shape=(9,), vocab=37, reduction=reduction, opts=ALL, seed=50)
    inputs = make_inputs(case_, device)
    weight = weights_for(case_)
    returns = dict(return_z_loss=True, return_lse=True, return_accuracy=True, return_entropy=True)
    kwargs = dict(reduction=reduction, backend="kernel", **ALL.as_kwargs(), **returns)
    x64, labels = as_f64(inputs.logits), inputs.labels.cpu().numpy()
    want = reference.outputs(x64, labels, reduction=reduction, opts=ALL, weight=weight.numpy().astype(np.float64))
    plain = reference.outputs(x64, labels, reduction=reduction, opts=ALL)
    if package == "torch":
        out = fastce_torch.cross_entropy(inputs.logits, inputs.labels, weight=weight.to(device), **kwargs)
        got = {name: as_f64(getattr(out, name)) for name in ("z_loss", "lse", "accuracy", "entropy")}
    else:
        fastce_jax = jax_or_skip()
        out = fastce_jax.cross_entropy(
            exchange.to_jax(inputs.logits),
            exchange.labels_to_jax(inputs.labels),
            weight=exchange.to_jax(weight.to(device)),
            **kwargs,
        )
        got = {name: np.asarray(getattr(out, name), np.float64) for name in ("z_loss", "lse", "accuracy", "entropy")}
    tol = 1e-5 * (1.0 + np.abs(np.nan_to_num(want.z_loss, posinf=0, neginf=0)))
    check(got["z_loss"], want.z_loss, tol, "z_loss")
    check(got["lse"], plain.lse, 1e-5 * (1 + np.abs(np.where(np.isfinite(plain.lse), plain.lse, 0))), "lse")
    np.testing.assert_array_equal(got["accuracy"], plain.accuracy)
    check(got["entropy"], plain.entropy, 1e-5 * (1 + np.abs(plain.entropy)), "entropy")


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_z_loss_output_gradient(package, reduction, device):
    """d(loss + z_loss output) / d logits: the z-loss part counted twice, i.e. 2 grad(z_loss) - grad(z_loss=0) of
    the reference (the z_loss output is the loss's weighted term, so its gradient is that part of the loss's)."""
    opts = reference.Options(label_smoothing=0.1, z_loss=5e-2)
    case_ = Case("z-grad", shape=(9,), vocab=37, reduction=reduction, opts=opts, seed=55)
    inputs = make_inputs(case_, device)
    weight = weights_for(case_)
    with_z = expected(case_, inputs, weight)
    without = expected(dataclasses.replace(case_, opts=dataclasses.replace(opts, z_loss=0.0)), inputs, weight)
    want = 2.0 * with_z.grad - without.grad
    kwargs = dict(reduction=reduction, backend="kernel", return_z_loss=True, **opts.as_kwargs())
    if package == "torch":
        leaf = inputs.logits.detach().clone().requires_grad_()
        out = fastce_torch.cross_entropy(leaf + 0, inputs.labels, weight=weight.to(device), **kwargs)
        total = out.loss + out.z_loss
        total.backward(inputs.upstream if reduction == "none" else None)
        grad = as_f64(leaf.grad)
    else:
        fastce_jax = jax_or_skip()
        import jax

        x, y = exchange.to_jax(inputs.logits), exchange.labels_to_jax(inputs.labels)
        w = exchange.to_jax(weight.to(device))

        def total(v):
            out = fastce_jax.cross_entropy(v, y, weight=w, **kwargs)
            return out.loss + out.z_loss

        value, vjp = jax.vjp(total, x)
        cot = exchange.to_jax(inputs.upstream) if reduction == "none" else jax.numpy.ones((), value.dtype)
        grad = np.asarray(vjp(cot)[0], np.float64)
    assert_grad(grad, dataclasses.replace(with_z, grad=want, grad_scale=2 * with_z.grad_scale), "float32")


LINEAR_SPECS = [("mean", SMOOTH, None), ("sum", Z, 6), ("none", ALL, None), ("mean", ALL, None)]


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("reduction,opts,n_items", LINEAR_SPECS, ids=lambda v: str(v)[:24])
def test_linear_cross_entropy(package, reduction, opts, n_items, device):
    """linear_cross_entropy(class_weight=) over several row chunks (chunk_rows=3), loss and the hidden / weight /
    bias gradients against reference.linear_cross_entropy(class_weight=)."""
    gen = torch.Generator().manual_seed(60)
    n, width, vocab = 10, 8, 37
    hidden = torch.randn(n, width, generator=gen)
    head = torch.randn(vocab, width, generator=gen) * 0.5
    bias = torch.randn(vocab, generator=gen) * 0.1
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[[1, 6]] = -100
    weight = class_weights(vocab, 60, (5,))
    upstream = torch.randn(n, generator=gen)
    ref = reference.linear_cross_entropy(
        hidden.double().numpy(), head.double().numpy(), labels.numpy(), bias=bias.double().numpy(),
        reduction=reduction, n_items=n_items, upstream=upstream.numpy() if reduction == "none" else None,
        opts=opts, class_weight=weight.double().numpy(),
    )  # fmt: skip
    kwargs = dict(reduction=reduction, n_items=n_items, backend="kernel", chunk_rows=3, **opts.as_kwargs())
    if package == "torch":
        h, w, b = (t.clone().to(device).requires_grad_() for t in (hidden, head, bias))
        loss = fastce_torch.linear_cross_entropy(
            h, w, labels.to(device), bias=b, class_weight=weight.to(device), **kwargs
        )
        loss.backward(upstream.to(device) if reduction == "none" else None)
        got = [as_f64(t) for t in (loss, h.grad, w.grad, b.grad)]
    else:
        fastce_jax = jax_or_skip()
        import jax

        args = [exchange.to_jax(t.to(device)) for t in (hidden, head, bias)]
        y, cw = exchange.labels_to_jax(labels.to(device)), exchange.to_jax(weight.to(device))
        # The chunk matmuls follow JAX's default precision, TF32 for float32 on a GPU: ask for float32, as torch does.
        with jax.default_matmul_precision("float32"):
            loss, vjp = jax.vjp(
                lambda h, w, b: fastce_jax.linear_cross_entropy(h, w, y, bias=b, class_weight=cw, **kwargs), *args
            )
            cot = exchange.to_jax(upstream.to(device)) if reduction == "none" else jax.numpy.ones((), loss.dtype)
            got = [np.asarray(loss, np.float64)] + [np.asarray(g, np.float64) for g in vjp(cot)]
    assert_loss(got[0], ref.logits, f"{package} loss")
    scale = np.abs(ref.logits.grad_scale.reshape(n, vocab))
    exact = [ref.grad_hidden, ref.grad_weight, ref.grad_bias]
    bounds = [scale @ np.abs(head.double().numpy()), scale.T @ np.abs(hidden.double().numpy()), scale.sum(0)]
    for name, actual, want, bound in zip(("hidden", "weight", "bias"), got[1:], exact, bounds):
        check(actual, want, 16 * 2.0**-23 * (bound + 1e-3), f"{package} grad {name}")


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_z_loss_output_gradient(package, reduction, device):
    """linear_cross_entropy(class_weight=, return_z_loss=True): d(loss + z_loss output) / d hidden, weight over
    several row chunks is the reference's with the z-loss part counted twice."""
    gen = torch.Generator().manual_seed(65)
    n, width, vocab = 10, 8, 37
    hidden, head = torch.randn(n, width, generator=gen), torch.randn(vocab, width, generator=gen) * 0.5
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[[2, 7]] = -100
    weight = class_weights(vocab, 65, (4,))
    upstream = torch.randn(n, generator=gen)
    opts = reference.Options(label_smoothing=0.1, z_loss=5e-2)

    def ref(o):
        return reference.linear_cross_entropy(
            hidden.double().numpy(), head.double().numpy(), labels.numpy(), reduction=reduction,
            upstream=upstream.numpy() if reduction == "none" else None, opts=o, class_weight=weight.double().numpy(),
        )  # fmt: skip

    with_z, without = ref(opts), ref(dataclasses.replace(opts, z_loss=0.0))
    want = [2 * with_z.grad_hidden - without.grad_hidden, 2 * with_z.grad_weight - without.grad_weight]
    kwargs = dict(reduction=reduction, backend="kernel", chunk_rows=3, return_z_loss=True, **opts.as_kwargs())
    if package == "torch":
        h, w = (t.clone().to(device).requires_grad_() for t in (hidden, head))
        out = fastce_torch.linear_cross_entropy(h, w, labels.to(device), class_weight=weight.to(device), **kwargs)
        (out.loss + out.z_loss).backward(upstream.to(device) if reduction == "none" else None)
        got = [as_f64(h.grad), as_f64(w.grad)]
    else:
        fastce_jax = jax_or_skip()
        import jax

        y, cw = exchange.labels_to_jax(labels.to(device)), exchange.to_jax(weight.to(device))

        def total(h, w):
            out = fastce_jax.linear_cross_entropy(h, w, y, class_weight=cw, **kwargs)
            return out.loss + out.z_loss

        with jax.default_matmul_precision("float32"):  # not TF32 on a GPU
            value, vjp = jax.vjp(total, *(exchange.to_jax(t.to(device)) for t in (hidden, head)))
            cot = exchange.to_jax(upstream.to(device)) if reduction == "none" else jax.numpy.ones((), value.dtype)
            got = [np.asarray(g, np.float64) for g in vjp(cot)]
    for name, actual, exact in zip(("hidden", "weight"), got, want):
        np.testing.assert_allclose(actual, exact, rtol=1e-4, atol=1e-5, err_msg=f"{package} grad {name}")


@pytest.mark.parametrize("package", PACKAGES)
def test_bad_weights(package, device):
    logits = torch.randn(4, 7, device=device)
    labels = torch.tensor([0, 3, -100, 6], device=device)
    if package == "torch":
        ce, name = fastce_torch.cross_entropy, "weight"
        with pytest.raises(ValueError, match="not supported"):
            ce(logits, labels, weight=torch.ones(7, device=device, requires_grad=True))
        with pytest.raises(ValueError, match="on meta"):
            ce(logits, labels, weight=torch.ones(7, device="meta"))
        with pytest.raises(ValueError, match="class_weight must have shape"):
            fastce_torch.linear_cross_entropy(
                torch.randn(4, 3, device=device), torch.randn(7, 3, device=device), labels,
                class_weight=torch.ones(6, device=device),
            )  # fmt: skip
        bad = [torch.ones(6, device=device), torch.ones(7, 1, device=device), torch.ones(7, dtype=torch.int64)]
        x, y = logits, labels
    else:
        fastce_jax = jax_or_skip()
        import jax
        import jax.numpy as jnp

        ce, name = fastce_jax.cross_entropy, "weight"
        x, y = exchange.to_jax(logits), exchange.labels_to_jax(labels)
        with pytest.raises(ValueError, match="gradients with respect to class weights are not supported"):
            jax.grad(lambda w: ce(x, y, weight=w, backend="kernel"))(jnp.ones(7))
        with pytest.raises(ValueError, match="gradients with respect to class weights are not supported"):
            jax.grad(lambda w: ce(x, y, weight=w, backend="reference"))(jnp.ones(7))
        bad = [jnp.ones(6), jnp.ones((7, 1)), jnp.ones(7, jnp.int32)]
    for weight in bad:
        with pytest.raises((ValueError, TypeError), match=name):
            ce(x, y, weight=weight)


def test_torch_module_and_unsupported_paths(device):
    weight = class_weights(7, 70).to(device)
    logits = torch.randn(5, 7, device=device)
    labels = torch.tensor([0, 3, -100, 6, 2], device=device)
    module = fastce_torch.CrossEntropyLoss(weight=weight, label_smoothing=0.1, backend="kernel")
    assert torch.equal(module.weight, weight) and "weight" in module.state_dict()
    want = torch.nn.functional.cross_entropy(
        logits.double().cpu(), labels.cpu(), weight=weight.double().cpu(), label_smoothing=0.1
    )
    torch.testing.assert_close(module(logits, labels).double().cpu(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="class weights"):
        fastce_torch.cross_entropy(logits, labels, weight=weight, process_group=object())


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_against_optax(smoothing, device):
    """optax has no class-weight argument; its cross-entropy against the weighted smoothed targets w_c q_c
    (q = optax.smooth_labels of the one-hot label) is torch's weighted, smoothed loss per token."""
    fastce_jax = jax_or_skip()
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp

    case_ = Case("optax", shape=(9,), vocab=37, ignore="none", reduction="none", seed=80)
    inputs = make_inputs(case_, device)
    weight = class_weights(37, 80, (4,))
    x, y = exchange.to_jax(inputs.logits), exchange.labels_to_jax(inputs.labels)
    w = exchange.to_jax(weight.to(device))
    targets = optax.smooth_labels(jax.nn.one_hot(y, 37), smoothing) if smoothing else jax.nn.one_hot(y, 37)
    want = optax.softmax_cross_entropy(x, targets * w)
    got = fastce_jax.cross_entropy(x, y, weight=w, reduction="none", label_smoothing=smoothing, backend="kernel")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    mean = fastce_jax.cross_entropy(x, y, weight=w, label_smoothing=smoothing, backend="kernel")
    np.testing.assert_allclose(float(mean), float(jnp.sum(want) / jnp.sum(w[y])), rtol=2e-5)


SHARDED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import fastce_jax
from shared_tests import reference
assert len(jax.devices()) == 4
rng = np.random.default_rng(5)
x = (rng.standard_normal((8, 64)) * 2).astype(np.float32)
y = rng.integers(0, 64, 8).astype(np.int32)
y[3] = -100
w = rng.uniform(-0.5, 2.0, 64).astype(np.float32)
opts = reference.Options(label_smoothing=0.2, z_loss=1e-3)
ref = reference.cross_entropy(x, y, opts=opts, weight=w)
mesh = Mesh(np.array(jax.devices()), ("d",))
for spec in (P("d", None), P(None, "d")):
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = jax.jit(jax.value_and_grad(lambda v: fastce_jax.cross_entropy(
        v, y, weight=w, backend="kernel", label_smoothing=0.2, z_loss=1e-3)))
    loss, grad = f(xs)
    np.testing.assert_allclose(float(loss), float(ref.loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref.grad, rtol=1e-4, atol=1e-6)
print("sharded ok")
"""


@pytest.mark.slow
def test_jax_sharded_logits_on_4_cpu_devices(use_gpu_flag):
    """fastce_jax with class weights under jit with logits sharded over rows or over the vocabulary (4 CPU devices,
    the kernels interpreted): the weighted kernels run on the whole array (no partitioning rule), exactly."""
    jax_or_skip()
    if use_gpu_flag:
        pytest.skip("a CPU-devices check")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The device count added to the caller's XLA flags (CI's among them), not in their place.
    flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=4"]))
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0 and "sharded ok" in done.stdout, done.stdout[-4000:] + done.stderr[-4000:]


def test_jax_platform_route_under_jit(monkeypatch, use_gpu_flag):
    """In a process with a GPU backend, "auto" under jit decides when lowering (jax.lax.platform_dependent): the
    weights ride through both branches; lowered for the CPU it is the weighted reference, gradient included."""
    fastce_jax = jax_or_skip()
    if use_gpu_flag:
        pytest.skip("a CPU-lowering check")
    import jax

    from fastce_jax.core import options

    monkeypatch.setattr(options, "gpu_available", lambda: True)
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((6, 21)) * 2).astype(np.float32)
    y = rng.integers(0, 21, 6).astype(np.int32)
    y[0] = -100
    w = rng.uniform(-0.5, 2.0, 21).astype(np.float32)
    step = jax.jit(jax.value_and_grad(lambda v: fastce_jax.cross_entropy(v, y, weight=w, label_smoothing=0.1)))
    assert "platform_index" in str(jax.make_jaxpr(step)(x))
    loss, grad = step(x)
    ref = reference.cross_entropy(x, y, opts=reference.Options(label_smoothing=0.1), weight=w)
    np.testing.assert_allclose(float(loss), float(ref.loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref.grad, rtol=1e-4, atol=1e-6)


@pytest.fixture
def use_gpu_flag(request):
    return bool(request.config.getoption("--gpu", default=False))


@pytest.mark.parametrize("kind", ["cross_entropy", "linear"])
def test_torch_compile_fullgraph(kind, device):
    """torch.compile(fullgraph=True) through the custom ops with class weights (no graph break)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(90)
    weight = class_weights(37, 90, (2,)).to(device)
    labels = torch.randint(0, 37, (6,), generator=gen).to(device)
    labels[1] = -100
    opts = dict(label_smoothing=0.1, z_loss=1e-3, backend="kernel")
    if kind == "cross_entropy":
        x0 = (torch.randn(6, 37, generator=gen) * 2).to(device)

        def f(x):
            return fastce_torch.cross_entropy(x, labels, weight=weight, **opts)

        inputs = [x0]
    else:
        h0, w0 = torch.randn(6, 8, generator=gen).to(device), torch.randn(37, 8, generator=gen).to(device)

        def f(h, w):
            return fastce_torch.linear_cross_entropy(h, w, labels, class_weight=weight, chunk_rows=4, **opts)

        inputs = [h0, w0]
    eager = [t.clone().requires_grad_() for t in inputs]
    compiled = [t.clone().requires_grad_() for t in inputs]
    want = f(*eager)
    want.backward()
    got = torch.compile(f, fullgraph=True)(*compiled)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("reduction,opts", [("mean", SMOOTH), ("none", ALL), ("sum", Z)])
def test_gpu_large_vocab(package, dtype, reduction, opts, device):
    """The H200 variant: V = 50257 (4 chunks of 16384, the last partial), 257 rows, the default tiles."""
    c = Case("gpu", shape=(257,), vocab=50257, dtype=dtype, reduction=reduction, opts=opts, seed=100)
    inputs = make_inputs(c, device)
    weight = class_weights(c.vocab, c.seed, (0, 17))
    ref = expected(c, inputs, weight)
    loss, grad = run_package(package, c, inputs, weight)
    assert_loss(loss, ref, f"{package} loss")
    assert_grad(grad, ref, dtype, f"{package} grad")
    assert math.isfinite(float(np.sum(loss)))
