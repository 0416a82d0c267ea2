"""The second-order cases of vocab_parallel_check (its --second-order argument sets): create_graph=True through the
vocab-parallel loss, by a process group and by a DTensor sharded on the vocabulary; each rank's columns of H v
against the float64 reference's (shared_tests/test_second_order.py), the cross-rank terms through a differentiable
all-reduce."""

import torch
import torch.distributed as dist

import fastce_torch
from fastce_torch.tests import checks
from shared_tests import harness
from shared_tests.harness import Case
from shared_tests.reference import Options


def second_order_cases(vocab, rows, every_option):
    """The Hessian-vector product cases on `rows` rows of `vocab` columns (`every_option`: the options all at once)."""
    return [
        Case("hvp-mean", opts=every_option, vocab=vocab, shape=(rows,), seed=41),
        Case("hvp-sum", reduction="sum", opts=Options(logit_softcapping=5.0, z_loss=1e-2), vocab=vocab, shape=(rows,),
             seed=42),
        Case("hvp-none", reduction="none", opts=Options(label_smoothing=0.2, logit_scaling=1.5), vocab=vocab,
             shape=(rows,), seed=43),
        Case("hvp-n-items", n_items=2.5, opts=every_option, vocab=vocab, shape=(rows,), inplace=False, seed=44),
    ]  # fmt: skip


def hessian_vector_product(case, inputs, logits_of, group_loss):
    """Each rank differentiates sum(grad * v) over its own columns; the sum over ranks is <v, grad loss>, so each
    rank's result is its columns of H v. Returns (this rank's columns of H v, the full v)."""
    gen = torch.Generator().manual_seed(case.seed + 1000)
    v = torch.randn(inputs.logits.shape, generator=gen).to(inputs.logits.dtype).to(inputs.logits.device)
    leaf, x, v_local = logits_of(v)
    loss = group_loss(x)
    if case.reduction == "none":
        loss = (loss * inputs.upstream).sum()
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    (hvp,) = torch.autograd.grad((grad * v_local).sum(), leaf)
    return hvp, v


def check_hvp(case, inputs, hvp_full, v):
    from shared_tests.test_second_order import check_hvp as check
    from shared_tests.test_second_order import exact_hvp

    n_items = inputs.n_items.item() if isinstance(inputs.n_items, torch.Tensor) else inputs.n_items
    exact, row_scale = exact_hvp(inputs.logits, inputs.labels, v, inputs.upstream, case.reduction, n_items, case.opts)
    check(hvp_full, exact, row_scale, case.dtype, "hvp vs float64 reference")


def run_second_order_group(case, device, widths, explicit, group, backend):
    rank = dist.get_rank(group)
    start, width = sum(widths[:rank]), widths[rank]
    inputs = harness.make_inputs(case, device)

    def logits_of(v):
        leaf = inputs.logits[..., start : start + width].detach().clone().requires_grad_()
        return leaf, leaf.clone(), v[..., start : start + width]

    def group_loss(x):
        return fastce_torch.cross_entropy(
            x, inputs.labels, reduction=case.reduction, n_items=inputs.n_items, backend=backend,
            inplace_backward=case.inplace, process_group=group, vocab_start=start if explicit else None,
            **case.opts.as_kwargs(),
        )  # fmt: skip

    hvp, v = hessian_vector_product(case, inputs, logits_of, group_loss)
    check_hvp(case, inputs, checks.gather_columns(hvp, widths, group), v)


def run_second_order_dtensor(case, device, mesh, backend):
    from torch.distributed.tensor import Shard, distribute_tensor

    inputs = harness.make_inputs(case, device)
    placements = [Shard(inputs.logits.dim() - 1)]

    def logits_of(v):
        leaf = distribute_tensor(inputs.logits.detach().contiguous(), mesh, placements).requires_grad_()
        return leaf, leaf, distribute_tensor(v, mesh, placements)

    def group_loss(x):
        loss = fastce_torch.cross_entropy(
            x, inputs.labels, reduction=case.reduction, n_items=inputs.n_items, backend=backend,
            **case.opts.as_kwargs(),
        )  # fmt: skip
        return loss.to_local()

    hvp, v = hessian_vector_product(case, inputs, logits_of, group_loss)
    check_hvp(case, inputs, hvp.full_tensor(), v)
