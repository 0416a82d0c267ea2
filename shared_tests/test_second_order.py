"""Second-order derivatives through both packages against the float64 reference: Hessian-vector products of
cross_entropy (every option, every reduction, n_items), of linear_cross_entropy (hidden, weight and bias), and the
gradient penalty users write (the squared gradient of the loss with respect to the hidden states, differentiated
with respect to the weight). torch: create_graph=True (in place and not) and torch.func.grad of grad; JAX: grad of
grad and jvp of grad.

The exact value: reference.py's analytic float64 gradient, differentiated by a central finite difference along the
direction v, (grad(x + e v) - grad(x - e v)) / 2e with e = 1e-5: its truncation error is e**2 |third derivative|
~ 1e-10 and its rounding error 1e-16 / e ~ 1e-11, far below the float32 bounds below.

Tolerance (an explicit float32-level bound): per row i, the Hessian of the contract's loss is upstream_i times
(diag(p) - p p^T) in z, times the transform's first derivatives (|dz/dx| <= s, the scaling) plus a term from the
softcap's second derivative (at most 2/t times the gradient, itself at most 2 s), so |(H v)_ij| <= S_i =
4 |upstream_i| s**2 (1 + 2|z_loss| (1 + |lse_i|)) max_k |v_ik|. The float32 computation of each entry sums O(V)
such terms: K eps32 S_i with K = 64 (V = 37 terms, twice over). The result is rounded once to the logits' dtype:
half an ulp (one for Triton's truncating bf16 conversion), plus tolerances.FLOOR.
"""

import numpy as np
import pytest
import torch

from . import exchange, reference, tolerances
from .harness import as_f64 as f64

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")

N, V, H = 6, 37, 8
STEP = 1e-5
K = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OPTIONS = {
    "plain": reference.Options(),
    "smoothing_zloss": reference.Options(label_smoothing=0.1, z_loss=1e-3),
    "softcap_scaling": reference.Options(logit_softcapping=5.0, logit_scaling=1.5),
    "all": reference.Options(logit_softcapping=4.0, logit_scaling=0.8, label_smoothing=0.2, z_loss=1e-2),
}
REDUCTIONS = [("mean", None), ("sum", None), ("none", None), ("mean", 4.0), ("sum", 2.5)]


def make(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (2.0 * torch.randn(N, V, generator=g)).to(DTYPES[dtype])
    v = torch.randn(N, V, generator=g).to(DTYPES[dtype])
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3] = -100
    upstream = torch.rand(N, generator=g) + 0.5
    return logits.to(device), labels.to(device), v.to(device), upstream.to(device)


def exact_hvp(logits, labels, v, upstream, reduction, n_items, opts):
    x, y, d = f64(logits), labels.cpu().numpy(), f64(v)
    up = f64(upstream) if reduction == "none" else None

    def grad(at):
        return reference.cross_entropy(at, y, reduction=reduction, n_items=n_items, upstream=up, opts=opts)

    base = grad(x)
    hvp = (grad(x + STEP * d).grad - grad(x - STEP * d).grad) / (2 * STEP)
    s = opts.logit_scaling if opts.logit_scaling != 0.0 else 1.0
    lse = np.where(np.isfinite(base.lse), np.abs(base.lse), 0.0)
    row = 4 * np.abs(base.upstream) * s * s * (1 + 2 * abs(opts.z_loss) * (1 + lse)) * np.abs(d).max(-1)
    return hvp, row[:, None]


def check_hvp(actual, exact, row_scale, dtype, what):
    actual = f64(actual) if isinstance(actual, torch.Tensor) else np.asarray(actual, np.float64)
    assert np.abs(exact).max() > 1e-3, "a second derivative that is not trivially zero"
    magnitude = np.maximum(np.abs(actual), np.abs(exact))
    ulps = tolerances.reference_ulps(dtype, truncating_bf16=True)
    bound = K * tolerances.EPS32 * row_scale + ulps * tolerances.ulp(magnitude, dtype) + tolerances.FLOOR
    tolerances.check(actual, exact, bound, what)


def torch_hvp(logits, labels, v, upstream, reduction, n_items, opts, backend, inplace):
    leaf = logits.clone().requires_grad_()
    x = leaf * 1  # an intermediate, so the in-place backward is eligible
    loss = fastce_torch.cross_entropy(
        x, labels, reduction=reduction, n_items=n_items, backend=backend, inplace_backward=inplace, **opts.as_kwargs()
    )
    if reduction == "none":
        loss = (loss * upstream).sum()
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    (hvp,) = torch.autograd.grad((grad * v).sum(), leaf)
    return hvp


