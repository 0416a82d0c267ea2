"""The entropy output's gradient (issue 37: return_entropy=True is differentiable) in cross_entropy and
linear_cross_entropy of both packages, every reduction, alone and together with the loss's gradient, against the
float64 reference (reference.entropy_grad: dH/dz_j = p_j (mz - z_j), chained through dz/dx) and each other.

The objective is `loss . g + entropy . h` (per-token cotangents for "none"; scalars for "mean" / "sum", where the
entropy is reduced like the loss: "mean" over the non-ignored tokens). linear_cross_entropy's "mean" / "sum" run the
gradient-in-forward path for the loss and a recomputing pass for the differentiated entropy; "none" adds the term to
the backward it already runs. Tolerances: the shared model (cross_entropy: RTOL times the reference's error scales,
the entropy's included; linear: test_linear_cross_entropy.py's u (M + 2 E) model).
"""

import inspect

import numpy as np
import pytest
import torch

from . import exchange, reference
from .harness import Case, as_f64, make_inputs, optional_jax
from .test_linear_cross_entropy import K_FACTOR, UNIT_ROUNDOFF, LinearCase, assert_within
from .test_linear_cross_entropy import make_inputs as make_linear_inputs
from .tolerances import FLOOR, RTOL, ULPS, ULPS_PAIR, check, ulp

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")

OPTION_SETS = {
    "temperature": reference.Options(temperature=0.7),
    "all": reference.Options(
        logit_softcapping=5.0, logit_scaling=0.8, label_smoothing=0.1, z_loss=1e-3, temperature=0.6
    ),
    "ignore-minus-one": reference.Options(ignore_index=-1, logit_scaling=-1.2),
}
ENTROPY_WEIGHT = -0.3  # the objective's scalar on a reduced entropy (a bonus: negative)


def modules_with(function, needed=("temperature",)):
    """The packages whose `function` takes the keywords `needed` (the others are skipped at the end)."""
    found = {}
    for name, module in (("torch", fastce_torch), ("jax", optional_jax())):
        fn = getattr(module, function, None) if module is not None else None
        if callable(fn) and all(k in inspect.signature(fn).parameters for k in needed):
            found[name] = module
    if not found:
        pytest.skip(f"no package's {function} takes {needed} yet")
    return found


def cotangents(shape, reduction, loss_on, seed):
    gen = torch.Generator().manual_seed(seed + 77)
    if reduction == "none":
        g = torch.randn(shape, generator=gen, dtype=torch.float64) * loss_on
        return g, torch.randn(shape, generator=gen, dtype=torch.float64)
    return torch.tensor(float(loss_on), dtype=torch.float64), torch.tensor(ENTROPY_WEIGHT, dtype=torch.float64)


def objective(out, g, h, like):
    """loss . g + entropy . h in the output's framework."""
    if isinstance(out.loss, torch.Tensor):
        return (out.loss * g.to(like.device).float()).sum() + (out.entropy * h.to(like.device).float()).sum()
    import jax.numpy as jnp

    return jnp.sum(out.loss * jnp.asarray(g.numpy(), jnp.float32)) + jnp.sum(
        out.entropy * jnp.asarray(h.numpy(), jnp.float32)
    )


