"""What one chunk of fastce_torch's fused linear cross-entropy costs, operation by operation, on a GPU:
`PYTHONPATH=. python -m bench.tools.linear_chunk_probe [--shape 8192x4096x128256] [--rows 1024]` (~15 s on an H200).

Each operation of the chunk loop (the logits matmul into the workspace, the CE forward and in-place backward kernels,
the dh matmul, the dW accumulation) is timed alone (do_bench medians, L2 flushed between repeats), beside the
variants of the dW product that the accumulation could use instead (beta=0, a float32 output with and without
beta=1, an (H, V)-major product): the sum of a chunk's operations times the chunk count, set against the loop's
measured time in `python -m bench --linear`, tells whether the loop loses its time in an operation or between them.
Times of single operations are burst rates: a loop of back-to-back matmuls runs at the card's sustained rate.
"""

import argparse

import torch
import triton.testing

from fastce_torch import kernels


def per_op_ms(n_rows, hidden_size, vocab, chunk, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    device = "cuda"
    hidden = torch.randn(n_rows, hidden_size, device=device, dtype=dtype) * 0.05
    weight = torch.randn(vocab, hidden_size, device=device, dtype=dtype) * 0.05
    labels = torch.randint(0, vocab, (n_rows,), device=device)
    workspace = torch.empty(chunk, vocab, device=device, dtype=dtype)
    grad_weight = torch.zeros(vocab, hidden_size, device=device, dtype=dtype)
    grad_weight32 = torch.zeros(vocab, hidden_size, device=device, dtype=torch.float32)
    grad_hidden = torch.empty(n_rows, hidden_size, device=device, dtype=dtype)
    hidden_chunk, labels_chunk = hidden[:chunk], labels[:chunk]
    options = kernels.Options()
    one = torch.ones((), device=device)
    torch.matmul(hidden_chunk, weight.t(), out=workspace)
    _, lse, denominator = kernels.forward(workspace, labels_chunk, options, reduction="mean")
    dlogits_vk = workspace.t().contiguous()
    ops = {
        "logits matmul into the workspace": lambda: torch.matmul(hidden_chunk, weight.t(), out=workspace),
        "CE forward kernel": lambda: kernels.forward(workspace, labels_chunk, options, reduction="mean"),
        "CE backward kernel, in place": lambda: kernels.backward(
            one, workspace, labels_chunk, lse, workspace, options, denominator=denominator
        ),
        "dh matmul into dh[rows]": lambda: torch.matmul(workspace, weight, out=grad_hidden[:chunk]),
        "dW addmm_, dtype of the weight (beta=1)": lambda: grad_weight.addmm_(workspace.t(), hidden_chunk),
        "dW product, beta=0": lambda: torch.matmul(workspace.t(), hidden_chunk, out=grad_weight),
        "dW addmm, float32 output (beta=1)": lambda: torch.addmm(
            grad_weight32, workspace.t(), hidden_chunk, out_dtype=torch.float32, out=grad_weight32
        ),
        "dW mm, float32 output, beta=0": lambda: torch.mm(workspace.t(), hidden_chunk, out_dtype=torch.float32),
        "dW addmm_, (V, K)-contiguous dlogits": lambda: grad_weight.addmm_(dlogits_vk, hidden_chunk),
        "dW as (H, V): hidden^T @ dlogits": lambda: grad_weight.view(hidden_size, vocab).addmm_(
            hidden_chunk.t(), workspace
        ),
    }
    return {name: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for name, fn in ops.items()}


LOOP = (
    "logits matmul into the workspace",
    "CE forward kernel",
    "CE backward kernel, in place",
    "dh matmul into dh[rows]",
    "dW addmm_, dtype of the weight (beta=1)",
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x4096x128256", help="N x H x V")
    parser.add_argument("--rows", type=int, default=1024, help="rows per chunk")
    args = parser.parse_args()
    n_rows, hidden_size, vocab = (int(x) for x in args.shape.split("x"))
    times = per_op_ms(n_rows, hidden_size, vocab, args.rows)
    flops = 2 * args.rows * hidden_size * vocab
    for name, ms in times.items():
        rate = f"{flops / ms / 1e9:6.0f} TFLOP/s" if "matmul" in name or "dW" in name else ""
        print(f"{name:44s} {ms:7.3f} ms {rate}")
    chunk_ms = sum(times[name] for name in LOOP)
    n_chunks = -(-n_rows // args.rows)
    print(f"one chunk of the default loop {chunk_ms:.3f} ms; x {n_chunks} chunks = {chunk_ms * n_chunks:.2f} ms")


if __name__ == "__main__":
    main()
