"""Sweep fastce_torch's tile sizes and warps on the GPU: `PYTHONPATH=. python -m bench.tools.tune_kernels`.

Prints, per shape, the forward and backward kernel times for each candidate against the same run's copy bandwidth,
so the constants at the top of fastce_torch/kernels.py can be chosen from measurements.
"""

import argparse
import itertools
import json

import torch
import triton.testing

from fastce_torch import kernels

from ..torch_measure import copy_bandwidth_TBps

SHAPES = [(8192, 32000), (8192, 128256), (8192, 256000), (512, 256000)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_TBps()
    print(f"copy bandwidth {bandwidth:.2f} TB/s")
    rows = []
    for n_rows, vocab in SHAPES:
        logits = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16)
        labels = torch.randint(0, vocab, (n_rows,), device="cuda")
        labels[::7] = -100
        grad_loss = torch.ones((), device="cuda").expand(n_rows)
        one_pass_ms = logits.numel() * 2 / bandwidth / 1e9
        options = kernels.Options()
        for block, warps, chunk, stages in itertools.product(
            [2048, 4096, 8192], [2, 4, 8], [8192, 16384, 65536], [1, 3]
        ):
            kernels.FORWARD_BLOCK, kernels.CHUNK, kernels.FORWARD_STAGES = block, max(chunk, block), stages
            kernels.FORWARD_WARPS = warps
            ms = triton.testing.do_bench(lambda: kernels.forward(logits, labels, options), return_mode="median")
            rows.append(
                dict(
                    kernel="forward",
                    N=n_rows,
                    V=vocab,
                    block=block,
                    warps=warps,
                    chunk=chunk,
                    stages=stages,
                    ms=ms,
                    ratio=ms / one_pass_ms,
                )
            )
        _, lse, _ = kernels.forward(logits, labels, options)
        for block, warps in itertools.product([1024, 2048, 4096, 8192], [4, 8]):
            kernels.BACKWARD_BLOCK, kernels.BACKWARD_WARPS = block, warps
            ms = triton.testing.do_bench(
                lambda: kernels.backward(grad_loss, logits, labels, lse, logits, options), return_mode="median"
            )
            rows.append(
                dict(
                    kernel="backward",
                    N=n_rows,
                    V=vocab,
                    block=block,
                    warps=warps,
                    chunk=0,
                    ms=ms,
                    ratio=ms / (2 * one_pass_ms),
                )
            )
        del logits
        for kernel in ("forward", "backward"):
            best = sorted(
                (r for r in rows if r["kernel"] == kernel and r["V"] == vocab and r["N"] == n_rows),
                key=lambda r: r["ms"],
            )[:4]
            for r in best:
                print(
                    f"{kernel:8s} N={n_rows} V={vocab} block={r['block']} warps={r['warps']} chunk={r['chunk']} "
                    f"stages={r.get('stages', '-')}: "
                    f"{r['ms']:.3f} ms = {r['ratio']:.2f}x floor"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bandwidth_TBps=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
