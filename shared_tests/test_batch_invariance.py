"""Batch invariance in both packages: a row's loss and gradient are bitwise the same alone and inside batches of
other sizes, with rows split into several chunks (small tiles and chunks forced so that V=300 takes five chunks of 64
in the interpreters). The chunking depends on V alone, so the same forced configuration holds for every N."""

import functools

import numpy as np
import pytest
import torch

import fastce_torch
from fastce_torch.losses.cross_entropy import launch as torch_launch

from .harness import optional_jax

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning", "ignore::DeprecationWarning", "ignore:invalid value:RuntimeWarning"
)

VOCAB, N_ROWS = 300, 70  # 70 rows: more than one group of 64 in the torch kernel's in-kernel reduction
SUBSETS = ([5], [5, 69, 0], list(range(69, -1, -2)))


def inputs(seed=8):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((N_ROWS, VOCAB)) * 2.0
    # Each row shifted so its logsumexp is near 0: there float32 keeps the low bits in which a chunking that
    # depended on N would show (near lse ~ 6 they round away and the test could not fail).
    row_max = logits.max(axis=1, keepdims=True)
    logits = (logits - row_max - np.log(np.exp(logits - row_max).sum(axis=1, keepdims=True))).astype(np.float32)
    labels = rng.integers(0, VOCAB, N_ROWS)
    labels[::4] = -100
    return logits, labels


@pytest.fixture
def small_chunks(monkeypatch):
    # The launchers take forward_config(V) from losses/cross_entropy/launch.py when given no config: the fixture
    # swaps in the tuned function with the small settings there (the module constants are read once per V and
    # cached, so they are never changed).
    launch = torch_launch
    monkeypatch.setattr(launch, "forward_config", functools.partial(launch.forward_config, block=32, chunk=64))
    assert launch.forward_config(VOCAB).n_chunks == 5


def test_torch_rows_alone_and_in_batches(device, small_chunks):
    logits, labels = inputs()

    def run(rows):
        leaf = torch.tensor(logits[rows], device=device).requires_grad_()
        loss = fastce_torch.cross_entropy(
            leaf, torch.tensor(labels[rows], device=device), reduction="none", backend="kernel", label_smoothing=0.1
        )
        loss.backward(torch.ones_like(loss))
        return loss.detach().cpu(), leaf.grad.cpu()

    full_loss, full_grad = run(list(range(N_ROWS)))
    for rows in SUBSETS:
        loss, grad = run(rows)
        assert torch.equal(loss, full_loss[rows]) and torch.equal(grad, full_grad[rows])


def test_jax_rows_alone_and_in_batches(device, monkeypatch):
    if optional_jax() is None:
        pytest.skip("fastce_jax cannot be imported")
    import jax

    import fastce_jax
    from fastce_jax.losses.cross_entropy import launch as jax_launch

    monkeypatch.setattr(jax_launch, "FORWARD_BLOCK", 32)
    monkeypatch.setattr(jax_launch, "CHUNK", 64)
    assert jax_launch.forward_config(VOCAB)[2] == 5
    jax.clear_caches()  # the chunking is read while tracing
    logits, labels = inputs()

    def run(rows):
        x = jax.numpy.asarray(logits[rows])
        y = jax.numpy.asarray(labels[rows].astype(np.int32))

        def total(a):
            loss = fastce_jax.cross_entropy(a, y, reduction="none", backend="kernel", label_smoothing=0.1)
            return loss.sum(), loss

        (_, loss), grad = jax.value_and_grad(total, has_aux=True)(x)
        return np.asarray(loss), np.asarray(grad)

    full_loss, full_grad = run(list(range(N_ROWS)))
    for rows in SUBSETS:
        loss, grad = run(rows)
        np.testing.assert_array_equal(loss, full_loss[rows])
        np.testing.assert_array_equal(grad, full_grad[rows])
    jax.clear_caches()
