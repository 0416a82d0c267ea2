"""Vocab-parallel correctness check, one process per rank (run with torchrun / torch.distributed.run):

    torchrun --nproc-per-node 2 -m fastce_torch.tests.vocab_parallel_check --device cuda --size mid
    python -m torch.distributed.run --standalone --nproc-per-node 3 -m fastce_torch.tests.vocab_parallel_check \\
        --device cpu --widths 10,15,12

Every rank makes the same full inputs (seeded), takes its columns, runs fastce_torch.cross_entropy with the
process group (and with a DTensor sharded on the vocabulary), and the loss and the gathered gradient are compared
with the float64 reference of shared_tests/reference.py on the full logits, with the shared suite's tolerances.
Every rank must return the same loss bits. Exit status 0 only when every case passed on every rank. `--then`
separates argument sets that one launch runs in turn (one summary line each), e.g. `--poisoned --then --second-order`.

With --compile=aot_eager (or inductor) every call runs under torch.compile(fullgraph=True) as well (a graph break
raises): the compiled loss and gradient against the float64 reference and against the eager call's; with aot_eager
the recorded graphs must hold the two all-reduces of O(N) floats in the forward, nothing communicating in the
backward and no host synchronisation.
"""

import argparse
import contextlib
import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist

import fastce_torch  # noqa: F401  (before triton: chooses Triton's interpreter on a CPU machine)
from fastce_torch.tests import checks, vocab_parallel_rl
from fastce_torch.tests.checks import gather_columns, same_on_every_rank
from fastce_torch.tests.vocab_parallel_compile import check_graphs, close_to_eager, compiled, run_compile_checks
from fastce_torch.tests.vocab_parallel_second_order import (
    run_second_order_dtensor,
    run_second_order_group,
    second_order_cases,
)
from shared_tests import harness, tolerances
from shared_tests.harness import Case
from shared_tests.reference import Options

ALL = Options(logit_softcapping=30.0, logit_scaling=0.5, label_smoothing=0.1, z_loss=1e-3)


