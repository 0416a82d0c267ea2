"""One cross-entropy forward written for Pallas' Mosaic GPU backend (plgpu), timed against fastce_jax's
Pallas-Triton forward and a copy-bandwidth floor on the same GPU: `PYTHONPATH=. python -m bench.tools.mosaic_ce_probe`.

The Mosaic GPU kernel (plgpu.kernel): one program per block of 64 rows (one warpgroup); an emit_pipeline streams
(64, TILE) bf16 tiles of the logits through shared memory (TMA, several stages in flight) and the body keeps the online
logsumexp (running max, rescaled sum) and the label's logit as row vectors in registers (the pipeline's carry, in the
row layout of the WGMMA register layout). Out: the float32 loss and lse per row, what fastce_jax's forward returns.
Only the plain loss (no options, no ignore_index handling): enough to compare the memory-bound core.

Timing: each candidate runs 20 times inside one jitted fori_loop (the labels shifted per step so no call is hoisted);
the median over 7 loops of the loop's wall time / 20 is the device time per call (host dispatch is outside the
loop). The floor: the copy bandwidth, the faster of torch's device copy (CUDA events) and a bf16 elementwise pass in
the same kind of loop, over the logits' bytes; the one-pass floor is the logits' bytes read once at that bandwidth.
Needs a Hopper GPU and jax with Mosaic GPU (run on the H200 machine with jax 0.11.2: docs/jax-backends.md has the
numbers; jax 0.12 should work: plgpu.load has no index argument there, handled in _load); prints JSON lines.
"""

import inspect
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU for the copy floor

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS_PER_PROGRAM = 64  # one warpgroup's WGMMA register layout covers 64 rows


