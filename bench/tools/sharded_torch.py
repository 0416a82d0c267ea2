"""Vocab-parallel cross-entropy over the ranks of one host (torchrun, NCCL): fastce_torch with process_group= and
with a Shard(-1) DTensor against DTensor's loss_parallel() + F.cross_entropy, in the same run.

    torchrun --nproc-per-node 2 -m bench.tools.sharded_torch --json bench/results/<date>-h200x2-sharded-torch.json

Per global shape (bf16, V / ranks columns per rank), forward+backward on every rank: median time (CUDA events, L2
flushed), peak extra memory, the local three-pass floor, the all-reduces alone and fastce from a CUDA graph (every
rank's rows in the JSON). `--smoke`: CPU, gloo.
"""

import argparse
import contextlib
import os
import statistics
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastce_torch

from .. import envinfo, torch_measure
from ..report import write_json

IGNORE_INDEX = -100
CAPTURED = ("fastce_torch", "fastce_torch_dtensor")  # the implementations also timed from a CUDA graph


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)

    def median_ms(self, fn, warmup, reps):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.cuda:
                self.flush.zero_()
            times.append(torch_measure.timed(fn, self.cuda)[1])
        return statistics.median(times)


def peak_extra_bytes(fn, device):
    return torch_measure.peak_extra_bytes(fn) if device.type == "cuda" else None


