"""Reliability: precision near p = 1, determinism, batch invariance, huge vocabularies, devices."""

import numpy as np
import pytest
import torch

from fastce_torch import cross_entropy

from .checks import as_float64, assert_grad, assert_loss, expected
from .test_cross_entropy import run_kernel

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning", "ignore::DeprecationWarning", "ignore:invalid value:RuntimeWarning"
)


@pytest.mark.parametrize("margin", [12.0, 15.0, 19.0])  # 1 - p_y from ~5e-3 down to ~1e-6
def test_confident_label_gradient_keeps_bf16_precision(margin, device):
    """With p_y = 1 - eps the label's gradient is -eps: computed in float32 and rounded once, it keeps bf16's
    relative precision while eps >= ~1e-4 (a bf16 softmax would round p_y to 1 and the gradient to 0 or a coarse
    step). Below that the float32 logsumexp (resolution ~1e-6 at logits ~20) bounds the absolute error."""
    generator = torch.Generator().manual_seed(int(margin))
    vocab = 5000
    logits = torch.randn(4, vocab, generator=generator, dtype=torch.float64) * 0.5
    labels = torch.randint(0, vocab, (4,), generator=generator)
    logits[torch.arange(4), labels] = logits.max() + margin + torch.arange(4, dtype=torch.float64)
    logits = logits.to(torch.bfloat16).to(device)
    labels = labels.to(device)
    _, grad = run_kernel(logits, labels)
    ref = expected(logits, labels)
    assert_grad(grad, ref)
    # At the label the claim is stronger than the general tolerance (which allows RTOL * (1 + |lse| + max|z|)):
    rows, cols = np.arange(4), labels.cpu().numpy()
    at_label, exact = as_float64(grad)[rows, cols], ref.grad[rows, cols]
    assert (exact < 0).all() and (exact > -0.1).all()
    assert (at_label <= 0).all() and (at_label[exact < -1e-6] < 0).all(), "lost its sign"
    bound = np.maximum(1.6e-2 * np.abs(exact), 2e-6)
    assert (np.abs(at_label - exact) <= bound).all(), (at_label, exact)


def test_batch_invariance(device):
    """A row's loss and gradient are bit-identical whatever else is in the batch (no cross-row arithmetic)."""
    generator = torch.Generator().manual_seed(21)
    vocab = 70000
    big = torch.randn(9, vocab, generator=generator).to(torch.bfloat16).to(device)
    labels = torch.randint(0, vocab, (9,), generator=generator).to(device)
    labels[4] = -100
    full_loss, full_grad = run_kernel(big, labels)
    for rows in ([2], [7, 2, 5], [0, 1, 2, 3, 4, 5, 6, 7, 8][::-1]):
        sub_loss, sub_grad = run_kernel(big[rows], labels[rows])
        assert torch.equal(sub_loss, full_loss[rows]) and torch.equal(sub_grad, full_grad[rows])


@pytest.mark.gpu
def test_labels_on_another_device(device):
    logits = torch.randn(4, 100, device=device)
    with pytest.raises(ValueError, match="labels are on"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long))


@pytest.mark.gpu
def test_bitwise_deterministic(device):
    generator = torch.Generator(device=device).manual_seed(22)
    logits = torch.randn(2048, 256000, device=device, dtype=torch.bfloat16, generator=generator)
    labels = torch.randint(0, 256000, (2048,), device=device, generator=generator)
    labels[::7] = -100
    results = []
    for _ in range(3):
        leaf = logits.clone().requires_grad_()
        loss = cross_entropy(leaf.clone(), labels, label_smoothing=0.1, z_loss=1e-4)
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])


@pytest.mark.gpu
def test_vocabulary_of_2_pow_20(device):
    n_rows, vocab = 64, 2**20
    generator = torch.Generator(device=device).manual_seed(23)
    logits = torch.randn(n_rows, vocab, device=device, dtype=torch.bfloat16, generator=generator)
    labels = torch.randint(0, vocab, (n_rows,), device=device, generator=generator)
    labels[3] = -100
    loss, grad = run_kernel(logits, labels, logit_softcapping=30.0, z_loss=1e-4)
    rows = [0, 3, 31, 63]
    ref = expected(logits[rows], labels[rows], logit_softcapping=30.0, z_loss=1e-4)
    assert_loss(loss[rows], ref)
    assert_grad(grad[rows], ref)
