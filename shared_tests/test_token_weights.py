"""token_weights (issue 37) in cross_entropy and linear_cross_entropy of both packages, every reduction, against the
float64 reference (reference.cross_entropy / linear_cross_entropy with token_weights=) and each other, through the
shared harness (the same buffers, DLPack).

Contract: loss_t is multiplied by w_t (its z-loss term included) before the reduction; "mean" still divides by the
number of non-ignored tokens (or n_items, or the class weights' divisor), never by the weights' sum; "none" returns
w_t loss_t; weights may be negative; a NaN weight makes its token's loss (and gradient row) NaN; with shift=k the
weights go with the labels (w[..., t] with label[..., t], the first k unused); the z_loss output is weighted like the
loss's term, lse / accuracy / entropy are not. Tolerances: the shared model (the reference's error scales carry |w_t|).
"""

import dataclasses

import numpy as np
import pytest
import torch

from . import reference
from .harness import Case, as_f64, compare, make_inputs, optional_jax, run_jax, run_torch
from .test_linear_cross_entropy import LinearCase, check_result, package_runner, small_chunks
from .test_linear_cross_entropy import make_inputs as make_linear_inputs
from .tolerances import check

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")

ALL = reference.Options(logit_softcapping=5.0, logit_scaling=0.7, label_smoothing=0.1, z_loss=1e-3, temperature=0.8)
Z = reference.Options(z_loss=1e-2)


def supports_token_weights(module, name="cross_entropy"):
    import inspect

    return module is not None and "token_weights" in inspect.signature(getattr(module, name)).parameters


def skip_without_token_weights(name="cross_entropy"):
    for module in (fastce_torch, optional_jax()):
        if not supports_token_weights(module, name):
            pytest.skip(f"{getattr(module, '__name__', 'fastce_jax')}.{name} has no token_weights yet")


def make_weights(shape, seed, pattern="random", device="cpu"):
    """Weights like advantages: either sign, some exactly 0; `pattern` "nan" puts a NaN on one scored token (and
    the test on the ignored ones)."""
    gen = torch.Generator().manual_seed(seed + 500)
    weights = torch.randn(shape, generator=gen) * 1.5
    flat = weights.reshape(-1)
    flat[::5] = 0.0
    if pattern == "ones":
        weights = torch.ones(shape)
    elif pattern == "nan":
        flat[-1] = float("nan")  # the harness keeps the last token scored
    return weights.to(device)


def case(name, weights="random", shift=0, **fields):
    fields.setdefault("shape", (2, 6))
    fields.setdefault("vocab", 37)
    return pytest.param(Case(name, **fields), weights, shift, id=f"{name}-{fields.get('dtype', 'float32')}")


CASES = [
    case("mean", seed=1),
    case("sum", reduction="sum", seed=2),
    case("none", reduction="none", seed=3),
    case("ones-mean-is-the-plain-mean", weights="ones", seed=4),
    case("z-loss-mean", opts=Z, offset=5.0, seed=5),
    case("z-loss-none", opts=Z, reduction="none", seed=6),
    case("all-options", opts=ALL, reduction="none", seed=7),
    case("all-options-sum", opts=ALL, reduction="sum", seed=8),
    case("n-items", n_items=5, opts=Z, seed=9),
    case("n-items-tensor-sum", reduction="sum", n_items=("tensor", 3.5), seed=10),
    case("ignore-real-class", ignore="class", opts=reference.Options(ignore_index=3), seed=11),
    case("all-ignored", ignore="all", seed=12),
    case("nan-weight-none", weights="nan", reduction="none", seed=13),
    case("nan-weight-mean", weights="nan", seed=14),
    case("bad-labels", bad_labels=(37,), reduction="none", seed=15),
    case("shift", shift=1, reduction="none", opts=ALL, seed=16),
    case("shift-mean", shift=2, seed=17),
    case("not-inplace", inplace=False, opts=Z, seed=18),
    case("jit", jit=True, reduction="none", seed=19),
    case("bf16", dtype="bfloat16", opts=ALL, seed=20),
    case("bf16-none", dtype="bfloat16", reduction="none", seed=21),
]


def shifted_reference(case, inputs, weights, shift, class_weight=None):
    """The reference of the scored problem (logits[..., :kept, :] against labels[..., shift:] and their weights),
    its gradient (and error scales) padded back to the full logits with zeros."""
    x = inputs.logits.detach().to("cpu", torch.float64).numpy()
    y, w = inputs.labels.cpu().numpy(), weights.cpu().double().numpy()
    kept = y[..., shift:].shape[-1]
    n_items = inputs.n_items.item() if isinstance(inputs.n_items, torch.Tensor) else inputs.n_items
    ref = reference.cross_entropy(
        x[..., :kept, :],
        y[..., shift:],
        reduction=case.reduction,
        n_items=n_items,
        upstream=inputs.upstream[..., :kept].cpu().numpy(),
        opts=case.opts,
        weight=class_weight,
        token_weights=w[..., shift:],
    )
    if not shift:
        return ref

    def pad(values):
        padded = np.zeros(x.shape)
        padded[..., :kept, :] = values
        return padded

    return dataclasses.replace(ref, grad=pad(ref.grad), grad_scale=pad(ref.grad_scale), grad_terms=pad(ref.grad_terms))


