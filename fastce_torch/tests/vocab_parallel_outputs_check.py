"""The extra outputs of vocab-parallel cross_entropy (process_group=), one process per rank:

    python -m torch.distributed.run --standalone --nproc-per-node 3 \\
        -m fastce_torch.tests.vocab_parallel_outputs_check --device cpu --widths 10,15,12 --backend kernel

Every rank makes the same full inputs (seeded), takes its columns and asks for every output; each output is checked
against reference.outputs on the full logits (shared_tests/test_outputs.py's tolerances), must be the same bits on
every rank, and the gradient of the z_loss output (and of loss + z_loss), gathered over the ranks, against the
reference's z-loss part; then the same through a DTensor sharded on the vocabulary. Exit status 0 only when every
case passed on every rank.
"""

import argparse
import dataclasses
import datetime
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import fastce_torch
from shared_tests import harness, reference, tolerances
from shared_tests.harness import Case
from shared_tests.test_outputs import ALL, ALL_RETURNS, FIELDS, Z, check_outputs, z_loss_gradient_reference

from . import checks
from .checks import gather_columns, same_on_every_rank


def cases(vocab):
    base = [
        Case("mean", opts=Z, seed=1),
        Case("sum-n-items", reduction="sum", n_items=5, opts=ALL, seed=2),
        Case("none", reduction="none", opts=Z, seed=3),
        Case("all-options-none", reduction="none", opts=ALL, seed=4),
        Case("bad-labels", bad_labels=(vocab, -5), reduction="none", opts=Z, seed=5),
        Case("neg-inf-tail", neg_inf="tail", reduction="none", seed=6),
        Case("nonfinite-rows", nonfinite_rows=True, reduction="none", seed=7),
        Case("all-ignored", ignore="all", seed=8),
        Case("ties", reduction="none", std=0.0, offset=1.0, ignore="none", seed=9),
        Case("not-inplace", inplace=False, opts=Z, seed=10),
        Case("bf16", dtype="bfloat16", reduction="none", opts=Z, seed=11),
    ]
    return [dataclasses.replace(case, vocab=vocab, shape=(6,)) for case in base]


def run_case(case, device, widths, group, backend):
    rank = dist.get_rank(group)
    start, width = sum(widths[:rank]), widths[rank]
    inputs = harness.make_inputs(case, device)
    if case.std == 0.0:
        # Every logit equal, then the largest value in two slices (the last column of rank 0 and a column of the last
        # rank) on every row: the first column must win, and every other row's label is that column.
        inputs.logits[:, widths[0] - 1] = 2.0
        inputs.logits[:, sum(widths) - 2] = 2.0
        inputs.labels[::2] = widths[0] - 1
        inputs.labels[1::2] = sum(widths) - 2
    x, y = harness.as_f64(inputs.logits), inputs.labels.cpu().numpy()
    n_items = inputs.n_items.item() if isinstance(inputs.n_items, torch.Tensor) else inputs.n_items
    upstream = inputs.upstream if case.reduction == "none" else torch.ones((), device=device)
    for objective in ("z_loss", "loss+z_loss"):
        local = inputs.logits[..., start : start + width]
        leaf = local.detach().clone().requires_grad_()
        out = fastce_torch.cross_entropy(
            leaf.clone() if case.inplace else leaf, inputs.labels, reduction=case.reduction, n_items=inputs.n_items,
            backend=backend, inplace_backward=case.inplace, process_group=group,
            vocab_start=start if len(set(widths)) > 1 else None, **case.opts.as_kwargs(), **ALL_RETURNS,
        )  # fmt: skip
        check_outputs(out, x, y, case.reduction, n_items, case.opts, what=f"rank {rank} ")
        for name in FIELDS:
            assert same_on_every_rank(getattr(out, name).detach(), group), f"{name} differs between ranks"
        total = (out.z_loss * upstream).sum()
        if objective == "loss+z_loss":
            total = total + (out.loss * upstream).sum()
        total.backward()
        grad = gather_columns(leaf.grad, widths, group)
        up = inputs.upstream.cpu().numpy() if case.reduction == "none" else None
        with_z, z_part = z_loss_gradient_reference(x, y, case.reduction, n_items, case.opts, up)
        expected = z_part if objective == "z_loss" else with_z.grad + z_part
        bound = tolerances.grad_bound(with_z, harness.as_f64(grad), case.dtype, ulps=1.0) + tolerances.FLOOR
        tolerances.check(harness.as_f64(grad), expected, bound, f"d {objective}")
    if case.std == 0.0:
        expected = reference.outputs(x, y, reduction="none", opts=case.opts).accuracy
        np.testing.assert_array_equal(harness.as_f64(out.accuracy), expected)


