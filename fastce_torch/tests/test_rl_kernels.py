"""The backward kernel's entropy-gradient variant (HAS_ENTROPY_GRAD, launch.backward(grad_entropy=, mean_z=))
against the float64 reference (shared_tests/reference.py), alone and with the loss's gradient, with every option,
-inf logits, ignored rows, and in vocab-parallel mode (two column slices with the global lse and mz). On the
`device` fixture's device (CPU: Triton's interpreter)."""

import pytest
import torch

from fastce_torch.core.options import Options, with_temperature
from fastce_torch.core.reference import entropy_gradient
from fastce_torch.losses.cross_entropy import launch
from shared_tests import reference

from .checks import as_float64

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore:invalid value:RuntimeWarning", "ignore:divide by zero:RuntimeWarning"
)

OPTION_SETS = {
    "plain": Options(),
    "all": Options(logit_softcapping=3.0, logit_scaling=0.7, label_smoothing=0.1, z_loss=1e-3),
    "temperature": with_temperature(Options(logit_softcapping=5.0), 0.6),
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
    """d(sum_t g_t loss_t + g_H,t H_t) / d logits in float64 (reference.differentiated; g_t = 0 without grad_loss)."""
    upstream = (0.0 if grad_loss is None else as_float64(grad_loss), 0.0, as_float64(grad_entropy))
    ref = reference.differentiated(
        as_float64(logits), labels.cpu().numpy(), reduction="none", opts=reference.Options(*options), upstream=upstream
    )
    return torch.as_tensor(ref.loss.grad)


def assert_close(grad, expected):
    scale = expected.abs().max().item()
    torch.testing.assert_close(grad.cpu().double(), expected, rtol=2e-5, atol=2e-6 * scale)


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
@pytest.mark.parametrize("with_loss", [True, False])
def test_entropy_gradient_variant(name, with_loss, device):
    options = OPTION_SETS[name]
    logits, labels, grad_loss, grad_entropy = problem(8, 2500, device)
    _, lse, _, _, mean_z = launch.forward(logits, labels, options, outputs=True)
    upstream = grad_loss if with_loss else torch.zeros((), device=device)
    grad = torch.full_like(logits, float("nan"))
    launch.backward(upstream, logits, labels, lse, grad, options, grad_entropy=grad_entropy, mean_z=mean_z)
    expected = reference_gradient(logits, labels, grad_loss if with_loss else None, grad_entropy, options)
    assert_close(grad, expected)
    assert torch.equal(grad[labels == -100], torch.zeros_like(grad[labels == -100]))
    # The plain-torch form the differentiable fallbacks use agrees too.
    assert_close(
        entropy_gradient(grad_entropy, logits, labels, options),
        expected
        - (reference_gradient(logits, labels, grad_loss, torch.zeros_like(grad_entropy), options) if with_loss else 0),
    )


def test_entropy_gradient_vocab_parallel(device):
    """Each slice's columns from the global lse and mz (what distributed/vocab_parallel.py gives the kernel) equal
    the full gradient."""
    options = OPTION_SETS["all"]
    logits, labels, grad_loss, grad_entropy = problem(8, 2500, device, seed=1)
    _, lse, _, _, mean_z = launch.forward(logits, labels, options, outputs=True)
    vocab, cut = logits.shape[-1], 1100
    grad = torch.full_like(logits, float("nan"))
    for start, stop in ((0, cut), (cut, vocab)):
        columns = logits[:, start:stop].contiguous()
        part = torch.full_like(columns, float("nan"))
        launch.backward(
            grad_loss, columns, labels, lse, part, options, vocab_start=start, vocab_total=vocab,
            grad_entropy=grad_entropy, mean_z=mean_z,
        )  # fmt: skip
        grad[:, start:stop] = part
    assert_close(grad, reference_gradient(logits, labels, grad_loss, grad_entropy, options))


def test_entropy_gradient_needs_both(device):
    logits, labels, grad_loss, grad_entropy = problem(4, 100, device)
    _, lse, _ = launch.forward(logits, labels, Options())
    with pytest.raises(ValueError, match="grad_entropy and mean_z"):
        launch.backward(grad_loss, logits, labels, lse, logits.clone(), Options(), grad_entropy=grad_entropy)
