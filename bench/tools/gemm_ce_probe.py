"""Can a Triton GEMM with the CE forward in its epilogue replace cuBLAS's logits matmul + fastce's CE forward kernel
for one chunk of the fused linear loss? `PYTHONPATH=. python -m bench.tools.gemm_ce_probe [--shape 1024x4096x128256]
[--configs 128x256x64x8x3,...]` (an H200: 1-2 minutes, most of it Triton compiles;
`--compile-only` with TRITON_INTERPRET=0 compiles the configs for sm_90 on any machine and prints ptxas's report).

One chunk of fastce_torch.linear_cross_entropy computes logits = hidden_chunk @ weight.T into a workspace (cuBLAS),
then the CE forward kernel reads the workspace once for the per-row logsumexp and the label's logit. Here
`gemm_ce` computes the same product tile by tile (fp32 accumulation), stores it rounded to the inputs' dtype (the
workspace the backward still needs) and, while the tile is in registers, writes per (row, column tile) the tile's
max and sum of exp(c - max) of the *rounded* values (what a CE forward over the stored logits would compute) and,
in the one tile that holds a row's label, the label's logit. `combine` turns the partials into per-row lse and the
plain CE loss (no options; ignore_index -100 rows give loss 0 and lse -inf, a label outside [0, V) gives NaN, as
fastce's kernels do). The same kernel without the epilogue (WITH_CE=False) separates Triton's GEMM efficiency from
the epilogue's cost.

GPU mode times (do_bench medians): (a) torch.matmul into a workspace, alone and + fastce's CE forward kernel;
(b) gemm_ce alone (no CE), and gemm_ce + combine, for each block config; TFLOP/s counted as 2*M*K*V flops. It
checks (b)'s loss against fastce's CE forward over (b)'s own logits (the epilogue's correctness; float32 tolerance)
and against (a)'s loss (cuBLAS's and Triton's products may round a logit to adjacent bf16 values: a looser bound).
Module level imports no GPU: the kernels are dtype-generic, and bench/tests/test_gemm_ce_probe.py runs them in
Triton's interpreter with float32 inputs (bf16 tl.dot is wrong in the interpreter).
"""

import argparse
import json

import torch

import fastce_torch  # noqa: F401  (before triton: on a machine without CUDA it selects Triton's interpreter)

# isort: split
import triton
import triton.language as tl
from triton import knobs

from shared_tests import tolerances

DEFAULT_SHAPE = "1024x4096x128256"
# BLOCK_M x BLOCK_N x BLOCK_K x num_warps x num_stages. 128x256 and 256x128 at 4 stages take 192 KiB of the H200's
# 227 KiB of shared memory per block (--compile-only reports it); a config that fails to launch is reported, not fatal.
DEFAULT_CONFIGS = "128x256x64x8x3,128x256x64x8x4,128x128x64x8x3,128x128x64x8x4,256x128x64x8x3,256x128x64x8x4"
GROUP_M = 8  # row tiles that share a column tile of B back to back (B is read from DRAM about once)
IGNORE_INDEX = -100


@triton.jit
def _gemm_ce_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    labels_ptr,
    part_max_ptr,
    part_sum_ptr,
    z_label_ptr,
    M,
    V,
    K,
    stride_am,
    stride_bv,
    stride_cm,
    n_tiles_v,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    WITH_CE: tl.constexpr,
):
    # Grouped order: GROUP row tiles walk the same column tiles one after the other, so a tile of B (the weight,
    # the large operand) is still in L2 when the next row tile needs it.
    pid = tl.program_id(0)
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP * n_tiles_v
    first_m = (pid // per_group) * GROUP
    group_rows = min(n_tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Loads wrap rows and columns past the edge back into range (no masks in the main loop); the epilogue masks them.
    a_rows = (rows % M).to(tl.int64)
    b_cols = (cols % V).to(tl.int64)
    # K is the contiguous dimension of both operands (the launcher makes sure): the loads vectorise along it.
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + b_cols[None, :] * stride_bv + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    c = acc.to(c_ptr.dtype.element_ty)
    row_ok = rows < M
    col_ok = cols < V
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, c, mask=row_ok[:, None] & col_ok[None, :])
    if WITH_CE:
        # The statistics of the stored (rounded) values, so they equal a CE forward's over the workspace.
        z = tl.where(col_ok[None, :], c.to(tl.float32), -float("inf"))
        tile_max = tl.max(z, 1)  # finite: every tile has at least one column < V
        tile_sum = tl.sum(tl.exp(z - tile_max[:, None]), 1)
        part = rows.to(tl.int64) * n_tiles_v + pid_n
        tl.store(part_max_ptr + part, tile_max, mask=row_ok)
        tl.store(part_sum_ptr + part, tile_sum, mask=row_ok)
        labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        here = (labels >= pid_n * BLOCK_N) & (labels < pid_n * BLOCK_N + BLOCK_N) & (labels < V)
        z_label = tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), 1)
        tl.store(z_label_ptr + rows, z_label, mask=row_ok & here)