def run_dtensor_case(case, device, mesh, backend):
    """A DTensor sharded on the vocabulary (Shard's own chunking): every output a DTensor placed like the loss (or
    the labels), the same values, and the z_loss output's gradient a DTensor placed like the logits."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    inputs = harness.make_inputs(case, device)
    full = inputs.logits.detach().contiguous()
    logits = distribute_tensor(full, mesh, [Shard(full.dim() - 1)]).requires_grad_()
    out = fastce_torch.cross_entropy(
        logits, inputs.labels, reduction=case.reduction, n_items=inputs.n_items, backend=backend,
        **case.opts.as_kwargs(), **ALL_RETURNS,
    )  # fmt: skip
    for name in ("loss", *FIELDS):
        value = getattr(out, name)
        assert isinstance(value, DTensor) and tuple(value.placements) == (Replicate(),), (name, value)
    local = type(out)(*(value.to_local().detach() for value in out))
    x, y = harness.as_f64(full), inputs.labels.cpu().numpy()
    n_items = inputs.n_items.item() if isinstance(inputs.n_items, torch.Tensor) else inputs.n_items
    check_outputs(local, x, y, case.reduction, n_items, case.opts, what="DTensor ")
    upstream = inputs.upstream if case.reduction == "none" else torch.ones((), device=device)
    (out.z_loss.to_local() * upstream).sum().backward()
    assert isinstance(logits.grad, DTensor) and tuple(logits.grad.placements) == (Shard(full.dim() - 1),)
    up = inputs.upstream.cpu().numpy() if case.reduction == "none" else None
    with_z, z_part = z_loss_gradient_reference(x, y, case.reduction, n_items, case.opts, up)
    grad = harness.as_f64(logits.grad.full_tensor())
    bound = tolerances.grad_bound(with_z, grad, case.dtype, ulps=1.0) + tolerances.FLOOR
    tolerances.check(grad, z_part, bound, "DTensor d z_loss")


def run_segment(args, device, mesh):
    """Every case of one argument set on this rank: the number that failed."""
    rank = dist.get_rank()
    widths = [int(w) for w in args.widths.split(",")]
    assert len(widths) == dist.get_world_size(), "--widths needs one entry per rank"
    from fastce_torch.losses.cross_entropy import launch

    # Several chunks per slice: the kernel's in-launch combine, then the ranks'. The constants live in
    # losses/cross_entropy/launch.py, and forward_config caches what it read from them.
    tiles = launch.FORWARD_BLOCK, launch.CHUNK
    if args.small_chunks:
        launch.FORWARD_BLOCK, launch.CHUNK = 4, 8
        launch.forward_config.cache_clear()
    failures = 0
    try:
        for case in cases(sum(widths)):
            try:
                run_case(case, device, widths, dist.group.WORLD, args.backend)
                if case.std != 0.0:  # the ties case places its maxima by the explicit widths
                    run_dtensor_case(case, device, mesh, args.backend)
            except Exception as error:  # report every case, not only the first
                failures += 1
                print(f"rank {rank} FAIL {case.id}: {type(error).__name__}: {error}", flush=True)
    finally:
        launch.FORWARD_BLOCK, launch.CHUNK = tiles
        launch.forward_config.cache_clear()
    return failures, widths


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="kernel")
    parser.add_argument("--widths", default="10,15,12")
    parser.add_argument("--small-chunks", action="store_true", help="tiles of 4 and chunks of 8 columns")
    segments = checks.argument_sets(parser, sys.argv[1:])  # `--then` between sets, one summary line each
    cuda = segments[0].device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda" if cuda else "cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    any_failed = False
    for args in segments:
        failures, widths = run_segment(args, device, mesh)
        total = torch.tensor([failures], device=device)
        dist.all_reduce(total)
        any_failed = any_failed or int(total) > 0
        if rank == 0:
            how = ", small chunks" if args.small_chunks else ""
            status = "ok" if int(total) == 0 else "FAILED"
            print(f"vocab-parallel outputs {args.backend} widths {widths}{how}: {status}", flush=True)
    checks.exit_skipping_teardown(any_failed)


if __name__ == "__main__":
    main()