@pytest.mark.parametrize("loss_on", [0, 1], ids=["entropy-alone", "with-the-loss"])
@pytest.mark.parametrize("options", list(OPTION_SETS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_entropy_gradient(reduction, options, loss_on, device):
    found = modules_with("cross_entropy")
    opts = OPTION_SETS[options]
    case = Case("entropy-grad", shape=(2, 6), vocab=37, reduction=reduction, opts=opts, seed=51)
    inputs = make_inputs(case, device)
    x, y = inputs.logits.detach().double().cpu().numpy(), inputs.labels.cpu().numpy()
    g, h = cotangents(y.shape, reduction, loss_on, case.seed)
    upstream = g.numpy() if reduction == "none" else None
    ce = reference.cross_entropy(x, y, reduction=reduction, upstream=upstream, opts=opts)
    ent_upstream = h.numpy() if reduction == "none" else None
    ent_grad, ent_scale, _ = reference.entropy_grad(x, y, reduction=reduction, upstream=ent_upstream, opts=opts)
    scale_g, scale_h = (1.0, 1.0) if reduction == "none" else (float(g), float(h))
    expected = scale_g * ce.grad + scale_h * ent_grad
    error_scale = abs(scale_g) * ce.grad_scale + abs(scale_h) * ent_scale
    kwargs = dict(reduction=reduction, return_entropy=True, backend="kernel", **opts.as_kwargs())
    grads = {}
    for package, module in found.items():
        if package == "torch":
            leaf = inputs.logits.detach().requires_grad_()
            out = module.cross_entropy(leaf, inputs.labels, **kwargs)
            objective(out, g, h, leaf).backward()
            grads[package] = as_f64(leaf.grad)
        else:
            import jax

            labels = exchange.labels_to_jax(inputs.labels)
            run = lambda a: objective(module.cross_entropy(a, labels, **kwargs), g, h, None)  # noqa: E731
            grads[package] = as_f64(exchange.to_torch(jax.grad(run)(exchange.to_jax(inputs.logits))))
        magnitude = np.maximum(np.abs(grads[package]), np.abs(expected))
        bound = RTOL * error_scale + ULPS * ulp(magnitude, case.dtype) + FLOOR
        check(grads[package], expected, bound, f"{package} d (loss, entropy) / d logits")
    if len(found) < 2:
        pytest.skip(f"only {list(found)} take the keywords: that side checked")
    both = np.maximum(np.abs(grads["torch"]), np.abs(grads["jax"]))
    bound = RTOL * error_scale + ULPS_PAIR * ulp(both, case.dtype) + FLOOR
    check(grads["torch"], grads["jax"], bound, "torch vs jax gradient")


LINEAR_CASES = [
    LinearCase("mean", opts=OPTION_SETS["temperature"]),
    LinearCase("sum-bias", reduction="sum", bias=True, opts=OPTION_SETS["all"]),
    LinearCase("none-bias", reduction="none", bias=True, opts=OPTION_SETS["all"]),
    LinearCase("mean-n_items", n_items=7, opts=OPTION_SETS["ignore-minus-one"]),
    LinearCase("bf16-mean", dtype="bfloat16", bias=True, opts=OPTION_SETS["temperature"]),
]
CHUNK_ROWS = 5


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.id)
def test_linear_cross_entropy_entropy_gradient(case, device):
    found = modules_with("linear_cross_entropy")
    hidden, weight, bias, labels, _, n_items = make_linear_inputs(case, device)
    as64 = lambda t: None if t is None else t.detach().double().cpu().numpy()  # noqa: E731
    logits, logits_abs, h64, w64, b64, lead = reference.head_logits(as64(hidden), as64(weight), as64(bias))
    y = labels.cpu().numpy()
    g, h = cotangents(y.shape, case.reduction, 1, seed=61)
    none = case.reduction == "none"
    ce = reference.cross_entropy(
        logits,
        y.reshape(-1),
        reduction=case.reduction,
        n_items=n_items,
        upstream=g.numpy().reshape(-1) if none else None,
        opts=case.opts,
    )
    ent_grad, ent_scale, ent_terms = reference.entropy_grad(
        logits,
        y.reshape(-1),
        reduction=case.reduction,
        n_items=n_items,
        upstream=h.numpy().reshape(-1) if none else None,
        opts=case.opts,
    )
    scale_h = 1.0 if none else float(h)
    grad_logits = ce.grad + scale_h * ent_grad
    want = reference.chain_through_head(grad_logits, h64, w64, b64, lead)
    # test_linear_cross_entropy's model: S = error scales + 2 E (terms), then through the products.
    u = UNIT_ROUNDOFF[case.dtype] * K_FACTOR[case.dtype]
    two_e = 2.0 * logits_abs.max(axis=-1)[:, None]
    S = ce.grad_scale + abs(scale_h) * ent_scale + two_e * (ce.grad_terms + abs(scale_h) * ent_terms)
    G = np.abs(np.nan_to_num(grad_logits))
    chunks = -(-len(y.reshape(-1)) // CHUNK_ROWS)
    bounds = (
        (u * ((S + G) @ np.abs(w64))).reshape(hidden.shape),
        u * (1 + chunks) * ((S + G).T @ np.abs(h64)),
        None if bias is None else u * (1 + chunks) * (S + G).sum(axis=0),
    )
    kwargs = dict(
        reduction=case.reduction,
        n_items=n_items,
        return_entropy=True,
        chunk_rows=CHUNK_ROWS,
        backend="kernel",
        **case.opts.as_kwargs(),
    )
    for package, module in found.items():
        if package == "torch":
            leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
            out = module.linear_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2], **kwargs)
            objective(out, g, h, hidden).backward()
            got = [None if t is None else t.grad for t in leaves]
        else:
            import jax

            y_jax = exchange.labels_to_jax(labels)

            def run(a, w, b):
                return objective(module.linear_cross_entropy(a, w, y_jax, bias=b, **kwargs), g, h, None)

            args = [None if t is None else exchange.to_jax(t) for t in (hidden, weight, bias)]
            with jax.default_matmul_precision("float32"):
                got = [None if v is None else exchange.to_torch(v) for v in jax.grad(run, argnums=(0, 1, 2))(*args)]
        for name, value, expected, bound in zip(("d hidden", "d weight", "d bias"), got, want, bounds):
            if expected is not None:
                assert_within(value, expected, bound, f"{package} {name}")
    if len(found) < 2:
        pytest.skip(f"only {list(found)} take the keywords: that side checked")
