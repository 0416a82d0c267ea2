"""where= (optax's token mask) and weight_layout="hv" (a Flax (H, V) kernel) in both packages (issue 39), against the
float64 reference and each other.

where: False positions are left out exactly like ignored labels (loss 0, gradient 0, not counted by "mean"). The
reference here is not the packages' folding: it is the float64 loss of the kept tokens alone (the masked rows cut
out of logits, hidden, labels and upstream), its per-token results and gradients put back in place with zeros on
the masked rows; so a masked token that still counted in a "mean", or a gradient leaking into a masked row, fails.
With shift the mask goes with the labels: the call equals the one with the labels masked first (bitwise).

weight_layout="hv": linear_cross_entropy with the (H, V) transpose of the case's weight (a contiguous kernel, as
Flax stores it) against the reference of the (V, H) problem, the weight's gradient (H, V) compared transposed;
linear_log_probs passes the keyword on.
"""

import dataclasses

import numpy as np
import pytest
import torch

from . import exchange, reference
from .harness import Case, compare, make_inputs, run_jax, run_torch
from .test_linear_cross_entropy import LinearCase, check_result, package_runner, small_chunks
from .test_linear_cross_entropy import make_inputs as make_linear_inputs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")
fastce_jax = pytest.importorskip("fastce_jax")

SMOOTH_Z = reference.Options(label_smoothing=0.1, z_loss=1e-3, logit_softcapping=5.0)


def make_mask(shape, seed, pattern="random"):
    """A bool mask shaped like the labels: about a third False, the last token kept (it is never ignored by the
    harness: at least one scored token); "none" keeps nothing."""
    if pattern == "none":
        return torch.zeros(shape, dtype=torch.bool)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed + 900)) > 0.35
    mask.view(-1)[-1] = True
    mask.view(-1)[0] = False
    return mask


def kept_reference(case, inputs, mask):
    """The float64 result of the kept tokens alone, put back in place (zeros on the masked tokens)."""
    x = inputs.logits.detach().to("cpu", torch.float64).numpy()
    vocab, lead = x.shape[-1], x.shape[:-1]
    kept = mask.cpu().numpy().reshape(-1)
    n_items = inputs.n_items.item() if isinstance(inputs.n_items, torch.Tensor) else inputs.n_items
    part = reference.cross_entropy(
        x.reshape(-1, vocab)[kept],
        inputs.labels.cpu().numpy().reshape(-1)[kept],
        reduction=case.reduction,
        n_items=n_items,
        upstream=inputs.upstream.cpu().numpy().reshape(-1)[kept],
        opts=case.opts,
    )

    def placed(values, fill=0.0, shape=None):
        full = np.full((kept.size, *np.shape(values)[1:]), fill)
        full[kept] = values
        return full.reshape(shape) if shape is not None else full

    rows = lambda a: np.reshape(a, (-1, vocab))  # noqa: E731
    per_token = case.reduction == "none"
    return dataclasses.replace(
        part,
        token_loss=placed(part.token_loss),
        loss=placed(part.loss, shape=lead) if per_token else part.loss,
        grad=placed(rows(part.grad), shape=x.shape),
        lse=placed(part.lse, -np.inf),
        upstream=placed(part.upstream),
        loss_scale=placed(part.loss_scale),
        grad_scale=placed(rows(part.grad_scale), shape=x.shape),
        grad_terms=placed(rows(part.grad_terms), shape=x.shape),
    )


def where_case(name, mask="random", **fields):
    fields.setdefault("shape", (2, 6))
    fields.setdefault("vocab", 37)
    return pytest.param(Case(name, **fields), mask, id=f"{name}-{fields.get('dtype', 'float32')}")


WHERE_CASES = [
    where_case("mean", seed=1),
    where_case("sum-n-items", reduction="sum", n_items=5, seed=2),
    where_case("none-options", reduction="none", opts=SMOOTH_Z, seed=3),
    where_case("mean-jit-bf16", dtype="bfloat16", jit=True, opts=SMOOTH_Z, seed=4),
    where_case("nothing-kept", mask="none", seed=5),
]


@pytest.mark.parametrize("case,mask", WHERE_CASES)
def test_cross_entropy_where(case, mask, device):
    inputs = make_inputs(case, device)
    where = make_mask(case.shape, case.seed, mask).to(device)
    ref = kept_reference(case, inputs, where)
    compare(case, inputs, run_torch(case, inputs, where=where), run_jax(case, inputs, where=where), ref)


def test_where_with_shift_is_masking_the_labels_first(device):
    case = Case("shift", shape=(2, 6), vocab=37, reduction="none", seed=6)
    inputs = make_inputs(case, device)
    where = make_mask(case.shape, case.seed).to(device)
    inputs = dataclasses.replace(inputs, upstream=inputs.upstream[..., 1:].contiguous())
    folded = dataclasses.replace(inputs, labels=torch.where(where, inputs.labels, -100))
    for run in (run_torch, run_jax):
        with_where, masked_first = run(case, inputs, where=where, shift=1), run(case, folded, shift=1)
        for a, b in zip(with_where, masked_first):
            assert torch.equal(a.cpu(), b.cpu()), run.__name__


LINEAR_WHERE = [LinearCase("mean-bias", bias=True, seed=11), LinearCase("none", reduction="none", seed=12)]