@triton.jit
def _combine_kernel(
    part_max_ptr,
    part_sum_ptr,
    z_label_ptr,
    labels_ptr,
    lse_ptr,
    loss_ptr,
    V,
    n_tiles_v,
    ignore_index,
    TILES_BLOCK: tl.constexpr,
):
    # One program per row: the row's tiles' (max, sum of exp) pairs give its logsumexp.
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, TILES_BLOCK)
    ok = tiles < n_tiles_v
    part_max = tl.load(part_max_ptr + row * n_tiles_v + tiles, mask=ok, other=-float("inf"))
    part_sum = tl.load(part_sum_ptr + row * n_tiles_v + tiles, mask=ok, other=0.0)
    row_max = tl.max(part_max, 0)
    lse = row_max + tl.log(tl.sum(part_sum * tl.exp(part_max - row_max), 0))
    label = tl.load(labels_ptr + row)
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < V)
    # z_label was written only by the tile holding an in-range label: read it only then.
    z_label = tl.load(z_label_ptr + row, mask=in_range, other=0.0)
    loss = tl.where(in_range, lse - z_label, float("nan"))
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))
    tl.store(lse_ptr + row, tl.where(ignored, -float("inf"), lse))


def gemm_ce(a, b, labels, block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, with_ce=True):
    """C = a @ b.T in a's dtype (fp32 accumulation) and, with with_ce, the per-tile CE partials of C's rounded values:
    returns (c, part_max (M, T) float32, part_sum (M, T) float32, z_label (M,) float32), T = cdiv(V, block_n);
    z_label holds the label's logit only for labels in [0, V) (other entries unwritten). a (M, K), b (V, K),
    labels (M,) integer, all on one device."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"need a (M, K) and b (V, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"a and b must share one of float32, bfloat16, float16; got {a.dtype} and {b.dtype}")
    if labels.shape != (a.shape[0],) or labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"labels must be int32/int64 of shape ({a.shape[0]},), got {labels.dtype} {tuple(labels.shape)}"
        )
    (m, k), v = a.shape, b.shape[0]
    if m == 0 or v == 0 or k == 0:
        raise ValueError(f"empty operand: M={m}, V={v}, K={k}")
    a, b = (x if x.stride(1) == 1 else x.contiguous() for x in (a, b))
    n_tiles_v = triton.cdiv(v, block_n)
    c = torch.empty(m, v, device=a.device, dtype=a.dtype)
    part_max = torch.empty(m, n_tiles_v, device=a.device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    z_label = torch.empty(m, device=a.device, dtype=torch.float32)
    grid = (triton.cdiv(m, block_m) * n_tiles_v,)
    _gemm_ce_kernel[grid](
        a,
        b,
        c,
        labels,
        part_max,
        part_sum,
        z_label,
        m,
        v,
        k,
        a.stride(0),
        b.stride(0),
        c.stride(0),
        n_tiles_v,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP=GROUP_M,
        EVEN_K=k % block_k == 0,
        # float32 operands: full-precision products (tf32 would keep 10 mantissa bits); 16-bit ones: the default.
        PRECISION="ieee" if a.dtype == torch.float32 else None,
        WITH_CE=with_ce,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return c, part_max, part_sum, z_label


def combine(part_max, part_sum, z_label, labels, vocab):
    """Per-row (lse, loss) of plain CE from gemm_ce's partials: float32 (M,) each; ignore_index -100 rows give lse
    -inf and loss 0, labels outside [0, vocab) give NaN."""
    m, n_tiles_v = part_max.shape
    lse = torch.empty(m, device=part_max.device, dtype=torch.float32)
    loss = torch.empty_like(lse)
    _combine_kernel[(m,)](
        part_max,
        part_sum,
        z_label,
        labels,
        lse,
        loss,
        vocab,
        n_tiles_v,
        IGNORE_INDEX,
        TILES_BLOCK=triton.next_power_of_2(n_tiles_v),
    )
    return lse, loss


def linear_ce_chunk(a, b, labels, **config):
    """(logits, lse, loss) of one chunk through gemm_ce + combine."""
    c, part_max, part_sum, z_label = gemm_ce(a, b, labels, **config)
    lse, loss = combine(part_max, part_sum, z_label, labels, b.shape[0])
    return c, lse, loss


def compile_report(config, shape, with_ce=True, dtype="bfloat16"):
    """Compile the GEMM kernel for the H200 (sm_90) without a GPU (TRITON_INTERPRET=0) with the specialisation a
    launch at `shape` (M, K, V) gets, and read what the compiler chose (`sm90_report`)."""
    m, k, v = shape
    n_tiles_v = triton.cdiv(v, config["block_n"])
    values = dict(M=m, V=v, K=k, stride_am=k, stride_bv=k, stride_cm=v, n_tiles_v=n_tiles_v)
    constexprs = dict(
        BLOCK_M=config["block_m"],
        BLOCK_N=config["block_n"],
        BLOCK_K=config["block_k"],
        GROUP=GROUP_M,
        EVEN_K=k % config["block_k"] == 0,
        PRECISION="ieee" if dtype == "float32" else None,
        WITH_CE=with_ce,
    )
    operand = POINTER_TYPES[dtype]
    pointers = dict(a_ptr=operand, b_ptr=operand, c_ptr=operand, labels_ptr="*i64")
    return sm90_report(_gemm_ce_kernel, values, constexprs, pointers, config["num_warps"], config["num_stages"])


POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}


def sm90_report(fn, values, constexprs, pointers, num_warps, num_stages):
    """Compile `fn` for the H200 (sm_90) without a GPU (TRITON_INTERPRET=0) with the specialisation a launch with
    these integer `values` gets (pointers, and integers divisible by 16, flagged so; pointers not in `pointers` are
    *fp32) and read what the compiler chose: shared memory, registers and spills (ptxas -v), wgmma instructions,
    TMA or cp.async copies."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*fp32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if values[name] % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        run = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.o"],
            capture_output=True,
            text=True,
            check=True,
        )
    log = run.stdout + run.stderr

    def number(pattern):
        found = re.search(pattern, log)
        return int(found.group(1)) if found else None

    return dict(
        shared_bytes=compiled.metadata.shared,
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        wgmma=ptx.count("wgmma.mma_async"),
        tma=ptx.count("cp.async.bulk.tensor"),
        cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
    )


