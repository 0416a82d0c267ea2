"""Can a Triton kernel run the fused linear loop's d weight product faster than cuBLAS at the chunk's short inner
dimension? `PYTHONPATH=. python -m bench.tools.dw_product_probe [--shapes VxHxK,...] [--configs ...]` (an H200:
1-2 minutes, most of it Triton compiles; `--compile-only` with TRITON_INTERPRET=0 compiles every config for sm_90
on any machine and prints ptxas's report).

Why: bench.tools.linear_profile shows fastce_torch's fused loop losing to the unfused path only in this product,
dW (V, H) += dlogits.T @ hidden_chunk, whose inner dimension K is the chunk's rows (1024 at V=128256, 512 at
V=256000 in the default 256 MiB workspace): cuBLAS's `addmm_` runs it at 482-599 TF/s there, against ~715 with all
rows, because every chunk re-reads and re-writes the whole V x H gradient (2·V·H·2 bytes for 2·K·V·H flops: at K=512
close to the H200's flop-per-byte ridge) and the C traffic is only partly hidden behind the short main loop.

`dw_product` computes the same tiles, accumulating in float32 and rounding once to dW's dtype; dW may be bfloat16
(the default accumulation: one rounding per chunk) or float32 (the accumulator of accumulate_in_float32). Three
schedules (SCHEDULES): one program per tile with the previous dW tile's load issued before the K loop ("prefetch",
so its latency overlaps the loop) or after it ("after"), or one or two persistent programs per SM striding over the
tiles in one flattened loop ("persistent", `tl.range(..., flatten=True)`: the compiler may pipeline the next tile's
loads under this tile's epilogue). Tiles walk the vocabulary-major order: the tiles of one V block (every H block)
run back to back, so that block of dlogits (K x BLOCK_M) is read from DRAM about once and the hidden chunk stays in
L2.

GPU mode times (do_bench medians, L2 flushed) per shape: cuBLAS `dW.addmm_(dlogits.t(), hidden)` (beta=1, what the
package runs), the same product with beta=0 (no C read), cuBLAS with a float32 C (`torch.addmm(..., out_dtype=
float32)`), and each Triton config in each schedule, bf16 and float32 C; TFLOP/s as 2·K·V·H. Every
Triton result is checked against the float32 sum of the same operands first (a mismatch is reported and counted).
`--loop` then times the whole fused loss (fastce_torch.linear_cross_entropy, forward+backward with both gradients,
default settings and accumulate_in_float32=True) at the fused linear bench's shapes with the package's d weight
product replaced by `dw_product` (`triton_d_weight`: fastce_torch.linear_cross_entropy.accumulate_grads patched for
the duration, nothing else changed), each shape with the fastest config the product timings found at its chunk
shape and schedule, against the package as it is, with both weight gradients' rms error against bench.linear's float32
computation: whether the kernel closes the fused loop's gap end to end.
bench/tests/test_dw_product_probe.py runs the kernel in Triton's interpreter with float32 operands (bf16 tl.dot is
wrong there).
"""

import argparse
import contextlib
import importlib

import torch

import fastce_torch  # before triton: on a machine without CUDA it selects Triton's interpreter

# isort: split
import triton
import triton.language as tl
from triton import knobs

from bench import envinfo
from bench.tools.gemm_ce_probe import (
    POINTER_TYPES,
    config_name,
    cuda_timer,
    finish,
    parse_configs,
    report_or_failure,
    sm90_report,
)
from shared_tests import tolerances

# V x H x K: the d weight products of the fused linear bench's shapes at the default workspace (K = chunk rows), and
# the 512 MiB one's K at V=256000.
DEFAULT_SHAPES = "128256x4096x1024,152064x3584x768,256000x2304x512,256000x2304x1024"
# BLOCK_M (over V) x BLOCK_N (over H) x BLOCK_K x num_warps x num_stages. `--compile-only` (sm_90, K=1024): the
# 128x256 and 256x128 tiles take one block per SM (147-197 KiB of shared memory, ~240-255 registers a thread, the
# prefetched C spilling); 128x128x64 with 8 warps at 3 stages (96 KiB, 126 registers without the prefetch) and
# 128x128x32 at 4 stages leave room for two blocks per SM, so one block's C traffic can overlap the other's loop.
DEFAULT_CONFIGS = "128x256x64x8x3,256x128x64x8x3,128x128x64x8x4,128x128x64x8x3,128x128x32x8x4,128x128x32x4x5"


