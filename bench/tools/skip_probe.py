"""Does skip_ignored_rows pay, and does fastce_jax's per-chunk lax.cond hold the host? On a GPU:
`PYTHONPATH=. python -m bench.tools.skip_probe [--shape 8192x4096x128256] [--ignored 0,0.5,0.9] [--package both]`
(~2 min on an H200 at the default shape).

For each fraction of ignored labels (bench.linear_shapes.ignored_rows: every 1024-row sequence starts with its
ignored part) and each package, forward + backward (gradients for hidden and weight, "mean") with and without
skip_ignored_rows=True: the time per call, and for JAX also the host time until the call returns (dispatch). JAX
dispatches asynchronously: a call that returns long before the GPU is done holds no host synchronisation; a
dispatch time close to the whole step's time with the keyword (and not without it) says XLA's conditional waits on
the host for its predicate, once per chunk (XLA's ConditionalThunk does that outside a command buffer). Run it
again with XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE
(the loop and its conditionals as CUDA-graph nodes) to see whether that removes the wait. The torch rows synchronise
by design (one nonzero per call).
"""

import argparse
import statistics
import time

from bench import jax_setup
from bench.linear_shapes import LinearShape, ignored_rows, parse_ignored, parse_linear_shapes


def torch_rows(shape, fractions):
    import torch
    import triton.testing

    import fastce_torch
    from bench import linear

    rows = []
    for fraction in fractions:
        s = LinearShape(shape.N, shape.H, shape.V, shape.dtype, fraction)
        hidden, weight, labels = linear.make_inputs(s)
        for skip in (False, True):

            def step(skip=skip):
                loss = fastce_torch.linear_cross_entropy(hidden, weight, labels, skip_ignored_rows=skip)
                return torch.autograd.grad(loss, (hidden, weight))

            step()
            ms = triton.testing.do_bench(step, warmup=50, rep=500)
            rows.append(("fastce_torch", fraction, skip, ms, None))
            print(f"fastce_torch {s} skip={skip}: {ms:.2f} ms", flush=True)
        del hidden, weight, labels
        torch.cuda.empty_cache()
    return rows


def jax_rows(shape, fractions, calls=20):
    import jax

    import fastce_jax
    from bench import jax_linear

    rows = []
    for fraction in fractions:
        s = LinearShape(shape.N, shape.H, shape.V, shape.dtype, fraction)
        hidden, weight, labels = jax_linear.make_inputs(s)
        for skip in (False, True):

            def loss(h, w, skip=skip):
                return fastce_jax.linear_cross_entropy(h, w, labels, skip_ignored_rows=skip)

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            jax.block_until_ready(step(hidden, weight))
            dispatch, total = [], []
            for _ in range(calls):
                t0 = time.perf_counter()
                out = step(hidden, weight)
                t1 = time.perf_counter()
                jax.block_until_ready(out)
                t2 = time.perf_counter()
                dispatch.append((t1 - t0) * 1e3)
                total.append((t2 - t0) * 1e3)
            ms, host = statistics.median(total), statistics.median(dispatch)
            rows.append(("fastce_jax", fraction, skip, ms, host))
            print(f"fastce_jax {s} skip={skip}: {ms:.2f} ms, the call returned after {host:.2f} ms", flush=True)
        del hidden, weight, labels
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8192x4096x128256", help="NxHxV[:dtype]")
    parser.add_argument("--ignored", default="0,0.5,0.9", type=parse_ignored)
    parser.add_argument("--package", choices=("torch", "jax", "both"), default="both")
    args = parser.parse_args(argv)
    jax_setup.configure()
    (shape,) = parse_linear_shapes(args.shape)
    rows = []
    if args.package in ("torch", "both"):
        rows += torch_rows(shape, args.ignored)
    if args.package in ("jax", "both"):
        rows += jax_rows(shape, args.ignored)
    print(f"\n{shape}, fwd+bwd 'mean'\n")
    print("| package | ignored | skip_ignored_rows | ms | JAX call returned after (ms) |\n|---|---|---|---|---|")
    for package, fraction, skip, ms, host in rows:
        kept = 1.0 - float(ignored_rows(LinearShape(shape.N, 1, 1, ignored=fraction)).mean())
        host_cell = "-" if host is None else f"{host:.2f}"
        print(f"| {package} | {1 - kept:.0%} | {skip} | {ms:.2f} | {host_cell} |")


if __name__ == "__main__":
    main()