def cases(vocab, rows):
    """The contract's options and edge cases on a vocabulary of `vocab` columns (every one on `rows` rows)."""
    base = [
        Case("mean", seed=1),
        Case("sum", reduction="sum", seed=2),
        Case("none", reduction="none", seed=3),
        Case("softcap", opts=Options(logit_softcapping=5.0), std=4.0, seed=4),
        Case("scaling", opts=Options(logit_scaling=0.25), seed=5),
        Case("scaling-negative", opts=Options(logit_scaling=-1.5), reduction="none", seed=6),
        Case("smoothing", opts=Options(label_smoothing=0.1), seed=7),
        Case("smoothing-sum", opts=Options(label_smoothing=0.7), reduction="sum", seed=8),
        Case("z-loss", opts=Options(z_loss=1e-2), offset=20.0, seed=9),
        Case("all-options", opts=ALL, reduction="none", seed=10),
        Case("all-options-mean", opts=ALL, seed=11),
        Case("all-options-3d", shape=(2, rows // 2), opts=ALL, reduction="sum", seed=12),
        Case("n-items-int", n_items=7, seed=13),
        Case("n-items-float", n_items=2.5, opts=Options(label_smoothing=0.2), seed=14),
        Case("n-items-tensor", n_items=("tensor", 23), seed=15),
        Case("n-items-sum", reduction="sum", n_items=("tensor", 6), opts=Options(z_loss=1e-3), seed=16),
        Case("all-ignored", ignore="all", seed=17),
        Case("all-ignored-sum", ignore="all", reduction="sum", opts=ALL, seed=18),
        Case("none-ignored", ignore="none", seed=19),
        Case("ignore-real-class", ignore="class", opts=Options(ignore_index=3), seed=20),
        Case("ignore-minus-one", opts=Options(ignore_index=-1), bad_labels=(-100,), reduction="none", seed=21),
        Case("bad-labels-none", bad_labels=(-1, vocab, vocab + 7, -(2**31), 2**31 - 1), reduction="none", seed=22),
        Case("bad-labels-mean", bad_labels=(vocab,), opts=ALL, seed=23),
        Case("bad-labels-int32", bad_labels=(-5, vocab), label_dtype="int32", reduction="none", seed=24),
        Case("neg-inf-tail", neg_inf="tail", reduction="none", seed=25),
        Case("neg-inf-scatter", neg_inf="scatter", opts=Options(z_loss=1e-3), seed=26),
        Case("neg-inf-smoothing", neg_inf="tail", opts=Options(label_smoothing=0.1), reduction="none", seed=27),
        Case("nonfinite-rows", nonfinite_rows=True, reduction="none", seed=28),
        Case("nonfinite-rows-mean", nonfinite_rows=True, opts=ALL, seed=29),
        Case("offset-large", offset=60.0, std=8.0, opts=Options(z_loss=1e-4), seed=30),
        Case("offset-negative", offset=-80.0, reduction="sum", seed=31),
        Case("int32-labels", label_dtype="int32", seed=32),
        Case("not-inplace", inplace=False, opts=ALL, seed=33),
        Case("not-inplace-none", inplace=False, reduction="none", seed=34),
        Case("n0", shape=(0,), seed=35),
        Case("n0-none", shape=(0,), reduction="none", seed=36),
    ]
    out = []
    for case in base:
        shape = case.shape if case.shape != (8,) else (rows,)
        out.append(dataclasses.replace(case, vocab=vocab, shape=shape))
    other_dtypes = ("all-options", "all-options-mean", "nonfinite-rows", "bad-labels-none", "not-inplace")
    # float64: computed in float64 by the plain-torch path whatever the backend.
    float64 = ("all-options", "all-options-mean", "bad-labels-none", "nonfinite-rows-mean", "n-items-tensor")
    return (
        out
        + [
            dataclasses.replace(case, dtype=dtype)
            for case in out
            if case.name in other_dtypes
            for dtype in ("bfloat16", "float16")
        ]
        + [dataclasses.replace(case, dtype="float64") for case in out if case.name in float64]
    )


def widths_for(args, world):
    if args.widths:
        widths = [int(w) for w in args.widths.split(",")]
        if len(widths) != world:
            raise SystemExit(f"--widths has {len(widths)} entries for {world} ranks")
        return widths, True
    return [args.local_vocab] * world, False


def compare(case, inputs, loss, grad):
    ref = harness.run_reference(case, inputs)
    t_loss, t_grad = harness.as_f64(loss), harness.as_f64(grad)
    assert loss.dtype == (torch.float64 if case.dtype == "float64" else torch.float32), loss.dtype
    rtol = tolerances.RTOL64 if case.dtype == "float64" else tolerances.RTOL
    tolerances.check(t_loss, ref.loss, tolerances.loss_bound(ref, rtol), "loss vs reference")
    ulps = harness.torch_ulps_reference(inputs, case)
    bound = tolerances.grad_bound(ref, t_grad, case.dtype, rtol=rtol, ulps=ulps)
    tolerances.check(t_grad, ref.grad, bound, "grad vs reference")


def backward(loss, case, inputs):
    if case.reduction == "none":
        loss.backward(inputs.upstream)
    else:
        loss.backward()


def group_loss_and_grad(case, inputs, widths, explicit, group, backend, compile_backend=""):
    """(loss, this rank's gradient columns, the compiled graphs) of one process-group call."""
    rank = dist.get_rank(group)
    start, width = sum(widths[:rank]), widths[rank]
    local = inputs.logits[..., start : start + width]
    # Inplace: the local columns are an intermediate (a copy of a leaf), as an LM head's output would be; otherwise a
    # leaf whose rows are strided (a column slice of the full logits).
    leaf = local.detach().clone().requires_grad_() if case.inplace else local.detach().requires_grad_()
    x = leaf.clone() if case.inplace else leaf

    def loss_of(x, labels, n_items):
        return fastce_torch.cross_entropy(
            x,
            labels,
            reduction=case.reduction,
            n_items=n_items,
            backend=backend,
            inplace_backward=case.inplace,
            process_group=group,
            vocab_start=start if explicit else None,
            **case.opts.as_kwargs(),
        )

    graphs = None
    if compile_backend:
        loss_of, graphs = compiled(loss_of, compile_backend)
    loss = loss_of(x, inputs.labels, inputs.n_items)
    assert not fastce_torch.core.options.is_dtensor(loss)
    backward(loss, case, inputs)
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    assert grad.dtype == x.dtype and grad.shape == x.shape
    return loss.detach(), grad, graphs


def run_process_group(case, device, widths, explicit, group, backend, compile_backend=""):
    inputs = harness.make_inputs(case, device)
    loss, grad, _ = group_loss_and_grad(case, inputs, widths, explicit, group, backend)
    assert same_on_every_rank(loss, group), "ranks disagree on the loss"
    if compile_backend:
        eager = loss, grad
        loss, grad, graphs = group_loss_and_grad(case, inputs, widths, explicit, group, backend, compile_backend)
        assert same_on_every_rank(loss, group), "ranks disagree on the compiled loss"
        check_graphs(graphs, inputs.labels.numel(), backend, case.dtype)
        close_to_eager(loss, eager[0], "compiled loss")
        close_to_eager(grad, eager[1], "compiled grad")
    compare(case, inputs, loss, gather_columns(grad, widths, group))


def dtensor_loss_and_grad(case, inputs, mesh, backend, compile_backend=""):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    full = inputs.logits.detach().contiguous()
    logits = distribute_tensor(full, mesh, [Shard(full.dim() - 1)]).requires_grad_()

    def loss_of(logits, labels, n_items):
        return fastce_torch.cross_entropy(
            logits, labels, reduction=case.reduction, n_items=n_items, backend=backend, **case.opts.as_kwargs()
        )

    graphs = None
    if compile_backend:
        loss_of, graphs = compiled(loss_of, compile_backend)
    loss = loss_of(logits, inputs.labels, inputs.n_items)
    assert isinstance(loss, DTensor) and tuple(loss.placements) == (Replicate(),), loss
    if case.reduction == "none":
        loss.backward(DTensor.from_local(inputs.upstream, mesh, [Replicate()], run_check=False))
    else:
        loss.backward()
    assert isinstance(logits.grad, DTensor) and tuple(logits.grad.placements) == (Shard(full.dim() - 1),)
    assert torch.equal(harness.bits(full), harness.bits(inputs.logits)), "the DTensor's storage was overwritten"
    return loss.to_local().detach(), logits.grad.full_tensor(), graphs


def run_dtensor(case, device, mesh, backend, compile_backend=""):
    inputs = harness.make_inputs(case, device)
    loss, grad, _ = dtensor_loss_and_grad(case, inputs, mesh, backend)
    if compile_backend:
        eager = loss, grad
        loss, grad, graphs = dtensor_loss_and_grad(case, inputs, mesh, backend, compile_backend)
        check_graphs(graphs, inputs.labels.numel(), backend, case.dtype)
        close_to_eager(loss, eager[0], "compiled loss")
        close_to_eager(grad, eager[1], "compiled grad")
    compare(case, inputs, loss, grad)


def run_dtensor_2d(case, device, mesh, backend, compile_backend=""):
    """A (data, tensor) mesh: rows sharded on the first mesh dimension, the vocabulary on the second; labels a
    DTensor placed (Shard(0), Replicate()). "sum"/"mean" give Partial on the data dimension; full_tensor() sums it."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    inputs = harness.make_inputs(case, device)
    full = inputs.logits.detach().contiguous()
    logits = distribute_tensor(full, mesh, [Shard(0), Shard(full.dim() - 1)]).requires_grad_()
    labels = distribute_tensor(inputs.labels, mesh, [Shard(0), Replicate()])

    def loss_of(logits, labels, n_items):
        return fastce_torch.cross_entropy(
            logits, labels, reduction=case.reduction, n_items=n_items, backend=backend, **case.opts.as_kwargs()
        )

    if compile_backend:
        loss_of, _ = compiled(loss_of, compile_backend)
    loss = loss_of(logits, labels, inputs.n_items)
    expected = (Shard(0), Replicate()) if case.reduction == "none" else (Partial("sum"), Replicate())
    assert isinstance(loss, DTensor) and tuple(loss.placements) == expected, loss.placements
    total = loss.full_tensor()
    if case.reduction == "none":
        total.backward(inputs.upstream)
    else:
        total.backward()
    compare(case, inputs, total.detach(), logits.grad.full_tensor())


def run_errors(device, widths, explicit, group, backend):
    """Unequal widths without vocab_start give NaN; offsets that do not tile the vocabulary raise."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    case = Case("errors", shape=(4,), vocab=sum(widths))
    inputs = harness.make_inputs(case, device)
    start, width = sum(widths[:rank]), widths[rank]
    local = inputs.logits[..., start : start + width]
    if len(set(widths)) > 1:
        loss = fastce_torch.cross_entropy(local, inputs.labels, process_group=group, backend=backend)
        assert torch.isnan(loss), f"unequal widths without vocab_start must give NaN, got {loss}"
    if world > 1:
        try:
            fastce_torch.cross_entropy(local, inputs.labels, process_group=group, vocab_start=0, backend=backend)
        except ValueError as e:
            assert "tile" in str(e), e
        else:
            raise AssertionError("overlapping slices (every rank at vocab_start=0) did not raise")


def run_shift(device, widths, explicit, group, mesh, backend, compile_backend=""):
    """shift=2 with a process group equals the sliced call (loss and this rank's gradient; the shifted call compiled
    with --compile); a DTensor refuses it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = dist.get_rank(group)
    case = Case("shift", shape=(2, 5), vocab=sum(widths), opts=ALL, seed=40)
    inputs = harness.make_inputs(case, device)
    start, width = sum(widths[:rank]), widths[rank]
    local = inputs.logits[..., start : start + width].detach()
    results = []
    for shifted in (True, False):
        leaf = local.clone().requires_grad_()
        x = leaf.clone()
        logits, labels = (x, inputs.labels) if shifted else (x[:, :-2], inputs.labels[:, 2:])

        def loss_of(logits, labels, shifted=shifted):
            return fastce_torch.cross_entropy(
                logits,
                labels,
                reduction="none",
                backend=backend,
                process_group=group,
                vocab_start=start if explicit else None,
                shift=2 if shifted else 0,
                **case.opts.as_kwargs(),
            )

        if shifted and compile_backend and not explicit:
            loss_of, _ = compiled(loss_of, compile_backend)
        loss = loss_of(logits, labels)
        loss.backward(inputs.upstream[:, :-2])
        results.append((loss.detach(), leaf.grad))
    (loss, grad), (want_loss, want_grad) = results
    assert loss.shape == want_loss.shape, (loss.shape, want_loss.shape)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
    logits = distribute_tensor(inputs.logits.detach().contiguous(), mesh, [Shard(2)])
    try:
        fastce_torch.cross_entropy(logits, inputs.labels, backend=backend, shift=1)
    except NotImplementedError as e:
        assert "shift" in str(e), e
    else:
        raise AssertionError("a DTensor with shift did not raise NotImplementedError")


def parse_segments(argv):
    """One argument set per segment: `--then` separates them, so that one launch (one set of processes, each paying
    the imports and the interpreter's warm-up once) runs several configurations in turn."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("kernel", "reference"), default="kernel")
    parser.add_argument("--local-vocab", type=int, default=20, help="columns per rank (equal widths)")
    parser.add_argument("--widths", default="", help="comma-separated columns per rank: explicit vocab_start")
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--size", choices=("tiny", "mid"), default="tiny", help="mid: 128 rows x 40000 per rank")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--second-order", action="store_true", help="only the Hessian-vector product cases")
    parser.add_argument("--poisoned", action="store_true", help="torch.empty / empty_like buffers start as NaN")
    parser.add_argument("--rl", action="store_true", help="only the RL keywords' cases (vocab_parallel_rl.py)")
    parser.add_argument(
        "--compile", default="", choices=("", "aot_eager", "inductor"), help="also under torch.compile(fullgraph=True)"
    )
    segments = checks.argument_sets(parser, argv)
    for args in segments:
        if args.compile and args.second_order:
            raise SystemExit("--second-order runs eagerly (under --compile a second backward is checked to raise)")
        if args.size == "mid":
            args.rows, args.local_vocab = 128, 40000  # three chunks per local row
    return segments


def run_segment(args, device, group, mesh):
    """Every case of one argument set on every rank: (cases run, failure lines)."""
    world = dist.get_world_size()
    widths, explicit = widths_for(args, world)
    if args.rl:
        return (*vocab_parallel_rl.run_rl(device, widths, explicit, group, mesh, args.backend), widths)
    only = set(args.only.split(",")) if args.only else None
    failures, ran = [], 0
    for case in second_order_cases(sum(widths), args.rows, ALL) if args.second_order else ():
        for how, run in (("group", run_second_order_group), ("dtensor", run_second_order_dtensor)):
            if how == "dtensor" and explicit:
                continue
            ran += 1
            try:
                if how == "group":
                    run(case, device, widths, explicit, group, args.backend)
                else:
                    run(case, device, mesh, args.backend)
            except AssertionError as e:
                failures.append(f"{case.id} [{how}, second order]: {e}")
    for case in () if args.second_order else cases(sum(widths), args.rows):
        if only and case.name not in only:
            continue
        for how in ("group", "dtensor"):
            if how == "dtensor" and case.dtype != "float32" and case.name != "all-options":
                continue
            if how == "group" and explicit and args.compile:
                continue  # vocab_start= under compile is a graph break: run_compile_checks
            ran += 1
            try:
                if how == "group":
                    run_process_group(case, device, widths, explicit, group, args.backend, args.compile)
                else:
                    run_dtensor(case, device, mesh, args.backend, args.compile)
            except AssertionError as e:
                failures.append(f"{case.id} [{how}]: {e}")
    if world == 4 and not args.only and not args.second_order:
        from torch.distributed.device_mesh import init_device_mesh

        mesh_2d = init_device_mesh(args.device, (2, 2))
        for case in cases(sum(widths), args.rows):
            if case.reduction == "mean" and case.n_items is None or case.dtype != "float32" or not case.shape[0]:
                continue
            ran += 1
            try:
                run_dtensor_2d(case, device, mesh_2d, args.backend, args.compile)
            except AssertionError as e:
                failures.append(f"{case.id} [dtensor 2-D]: {e}")
    checks_of_segment = [
        ("errors", lambda: run_errors(device, widths, explicit, group, args.backend)),
        ("shift", lambda: run_shift(device, widths, explicit, group, mesh, args.backend, args.compile)),
    ]
    if args.compile:
        ran += 1
        checks_of_segment.append(
            (
                "compile checks",
                lambda: run_compile_checks(device, widths, explicit, group, args.backend, args.compile, ALL),
            )
        )
    for name, check in checks_of_segment:
        try:
            check()
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    return ran, failures, widths


def main():
    segments = parse_segments(sys.argv[1:])
    device_kind = segments[0].device
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_kind, torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_kind, (world,))
    any_failed = False
    for args in segments:
        # Poisoning holds for the whole segment (every case on poisoned buffers) and ends with it.
        with checks.poisoned_allocations() if args.poisoned else contextlib.nullcontext():
            ran, failures, widths = run_segment(args, device, group, mesh)
        counts = torch.tensor([len(failures)], device=device)
        dist.all_reduce(counts)
        any_failed = any_failed or int(counts) > 0
        for line in failures:
            print(f"rank {rank} FAIL {line}", flush=True)
        if rank == 0:
            status = "ok" if int(counts) == 0 else f"{int(counts)} failures"
            how = f", torch.compile {args.compile}" if args.compile else ""
            how += ", second order" if args.second_order else ""
            how += ", poisoned" if args.poisoned else ""
            how += ", RL keywords" if args.rl else ""
            print(
                f"vocab-parallel: {ran} cases x {world} ranks (widths {widths}, {args.backend}, {args.device}{how}): "
                f"{status}",
                flush=True,
            )
    checks.exit_skipping_teardown(any_failed)


if __name__ == "__main__":
    main()
