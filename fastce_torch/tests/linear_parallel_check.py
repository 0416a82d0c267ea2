"""Sharded-head linear_cross_entropy against the float64 reference, one process per rank (torch.distributed.run):

    python -m torch.distributed.run --standalone --nproc-per-node 3 -m fastce_torch.tests.linear_parallel_check \\
        --mode tp --backend reference
    torchrun --nproc-per-node 2 -m fastce_torch.tests.linear_parallel_check --mode fsdp --device cuda --size mid

Every rank makes the same full inputs (shared_tests/test_linear_cross_entropy.py's cases, seeded) and checks its
result with that file's float64 reference and tolerances (check_result) on the full head:
- tp: a column-parallel head, `process_group=` with this rank's weight rows (and bias entries); equal widths
  without vocab_start, an uneven split with it. The loss (the same bits on every rank), d hidden (summed over the
  ranks) and the gathered d weight / d bias.
- dtensor-tp: hidden a Replicate DTensor, weight (and bias) Shard(0) DTensors: the same numbers, the gradients
  DTensors placed like their inputs.
- fsdp: the weight a Shard(0) DTensor, each rank its own rows (data parallel): rank r's objective is R times its
  share, so that the weight's gradient (averaged over the ranks, as FSDP2 averages) is that of the whole batch;
  then the same under a real fully_shard(lm_head) against calling lm_head and cross_entropy.
The tp mode's refusals, extra outputs, RL keywords and linear_log_probs are linear_parallel_outputs.py. Exit status
0 only when every case passed on every rank.
"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import fastce_torch
from fastce_torch.distributed import linear_sharded as fastce_linear_sharded
from fastce_torch.tests import checks
from fastce_torch.tests.linear_parallel_outputs import run_outputs, run_refusals, run_rl_outputs
from shared_tests import test_linear_cross_entropy as lin
from shared_tests.reference import Options

TP_CASES = (
    "mean,mean-bias,sum,sum-n_items,mean-n_items-tensor,none,none-3d,softcap-scaling,smoothing-zloss,"
    "none-all-options,ignore-index-is-a-class,ignore-7-sum-n_items,all-ignored,bad-label,bad-label-none,"
    "strided-3d-int32,bf16,bf16-none-softcap"
)
MID = [
    lin.LinearCase("mid-bf16", shape=(2048,), width=512, vocab=32768, dtype="bfloat16", bias=True),
    lin.LinearCase(
        "mid-none-f32",
        shape=(1024,),
        width=256,
        vocab=50000,
        reduction="none",
        opts=Options(logit_softcapping=30.0, label_smoothing=0.1, z_loss=1e-4),
    ),  # fmt: skip
]


def selected(only, size):
    if size == "mid":
        return MID
    names = (only or TP_CASES).split(",")
    by_name = {case.name: case for case in lin.CASES}
    return [by_name[name] for name in names]


def chunked(case):
    """The case and how many chunks bound its weight gradient's roundings: the small cases with
    lin.CHUNK_ROWS_SMALL rows per chunk; the mid ones at the default workspace, counting every rank's chunks
    (tp: the rows against V / ranks columns; fsdp: N / ranks rows against V, the ranks' gradients summed)."""
    if not case.name.startswith("mid"):
        return lin.small_chunks(case)
    from fastce_torch.linear.engine import rows_per_chunk

    world, n_rows = dist.get_world_size(), case.shape[0]
    itemsize = lin.TORCH_DTYPES[case.dtype].itemsize
    tp = -(-n_rows // rows_per_chunk(n_rows, -(-case.vocab // world), itemsize))
    mine = -(-n_rows // world)
    fsdp = world * -(-mine // rows_per_chunk(mine, case.vocab, itemsize))
    return case, max(tp, fsdp)


def assembled(local, rows_or_slice, full_shape, group=None):
    """The full tensor from every rank's piece (zeros elsewhere, summed over the ranks: NaN survives)."""
    full = torch.zeros(full_shape, dtype=torch.float64, device=local.device)
    full[rows_or_slice] = local.detach().double()
    dist.all_reduce(full, group=group)
    return full


def run_tp(case, device, backend, mode, hv=False):
    """hv: the rank's slice as an (H, V_local) kernel with weight_layout="hv" (process_group only)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case, chunks = chunked(case)
    inputs = lin.make_inputs(case, device)
    hidden, weight, bias, labels, upstream, n_items = inputs
    vocab = weight.shape[0]
    if mode == "dtensor-tp":
        chunk = -(-vocab // world)
        start, stop, vocab_start = min(rank * chunk, vocab), min((rank + 1) * chunk, vocab), None
    elif vocab % world == 0:
        width = vocab // world
        start, stop, vocab_start = rank * width, (rank + 1) * width, None
    else:  # uneven: the first V % R ranks one row more, explicit offsets
        bounds = [i * vocab // world for i in range(world + 1)]
        start, stop = bounds[rank], bounds[rank + 1]
        vocab_start = start
    h = hidden.detach().clone().requires_grad_()
    w = weight[start:stop].detach().clone()
    w = (w.t().contiguous() if hv else w).requires_grad_()
    b = None if bias is None else bias[start:stop].detach().clone().requires_grad_()
    kwargs = lin.kwargs_of(case, n_items)
    if mode == "dtensor-tp":
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,))
        hd = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
        wd = torch.distributed.tensor.distribute_tensor(weight.detach().clone(), mesh, [Shard(0)])
        wd.requires_grad_()
        bd = None
        if bias is not None:
            bd = torch.distributed.tensor.distribute_tensor(bias.detach().clone(), mesh, [Shard(0)])
            bd.requires_grad_()
        loss = fastce_torch.linear_cross_entropy(hd, wd, labels, bias=bd, backend=backend, **kwargs)
        assert isinstance(loss, DTensor) and loss.placements == (Replicate(),), type(loss)
        (loss.to_local() * upstream).sum().backward()
        assert wd.grad.placements == (Shard(0),) and wd.grad.shape == weight.shape
        assert h.grad is not None
        loss = loss.to_local()
        grad_w, grad_b = wd.grad.full_tensor(), None if bd is None else bd.grad.full_tensor()
        try:  # an (H, V) DTensor kernel is refused, naming the keyword (nothing communicated before)
            fastce_torch.linear_cross_entropy(hd, wd, labels, weight_layout="hv")
        except NotImplementedError as caught:
            assert "weight_layout" in str(caught), caught
        else:
            raise AssertionError('weight_layout="hv" with DTensors was not refused')
    else:
        group = dist.group.WORLD
        if hv:
            kwargs["weight_layout"] = "hv"
        loss = fastce_torch.linear_cross_entropy(
            h, w, labels, bias=b, backend=backend, process_group=group, vocab_start=vocab_start, **kwargs
        )
        (loss * upstream).sum().backward()
        assert w.grad.shape == w.shape and w.grad.is_contiguous()
        grad_w = assembled(w.grad.t() if hv else w.grad, slice(start, stop), weight.shape)
        grad_b = None if b is None else assembled(b.grad, slice(start, stop), bias.shape)
    losses = [torch.empty_like(loss) for _ in range(world)]
    dist.all_gather(losses, loss.detach().contiguous())
    assert all(torch.equal(x, loss) or torch.equal(x.isnan(), loss.isnan()) for x in losses), "ranks differ"
    lin.check_result(case, inputs, (loss.detach(), [h.grad, grad_w, grad_b]), chunks)


def run_fsdp_rl(device, backend):
    """A Shard(0) DTensor weight (data parallel) with issue 37's keywords: each rank's loss, outputs and d hidden
    are those of the gathered weight, its weight gradient the ranks' average."""
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,))
    gen = torch.Generator().manual_seed(200 + dist.get_rank())  # each rank its own batch
    width, vocab, n_rows = 8, 6 * world, 7
    weight = torch.randn(vocab, width, generator=torch.Generator().manual_seed(3)).to(device)
    hidden = torch.randn(n_rows, width, generator=gen).to(device)
    labels = torch.randint(0, vocab, (n_rows,), generator=gen).to(device)
    labels[::3] = -100
    options = dict(temperature=0.6, token_weights=torch.randn(n_rows, generator=gen).to(device), return_entropy=True,
                   backend=backend, chunk_rows=3)  # fmt: skip
    results = []
    for sharded in (False, True):
        h = hidden.clone().requires_grad_()
        w = distribute_tensor(weight.clone(), mesh, [Shard(0)]) if sharded else weight.clone()
        w.requires_grad_()
        out = fastce_torch.linear_cross_entropy(h, w, labels, **options)
        (out.loss - 0.1 * out.entropy).backward()
        grad_w = w.grad.full_tensor() if sharded else w.grad / world
        if not sharded:
            dist.all_reduce(grad_w)
        results.append([out.loss.detach(), out.entropy.detach(), h.grad, grad_w])
    for got, want in zip(*reversed(results)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def run_fsdp(case, device, backend):
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    case, chunks = chunked(case)
    inputs = lin.make_inputs(case, device)
    hidden, weight, bias, labels, upstream, n_items = inputs
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,))
    n_rows, width = labels.numel(), hidden.shape[-1]
    rows = torch.arange(n_rows).tensor_split(world)[rank].to(device)
    h = hidden.reshape(n_rows, width)[rows].detach().clone().requires_grad_()
    y = labels.reshape(-1)[rows]
    wd = distribute_tensor(weight.detach().clone(), mesh, [Shard(0)]).requires_grad_()
    bd = None if bias is None else distribute_tensor(bias.detach().clone(), mesh, [Shard(0)]).requires_grad_()
    loss = fastce_torch.linear_cross_entropy(h, wd, y, bias=bd, backend=backend, **lin.kwargs_of(case, n_items))
    # The whole batch's objective is the sum of the ranks' (n_items fixes the "mean" divisor): rank r's gradient
    # of R times its share, averaged over the ranks, is the whole batch's.
    weights = upstream.reshape(-1)[rows] if case.reduction == "none" else upstream
    (loss * weights * world).sum().backward()
    assert wd.grad.placements == (Shard(0),) and wd.grad.shape == weight.shape, wd.grad
    if case.reduction == "none":
        full_loss = assembled(loss, rows, (n_rows,)).reshape(labels.shape)
    else:
        full_loss = loss.detach().double().clone()
        dist.all_reduce(full_loss)
    grad_h = (assembled(h.grad, rows, (n_rows, width)) / world).reshape(hidden.shape)
    grads = [grad_h, wd.grad.full_tensor(), None if bd is None else bd.grad.full_tensor()]
    lin.check_result(case, inputs, (full_loss, grads), chunks)


def run_fully_shard(device, backend, bias):
    """A real fully_shard(lm_head): linear_cross_entropy on lm_head.weight (the sharded DTensor) against calling
    lm_head and fastce cross_entropy, both under FSDP2: the same loss and the same sharded gradients."""
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,))
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own batch
    width, vocab, n_rows = 16, 37, 9
    x = torch.randn(n_rows, width, generator=gen).to(device)
    y = torch.randint(0, vocab, (n_rows,), generator=gen).to(device)
    y[::4] = -100

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(width, width)
            self.lm_head = torch.nn.Linear(width, vocab, bias=bias)

        def forward(self, x, y, fused):
            hidden = torch.tanh(self.body(x))
            if fused:
                assert fastce_torch.core.options.is_dtensor(self.lm_head.weight)  # what a fused loss sees here
                return fastce_torch.linear_cross_entropy(
                    hidden, self.lm_head.weight, y, bias=self.lm_head.bias, backend=backend, label_smoothing=0.1
                )
            return fastce_torch.cross_entropy(self.lm_head(hidden), y, backend=backend, label_smoothing=0.1)

    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = Model().to(device)
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = model(x, y, fused)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    for name, grad in grads_a.items():
        other = grads_b[name]
        assert other.placements == grad.placements, (name, other.placements, grad.placements)
        torch.testing.assert_close(other.full_tensor(), grad.full_tensor(), rtol=1e-4, atol=1e-6, msg=name)


