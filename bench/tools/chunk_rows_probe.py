"""Would another chunk-rows multiple make fastce_torch's fused linear cross-entropy faster at its default workspace?
`PYTHONPATH=. python -m bench.tools.chunk_rows_probe [--json F]` (a GPU; ~1-2 min on an H200).

The default splits the rows into as few chunks as 256 MiB of logits allows, each a multiple of ROWS_MULTIPLE (128)
rows. A smaller multiple can save a chunk (at 8192 x 3584 x 152064: 11 chunks of <= 768 rows at 128, 10 of <= 832
at 64), and with it one pass over the weight gradient (V x H read and written by each chunk's addmm_), at the price
of matmuls whose row count is not a whole number of 128-row tiles. Each shape is timed (forward + backward, do_bench
median) at the rows the default's rule gives for each multiple, all within the same workspace budget, beside the
unfused matmul + fastce_torch.cross_entropy of the same run.
"""

import argparse
import importlib
import math

import torch

import fastce_torch
from bench import envinfo
from bench.linear_shapes import LINEAR_SHAPES
from bench.tools.gemm_ce_probe import cuda_timer, finish

# The module, not the function of the same name that the package exports.
linear_module = importlib.import_module("fastce_torch.linear.chunks")

MULTIPLES = (128, 256, 64, 32)  # the package's first: a shape where another multiple changes nothing is timed once


def rows_for_multiple(n_rows, vocab, itemsize, multiple):
    """The default rule's chunk rows (rows_per_chunk with its 256 MiB budget) had ROWS_MULTIPLE been `multiple`."""
    saved = linear_module.ROWS_MULTIPLE
    linear_module.ROWS_MULTIPLE = multiple
    try:
        return linear_module.rows_per_chunk(n_rows, vocab, itemsize)
    finally:
        linear_module.ROWS_MULTIPLE = saved


def candidates(shape, itemsize=2):
    """{multiple: (rows, chunks)} for one shape, only the multiples whose rows differ from a larger multiple's."""
    out, seen = {}, set()
    for multiple in MULTIPLES:
        rows = rows_for_multiple(shape.N, shape.V, itemsize, multiple)
        if rows not in seen:
            seen.add(rows)
            out[multiple] = (rows, math.ceil(shape.N / rows))
    return out


def time_shape(shape, timer):
    torch.manual_seed(0)
    dtype = getattr(torch, shape.dtype)
    hidden = (torch.randn(shape.N, shape.H, device="cuda", dtype=dtype) * 0.05).requires_grad_()
    weight = (torch.randn(shape.V, shape.H, device="cuda", dtype=dtype) * 0.05).requires_grad_()
    labels = torch.randint(0, shape.V, (shape.N,), device="cuda")

    def fused(chunk_rows):
        loss = fastce_torch.linear_cross_entropy(hidden, weight, labels, chunk_rows=chunk_rows)
        return torch.autograd.grad(loss, (hidden, weight))

    def unfused():
        loss = fastce_torch.cross_entropy(hidden @ weight.t(), labels)
        return torch.autograd.grad(loss, (hidden, weight))

    rows = {}
    for multiple, (chunk_rows, chunks) in candidates(shape, hidden.element_size()).items():
        rows[multiple] = {"chunk_rows": chunk_rows, "chunks": chunks, "ms": timer(lambda r=chunk_rows: fused(r))}
    unfused_ms = timer(unfused)
    return {"shape": f"{shape.N}x{shape.H}x{shape.V}", "multiples": rows, "unfused_ms": unfused_ms}


def format_row(result):
    default = result["multiples"][linear_module.ROWS_MULTIPLE]["ms"]
    cells = [
        f"x{m}: {r['chunk_rows']} rows / {r['chunks']} chunks {r['ms']:.2f} ms ({r['ms'] / default:.3f})"
        for m, r in result["multiples"].items()
    ]
    return f"{result['shape']}: " + "; ".join(cells) + f"; unfused {result['unfused_ms']:.2f} ms"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    timer = cuda_timer("chunk_rows_probe", rep=200)
    results = []
    for shape in LINEAR_SHAPES:
        results.append(time_shape(shape, timer))
        print(format_row(results[-1]), flush=True)
    device = {"device": torch.cuda.get_device_name(), "date": envinfo.today(), "commit": envinfo.git_commit()}
    finish(device | {"results": results}, 0, args.json)


if __name__ == "__main__":
    main()
