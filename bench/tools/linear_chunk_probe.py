"""What one chunk of fastce_torch's fused linear cross-entropy costs, operation by operation, on a GPU:
`PYTHONPATH=. python -m bench.tools.linear_chunk_probe [--shape 8192x4096x128256] [--rows 1024]` (~15 s on an H200).

Each operation of the chunk loop (the logits matmul into the workspace, the CE forward and in-place backward kernels,
the dh matmul, the dW accumulation) is timed alone (do_bench medians, L2 flushed between repeats), beside the
variants of the dW product that the accumulation could use instead (beta=0, a float32 output with and without
beta=1, an (H, V)-major product): the sum of a chunk's operations times the chunk count, set against the loop's
measured time in `python -m bench --linear`, tells whether the loop loses its time in an operation or between them.
Times of single operations are burst rates: a loop of back-to-back matmuls runs at the card's sustained rate.

`--overlap` times whole loops over all N rows instead (a candidate design for the fused loss, not what the package
does): the serial loop as the package runs it (one stream, one workspace), the same with two workspaces where the
memory-bound CE kernels of chunk i run on a second stream while the compute stream runs chunk i+1's logits matmul
(events order the two; the workspace chunk i+1 writes was last read by chunk i-1's dh and dW products, earlier on the
compute stream), and the three matmuls alone (no CE: the floor of any schedule of these products). dh and dW of the
overlapped loop must equal the serial loop's bitwise (the same products in the same order on the same buffers);
`chunk_loops` runs on a CPU too (no streams there), which is what bench/tests checks.
"""

import argparse
import contextlib

import torch
import triton.testing

from fastce_torch import kernels
from fastce_torch.linear.chunks import accumulate_grads


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


def chunk_loops(hidden, weight, labels, chunk, options=None):
    """(serial, overlapped, matmuls_only): three callables that each run the whole fused loop over hidden's rows and
    return (dh, dW); the overlapped one uses two workspaces and, on CUDA, a second stream for the CE kernels."""
    options = kernels.Options() if options is None else options
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    workspaces = [torch.empty(chunk, vocab, device=device, dtype=hidden.dtype) for _ in range(2)]
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.empty_like(weight)
    one = torch.ones((), device=device)
    starts = list(range(0, n_rows, chunk))
    cuda = device.type == "cuda"
    ce_stream = torch.cuda.Stream(device) if cuda else None

    def logits_into(i):
        rows = slice(starts[i], starts[i] + chunk)
        out = workspaces[i % 2][: hidden[rows].shape[0]]
        torch.matmul(hidden[rows], weight.t(), out=out)
        return rows, out

    def ce_in_place(out, rows):
        _, lse, denominator = kernels.forward(out, labels[rows], options, reduction="mean")
        kernels.backward(one, out, labels[rows], lse, out, options, denominator=denominator)

    def products(i, out, rows):  # the package's own dh and dW products (beta=0 on the first chunk)
        accumulate_grads(out, hidden[rows], weight, rows, (grad_hidden, grad_weight, None), first=i == 0)

    def serial():
        for i in range(len(starts)):
            rows, out = logits_into(i)
            ce_in_place(out, rows)
            products(i, out, rows)
        return grad_hidden, grad_weight

    def matmuls_only():
        for i in range(len(starts)):
            rows, out = logits_into(i)
            products(i, out, rows)
        return grad_hidden, grad_weight

    def on_ce_stream():
        return torch.cuda.stream(ce_stream) if cuda else contextlib.nullcontext()

    def written():  # an event after what was just issued on the current stream
        if not cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def overlapped():
        pending = [(*logits_into(0), written())]
        for i in range(len(starts)):
            rows, out, logits_done = pending.pop()
            with on_ce_stream():
                if cuda:
                    ce_stream.wait_event(logits_done)
                ce_in_place(out, rows)
                ce_done = written()
            if i + 1 < len(starts):
                # Chunk i+1's logits go to the other workspace, whose last readers (chunk i-1's products) are
                # earlier on this stream; this matmul runs while chunk i's CE kernels do.
                pending.append((*logits_into(i + 1), written()))
            if cuda:
                torch.cuda.current_stream(device).wait_event(ce_done)
            products(i, out, rows)
        return grad_hidden, grad_weight

    return serial, overlapped, matmuls_only


def overlap_ms(n_rows, hidden_size, vocab, chunk, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    hidden = torch.randn(n_rows, hidden_size, device="cuda", dtype=dtype) * 0.05
    weight = torch.randn(vocab, hidden_size, device="cuda", dtype=dtype) * 0.05
    labels = torch.randint(0, vocab, (n_rows,), device="cuda")
    serial, overlapped, matmuls_only = chunk_loops(hidden, weight, labels, chunk)
    expected = [t.clone() for t in serial()]
    got = overlapped()
    same = all(torch.equal(a, b) for a, b in zip(got, expected))
    times = {
        name: triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        for name, fn in (("serial loop", serial), ("overlapped loop", overlapped), ("matmuls only", matmuls_only))
    }
    return times, same


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
    parser.add_argument("--overlap", action="store_true", help="whole loops: serial, overlapped CE, matmuls only")
    args = parser.parse_args()
    n_rows, hidden_size, vocab = (int(x) for x in args.shape.split("x"))
    if args.overlap:
        times, same = overlap_ms(n_rows, hidden_size, vocab, args.rows)
        print(f"{args.shape} bf16, {args.rows}-row chunks (two workspaces for the overlapped loop):")
        for name, ms in times.items():
            print(f"{name:44s} {ms:7.3f} ms  {ms / times['matmuls only']:.3f}x the matmuls alone")
        print(f"overlapped dh, dW == serial bitwise: {same}")
        return
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
