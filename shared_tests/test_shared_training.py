"""What training code relies on, the same in both packages: float64 logits are computed in float64 (a float64 loss
and gradient, whatever the backend), and a row's loss and gradient are the same bits whatever batch it is in (and,
in JAX, under vmap). Inputs are made once in torch and handed to JAX through DLPack."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from . import exchange, reference, tolerances

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")
fastce_jax = pytest.importorskip("fastce_jax")

from fastce_jax.losses.cross_entropy import launch as jax_launch  # noqa: E402
from fastce_torch.losses.cross_entropy import launch as torch_launch  # noqa: E402


def random_inputs(device, n, vocab, seed, *, dtype=torch.float32, shift=0.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn((n, vocab), generator=gen, dtype=torch.float64) * 2.0 + shift).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[n // 3] = -100
    upstream = torch.rand((n,), generator=gen, dtype=torch.float32) + 0.5  # a per-token cotangent, not all ones
    return logits.to(device), labels.to(device), upstream.to(device)


def torch_vjp(logits, labels, upstream, **kwargs):
    x = logits.detach().clone().requires_grad_(True)
    loss = fastce_torch.cross_entropy(x, labels, reduction="none", **kwargs)
    loss.backward(upstream)
    return loss.detach(), x.grad


def jax_vjp(logits, labels, upstream, **kwargs):
    def run(a, b, w):
        loss, vjp = jax.vjp(lambda t: fastce_jax.cross_entropy(t, b, reduction="none", **kwargs), a)
        return loss, vjp(w)[0]

    return jax.jit(run)(logits, labels, upstream)


def as_numpy(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


# ----------------------------------------------------------------------------------------------------------------
# float64 logits.
# ----------------------------------------------------------------------------------------------------------------


FLOAT64_CASES = [
    ("none", None, reference.Options()),
    ("none", None, reference.Options(logit_softcapping=3.0, logit_scaling=0.7, label_smoothing=0.1, z_loss=1e-3)),
    ("mean", None, reference.Options(label_smoothing=0.1, z_loss=1e-3)),
    ("sum", None, reference.Options(logit_softcapping=5.0)),
    ("mean", 7, reference.Options(logit_scaling=1.3)),
]


@pytest.mark.parametrize("backend", ["auto", "kernel", "reference"])
@pytest.mark.parametrize("reduction, n_items, opts", FLOAT64_CASES)
def test_float64_logits_are_computed_in_float64_in_both_packages(device, backend, reduction, n_items, opts):
    """float64 logits give a float64 loss and gradient, within RTOL64 of the float64 reference on the same
    (unrounded) logits, whatever the backend: both packages send them to their plain-framework reference."""
    x64, labels, upstream = random_inputs(device, 6, 300, seed=1, dtype=torch.float64)
    labels[4] = 300  # out of range: NaN loss and gradient row in float64 too (row 2 is ignored)
    upstream = upstream.double()
    kwargs = dict(backend=backend, reduction=reduction, n_items=n_items, **opts.as_kwargs())
    ref = reference.cross_entropy(
        as_numpy(x64),
        as_numpy(labels),
        reduction=reduction,
        n_items=n_items,
        upstream=as_numpy(upstream) if reduction == "none" else None,
        opts=opts,
    )
    cotangent = upstream if reduction == "none" else torch.ones((), dtype=torch.float64, device=device)

    x = x64.detach().clone().requires_grad_(True)
    t_loss = fastce_torch.cross_entropy(x, labels, **kwargs)
    t_loss.backward(cotangent.to(device))
    t_grad = x.grad

    def jax_run(a, b, w):
        loss, vjp = jax.vjp(lambda t: fastce_jax.cross_entropy(t, b, **kwargs), a)
        return loss, vjp(w)[0]

    with jax.enable_x64(True):
        jx64, jlabels, jup = exchange.to_jax(x64), exchange.labels_to_jax(labels), exchange.to_jax(cotangent)
        assert jx64.dtype == jnp.float64
        j_loss, j_grad = jax.jit(jax_run)(jx64, jlabels, jup)
        j_loss, j_grad = as_numpy(j_loss), as_numpy(j_grad)  # read inside the x64 scope
    assert t_loss.dtype == torch.float64 and t_grad.dtype == torch.float64
    assert j_loss.dtype == np.float64 and j_grad.dtype == np.float64
    for name, loss, grad in (("torch", t_loss, t_grad), ("jax", j_loss, j_grad)):
        tolerances.check(as_numpy(loss), ref.loss, tolerances.loss_bound(ref, tolerances.RTOL64), f"{name} loss")
        bound = tolerances.grad_bound(ref, as_numpy(grad), "float64", rtol=tolerances.RTOL64)
        tolerances.check(as_numpy(grad), ref.grad, bound, f"{name} grad")


# ----------------------------------------------------------------------------------------------------------------
# Batch invariance.
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def several_chunks(monkeypatch, device):
    """Five forward chunks at V=5000 in both packages (the chunk combine is exercised); on the GPU the packages'
    own configuration at V=128256."""
    if device.type == "cuda":
        return 128256
    # fastce_torch caches its tuned configuration per V: its launchers' forward_config is swapped for one with these
    # settings instead of changing the module constants.
    monkeypatch.setattr(
        torch_launch, "forward_config", functools.partial(torch_launch.forward_config, block=256, chunk=1024)
    )
    monkeypatch.setattr(jax_launch, "CHUNK", 1024)
    monkeypatch.setattr(jax_launch, "FORWARD_BLOCK", 256)
    for module in (torch_launch, jax_launch):
        assert module.forward_config(5000)[:3] == (256, 1024, 5)
    return 5000


def test_rows_are_batch_invariant_in_both_packages(device, several_chunks):
    vocab, n = several_chunks, 12
    # Shifted so that lse is near 0, where its float32 ulp is small enough to show a different chunk combine.
    x, labels, upstream = random_inputs(device, n, vocab, seed=2, shift=-10.0)
    kwargs = dict(backend="kernel", label_smoothing=0.1, z_loss=1e-3)
    jx, jlabels, jup = exchange.to_jax(x), exchange.labels_to_jax(labels), exchange.to_jax(upstream)
    for name, vjp, (a, b, w) in (("torch", torch_vjp, (x, labels, upstream)), ("jax", jax_vjp, (jx, jlabels, jup))):
        full_loss, full_grad = (as_numpy(t) for t in vjp(a, b, w, **kwargs))
        for rows in [slice(i, i + 1) for i in range(n)] + [slice(3, 8)]:
            loss, grad = vjp(a[rows], b[rows], w[rows], **kwargs)
            np.testing.assert_array_equal(as_numpy(loss), full_loss[rows], err_msg=f"{name} loss, rows {rows}")
            np.testing.assert_array_equal(as_numpy(grad), full_grad[rows], err_msg=f"{name} grad, rows {rows}")
        if name == "jax":
            loss, grad = jax.jit(jax.vmap(lambda p, q, r: jax_vjp(p, q, r, **kwargs)))(
                a.reshape(3, 4, vocab), b.reshape(3, 4), w.reshape(3, 4)
            )
            np.testing.assert_array_equal(as_numpy(loss).reshape(-1), full_loss, err_msg="jax vmap loss")
            np.testing.assert_array_equal(as_numpy(grad).reshape(-1, vocab), full_grad, err_msg="jax vmap grad")
    opts = reference.Options(label_smoothing=0.1, z_loss=1e-3)
    ref = reference.cross_entropy(as_numpy(x).astype(np.float64), as_numpy(labels), reduction="none", opts=opts)
    tolerances.assert_loss(full_loss, ref, "jax loss")
