"""The backward kernel's entropy-gradient variant (HAS_ENTROPY_GRAD, kernels.backward(grad_entropy=, mean_z=))
against float64 autograd, alone and with the loss's gradient, with every option, -inf logits, ignored rows, and in
vocab-parallel mode (two column slices with the global lse and mz). On the `device` fixture's device (CPU: Triton's
interpreter); the float64 reference on the CPU."""

import pytest
import torch

from fastce_torch import contract, kernels
from fastce_torch.contract import Options

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore:invalid value:RuntimeWarning", "ignore:divide by zero:RuntimeWarning"
)

OPTION_SETS = {
    "plain": Options(),
    "all": Options(logit_softcapping=3.0, logit_scaling=0.7, label_smoothing=0.1, z_loss=1e-3),
    "temperature": contract.with_temperature(Options(logit_softcapping=5.0), 0.6),
}


def problem(n_rows, vocab, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_rows, vocab, generator=generator, dtype=torch.float64) * 2.0
    logits[1, ::7] = -float("inf")  # -inf logits: p = 0, no 0 * inf in the entropy's gradient
    labels = torch.randint(0, vocab, (n_rows,), generator=generator)
    labels[::4] = -100
    labels[1] = 3  # finite on row 1
    grad_loss = torch.randn(n_rows, generator=generator, dtype=torch.float64)
    grad_entropy = torch.randn(n_rows, generator=generator, dtype=torch.float64)
    return tuple(t.to(device) for t in (logits.float(), labels, grad_loss.float(), grad_entropy.float()))


def reference_gradient(logits, labels, grad_loss, grad_entropy, options):
    """d(sum_t g_t loss_t + g_H,t H_t) / d logits in float64 autograd on the CPU, the entropy written out literally."""
    logits, labels, grad_entropy = logits.cpu(), labels.cpu(), grad_entropy.cpu()
    grad_loss = None if grad_loss is None else grad_loss.cpu()
    x = logits.double().requires_grad_()
    ignored = labels == options.ignore_index
    token_losses = contract.reference_token_losses(x, labels, options)
    z = contract.transform(x, options, labels)
    p, mean_z, _ = contract.softmax_mean(z)
    entropy = torch.where(ignored, 0.0, torch.logsumexp(z, -1) - mean_z.squeeze(-1))
    objective = (grad_entropy.double() * entropy).sum()
    if grad_loss is not None:
        objective = objective + (grad_loss.double() * token_losses).sum()
    objective.backward()
    return x.grad


def assert_close(grad, expected):
    scale = expected.abs().max().item()
    torch.testing.assert_close(grad.cpu().double(), expected, rtol=2e-5, atol=2e-6 * scale)


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
@pytest.mark.parametrize("with_loss", [True, False])
def test_entropy_gradient_variant(name, with_loss, device):
    options = OPTION_SETS[name]
    logits, labels, grad_loss, grad_entropy = problem(8, 2500, device)
    _, lse, _, _, mean_z = kernels.forward(logits, labels, options, outputs=True)
    upstream = grad_loss if with_loss else torch.zeros((), device=device)
    grad = torch.full_like(logits, float("nan"))
    kernels.backward(upstream, logits, labels, lse, grad, options, grad_entropy=grad_entropy, mean_z=mean_z)
    expected = reference_gradient(logits, labels, grad_loss if with_loss else None, grad_entropy, options)
    assert_close(grad, expected)
    assert torch.equal(grad[labels == -100], torch.zeros_like(grad[labels == -100]))
    # The plain-torch form the differentiable fallbacks use agrees too.
    assert_close(
        contract.entropy_gradient(grad_entropy, logits, labels, options),
        expected
        - (reference_gradient(logits, labels, grad_loss, torch.zeros_like(grad_entropy), options) if with_loss else 0),
    )


def test_entropy_gradient_vocab_parallel(device):
    """Each slice's columns from the global lse and mz (what sharding.py gives the kernel) equal the full gradient."""
    options = OPTION_SETS["all"]
    logits, labels, grad_loss, grad_entropy = problem(8, 2500, device, seed=1)
    _, lse, _, _, mean_z = kernels.forward(logits, labels, options, outputs=True)
    vocab, cut = logits.shape[-1], 1100
    grad = torch.full_like(logits, float("nan"))
    for start, stop in ((0, cut), (cut, vocab)):
        columns = logits[:, start:stop].contiguous()
        part = torch.full_like(columns, float("nan"))
        kernels.backward(
            grad_loss, columns, labels, lse, part, options, vocab_start=start, vocab_total=vocab,
            grad_entropy=grad_entropy, mean_z=mean_z,
        )  # fmt: skip
        grad[:, start:stop] = part
    assert_close(grad, reference_gradient(logits, labels, grad_loss, grad_entropy, options))


def test_entropy_gradient_needs_both(device):
    logits, labels, grad_loss, grad_entropy = problem(4, 100, device)
    _, lse, _ = kernels.forward(logits, labels, Options())
    with pytest.raises(ValueError, match="grad_entropy and mean_z"):
        kernels.backward(grad_loss, logits, labels, lse, logits.clone(), Options(), grad_entropy=grad_entropy)