def parse_shape(text):
    try:
        m, k, v = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be MxKxV (rows x hidden x vocab), got {text!r}") from None
    if min(m, k, v) <= 0:
        raise argparse.ArgumentTypeError(f"shape dimensions must be positive, got {text!r}")
    return m, k, v


def parse_configs(text):
    """'BMxBNxBKxWARPSxSTAGES,...' -> list of gemm_ce keyword dicts."""
    configs = []
    for item in text.split(","):
        try:
            bm, bn, bk, warps, stages = (int(x) for x in item.strip().lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"config must be BMxBNxBKxWARPSxSTAGES, got {item!r}") from None
        if any(x <= 0 or x & (x - 1) for x in (bm, bn, bk, warps)) or stages <= 0:
            raise argparse.ArgumentTypeError(f"block sizes and warps must be powers of two, stages > 0: {item!r}")
        configs.append(dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages))
    return configs


def config_name(config):
    return "{block_m}x{block_n}x{block_k} w{num_warps} s{num_stages}".format(**config)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, default=parse_shape(DEFAULT_SHAPE), help="M x K x V")
    parser.add_argument("--configs", type=parse_configs, default=parse_configs(DEFAULT_CONFIGS))
    parser.add_argument("--ignored", type=float, default=0.1, help="fraction of rows labelled -100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the timings and checks to this file")
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="no GPU needed: compile each config for sm_90 (TRITON_INTERPRET=0) and print what ptxas reports",
    )
    return parser.parse_args(argv)


