"""`fast_cross_entropy_loss` (Unsloth's name and signature) in both packages: loss and gradient against the float64
reference and against each other, on 3-D inputs made once in torch and handed to JAX through DLPack."""

import dataclasses

import jax
import pytest
import torch

from . import exchange, harness
from .reference import Options

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")
fastce_jax = pytest.importorskip("fastce_jax")


def unsloth_case(name, seed, **fields):
    """Unsloth's problem: (batch, seq_len) labels, -100 ignored, sum / n_items, the default n_items being the
    reference's "mean" (the number of non-ignored labels, at least 1)."""
    reduction = "mean" if fields.get("n_items") is None else "sum"
    return harness.Case(name, shape=(2, 5), vocab=300, reduction=reduction, seed=seed, **fields)


CASES = [
    unsloth_case("padding", 1),  # about 1 in 4 labels -100
    unsloth_case("no-padding", 2, ignore="none"),
    unsloth_case("softcap", 3, opts=Options(logit_softcapping=5.0), std=4.0),
    unsloth_case("scaling", 4, opts=Options(logit_scaling=0.25)),
    unsloth_case("scaling-softcap", 5, opts=Options(logit_softcapping=3.0, logit_scaling=-1.5)),
    unsloth_case("n-items-int", 6, n_items=7),
    unsloth_case("n-items-tensor", 7, n_items=("tensor", 23)),
    unsloth_case("n-items-float-tensor", 8, n_items=("tensor", 9.5), opts=Options(logit_softcapping=5.0)),
    unsloth_case("all-ignored", 9, ignore="all"),  # 0 with a zero gradient, not 0/0
    unsloth_case("bad-labels", 10, bad_labels=(300, -5)),  # NaN loss, NaN gradient rows, nothing read out of range
    unsloth_case("strided-rows", 11, row_pad=7),  # (2, 5, 307) buffer, NaN past V: an out-of-row read shows
    unsloth_case("bf16-softcap", 12, dtype="bfloat16", opts=Options(logit_softcapping=5.0), std=4.0),
]


def positional(case, inputs):
    """Unsloth's positional arguments after (logits, labels)."""
    return case.opts.logit_softcapping, case.opts.logit_scaling, inputs.n_items


def run_torch(case, inputs):
    leaf = inputs.logits.detach().requires_grad_()
    logits = leaf.clone()  # an intermediate, as lm_head's output is: the backward writes into its buffer
    loss = fastce_torch.fast_cross_entropy_loss(logits, inputs.labels, *positional(case, inputs), backend="kernel")
    assert loss.dtype == torch.float32 and loss.shape == ()
    loss.backward()
    return loss.detach(), leaf.grad


def run_jax(case, inputs):
    logits = exchange.to_jax(inputs.logits)
    labels = exchange.labels_to_jax(inputs.labels)
    softcap, scaling, n_items = positional(case, inputs)
    if isinstance(n_items, torch.Tensor):
        n_items = exchange.to_jax(n_items) if n_items.is_floating_point() else exchange.labels_to_jax(n_items)

    def loss_fn(x):
        return fastce_jax.fast_cross_entropy_loss(x, labels, softcap, scaling, n_items, backend="kernel")

    loss, grad = jax.value_and_grad(loss_fn)(logits)
    assert loss.dtype == jax.numpy.float32 and loss.shape == ()
    return exchange.to_torch(loss), exchange.to_torch(grad)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fast_cross_entropy_loss_matches_the_reference(case, device):
    inputs = harness.make_inputs(case, device)
    if case.row_pad:
        assert inputs.logits.dim() == 3 and not inputs.logits.is_contiguous()
    ref = harness.run_reference(case, inputs)
    harness.compare(case, inputs, run_torch(case, inputs), run_jax(case, inputs), ref)


def test_default_n_items_is_the_number_of_labels_that_count(device):
    """Unsloth's default: the sum divided by the non-ignored labels, the same as passing that count."""
    case = unsloth_case("padding", 13)
    inputs = harness.make_inputs(case, device)
    counted = int((inputs.labels != -100).sum())
    assert 0 < counted < inputs.labels.numel()
    explicit = dataclasses.replace(case, reduction="sum", n_items=counted)
    explicit_inputs = dataclasses.replace(inputs, n_items=counted)
    for run in (run_torch, run_jax):
        default_loss, default_grad = run(case, inputs)
        loss, grad = run(explicit, explicit_inputs)
        assert torch.equal(default_loss.cpu(), loss.cpu()) and torch.equal(default_grad.cpu(), grad.cpu())


@pytest.mark.parametrize("logits_shape,labels_shape", [((10, 300), (10,)), ((2, 5, 300), (10,)), ((2, 5, 300), (2, 4))])
def test_shapes_other_than_batch_seq_vocab_are_refused_in_both(logits_shape, labels_shape):
    logits, labels = torch.randn(logits_shape), torch.zeros(labels_shape, dtype=torch.int32)
    for call, x, y in (
        (fastce_torch.fast_cross_entropy_loss, logits, labels),
        (fastce_jax.fast_cross_entropy_loss, exchange.to_jax(logits), exchange.labels_to_jax(labels)),
    ):
        with pytest.raises(ValueError, match=r"\(batch, seq_len, vocab\)"):
            call(x, y)