# How the previous gradient tile is read and the tiles are scheduled: loaded before the K loop, loaded after it (one
# program per tile either way), or persistent programs striding over the tiles in one flattened loop.
SCHEDULES = ("prefetch", "after", "persistent")


def schedule_keywords(schedule, device="cuda"):
    """dw_product's prefetch_c / programs for a schedule; persistent: one program per SM (the flattened loop's extra
    buffers take 128 KiB of shared memory or more at the probe's tiles: one block per SM; `--compile-only` shows
    it), three programs in Triton's interpreter."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule != "persistent":
        return dict(prefetch_c=schedule == "prefetch", programs=None)
    if torch.device(device).type != "cuda":
        return dict(prefetch_c=False, programs=3)
    return dict(prefetch_c=False, programs=torch.cuda.get_device_properties(device).multi_processor_count)


@triton.jit
def _dw_tile(
    tile,
    a_ptr,
    b_ptr,
    c_ptr,
    V,
    H,
    K,
    stride_ak,
    stride_bk,
    stride_cv,
    n_tiles_h,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PREFETCH_C: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Vocabulary-major order: the H tiles of one V block run back to back (that block of dlogits stays in L2).
    pid_m = tile // n_tiles_h
    pid_n = tile % n_tiles_h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # vocabulary entries
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden units
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < V
    col_ok = cols < H
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cv + cols[None, :]
    c_mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE and PREFETCH_C:
        previous = tl.load(c_ptrs, mask=c_mask, other=0.0)
    # Loads wrap past the V and H edges back into range (no masks in the main loop); the store masks them.
    a_cols = rows % V
    b_cols = cols % H
    a_ptrs = a_ptr + ks.to(tl.int64)[:, None] * stride_ak + a_cols[None, :]
    b_ptrs = b_ptr + ks.to(tl.int64)[:, None] * stride_bk + b_cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=ks[:, None] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if ACCUMULATE:
        if not PREFETCH_C:
            previous = tl.load(c_ptrs, mask=c_mask, other=0.0)
        acc += previous.to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _dw_product_kernel(
    a_ptr,  # dlogits chunk (K, V), V contiguous
    b_ptr,  # hidden chunk (K, H), H contiguous
    c_ptr,  # dW (V, H), H contiguous: read (with ACCUMULATE) and written
    V,
    H,
    K,
    stride_ak,
    stride_bk,
    stride_cv,
    n_tiles_h,
    n_tiles,
    n_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PREFETCH_C: tl.constexpr,
    PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    pid = tl.program_id(0)
    if PERSISTENT:
        # n_programs programs walk the tiles in strides; the loop nest is flattened so that the compiler can pipeline
        # the next tile's loads under this tile's epilogue (the load and store of its gradient tile).
        for tile in tl.range(pid, n_tiles, n_programs, flatten=True):
            _dw_tile(tile, a_ptr, b_ptr, c_ptr, V, H, K, stride_ak, stride_bk, stride_cv, n_tiles_h, BLOCK_M, BLOCK_N,
                     BLOCK_K, EVEN_K, ACCUMULATE, PREFETCH_C, PRECISION)  # fmt: skip
    else:
        _dw_tile(pid, a_ptr, b_ptr, c_ptr, V, H, K, stride_ak, stride_bk, stride_cv, n_tiles_h, BLOCK_M, BLOCK_N,
                 BLOCK_K, EVEN_K, ACCUMULATE, PREFETCH_C, PRECISION)  # fmt: skip


def dw_product(dlogits, hidden, grad_weight, accumulate=True, prefetch_c=True, block_m=128, block_n=256, block_k=64,
               num_warps=8, num_stages=3, programs=None):  # fmt: skip
    """grad_weight (V, H) = [grad_weight +] dlogits.T @ hidden, accumulated in float32 and rounded once to
    grad_weight's dtype (bfloat16, float16 or float32), in place. dlogits (K, V) and hidden (K, H) share one 16- or
    32-bit float dtype; every last dimension contiguous. programs: None launches one program per tile; a number
    launches that many persistent programs (at most one per tile) that stride over the tiles in one flattened loop
    (the gradient tile is then loaded after the K loop, prefetch_c aside)."""
    if dlogits.dim() != 2 or hidden.dim() != 2 or dlogits.shape[0] != hidden.shape[0]:
        raise ValueError(f"need dlogits (K, V) and hidden (K, H), got {tuple(dlogits.shape)}, {tuple(hidden.shape)}")
    (k, v), h = dlogits.shape, hidden.shape[1]
    if grad_weight.shape != (v, h):
        raise ValueError(f"grad_weight must be ({v}, {h}), got {tuple(grad_weight.shape)}")
    if dlogits.dtype != hidden.dtype or grad_weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtypes: dlogits {dlogits.dtype}, hidden {hidden.dtype}, grad_weight {grad_weight.dtype}")
    if min(k, v, h) == 0:
        raise ValueError(f"empty operand: K={k}, V={v}, H={h}")
    if any(t.stride(1) != 1 for t in (dlogits, hidden, grad_weight)):
        raise ValueError("dlogits, hidden and grad_weight need a contiguous last dimension")
    n_tiles_h = triton.cdiv(h, block_n)
    n_tiles = triton.cdiv(v, block_m) * n_tiles_h
    persistent = programs is not None
    n_programs = min(int(programs), n_tiles) if persistent else n_tiles
    _dw_product_kernel[(n_programs,)](
        dlogits,
        hidden,
        grad_weight,
        v,
        h,
        k,
        dlogits.stride(0),
        hidden.stride(0),
        grad_weight.stride(0),
        n_tiles_h,
        n_tiles,
        n_programs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        ACCUMULATE=accumulate,
        PREFETCH_C=prefetch_c and not persistent,
        # float32 operands: full-precision products (tf32 would keep 10 mantissa bits); 16-bit ones: the default.
        PRECISION="ieee" if dlogits.dtype == torch.float32 else None,
        PERSISTENT=persistent,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return grad_weight


@contextlib.contextmanager
def triton_d_weight(config=None, schedule="prefetch"):
    """fastce_torch.linear_cross_entropy with its d weight product run by `dw_product` (config: dw_product's block
    keywords, None: its defaults; schedule: one of SCHEDULES) for the duration; d hidden and d bias as the package
    computes them."""
    # The module (the package exports the function under the same name).
    package = importlib.import_module("fastce_torch.linear.chunks")
    original = package.accumulate_grads
    config = config or {}
    keywords = None  # the schedule's keywords, from the first gradient's device

    def accumulate_grads(dlogits, hidden_chunk, weight, rows, grads, first):
        grad_hidden, grad_weight, grad_bias = grads
        original(dlogits, hidden_chunk, weight, rows, (grad_hidden, None, grad_bias), first)
        if grad_weight is not None:
            nonlocal keywords
            keywords = keywords or schedule_keywords(schedule, grad_weight.device)
            # The first chunk writes the gradient (its storage is uninitialised): no read of the previous tile.
            dw_product(dlogits, hidden_chunk, grad_weight, accumulate=not first, **keywords, **config)

    package.accumulate_grads = accumulate_grads
    try:
        yield
    finally:
        package.accumulate_grads = original


def compile_report(config, shape, c_dtype="bfloat16", schedule="prefetch", dtype="bfloat16"):
    """`sm90_report` of the kernel as a launch at shape (V, H, K) with `schedule` specialises it."""
    v, h, k = shape
    n_tiles_h = triton.cdiv(h, config["block_n"])
    n_tiles = triton.cdiv(v, config["block_m"]) * n_tiles_h
    values = dict(V=v, H=h, K=k, stride_ak=v, stride_bk=h, stride_cv=h, n_tiles_h=n_tiles_h, n_tiles=n_tiles,
                  n_programs=132 if schedule == "persistent" else n_tiles)  # fmt: skip
    constexprs = dict(
        BLOCK_M=config["block_m"],
        BLOCK_N=config["block_n"],
        BLOCK_K=config["block_k"],
        EVEN_K=k % config["block_k"] == 0,
        ACCUMULATE=True,
        PREFETCH_C=schedule == "prefetch",
        PRECISION="ieee" if dtype == "float32" else None,
        PERSISTENT=schedule == "persistent",
    )
    pointers = dict(a_ptr=POINTER_TYPES[dtype], b_ptr=POINTER_TYPES[dtype], c_ptr=POINTER_TYPES[c_dtype])
    return sm90_report(_dw_product_kernel, values, constexprs, pointers, config["num_warps"], config["num_stages"])


def product_bound(dlogits, hidden):
    """How far a float32-accumulated dlogits.T @ hidden may be from the exact sum, per element: K eps32 (|a|.T @ |b|)
    (products of 16-bit values are exact in float32; each addition rounds)."""
    return dlogits.shape[0] * tolerances.EPS32 * (dlogits.float().abs().t() @ hidden.float().abs())


def out_of_bound(got, expected, bound):
    """How many elements of got (rounded once to its dtype from a float32 sum within `bound` of the exact one) are
    further from `expected` (float64, exact) than twice the bound plus one ulp of got's dtype at the larger
    magnitude; written so that NaN counts."""
    got64, expected64 = got.double(), expected.double()
    magnitude = torch.maximum(got64.abs(), expected64.abs()).clamp_min(torch.finfo(torch.float32).tiny)
    bits = tolerances.MANTISSA_BITS[tolerances.dtype_name(got.dtype)]
    allowed = torch.exp2(torch.floor(torch.log2(magnitude)) - bits) + 2 * bound.double()
    return int((~((got64 - expected64).abs() <= allowed)).sum())


def parse_shapes(text):
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            v, h, k = (int(x) for x in item.lower().split("x"))
        except ValueError:
            message = f"shape must be VxHxK (vocab x hidden x chunk rows), got {item!r}"
            raise argparse.ArgumentTypeError(message) from None
        if min(v, h, k) <= 0:
            raise argparse.ArgumentTypeError(f"shape dimensions must be positive, got {item!r}")
        shapes.append((v, h, k))
    return shapes


def run_probe(shapes, configs, seed=0, device="cuda", dtype=torch.bfloat16, timer=None):
    """Check, then time (timer(fn) -> ms), every variant at every shape (V, H, K); prints a line per timing and
    returns (results, number of failed checks)."""
    results, failures = {"shapes": []}, 0
    for v, h, k in shapes:
        torch.manual_seed(seed)
        # dlogits as the CE backward leaves them: mostly tiny softmax probabilities, -1/N-sized at the labels.
        dlogits = (torch.randn(k, v, device=device) * 1e-4).to(dtype)
        hidden = torch.randn(k, h, device=device).to(dtype)
        start = torch.randn(v, h, device=device) * 1e-3
        product = dlogits.double().t() @ hidden.double()
        bound = product_bound(dlogits, hidden)
        flops = 2 * k * v * h
        entry = {"V": v, "H": h, "K": k, "timings_ms": {}, "checks": {}, "variants": []}
        results["shapes"].append(entry)
        print(f"dw_product_probe V={v} H={h} K={k} {dtype}, {flops / 1e12:.3f} TFLOP per product", flush=True)

        def line(name, fn, entry=entry, flops=flops):
            ms = timer(fn)
            entry["timings_ms"][name] = ms
            print(f"  {name:46s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
            return ms

        grad16 = start.to(dtype)
        grad32 = start.clone()
        line("cuBLAS addmm_ (beta=1), the package's", lambda: grad16.addmm_(dlogits.t(), hidden))
        line("cuBLAS mm (beta=0), no C read", lambda: torch.mm(dlogits.t(), hidden, out=grad16))
        if dlogits.is_cuda:
            line(
                "cuBLAS addmm, float32 C (beta=1)",
                lambda: torch.addmm(grad32, dlogits.t(), hidden, out_dtype=torch.float32, out=grad32),
            )
        for config in configs:
            for c_dtype in dict.fromkeys((dtype, torch.float32)):  # the operands' dtype, and float32
                for schedule in SCHEDULES:
                    keywords = schedule_keywords(schedule, device)
                    name = f"{config_name(config)} C {tolerances.dtype_name(c_dtype)} {schedule}"
                    grad = start.to(c_dtype)
                    # The float32 sum of the previous value (exact in float32) and the product rounds once more.
                    exact = grad.double() + product
                    allowed = bound + grad.float().abs() * tolerances.EPS32
                    try:
                        dw_product(dlogits, hidden, grad, **keywords, **config)
                    except Exception as error:  # a config that does not fit is reported, not fatal
                        entry["checks"][name] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:100]}"
                        print(f"  {name}: {entry['checks'][name]}", flush=True)
                        continue
                    outside = out_of_bound(grad, exact, allowed)
                    failures += outside > 0
                    entry["checks"][name] = f"{outside} elements beyond the bound"
                    if outside:
                        print(f"  {name}: MISMATCH, {outside} elements beyond the bound", flush=True)
                        continue
                    ms = line(name, lambda grad=grad, config=config, keywords=keywords: dw_product(
                        dlogits, hidden, grad, **keywords, **config))  # fmt: skip
                    entry["variants"].append(
                        dict(config=config, c_dtype=tolerances.dtype_name(c_dtype), schedule=schedule, ms=ms)
                    )
        del dlogits, hidden, start, product, bound, grad16, grad32
    return results, failures


def fastest_variants(results):
    """{(V, H, K, gradient dtype name): the fastest checked variant} from run_probe's results."""
    best = {}
    for entry in results["shapes"]:
        for variant in entry["variants"]:
            key = (entry["V"], entry["H"], entry["K"], variant["c_dtype"])
            if key not in best or variant["ms"] < best[key]["ms"]:
                best[key] = variant
    return best