def loss_bound(logits, lse):
    """atol for per-row loss / lse computed in float32 from these logits: the shared tolerance model's float32 term,
    RTOL * (1 + |lse| + max |z|), largest over the kept rows (shared_tests/tolerances.py)."""
    kept = torch.isfinite(lse)
    if not kept.any():
        return 0.0
    scale = 1.0 + float(lse[kept].abs().max()) + float(logits[kept].float().abs().amax())
    return tolerances.RTOL * scale


def sum_bound(a, b):
    """How far two float32-accumulated products a @ b.T may be apart before rounding: 2 K eps32 (|a| @ |b|.T), each
    within K eps32 sum_k |a_k b_k| of the exact value (products of 16-bit values are exact in float32)."""
    return 2 * a.shape[1] * tolerances.EPS32 * (a.float().abs() @ b.float().abs().t())


def logits_out_of_bound(logits, reference, bound_before_rounding):
    """How many of two products of the same operands, each rounded once to logits' dtype, differ by more than
    bound_before_rounding (sum_bound) plus one ulp of the dtype at the larger magnitude (two roundings of nearby
    sums may land on adjacent values)."""
    got, ref = logits.float(), reference.float()
    magnitude = torch.maximum(got.abs(), ref.abs()).clamp_min(torch.finfo(torch.float32).tiny)
    bits = tolerances.MANTISSA_BITS[tolerances.dtype_name(logits.dtype)]
    bound = torch.exp2(torch.floor(torch.log2(magnitude)) - bits)
    bound += bound_before_rounding
    return int((~((got - ref).abs() <= bound)).sum())  # written so that NaN counts as out of bound


def _max_abs(x):
    return float(x.abs().max()) if x.numel() else 0.0