def torch_func_hvp(logits, labels, v, upstream, reduction, n_items, opts, backend):
    """torch.func.grad of torch.func.grad: the inner backward runs under two grad levels."""

    def loss(x):
        out = fastce_torch.cross_entropy(
            x, labels, reduction=reduction, n_items=n_items, backend=backend, **opts.as_kwargs()
        )
        return (out * upstream).sum() if reduction == "none" else out

    return torch.func.grad(lambda x: (torch.func.grad(loss)(x) * v).sum())(logits)


def jax_hvp(logits, labels, v, upstream, reduction, n_items, opts, backend, mode):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import fastce_jax

    x, y, d, up = exchange.to_jax(logits), exchange.labels_to_jax(labels), exchange.to_jax(v), exchange.to_jax(upstream)

    def loss(a):
        out = fastce_jax.cross_entropy(a, y, reduction=reduction, n_items=n_items, backend=backend, **opts.as_kwargs())
        return jnp.sum(out * up) if reduction == "none" else out

    if mode == "grad_of_grad":
        hvp = jax.grad(lambda a: jnp.sum(jax.grad(loss)(a).astype(jnp.float32) * d.astype(jnp.float32)))(x)
    else:  # forward over reverse
        hvp = jax.jvp(jax.grad(loss), (x,), (d,))[1]
    assert hvp.dtype == x.dtype
    return np.asarray(hvp.astype(jnp.float32), np.float64)


# Each option set under "mean", and every option at once under each reduction and n_items: the options change the
# per-logit second derivative, the reduction only its row scale (upstream_i in the bound above). float32 on both
# backends; bfloat16 (the casts around the same float32 arithmetic) on the kernels with every option at once.
OPTIONS_AND_REDUCTIONS = [(name, *REDUCTIONS[0]) for name in OPTIONS] + [("all", *r) for r in REDUCTIONS[1:]]
HVP_CASES = [("float32", backend, *case) for backend in ("kernel", "reference") for case in OPTIONS_AND_REDUCTIONS]
HVP_CASES += [("bfloat16", "kernel", "all", *r) for r in REDUCTIONS[:3]]


@pytest.mark.parametrize("dtype,backend,options,reduction,n_items", HVP_CASES)
def test_hessian_vector_product(device, dtype, backend, options, reduction, n_items):
    opts = OPTIONS[options]
    seed = 7 + list(OPTIONS).index(options) + 10 * REDUCTIONS.index((reduction, n_items))
    logits, labels, v, upstream = make(device, dtype, seed)
    exact, row_scale = exact_hvp(logits, labels, v, upstream, reduction, n_items, opts)
    for inplace in (True, False):
        got = torch_hvp(logits, labels, v, upstream, reduction, n_items, opts, backend, inplace)
        check_hvp(got, exact, row_scale, dtype, f"torch hvp (inplace_backward={inplace})")
    got = torch_func_hvp(logits, labels, v, upstream, reduction, n_items, opts, backend)
    check_hvp(got, exact, row_scale, dtype, "torch hvp (torch.func.grad of grad)")
    for mode in ("grad_of_grad", "jvp_of_grad"):
        got = jax_hvp(logits, labels, v, upstream, reduction, n_items, opts, backend, mode)
        check_hvp(got, exact, row_scale, dtype, f"jax hvp ({mode})")


# --- linear_cross_entropy ---------------------------------------------------------------------------------------


