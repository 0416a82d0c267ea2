"""Unsloth's entry points: fast_cross_entropy_loss hands the logits to cross_entropy untouched, makes no host
synchronisation (GPU), and patch_loss_functions() is patch_transformers(). Values against the float64 reference, in
both packages: shared_tests/test_unsloth.py."""

import pytest
import torch

import fastce_torch
from fastce_torch.integrations import unsloth

# `unpatched` (autouse) is imported for its effect: every test here starts and ends with transformers unpatched.
from .test_transformers import assert_grads_close, batch, loss_and_grads, tiny_llama, transformers, unpatched  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::DeprecationWarning")


def test_strided_logits_reach_cross_entropy_as_they_are(monkeypatch, device):
    """No copy of its own: a (batch, seq_len, V) view of wider rows goes to cross_entropy unchanged (which reads the
    rows in place, since they flatten to a strided 2-D view)."""
    received = []

    def spy(logits, labels, **kwargs):
        received.append((logits, labels, kwargs))
        return fastce_torch.cross_entropy(logits, labels, **kwargs)

    monkeypatch.setattr(unsloth, "cross_entropy", spy)
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(2, 5, 307, generator=generator).to(device)
    logits = wide[..., :300]
    labels = torch.randint(0, 300, (2, 5), generator=generator).to(device)
    loss = fastce_torch.fast_cross_entropy_loss(logits, labels, 0, 0, 4, backend="kernel")
    assert torch.isfinite(loss)
    ((passed_logits, passed_labels, kwargs),) = received
    assert passed_logits is logits and passed_labels is labels
    assert kwargs["reduction"] == "sum" and kwargs["n_items"] == 4


@pytest.mark.gpu
@pytest.mark.parametrize("n_items", [None, "tensor"])
def test_no_host_synchronisation(device, n_items):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 64, 32000, generator=generator, dtype=torch.bfloat16).to(device).requires_grad_()
    labels = torch.randint(0, 32000, (2, 64), generator=generator).to(device)
    labels[0, :9] = -100
    n_items = torch.tensor(50, device=device) if n_items == "tensor" else None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = fastce_torch.fast_cross_entropy_loss(logits * 1.0, labels, 30.0, 0.5, n_items)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("torch_compile", [True, False])
def test_patch_loss_functions_is_patch_transformers(device, torch_compile):
    model = tiny_llama(device)
    ids, labels = batch(device)
    fastce_torch.patch_transformers()
    expected_loss, expected_grads = loss_and_grads(model, ids, labels, num_items_in_batch=torch.tensor(13))
    expected_mapping = dict(transformers.loss.loss_utils.LOSS_MAPPING)
    fastce_torch.unpatch_transformers()
    unpatched_mapping = dict(transformers.loss.loss_utils.LOSS_MAPPING)

    fastce_torch.patch_loss_functions(torch_compile=torch_compile)
    assert dict(transformers.loss.loss_utils.LOSS_MAPPING) == expected_mapping != unpatched_mapping
    loss, grads = loss_and_grads(model, ids, labels, num_items_in_batch=torch.tensor(13))
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    assert_grads_close(grads, expected_grads, rtol=0, atol=0)
    fastce_torch.unpatch_transformers()
    assert dict(transformers.loss.loss_utils.LOSS_MAPPING) == unpatched_mapping