def run_loop(shapes, best, timer, device="cuda", **base_settings):
    """The whole fused loss at each LinearShape, the package against the package with `triton_d_weight` (the fastest
    variant in `best` at the shape's chunk rows, else dw_product's defaults), at its default settings and with
    accumulate_in_float32: times (timer) and weight-gradient rms errors against bench.linear's float32 computation.
    Returns (rows, number of failed checks): a failed check is an error more than 1.25x the package's + 1e-4.
    base_settings: more keywords of every call (the CPU test's backend and chunk rows)."""
    from bench import linear as linear_bench
    from fastce_torch.linear import rows_per_chunk

    linear_bench.DEVICE = device
    rows_out, failures = [], 0
    for shape in shapes:
        inputs = linear_bench.make_inputs(shape)
        hidden, weight, labels = inputs
        reference = linear_bench.float32_reference(hidden, weight, labels)
        k = rows_per_chunk(shape.N, shape.V, hidden.element_size(), chunk_rows=base_settings.get("chunk_rows"))
        for settings, c_dtype in (({}, shape.dtype), ({"accumulate_in_float32": True}, "float32")):
            variant = best.get((shape.V, shape.H, k, c_dtype), {"config": {}, "schedule": "prefetch"})

            def loss_fn(h, w, y, settings=settings):
                return fastce_torch.linear_cross_entropy(h, w, y, **base_settings, **settings)

            def step(loss_fn=loss_fn):
                return torch.autograd.grad(loss_fn(hidden, weight, labels), (hidden, weight))

            package_ms = timer(step)
            package_error = linear_bench.gradient_errors(loss_fn, inputs, reference)["grad_weight_rel_rms"]
            with triton_d_weight(variant["config"], variant["schedule"]):
                triton_ms = timer(step)
                triton_error = linear_bench.gradient_errors(loss_fn, inputs, reference)["grad_weight_rel_rms"]
            bad = not triton_error <= 1.25 * package_error + 1e-4  # NaN fails
            failures += bad
            name = "default" if not settings else "accumulate_in_float32"
            row = dict(shape=[shape.N, shape.H, shape.V], settings=name, chunk_rows=k, package_ms=package_ms,
                       triton_ms=triton_ms, package_dw_error=package_error, triton_dw_error=triton_error,
                       config=variant["config"], schedule=variant["schedule"])  # fmt: skip
            rows_out.append(row)
            print(
                f"loop {shape} {name:22s} K={k}: package {package_ms:8.2f} ms (dW err {package_error:.2e}), "
                f"Triton d weight {triton_ms:8.2f} ms (dW err {triton_error:.2e})" + (" MISMATCH" if bad else ""),
                flush=True,
            )
        del inputs, hidden, weight, labels, reference
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows_out, failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES), help="VxHxK,...")
    parser.add_argument("--configs", type=parse_configs, default=parse_configs(DEFAULT_CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the timings and checks to this file")
    parser.add_argument(
        "--loop",
        action="store_true",
        help="then time the whole fused loss at the fused linear bench's shapes with the fastest variant per shape",
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="no GPU needed: compile each config for sm_90 (TRITON_INTERPRET=0) and print what ptxas reports",
    )
    args = parser.parse_args(argv)
    if args.compile_only:
        if knobs.runtime.interpret:
            raise SystemExit("Triton is in interpreter mode: run with TRITON_INTERPRET=0 to compile for sm_90")
        shape = args.shapes[0]
        for config in args.configs:
            for c_dtype in ("bfloat16", "float32"):
                for schedule in SCHEDULES:
                    report = report_or_failure(lambda: compile_report(config, shape, c_dtype, schedule))
                    print(f"{config_name(config)} C {c_dtype} {schedule}: {report}", flush=True)
        return
    timer = cuda_timer("dw_product_probe")
    results, failures = run_probe(args.shapes, args.configs, args.seed, timer=timer)
    results.update(device=torch.cuda.get_device_name(), date=envinfo.today(), commit=envinfo.git_commit())
    if args.loop:
        from bench.linear_shapes import LINEAR_SHAPES

        loop_timer = cuda_timer("dw_product_probe", warmup=100, rep=500)
        results["loop"], loop_failures = run_loop(LINEAR_SHAPES, fastest_variants(results), loop_timer)
        failures += loop_failures
    finish(results, failures, args.json)


if __name__ == "__main__":
    main()