def make_inputs(n_rows, vocab, dtype, device, seed=0):
    """Each rank's own columns as non-leaf logits (seeded by seed and rank); the same labels on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_vocab = vocab // world
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    anchor = torch.zeros((), dtype=dtype, device=device, requires_grad=True)
    logits = anchor.expand(n_rows, local_vocab).contiguous()
    with torch.no_grad():
        logits.normal_(generator=gen)
    label_gen = torch.Generator(device=device).manual_seed(seed)
    labels = torch.randint(0, vocab, (n_rows,), generator=label_gen, device=device)
    labels[::7] = IGNORE_INDEX
    return logits, labels


def implementations(mesh, backend):
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    group = dist.group.WORLD

    def fastce_process_group(logits, labels):
        return fastce_torch.cross_entropy(logits, labels, process_group=group, backend=backend)

    def to_dtensor(logits):
        return DTensor.from_local(logits, mesh, [Shard(1)], run_check=False)

    def fastce_dtensor(logits, labels):
        return fastce_torch.cross_entropy(to_dtensor(logits), labels, backend=backend)

    def torch_loss_parallel(logits, labels):
        # The backward must run under loss_parallel() too: the fwdbwd closure below keeps it open.
        return F.cross_entropy(to_dtensor(logits), labels, ignore_index=IGNORE_INDEX)

    return {"fastce_torch": (fastce_process_group, None), "fastce_torch_dtensor": (fastce_dtensor, None),
            "torch_loss_parallel": (torch_loss_parallel, loss_parallel)}  # fmt: skip


def measure_collectives(timer, n_rows, device, warmup, reps):
    group = dist.group.WORLD
    maxima = torch.randn(n_rows + 2, device=device)
    sums = torch.rand(2, n_rows, device=device)
    sums_smoothing = torch.rand(3, n_rows, device=device)

    def two_all_reduces(s):
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)

    return tuple(timer.median_ms(lambda s=s: two_all_reduces(s), warmup, reps) for s in (sums, sums_smoothing))


def run_shape(n_rows, vocab, dtype, device, timer, impls, warmup, reps, bandwidth):
    world = dist.get_world_size()
    local_vocab = vocab // world
    row = {"N": n_rows, "V": vocab, "V_local": local_vocab, "dtype": str(dtype).replace("torch.", ""), "impls": {}}
    floor_bytes = n_rows * local_vocab * torch.finfo(dtype).bits // 8 * 3
    row["floor_ms"] = floor_bytes / (bandwidth * 1e12) * 1e3 if bandwidth else None
    row["collectives_ms"], row["collectives_smoothing_ms"] = measure_collectives(timer, n_rows, device, warmup, reps)
    for name, (loss_fn, context) in impls.items():
        logits, labels = make_inputs(n_rows, vocab, dtype, device)

        def fwdbwd():
            with context() if context else contextlib.nullcontext():
                return torch.autograd.grad(loss_fn(logits, labels), logits)

        with torch.no_grad(), context() if context else contextlib.nullcontext():
            loss = loss_fn(logits, labels)
        loss = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        peak = peak_extra_bytes(fwdbwd, device)
        ms = timer.median_ms(fwdbwd, warmup, reps)
        row["impls"][name] = {"fwdbwd_ms": ms, "peak_extra_bytes": peak, "loss": loss}
        del logits, labels
        if name in CAPTURED and device.type == "cuda":
            row["impls"][name] |= torch_measure.measure_graph(
                loss_fn, None, inputs=lambda: make_inputs(n_rows, vocab, dtype, device),
                time_replays=lambda replay: timer.median_ms(replay, warmup, reps),
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def start(doc, shapes, warmup, reps, smoke_shapes):
    """The sharded torch benches' command line and this torchrun process's group, as a namespace: args, shapes (int
    tuples), device, rank, world, mesh (1-D), timer, smoke, backend, dtype. --smoke: gloo on CPU, smoke_shapes, one
    warm-up call, two timed, the plain-torch backend, float32; else NCCL, bf16."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--shapes", default=shapes, help="global sizes, comma-separated")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU processes (gloo), code paths only")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.warmup, args.reps = smoke_shapes, 1, 2
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return SimpleNamespace(
        args=args, shapes=[tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")],
        device=device, rank=dist.get_rank(), world=world, mesh=init_device_mesh(device.type, (world,)),
        timer=Timer(device), smoke=args.smoke, backend="reference" if args.smoke else "auto",
        dtype=torch.float32 if args.smoke else torch.bfloat16,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    )  # fmt: skip


def finish(run, doc, rows, report, **extra):
    """Every rank's rows to rank 0, which prints report(its rows) and writes the JSON record (`extra` fields
    after the rank count); then the ranks leave their groups."""
    every_rank = [None] * run.world
    dist.all_gather_object(every_rank, rows)
    if run.rank == 0:
        report(rows)
        if run.args.json:
            result = {"date": envinfo.today(), "commit": envinfo.git_commit(), "device": run.device_name,
                      "ranks": run.world, **extra, "versions": envinfo.versions(), "method": (doc or "").strip(),
                      "rows": rows, "per_rank": every_rank, "mode": "smoke" if run.smoke else "gpu"}  # fmt: skip
            print(f"wrote {write_json(result, run.args.json)}")
    if run.smoke:  # gloo (the CPU smoke run): its teardown sometimes aborts at exit after the results are written
        from fastce_torch.tests.checks import exit_skipping_teardown

        exit_skipping_teardown(False)
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()


def main():
    run = start(__doc__, "8192x128256,8192x256000", 5, 30, "16x64")
    timer, device = run.timer, run.device
    bandwidth = None if run.smoke else torch_measure.copy_bandwidth_TBps(time_ms=lambda c: timer.median_ms(c, 5, 20))
    impls = implementations(run.mesh, run.backend)
    if device.type == "cuda":
        torch_measure.prime_capture()
    rows = []
    for n_rows, vocab in run.shapes:
        if vocab % run.world:
            raise SystemExit(f"V={vocab} is not divisible by {run.world} ranks")
        warm = (run.args.warmup, run.args.reps, bandwidth)
        rows.append(run_shape(n_rows, vocab, run.dtype, device, timer, impls, *warm))

    def report(rows):
        print(f"{run.world} ranks, {run.device_name}" + (f", copy bandwidth {bandwidth:.2f} TB/s" if bandwidth else ""))
        for row in rows:
            print(f"N={row['N']} V={row['V']} (V_local={row['V_local']}): floor {row['floor_ms'] or 0:.3f} ms, "
                  f"collectives {row['collectives_ms']:.3f} ms ({row['collectives_smoothing_ms']:.3f} with "
                  "smoothing)")  # fmt: skip
            for name, r in row["impls"].items():
                peak = f"{r['peak_extra_bytes'] / 2**20:9.1f} MiB" if r["peak_extra_bytes"] is not None else ""
                target = (row["floor_ms"] or 0) + row["collectives_ms"]
                ratio = f"{r['fwdbwd_ms'] / target:5.2f}x floor+collectives" if row["floor_ms"] else ""
                print(f"  {name:<22}{r['fwdbwd_ms']:9.3f} ms {peak} {ratio}  loss {r['loss']:.6f}")
                if "fwdbwd_graph_ms" in r:
                    graph = r["fwdbwd_graph_ms"]
                    graph_ratio = f"{graph / target:5.2f}x floor+collectives" if graph and row["floor_ms"] else ""
                    text = f"{graph:9.3f} ms" if graph else f"not captured: {r['fwdbwd_graph_error'][:80]}"
                    print(f"    {'from a CUDA graph':<20}{text} {graph_ratio}")

    finish(run, __doc__, rows, report, copy_bandwidth_TBps=bandwidth)


if __name__ == "__main__":
    main()
