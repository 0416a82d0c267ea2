"""What training code relies on, the same in both packages: float64 logits are accepted and computed in float32 (a
float32 loss, a float64 gradient), and a row's loss and gradient are the same bits whatever batch it is in (and,
in JAX, under vmap). Inputs are made once in torch and handed to JAX through DLPack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from . import exchange, reference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")
fastce_jax = pytest.importorskip("fastce_jax")

from fastce_jax import kernels as jax_kernels  # noqa: E402
from fastce_torch import kernels as torch_kernels  # noqa: E402

LOSS_TOL = dict(rtol=2e-5, atol=2e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


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


@pytest.mark.parametrize("backend", ["auto", "kernel", "reference"])
def test_float64_logits_in_both_packages(device, backend):
    opts = reference.Options(label_smoothing=0.1, z_loss=1e-3)
    x64, labels, upstream = random_inputs(device, 6, 300, seed=1, dtype=torch.float64)
    x32 = x64.float()
    kwargs = dict(backend=backend, **opts.as_kwargs())
    ref = reference.cross_entropy(
        as_numpy(x32), as_numpy(labels), reduction="none", upstream=as_numpy(upstream), opts=opts
    )
    ref_loss, ref_grad = ref.loss, ref.grad

    t_loss, t_grad = torch_vjp(x64, labels, upstream, **kwargs)
    assert t_loss.dtype == torch.float32 and t_grad.dtype == torch.float64
    t_loss32, t_grad32 = torch_vjp(x32, labels, upstream, **kwargs)
    np.testing.assert_array_equal(as_numpy(t_loss), as_numpy(t_loss32))
    np.testing.assert_array_equal(as_numpy(t_grad), as_numpy(t_grad32).astype(np.float64))

    with jax.enable_x64(True):
        jx64, jlabels, jup = exchange.to_jax(x64), exchange.labels_to_jax(labels), exchange.to_jax(upstream)
        assert jx64.dtype == jnp.float64
        j_loss, j_grad = jax_vjp(jx64, jlabels, jup, **kwargs)
        assert j_loss.dtype == jnp.float32 and j_grad.dtype == jnp.float64
        j_loss32, j_grad32 = jax_vjp(exchange.to_jax(x32), jlabels, jup, **kwargs)
        np.testing.assert_array_equal(as_numpy(j_loss), as_numpy(j_loss32))
        np.testing.assert_array_equal(as_numpy(j_grad), as_numpy(j_grad32).astype(np.float64))

    for name, loss, grad in (("torch", t_loss, t_grad), ("jax", j_loss, j_grad)):
        np.testing.assert_allclose(as_numpy(loss), ref_loss, **LOSS_TOL, err_msg=f"{name} loss")
        np.testing.assert_allclose(as_numpy(grad), ref_grad, **GRAD_TOL, err_msg=f"{name} grad")


# ----------------------------------------------------------------------------------------------------------------
# Batch invariance.
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def several_chunks(monkeypatch, device):
    """Five forward chunks at V=5000 in both packages (the chunk combine is exercised); on the GPU the packages'
    own configuration at V=128256."""
    if device.type == "cuda":
        return 128256
    for module in (torch_kernels, jax_kernels):
        monkeypatch.setattr(module, "CHUNK", 1024)
        monkeypatch.setattr(module, "FORWARD_BLOCK", 256)
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
    ref_loss = reference.cross_entropy(as_numpy(x), as_numpy(labels), reduction="none", opts=opts).loss
    np.testing.assert_allclose(full_loss, ref_loss, **LOSS_TOL)