def run_probe(shape, configs, ignored=0.1, seed=0, device="cuda", dtype=torch.bfloat16, timer=None):
    """Time (timer(fn) -> ms) and check (a) and (b) at shape (M, K, V); prints a line per timing and returns
    (results dict, number of failed loss checks)."""
    from fastce_torch import kernels

    m, k, v = shape
    torch.manual_seed(seed)
    hidden = torch.randn(m, k, device=device, dtype=dtype) * 0.5
    weight = torch.randn(v, k, device=device, dtype=dtype) * 0.05
    labels = torch.randint(0, v, (m,), device=device)
    labels[torch.rand(m, device=device) < ignored] = IGNORE_INDEX
    labels[-1] = v - 1  # the last column tile, partial unless block_n divides V
    flops = 2 * m * k * v
    workspace = torch.empty(m, v, device=device, dtype=dtype)
    options = kernels.Options()
    device_name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else str(device)
    results = dict(shape=dict(M=m, K=k, V=v), dtype=str(dtype), device=device_name, timings_ms={}, checks={})
    bench = timer

    def line(name, ms, rate=True):
        results["timings_ms"][name] = ms
        tflops = f"{flops / ms / 1e9:6.0f} TFLOP/s" if rate else ""
        print(f"{name:48s} {ms:7.3f} ms {tflops}", flush=True)
        return ms

    print(f"gemm_ce_probe M={m} K={k} V={v} {dtype}, {flops / 1e12:.2f} TFLOP per call, {results['device']}")
    torch.matmul(hidden, weight.t(), out=workspace)
    ref_loss, ref_lse, _ = kernels.forward(workspace, labels, options, reduction="none")
    line("(a) cuBLAS matmul into the workspace", bench(lambda: torch.matmul(hidden, weight.t(), out=workspace)))
    line("(a) fastce CE forward alone", bench(lambda: kernels.forward(workspace, labels, options)), rate=False)
    line(
        "(a) cuBLAS matmul + fastce CE forward",
        bench(
            lambda: (
                torch.matmul(hidden, weight.t(), out=workspace),
                kernels.forward(workspace, labels, options, reduction="none"),
            )
        ),
    )
    product_bound = sum_bound(hidden, weight)
    failures, fused = 0, {}
    for config in configs:
        name = config_name(config)
        try:
            logits, part_max, part_sum, z_label = gemm_ce(hidden, weight, labels, **config)
            lse, loss = combine(part_max, part_sum, z_label, labels, v)
            if logits.is_cuda:
                torch.cuda.synchronize()
        except Exception as error:  # a config that does not fit (shared memory, registers) is reported, not fatal
            print(f"(b) {name}: failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            results["checks"][name] = f"failed: {type(error).__name__}"
            continue
        own_loss, own_lse, _ = kernels.forward(logits, labels, options, reduction="none")
        differ = logits != workspace
        largest = _max_abs(logits.float() - workspace.float())
        outside = logits_out_of_bound(logits, workspace, product_bound)
        failures += outside > 0
        checks = [
            f"logits against cuBLAS's: {float(differ.float().mean()):.2e} of them differ, largest |diff| "
            f"{largest:.3g}, {outside} beyond the bound" + (" MISMATCH" if outside else "")
        ]
        kept = labels != IGNORE_INDEX
        # A change of at most `largest` in every logit moves lse and z_label by at most `largest` each.
        for what, expected, expected_lse, extra in (
            ("its own logits", own_loss, own_lse, 0.0),
            ("cuBLAS's logits", ref_loss, ref_lse, 2 * largest),
        ):
            atol = loss_bound(logits, expected_lse) + extra
            errors = (_max_abs(loss - expected), _max_abs((lse - expected_lse)[kept]))
            verdict = f"max |dloss| {errors[0]:.2e}, |dlse| {errors[1]:.2e} (bound {atol:.1e})"
            try:
                torch.testing.assert_close(loss, expected, rtol=0.0, atol=atol)
                torch.testing.assert_close(lse, expected_lse, rtol=0.0, atol=atol)
            except AssertionError as error:
                failures += 1
                verdict = "MISMATCH: " + verdict + "; " + "; ".join(str(error).splitlines()[1:4])
            checks.append(f"vs fastce CE over {what}: {verdict}")
        results["checks"][name] = checks
        line(
            f"(b) {name}: GEMM alone (no CE epilogue)",
            bench(lambda: gemm_ce(hidden, weight, labels, **config, with_ce=False)),
        )
        fused[name] = line(
            f"(b) {name}: GEMM + CE epilogue + combine",
            bench(lambda: linear_ce_chunk(hidden, weight, labels, **config)),
        )
        line(
            f"(b) {name}: combine alone",
            bench(lambda: combine(part_max, part_sum, z_label, labels, v)),
            rate=False,
        )
        for check in checks:
            print(f"    {check}")
    if fused:
        best = min(fused, key=fused.get)
        pair = results["timings_ms"]["(a) cuBLAS matmul + fastce CE forward"]
        results["best"] = dict(config=best, ms=fused[best], against_ms=pair)
        print(
            f"best {best}: {fused[best]:.3f} ms against cuBLAS + CE forward {pair:.3f} ms ({fused[best] / pair:.3f}x)"
        )
    return results, failures


def main(argv=None):
    args = parse_args(argv)
    if args.compile_only:
        if knobs.runtime.interpret:
            raise SystemExit("Triton is in interpreter mode: run with TRITON_INTERPRET=0 to compile for sm_90")
        for config in args.configs:
            for with_ce in (False, True):
                report = report_or_failure(lambda: compile_report(config, args.shape, with_ce))
                print(f"{config_name(config)} {'GEMM + CE epilogue' if with_ce else 'GEMM alone        '}: {report}")
        return
    timer = cuda_timer("gemm_ce_probe")
    results, failures = run_probe(args.shape, args.configs, args.ignored, args.seed, timer=timer)
    finish(results, failures, args.json, "loss check(s)")


# --- the probes' shared command-line pieces (bench.tools.dw_product_probe uses them too) ---------------------------


def report_or_failure(compile_fn):
    """compile_fn()'s report, or one line saying why the compile failed (a config that does not fit is a result)."""
    try:
        return compile_fn()
    except Exception as error:
        return f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"


def cuda_timer(tool, warmup=25, rep=100):
    """timer(fn) -> the do_bench median in ms, on a CUDA device; a clear exit where none is visible."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{tool} times kernels on a CUDA device; none is visible (CPU test: bench/tests)")
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def finish(results, failures, json_path, what="check(s)"):
    """Write the results to json_path (when given), then exit non-zero if any check failed."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    if failures:
        raise SystemExit(f"{failures} {what} failed")


if __name__ == "__main__":
    main()
