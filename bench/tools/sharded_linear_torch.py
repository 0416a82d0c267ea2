"""Fused linear cross-entropy with a sharded LM head over the ranks of one host (torchrun, NCCL): fastce_torch's
column-parallel (process_group=) and FSDP2 (Shard(0) DTensor weight) paths against the same loss on one GPU and
DTensor's column-parallel F.linear + loss_parallel() F.cross_entropy, in the same run.

    torchrun --nproc-per-node 2 -m bench.tools.sharded_linear_torch --json bench/results/<date>-h200x2-linear.json

Per global shape NxHxV (bf16): one_gpu, tp, tp_dtensor_loss_parallel, fsdp and the collectives alone, timed as in
sharded_torch. `--smoke`: CPU processes, code paths only.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastce_torch

from .sharded_torch import finish, peak_extra_bytes, start

IGNORE_INDEX = -100


def make_inputs(n_rows, width, vocab, dtype, device, seed=0):
    """The same full hidden, weight and labels on every rank (seeded): each implementation takes its share."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n_rows, width, generator=gen, device=device, dtype=dtype)
    weight = torch.randn(vocab, width, generator=gen, device=device, dtype=dtype) * width**-0.5
    labels = torch.randint(0, vocab, (n_rows,), generator=gen, device=device)
    labels[::7] = IGNORE_INDEX
    return hidden, weight, labels


def implementations(mesh, backend, hidden, weight, labels):
    """name -> (fwdbwd closure returning the loss and gradients, context or None)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    local_vocab = weight.shape[0] // world
    group = dist.group.WORLD
    full_h, full_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    tp_h = hidden.clone().requires_grad_()
    tp_w = weight[rank * local_vocab : (rank + 1) * local_vocab].clone().requires_grad_()
    dt_w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    rows = torch.arange(hidden.shape[0], device=hidden.device).tensor_split(world)[rank]
    dp_h, dp_y = hidden[rows].clone().requires_grad_(), labels[rows]

    def one_gpu():
        loss = fastce_torch.linear_cross_entropy(full_h, full_w, labels, backend=backend)
        return loss, torch.autograd.grad(loss, (full_h, full_w))

    def tp():
        loss = fastce_torch.linear_cross_entropy(tp_h, tp_w, labels, backend=backend, process_group=group)
        return loss, torch.autograd.grad(loss, (tp_h, tp_w))

    def tp_dtensor_loss_parallel():
        with loss_parallel():
            h = DTensor.from_local(tp_h, mesh, [Replicate()], run_check=False)
            loss = F.cross_entropy(F.linear(h, dt_w), labels, ignore_index=IGNORE_INDEX)
            return loss.full_tensor(), torch.autograd.grad(loss, (tp_h, dt_w))

    def fsdp():
        loss = fastce_torch.linear_cross_entropy(dp_h, dt_w, dp_y, backend=backend)
        return loss, torch.autograd.grad(loss, (dp_h, dt_w))

    return {"one_gpu": one_gpu, "tp": tp, "tp_dtensor_loss_parallel": tp_dtensor_loss_parallel, "fsdp": fsdp}


def measure_collectives(timer, hidden, weight, warmup, reps):
    world = dist.get_world_size()
    grad_hidden = torch.empty_like(hidden)
    shard = weight[: weight.shape[0] // world].contiguous()
    gathered = torch.empty_like(weight[: shard.shape[0] * world])
    ms = lambda fn: timer.median_ms(fn, warmup, reps)
    return {"tp_grad_hidden_all_reduce_ms": ms(lambda: dist.all_reduce(grad_hidden)),
            "fsdp_weight_all_gather_ms": ms(lambda: dist.all_gather_into_tensor(gathered, shard)),
            "fsdp_grad_reduce_scatter_ms": ms(lambda: dist.reduce_scatter_tensor(shard, gathered))}  # fmt: skip


def run_shape(n_rows, width, vocab, dtype, device, timer, mesh, backend, warmup, reps):
    hidden, weight, labels = make_inputs(n_rows, width, vocab, dtype, device)
    row = {"N": n_rows, "H": width, "V": vocab, "dtype": str(dtype).replace("torch.", ""), "impls": {}}
    row["collectives"] = measure_collectives(timer, hidden, weight, warmup, reps)
    for name, fwdbwd in implementations(mesh, backend, hidden, weight, labels).items():
        loss = float(fwdbwd()[0].detach())
        peak = peak_extra_bytes(fwdbwd, device)
        ms = timer.median_ms(fwdbwd, warmup, reps)
        row["impls"][name] = {"fwdbwd_ms": ms, "peak_extra_bytes": peak, "loss": loss}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def main():
    run = start(__doc__, "8192x4096x128256,8192x4096x256000", 3, 15, "16x8x64")
    rows = []
    for n_rows, width, vocab in run.shapes:
        if vocab % run.world or n_rows % run.world:
            raise SystemExit(f"N={n_rows} and V={vocab} must be divisible by {run.world} ranks")
        warm = (run.args.warmup, run.args.reps)
        rows.append(run_shape(n_rows, width, vocab, run.dtype, run.device, run.timer, run.mesh, run.backend, *warm))

    def report(rows):
        print(f"{run.world} ranks, {run.device_name}")
        for row in rows:
            collectives = ", ".join(f"{k} {v:.3f}" for k, v in row["collectives"].items())
            print(f"N={row['N']} H={row['H']} V={row['V']}: {collectives}")
            for name, r in row["impls"].items():
                peak = f"{r['peak_extra_bytes'] / 2**20:9.1f} MiB" if r["peak_extra_bytes"] is not None else ""
                print(f"  {name:<26}{r['fwdbwd_ms']:9.3f} ms {peak}  loss {r['loss']:.6f}")

    finish(run, __doc__, rows, report)


if __name__ == "__main__":
    main()