@pytest.mark.parametrize("case,weights,shift", CASES)
def test_cross_entropy_token_weights(case, weights, shift, device):
    skip_without_token_weights()
    inputs = make_inputs(case, device)
    w = make_weights(case.shape, case.seed, weights, device)
    if weights == "nan":  # ignored tokens take no part, whatever their weight: NaN there changes nothing
        w = torch.where(inputs.labels == case.opts.ignore_index, float("nan"), w)
    extra = dict(token_weights=w, **({"shift": shift} if shift else {}))
    if shift:  # the upstream of "none" is shaped like the scored tokens
        inputs = dataclasses.replace(inputs, upstream=inputs.upstream[..., : case.shape[-1] - shift].contiguous())
    ref = shifted_reference(case, inputs, w, shift)
    compare(case, inputs, run_torch(case, inputs, **extra), run_jax(case, inputs, **extra), ref)
    if weights == "ones":  # unit weights change nothing: the same value as the call without them (per token
        # exactly; a reduced loss is summed by torch ops over the weighted tokens, not in the kernel: a few ulps)
        plain, weighted = as_f64(run_torch(case, inputs)[0]), as_f64(run_torch(case, inputs, **extra)[0])
        if case.reduction == "none":
            np.testing.assert_array_equal(plain, weighted)
        else:
            np.testing.assert_allclose(weighted, plain, rtol=4 * np.finfo(np.float32).eps, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_token_weights_with_class_weights(reduction, device):
    """Class and token weights multiply: loss_t = u_t (w[y_t] ...), "mean" divided by the class weights' divisor."""
    skip_without_token_weights()
    c = Case("class-and-token", shape=(9,), vocab=23, reduction=reduction, opts=ALL, seed=30)
    inputs = make_inputs(c, device)
    w = make_weights(c.shape, c.seed, device=device)
    class_weight = (torch.rand(c.vocab, generator=torch.Generator().manual_seed(31)) * 2).to(device)
    ref = shifted_reference(c, inputs, w, 0, class_weight=class_weight.cpu().double().numpy())
    extra = dict(token_weights=w, weight=class_weight)
    compare(c, inputs, run_torch(c, inputs, **extra), run_jax(c, inputs, **extra), ref)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("package", ["torch", "jax"])
def test_only_the_z_loss_output_is_weighted(package, reduction, device):
    skip_without_token_weights()
    from .test_outputs import RUNNERS, bounds

    c = Case("outputs", shape=(9,), vocab=37, reduction=reduction, opts=Z, seed=32)
    inputs = make_inputs(c, device)
    w = make_weights(c.shape, c.seed, device=device)
    returns = dict(return_z_loss=True, return_entropy=True, return_lse=True)
    if package == "torch":
        out, _ = RUNNERS[package](c, inputs.logits, inputs.labels, None, token_weights=w, **returns)
    else:
        from . import exchange

        out, _ = RUNNERS[package](c, inputs.logits, inputs.labels, None, token_weights=exchange.to_jax(w), **returns)
    x, y = inputs.logits.detach().double().cpu().numpy(), inputs.labels.cpu().numpy()
    u = w.cpu().double().numpy()
    expected = reference.outputs(x, y, reduction=reduction, opts=Z, token_weights=u)
    tolerance = bounds(x, y, reduction, None, Z)
    scale = np.max(np.abs(u))  # the weighted z-loss term's error is |w| times the unweighted one's
    check(as_f64(out.z_loss), expected.z_loss, tolerance["z_loss"] * scale, f"{package} z_loss")
    check(as_f64(out.entropy), expected.entropy, tolerance["entropy"], f"{package} entropy")
    check(as_f64(out.lse), expected.lse, tolerance["lse"], f"{package} lse")


LINEAR_CASES = [
    LinearCase("mean"),
    LinearCase("sum", reduction="sum", ignore="none", bias=True),
    LinearCase("none", reduction="none", bias=True),
    LinearCase("mean-n_items", n_items=7, scalar_upstream=1.3),
    LinearCase("all-options", opts=reference.Options(-1, 5.0, 0.8, 0.2, 1e-4, 0.7), bias=True),
    LinearCase("none-all-options", reduction="none", opts=reference.Options(-1, 5.0, 0.8, 0.2, 1e-4, 0.7)),
    LinearCase("shift", shape=(2, 6), shift=1, reduction="sum"),
    LinearCase("bf16", dtype="bfloat16", bias=True, scalar_upstream=1.7),
    LinearCase("bf16-none", dtype="bfloat16", reduction="none"),
]


@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.id)
def test_linear_cross_entropy_token_weights(case, package, device):
    """The gradient-in-forward path of "mean" / "sum" and the recompute path of "none" with per-token weights."""
    skip_without_token_weights("linear_cross_entropy")
    runner = package_runner(package)
    case, chunks = small_chunks(case)
    inputs = make_linear_inputs(case, device)
    w = make_weights(case.shape, case.seed, device=device)
    result = runner(case, inputs, token_weights=w)
    scored_w = w[..., case.shift :] if case.shift else w
    if case.shift:  # the reference of the scored problem, with the gradient of hidden's last rows zero
        hidden, weight, bias, labels, upstream, n_items = inputs
        kept = case.shape[-1] - case.shift
        loss, (g_hidden, g_weight, g_bias) = result
        assert torch.all(g_hidden[..., kept:, :] == 0)
        sliced = (hidden[..., :kept, :], weight, bias, labels[..., case.shift :], upstream, n_items)
        inputs, result = sliced, (loss, [g_hidden[..., :kept, :], g_weight, g_bias])
        case = dataclasses.replace(case, shape=(*case.shape[:-1], kept), shift=0)
    check_result(case, inputs, result, chunks, token_weights=scored_w)