def run_segment(args, device, rank):
    """Every case of one argument set: the number that failed on this rank."""
    failures = 0
    cases = selected(args.only, args.size)
    if args.mode == "fsdp":
        cases = [c for c in cases if c.reduction != "mean" or c.n_items is not None]
    for case in cases:
        try:
            if args.mode == "fsdp":
                run_fsdp(case, device, args.backend)
            else:
                run_tp(case, device, args.backend, args.mode)
            print(f"{case.id}: ok", flush=True)
        except Exception as error:  # noqa: BLE001 - every case reported, then the exit status
            failures += 1
            print(f"FAIL {case.id} (rank {rank}): {type(error).__name__}: {error}", flush=True)
    if args.mode == "tp" and args.size == "small":
        try:
            run_refusals(device, args.backend)
            print("refusals: ok", flush=True)
            for case in selected("mean-bias,none-all-options", "small"):  # weight_layout="hv": (H, V_local)
                run_tp(case, device, args.backend, args.mode, hv=True)
                print(f"hv-{case.id}: ok", flush=True)
            for reduction in ("mean", "sum", "none"):
                run_outputs(device, args.backend, reduction)
                print(f"outputs-{reduction}: ok", flush=True)
                run_rl_outputs(device, args.backend, reduction)
                print(f"rl-outputs-{reduction}: ok", flush=True)
        except Exception as error:  # noqa: BLE001
            failures += 1
            print(f"FAIL refusals (rank {rank}): {type(error).__name__}: {error}", flush=True)
    if args.mode == "fsdp" and args.size == "small":
        try:
            run_fsdp_rl(device, args.backend)
            print("fsdp-rl: ok", flush=True)
        except Exception as error:  # noqa: BLE001
            failures += 1
            print(f"FAIL fsdp-rl (rank {rank}): {type(error).__name__}: {error}", flush=True)
        for bias in (False, True):
            try:
                run_fully_shard(device, args.backend, bias)
                print(f"fully_shard-bias={bias}: ok", flush=True)
            except Exception as error:  # noqa: BLE001
                failures += 1
                print(f"FAIL fully_shard-bias={bias} (rank {rank}): {type(error).__name__}: {error}", flush=True)
    return failures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("tp", "dtensor-tp", "fsdp"), default="tp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--size", choices=("small", "mid"), default="small")
    parser.add_argument("--only", default=None)
    segments = checks.argument_sets(parser, sys.argv[1:])  # `--then` between sets, one summary line each
    rank = int(os.environ["RANK"])
    if segments[0].device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
    torch.backends.cuda.matmul.allow_tf32 = False
    any_failed = False
    initial_seed = torch.initial_seed()
    for args in segments:
        # Each set starts as in a fresh process: the global generator as it started (run_refusals draws its labels
        # from it, and an fsdp set draws a different amount on each rank), no dynamo cache, and no widths
        # remembered as verified by the sharded head (the first call per (group, width) gathers every rank's width:
        # run_refusals' unequal widths would otherwise gather on the rank with the new width only, and hang).
        torch.manual_seed(initial_seed)
        torch._dynamo.reset()
        fastce_linear_sharded.VERIFIED_WIDTHS.clear()
        total = torch.tensor([run_segment(args, device, rank)], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        any_failed = any_failed or total.item() != 0
        if rank == 0:
            status = "ok" if total.item() == 0 else "FAILED"
            print(f"linear-parallel {args.mode} {args.backend}: {status}", flush=True)
    checks.exit_skipping_teardown(any_failed)


if __name__ == "__main__":
    main()