def linear_inputs(device, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    bias = 0.5 * torch.randn(V, generator=g)
    directions = [torch.randn(t.shape, generator=g) for t in (hidden, weight, bias)]
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = -100
    return [t.to(device) for t in (hidden, weight, bias, labels, *directions)]


def exact_linear_hvp(hidden, weight, bias, labels, directions, reduction, opts):
    y = labels.cpu().numpy()
    base = [f64(t) for t in (hidden, weight, bias)]
    d = [f64(t) for t in directions]

    def grads(step):
        h, w, b = (p + step * q for p, q in zip(base, d))
        r = reference.linear_cross_entropy(h, w, y, bias=b, reduction=reduction, opts=opts)
        return r.grad_hidden, r.grad_weight, r.grad_bias

    plus, minus = grads(STEP), grads(-STEP)
    return [(p - m) / (2 * STEP) for p, m in zip(plus, minus)]


def check_linear(actual, exact, what):
    # Every entry sums O(V + N) products of float32 values no larger than the largest exact entry's terms: a
    # float32-level bound relative to the component's largest magnitude.
    for name, a, e in zip(("hidden", "weight", "bias"), actual, exact):
        bound = 4 * K * tolerances.EPS32 * np.abs(e).max() + tolerances.FLOOR
        tolerances.check(np.asarray(a, np.float64), e, bound, f"{what}: d {name}")


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_hessian_vector_product(device, backend, reduction):
    opts = OPTIONS["all"]
    hidden, weight, bias, labels, *directions = linear_inputs(device, seed=3)
    exact = exact_linear_hvp(hidden, weight, bias, labels, directions, reduction, opts)

    params = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = fastce_torch.linear_cross_entropy(
        params[0], params[1], labels, bias=params[2], reduction=reduction, backend=backend, **opts.as_kwargs()
    )
    grads = torch.autograd.grad(loss.sum(), params, create_graph=True)
    hvp = torch.autograd.grad(sum((g * d).sum() for g, d in zip(grads, directions)), params)
    check_linear([f64(t) for t in hvp], exact, "torch")

    jax = pytest.importorskip("jax")
    import fastce_jax

    h, w, b = (exchange.to_jax(t) for t in (hidden, weight, bias))
    d = [exchange.to_jax(t) for t in directions]
    y = exchange.labels_to_jax(labels)

    def loss_fn(h, w, b):
        out = fastce_jax.linear_cross_entropy(h, w, y, bias=b, reduction=reduction, backend=backend, **opts.as_kwargs())
        return out.sum()

    def directional(h, w, b):
        gh, gw, gb = jax.grad(loss_fn, argnums=(0, 1, 2))(h, w, b)
        return (gh * d[0]).sum() + (gw * d[1]).sum() + (gb * d[2]).sum()

    with jax.default_matmul_precision("highest"):
        hvp = jax.grad(directional, argnums=(0, 1, 2))(h, w, b)
    check_linear([np.asarray(t, np.float64) for t in hvp], exact, "jax")


# --- the user's idiom: a gradient penalty through hidden @ weight ---------------------------------------------


def exact_penalty_slope(hidden, weight, labels, direction, opts):
    """d/de of ||d loss / d hidden||^2 at weight + e * direction, by a central difference of the float64 value."""
    h, w, d, y = f64(hidden), f64(weight), f64(direction), labels.cpu().numpy()

    def penalty(step):
        r = reference.linear_cross_entropy(h, w + step * d, y, opts=opts)
        return float(np.sum(r.grad_hidden**2))

    return (penalty(STEP) - penalty(-STEP)) / (2 * STEP)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("fused", [False, True])
def test_gradient_penalty_through_hidden_at_weight(device, backend, fused):
    opts = OPTIONS["softcap_scaling"]
    hidden, weight, _, labels, _, direction, _ = linear_inputs(device, seed=5)
    exact = exact_penalty_slope(hidden, weight, labels, direction, opts)

    def torch_loss(h, w):
        if fused:
            return fastce_torch.linear_cross_entropy(h, w, labels, backend=backend, **opts.as_kwargs())
        return fastce_torch.cross_entropy(h @ w.T, labels, backend=backend, **opts.as_kwargs())

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (grad_h,) = torch.autograd.grad(torch_loss(h, w), h, create_graph=True)
    (grad_w,) = torch.autograd.grad((grad_h**2).sum(), w)
    slopes = {"torch": float((grad_w.double() * direction.double()).sum())}

    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import fastce_jax

    y = exchange.labels_to_jax(labels)

    def jax_loss(h, w):
        if fused:
            return fastce_jax.linear_cross_entropy(h, w, y, backend=backend, **opts.as_kwargs())
        return fastce_jax.cross_entropy(h @ w.T, y, backend=backend, **opts.as_kwargs())

    with jax.default_matmul_precision("highest"):
        grad_w = jax.grad(lambda w, h: jnp.sum(jax.grad(jax_loss)(h, w) ** 2))(
            exchange.to_jax(weight), exchange.to_jax(hidden)
        )
    slopes["jax"] = float(np.sum(np.asarray(grad_w, np.float64) * f64(direction)))
    # The directional derivative sums N x V x H float32 products: K eps32 times the sum of their magnitudes.
    bound = K * tolerances.EPS32 * float(np.sum(np.abs(np.asarray(grad_w, np.float64) * f64(direction))))
    assert abs(exact) > 1e-3
    for name, slope in slopes.items():
        assert abs(slope - exact) <= bound + 1e-7, (name, slope, exact, bound)