def linear_subset(case, inputs, kept):
    """The case and inputs of the kept rows alone (hidden, labels and a per-token upstream cut)."""
    hidden, weight, bias, labels, upstream, n_items = inputs
    width = hidden.shape[-1]
    flat = kept.reshape(-1).cpu()
    cut = lambda t: t.reshape(-1, *t.shape[len(case.shape) :])[flat]  # noqa: E731
    up = cut(upstream) if case.reduction == "none" else upstream
    n_kept = int(flat.sum())
    subset = dataclasses.replace(case, shape=(n_kept,), strided=False)
    return subset, (cut(hidden).reshape(n_kept, width), weight, bias, cut(labels), up, n_items)


@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
@pytest.mark.parametrize("case", LINEAR_WHERE, ids=lambda c: c.id)
def test_linear_cross_entropy_where(case, package, device):
    runner = package_runner(package)
    case, chunks = small_chunks(case)
    inputs = make_linear_inputs(case, device)
    where = make_mask(case.shape, case.seed).to(device)
    loss, (g_hidden, g_weight, g_bias) = runner(case, inputs, where=where)
    masked = ~where.cpu()
    assert torch.all(g_hidden.cpu()[masked] == 0)
    if case.reduction == "none":
        assert torch.all(loss.cpu()[masked] == 0)
        loss = loss.cpu()[~masked]
    subset, sub_inputs = linear_subset(case, inputs, where)
    check_result(subset, sub_inputs, (loss, [g_hidden.cpu()[~masked], g_weight, g_bias]), chunks)


# --- weight_layout="hv" --------------------------------------------------------------------------------------------

HV_CASES = [
    LinearCase("mean-bias", bias=True, vocab=300, width=16),
    LinearCase("none-all-options", reduction="none", opts=reference.Options(-1, 5.0, 0.8, 0.2, 1e-4), bias=True),
    LinearCase("bf16-sum", dtype="bfloat16", reduction="sum", scalar_upstream=1.7),
]


@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
@pytest.mark.parametrize("case", HV_CASES, ids=lambda c: c.id)
def test_linear_cross_entropy_hv(case, package, device):
    runner = package_runner(package)
    case, chunks = small_chunks(case)
    inputs = make_linear_inputs(case, device)
    hidden, weight, bias, labels, upstream, n_items = inputs
    kernel = weight.t().contiguous()  # (H, V), as Flax stores it
    loss, (g_hidden, g_kernel, g_bias) = runner(
        case, (hidden, kernel, bias, labels, upstream, n_items), weight_layout="hv"
    )
    assert tuple(g_kernel.shape) == tuple(kernel.shape) and g_kernel.dtype == kernel.dtype
    check_result(case, inputs, (loss, [g_hidden, g_kernel.t(), g_bias]), chunks)


def test_linear_log_probs_hv(device):
    """linear_log_probs hands weight_layout on: the (H, V) kernel gives the (V, H) call's log-probs and the
    transposed gradient, in both packages."""
    import jax
    import jax.numpy as jnp

    case = LinearCase("log-probs", shape=(2, 5), seed=13)
    hidden, weight, _, labels, _, _ = make_linear_inputs(case, device)
    kernel = weight.t().contiguous()
    results = {}
    for layout, w in (("vh", weight), ("hv", kernel)):
        h_t, w_t = hidden.clone().requires_grad_(), w.clone().requires_grad_()
        lp = fastce_torch.linear_log_probs(h_t, w_t, labels, backend="kernel", shift=1, weight_layout=layout)
        lp.sum().backward()
        f = lambda h, w, layout=layout: jnp.sum(  # noqa: E731
            fastce_jax.linear_log_probs(
                h, w, exchange.labels_to_jax(labels), backend="kernel", shift=1, weight_layout=layout
            )
        )
        value, grads = jax.value_and_grad(f, argnums=(0, 1))(exchange.to_jax(hidden), exchange.to_jax(w))
        results[layout] = (lp.sum().detach().cpu(), h_t.grad.cpu(), w_t.grad.cpu(), float(value), grads)
    (t_vh, th_vh, tw_vh, j_vh, jg_vh), (t_hv, th_hv, tw_hv, j_hv, jg_hv) = results["vh"], results["hv"]
    torch.testing.assert_close(t_hv, t_vh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(th_hv, th_vh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tw_hv.t(), tw_vh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(j_hv, j_vh, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jg_hv[1]).T, np.asarray(jg_vh[1]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "what,error,name",
    [
        ("where int", TypeError, "where"),
        ("where shape", ValueError, "where"),
        ("layout name", ValueError, "weight_layout"),
        ("layout shape", ValueError, "weight"),
    ],
)
def test_bad_where_and_weight_layout_raise_the_same_error_in_both(what, error, name, device):
    gen = torch.Generator().manual_seed(14)
    hidden, weight = torch.randn(4, 8, generator=gen).to(device), torch.randn(10, 8, generator=gen).to(device)
    labels = torch.tensor([1, 2, -100, 9], device=device)
    kwargs = {
        "where int": dict(where=torch.ones(4, dtype=torch.int32, device=device)),
        "where shape": dict(where=torch.ones(3, dtype=torch.bool, device=device)),
        "layout name": dict(weight_layout="HV"),
        "layout shape": dict(weight_layout="hv"),  # a (V, H) weight declared (H, V)
    }[what]
    jax_kwargs = {k: exchange.to_jax(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    h, w, y = exchange.to_jax(hidden), exchange.to_jax(weight), exchange.labels_to_jax(labels)
    calls = [(fastce_torch, (hidden, weight, labels), kwargs), (fastce_jax, (h, w, y), jax_kwargs)]
    for module, args, kw in calls:
        with pytest.raises(error, match=name):
            module.linear_cross_entropy(*args, **kw)
        if what.startswith("where"):
            with pytest.raises(error, match=name):
                module.cross_entropy(args[0] @ args[1].T, args[2], **kw)