def _load(ref, layout, optimized=True):
    # jax 0.10 requires the index argument, 0.11 deprecates passing one, 0.12 has none
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def mosaic_forward(logits, labels, tile=256, stages=4):
    """(loss, lse) float32 (N,) of bf16 logits (N, V), int32 labels (N,); N % 64 == 0 and V % tile == 0."""
    n, vocab = logits.shape
    rows = ROWS_PER_PROGRAM
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(logits_gmem, labels_gmem, loss_gmem, lse_gmem):
        these_rows = pl.ds(lax.axis_index("rows") * rows, rows)
        label = _load(labels_gmem.at[these_rows], row_layout, optimized=False)
        neg_inf = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout)
        zero = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout)

        def step(indices, tile_smem, carry):
            running_max, running_sum, label_logit = carry
            (j,) = indices
            x = _load(tile_smem, plgpu.Layout.WGMMA).astype(jnp.float32)
            new_max = jnp.maximum(running_max, jnp.max(x, axis=1))
            shifted = jnp.exp(x - lax.broadcast_in_dim(new_max, x.shape, [0]))
            running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(shifted, axis=1)
            columns = plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=plgpu.Layout.WGMMA) + j * tile
            hit = columns == lax.broadcast_in_dim(label, x.shape, [0])
            label_logit = label_logit + jnp.sum(jnp.where(hit, x, 0.0), axis=1)
            return new_max, running_sum, label_logit

        running_max, running_sum, label_logit = plgpu.emit_pipeline(
            step,
            grid=(vocab // tile,),
            in_specs=[plgpu.BlockSpec((rows, tile), lambda j: (0, j), transforms=transforms)],
            max_concurrent_steps=stages,
            init_carry=(neg_inf, zero, zero),
        )(logits_gmem.at[these_rows])
        lse = running_max + jnp.log(running_sum)
        lse_gmem[these_rows] = lse
        loss_gmem[these_rows] = lse - label_logit

    # plgpu.kernel (a mesh of programs), not pl.pallas_call: on jax 0.11.2, pallas_call with Mosaic GPU's
    # CompilerParams found no lowering rule (an AssertionError in pallas_call's gpu_lowering).
    out = jax.ShapeDtypeStruct((n,), jnp.float32)
    return plgpu.kernel(
        kernel,
        out_type=(out, out),
        grid=(n // rows,),
        grid_names=("rows",),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(logits, labels)


def triton_forward(logits, labels):
    from fastce_jax import kernels
    from fastce_jax.contract import Options

    loss, lse = kernels.forward(logits, labels, Options(), interpret=False)[:2]
    return loss, lse


def reference(logits, labels):
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    return lse - jnp.take_along_axis(x, labels[:, None], axis=-1)[:, 0], lse


def loop_ms(fn, logits, labels, steps=20, repeats=7):
    vocab = logits.shape[1]

    @jax.jit
    def many(x, y):
        def body(i, acc):
            loss, lse = fn(x, (y + i) % vocab)
            return acc + loss + lse

        return lax.fori_loop(0, steps, body, jnp.zeros(y.shape, jnp.float32))

    jax.block_until_ready(many(logits, labels))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(many(logits, labels))
        times.append((time.perf_counter() - start) * 1e3 / steps)
    return statistics.median(times)


def copy_ms(logits, steps=20, repeats=7):
    @jax.jit
    def many(x):
        def body(i, y):
            return x + (i % 2).astype(x.dtype)

        return lax.fori_loop(0, steps, body, x)

    jax.block_until_ready(many(logits))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(many(logits))
        times.append((time.perf_counter() - start) * 1e3 / steps)
    return statistics.median(times)


def torch_copy_ms(nbytes, repeats=7, steps=20):
    """The repo's floor method (bench/NOTES.md): torch's device-to-device copy of that many bytes, CUDA events."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times)


def _diagnose_backend():
    """Which Pallas GPU lowering the installed jax has for Mosaic GPU's CompilerParams (a probe's first question)."""
    import importlib

    found = {}
    for module in ("jax._src.pallas.mosaic_gpu.pallas_call_registration", "jax.experimental.mosaic.gpu"):
        try:
            importlib.import_module(module)
            found[module] = "imported"
        except Exception as error:
            found[module] = f"{type(error).__name__}: {error}"
    from jax._src.pallas import core as pallas_core

    found["rule"] = repr(pallas_core.get_lowering_rule(plgpu.CompilerParams, "gpu"))
    return found


def main():
    shapes = [(128, 1024), (8192, 128256), (8192, 32000)]
    configs = [(256, 4), (128, 6), (256, 3)]
    print(json.dumps({"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}), flush=True)
    print(json.dumps(_diagnose_backend()), flush=True)
    for n, vocab in shapes:
        key = jax.random.key(0)
        logits = (jax.random.normal(key, (n, vocab), jnp.float32) * 2).astype(jnp.bfloat16)
        labels = jax.random.randint(jax.random.key(1), (n,), 0, vocab, jnp.int32)
        want_loss, want_lse = reference(logits, labels)
        xla_copy = copy_ms(logits)
        torch_copy = torch_copy_ms(logits.nbytes)
        copy = min(xla_copy, torch_copy)
        bandwidth = 2 * logits.nbytes / (copy * 1e-3)
        floor = logits.nbytes / bandwidth * 1e3
        row = {"shape": [n, vocab], "xla_copy_ms": round(xla_copy, 4), "torch_copy_ms": round(torch_copy, 4)}
        row["copy_TBps"] = round(bandwidth / 1e12, 3)
        row["one_pass_floor_ms"] = round(floor, 4)
        candidates = {"pallas_triton (fastce_jax.kernels.forward)": triton_forward}
        for tile, stages in configs:
            if vocab % tile == 0:
                candidates[f"mosaic_gpu tile={tile} stages={stages}"] = lambda x, y, t=tile, s=stages: mosaic_forward(
                    x, y, t, s
                )
        for name, fn in candidates.items():
            try:
                loss, lse = jax.jit(fn)(logits, labels)
                err = float(jnp.max(jnp.abs(loss - want_loss)))
                err_lse = float(jnp.max(jnp.abs(lse - want_lse)))
                ms = loop_ms(fn, logits, labels)
                row[name] = {
                    "ms": round(ms, 4),
                    "x_floor": round(ms / floor, 3),
                    "max_err_loss": err,
                    "max_err_lse": err_lse,
                }
            except Exception as error:  # a probe: report the failure and go on
                row[name] = {
                    "error": f"{type(error).__name__}: {str(error)[:800]}",
                    "where": traceback.format_exc()[-2500:],
                }
            print(json.dumps({name: row[name]}), flush=True)
        print(json.dumps(row), flush=True)
        del logits
    return 0


if __name__ == "__main__":
    sys.exit(main())
