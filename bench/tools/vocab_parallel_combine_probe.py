"""Can two small kernels replace the ~30 torch ops with which fastce_torch's vocab-parallel forward combines the
ranks' statistics? `PYTHONPATH=. python -m bench.tools.vocab_parallel_combine_probe` (a GPU: one NCCL rank, a few
seconds; a CPU: gloo and Triton's interpreter, values only; `--compile-only` with TRITON_INTERPRET=0 compiles both
kernels for sm_90 on any machine).

Today (fastce_torch/sharding.py): after the statistics kernel, the MAX all-reduce of the local logsumexps (plus the
width check's two entries), then in torch ops the rows' shift, exp(lse_local - shift) and a stack, the SUM
all-reduce, then lse = shift + log(sum), the width check, the per-token loss with its ignored / out-of-range masks,
the divisor and the reduction: about 30 launches, each 10-20 us of host time on the H200 machine. Here `rescale`
writes row 0 of the SUM buffer from the reduced maxima (one launch) and `combine` writes the global lse, the per-token
losses and, reduced, the loss and its divisor (one launch; one program walks the rows in a fixed order, so the sum
does not depend on the grid: batch invariance). Both are checked against the package's own path on the same
statistics (float32 tolerance: the sum's order differs), for "none", "mean", "sum" and n_items, with smoothing and
z-loss, ignored and out-of-range labels, and an all-ignored batch. The buffers' preparation (the maxima's copy and
width fills, z_label / sum_z into the SUM buffer) stays torch ops here; in the package the statistics kernel would
write them in place. The probe launches its kernels through Triton's generic `kernel[grid](...)` dispatch, which
costs more host time per launch than the package's launch cache would: its timing is an upper bound for the kernels.
"""

import argparse

import torch

import fastce_torch  # noqa: F401  (before triton: on a machine without CUDA it selects Triton's interpreter)

# isort: split
import torch.distributed as dist
import triton
import triton.language as tl

from fastce_torch import contract, kernels, sharding

from .overhead import one_rank_group, per_call_us

BLOCK = 1024


@triton.jit
def _rescale_kernel(maxima_ptr, lse_local_ptr, sums_ptr, n_rows, BLOCK: tl.constexpr):
    """sums[0, r] = exp(lse_local[r] - shift[r]), shift the reduced maximum (0 where it is -inf: every rank's row
    empty, so exp(-inf - 0) = 0 and no -inf - -inf)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_rows = offsets < n_rows
    row_max = tl.load(maxima_ptr + offsets, mask=in_rows, other=0.0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    lse_local = tl.load(lse_local_ptr + offsets, mask=in_rows, other=float("-inf"))
    tl.store(sums_ptr + offsets, tl.exp(lse_local - shift), mask=in_rows)


@triton.jit
def _combine_kernel(
    maxima_ptr,  # (n_rows [+ 2]) reduced MAX: the rows' largest local lse, then width and -width when checked
    sums_ptr,  # (2 or 3, sums_stride) reduced SUM: rescaled exp-sums, label logits, sums of z (with smoothing)
    sums_stride,
    labels_ptr,
    lse_ptr,  # out: (n_rows) global logsumexp (NaN where the widths differ, -inf on ignored rows)
    losses_ptr,  # out: (n_rows) per-token loss (0 ignored, NaN out of range)
    loss_ptr,  # out (REDUCE): the reduced loss
    denominator_ptr,  # out (REDUCE): its divisor; in (DENOMINATOR_MODE 2): n_items as a tensor
    n_rows,
    vocab_total,
    ignore_index,
    label_smoothing,
    z_loss,
    denominator_value,  # DENOMINATOR_MODE 1: the divisor ("sum": 1, or a number n_items)
    CHECK_WIDTHS: tl.constexpr,
    HAS_SUM_Z: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    REDUCE: tl.constexpr,
    DENOMINATOR_MODE: tl.constexpr,  # 0 kept tokens (at least 1), 1 denominator_value, 2 read from denominator_ptr
    BLOCK: tl.constexpr,
):
    widths_equal = True
    if CHECK_WIDTHS:
        widths_equal = tl.load(maxima_ptr + n_rows) == -tl.load(maxima_ptr + n_rows + 1)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    kept = tl.zeros([BLOCK], dtype=tl.float32)
    # Reduced: one program walks every block in order; "none": one block per program.
    if REDUCE:
        n_blocks = tl.cdiv(n_rows, BLOCK)
        first = 0
    else:
        n_blocks = 1
        first = tl.program_id(0) * BLOCK
    for block in range(n_blocks):
        offsets = first + block * BLOCK + tl.arange(0, BLOCK)
        in_rows = offsets < n_rows
        row_max = tl.load(maxima_ptr + offsets, mask=in_rows, other=0.0)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        lse = shift + tl.log(tl.load(sums_ptr + offsets, mask=in_rows, other=1.0))
        lse = tl.where(widths_equal, lse, float("nan"))
        loss = lse - tl.load(sums_ptr + sums_stride + offsets, mask=in_rows, other=0.0)
        if HAS_SUM_Z:
            sum_z = tl.load(sums_ptr + 2 * sums_stride + offsets, mask=in_rows, other=0.0)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sum_z / vocab_total)
        if HAS_Z_LOSS:
            loss = loss + z_loss * lse * lse
        labels = tl.load(labels_ptr + offsets, mask=in_rows, other=ignore_index)
        ignored = labels == ignore_index
        loss = tl.where(((labels >= 0) & (labels < vocab_total)) | ignored, loss, float("nan"))
        loss = tl.where(ignored, 0.0, loss)
        tl.store(lse_ptr + offsets, lse, mask=in_rows)
        tl.store(losses_ptr + offsets, loss, mask=in_rows)
        if REDUCE:
            total += tl.where(in_rows, loss, 0.0)
            kept += tl.where(in_rows & (labels != ignore_index), 1.0, 0.0)
    if REDUCE:
        if DENOMINATOR_MODE == 0:
            denominator = tl.maximum(tl.sum(kept, axis=0), 1.0)
        elif DENOMINATOR_MODE == 1:
            denominator = denominator_value
        else:
            denominator = tl.load(denominator_ptr)
        tl.store(loss_ptr, tl.sum(total, axis=0) / denominator)
        tl.store(denominator_ptr, denominator)


def package_path(lse_local, z_label, sum_z, labels, options, reduction, n_items, group, local_width, vocab_total):
    """What _VocabParallelFunction.forward does between the statistics kernel and its return: (lse, losses,
    loss, denominator)."""
    with_sum_z = options.label_smoothing > 0.0
    lse, z_label_global, sum_z_global = sharding.combine_statistics(
        lse_local, z_label, sum_z, group, local_width, True, with_sum_z
    )
    losses = contract.token_loss_from_statistics(lse, z_label_global, sum_z_global, labels, options, vocab_total)
    denominator = contract.loss_divisor(labels, reduction, n_items, options.ignore_index)
    loss = losses if denominator is None else losses.sum() / denominator
    return lse, losses, loss, denominator


def kernel_path(
    lse_local, z_label, sum_z, labels, options, reduction, n_items, group, local_width, vocab_total, poison=False
):
    """The same through the two kernels: (lse, losses, loss, denominator); poison: outputs start as NaN (the checks:
    a value the kernel did not write cannot pass), not for timing."""
    n_rows, device = lse_local.shape[0], lse_local.device
    maxima = torch.empty(n_rows + 2, dtype=torch.float32, device=device)
    maxima[:n_rows].copy_(lse_local)
    maxima[n_rows].fill_(local_width)
    maxima[n_rows + 1].fill_(-local_width)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    with_sum_z = options.label_smoothing > 0.0
    stride = -(-n_rows // 16) * 16
    sums = torch.empty(3 if with_sum_z else 2, stride, dtype=torch.float32, device=device)
    sums[1, :n_rows].copy_(z_label)
    if with_sum_z:
        sums[2, :n_rows].copy_(sum_z)
    grid = (triton.cdiv(n_rows, BLOCK),)
    with kernels.on_device(lse_local):
        _rescale_kernel[grid](maxima, lse_local, sums, n_rows, BLOCK=BLOCK)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    reduce = reduction != "none"
    new = (
        (lambda shape: torch.full(shape, float("nan"), device=device))
        if poison
        else (lambda shape: torch.empty(shape, device=device))
    )
    lse, losses = new((n_rows,)), new((n_rows,))
    loss = new(()) if reduce else losses
    denominator = new(()) if reduce else None
    mode, value = (0, 1.0) if reduction == "mean" else (1, 1.0)
    if n_items is not None:
        if isinstance(n_items, torch.Tensor):
            mode = 2
            denominator.copy_(n_items)
        else:
            mode, value = 1, float(n_items)
    with kernels.on_device(lse_local):
        _combine_kernel[(1,) if reduce else grid](
            maxima, sums, stride, labels, lse, losses, loss, denominator if reduce else lse,
            n_rows, vocab_total, options.ignore_index, options.label_smoothing, options.z_loss, value,
            CHECK_WIDTHS=True, HAS_SUM_Z=with_sum_z, HAS_Z_LOSS=options.z_loss != 0.0, REDUCE=reduce,
            DENOMINATOR_MODE=mode, BLOCK=BLOCK,
        )  # fmt: skip
    return lse, losses, loss, denominator


def statistics(n_rows, vocab, options, device, all_ignored=False, out_of_range=False, seed=0):
    """The statistics kernel's outputs on fresh logits of one rank holding the whole vocabulary, and the labels
    (every 5th ignored, or all; with out_of_range one label past the vocabulary: a NaN row, and a NaN reduced loss)."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n_rows, vocab, generator=generator) * 2).to(device)
    labels = torch.randint(0, vocab, (n_rows,), generator=generator).to(device)
    if all_ignored:
        labels.fill_(options.ignore_index)
    else:
        labels[::5] = options.ignore_index
        if out_of_range:
            labels[1] = vocab + 3
    lse_local, z_label, sum_z = kernels.forward(logits, labels, options, vocab_start=0, vocab_total=vocab)
    return lse_local, z_label, sum_z, labels


CASES = [  # (reduction, n_items, label_smoothing, z_loss, all ignored, a label out of range)
    ("none", None, 0.0, 0.0, False, True),
    ("none", None, 0.1, 1e-4, False, False),
    ("mean", None, 0.0, 0.0, False, False),
    ("mean", None, 0.0, 0.0, False, True),
    ("sum", None, 0.1, 1e-4, False, False),
    ("mean", 7.0, 0.0, 1e-4, False, False),
    ("sum", "tensor", 0.2, 0.0, False, False),
    ("mean", None, 0.0, 0.0, True, False),
]


def compare(group, device, n_rows=37, vocab=300):
    """Every case: the kernel path against the package's; returns [(case, largest |difference|)] and raises on a
    mismatch (NaN where the other has NaN, else within float32 tolerance)."""
    results = []
    for case in CASES:
        reduction, n_items, smoothing, z_loss, all_ignored, out_of_range = case
        options = kernels.Options(label_smoothing=smoothing, z_loss=z_loss)
        lse_local, z_label, sum_z, labels = statistics(n_rows, vocab, options, device, all_ignored, out_of_range)
        items = torch.tensor(11.0, device=device) if n_items == "tensor" else n_items
        args = (lse_local, z_label, sum_z, labels, options, reduction, items, group, vocab, vocab)
        expected = package_path(*args)
        got = kernel_path(*args, poison=True)
        largest = 0.0
        for name, a, b in zip(("lse", "losses", "loss", "denominator"), got, expected):
            if b is None:
                assert a is None, name
                continue
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6, equal_nan=True, msg=lambda m: f"{name}: {m}")
            finite = torch.isfinite(b)
            if finite.any():
                largest = max(largest, (a - b).abs()[finite].max().item())
        if reduction != "none" and not out_of_range:
            assert torch.isfinite(expected[2]), case  # the reduced loss itself was compared, not two NaNs
        results.append((case, largest))
    return results


def compile_for_sm90():
    """Compile both kernels for the H200 (sm_90) without a GPU (TRITON_INTERPRET=0), the combine kernel in its
    reduced and per-token variants with every option on: what the interpreter does not check (types, constexpr
    branches, the cubin). Returns {variant: cubin bytes}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    floats = {"label_smoothing", "z_loss", "denominator_value"}
    variants = {
        "rescale": (_rescale_kernel, {"BLOCK": BLOCK}),
        "combine, reduced": (_combine_kernel, {"CHECK_WIDTHS": True, "HAS_SUM_Z": True, "HAS_Z_LOSS": True,
                                              "REDUCE": True, "DENOMINATOR_MODE": 2, "BLOCK": BLOCK}),
        "combine, per token": (_combine_kernel, {"CHECK_WIDTHS": True, "HAS_SUM_Z": True, "HAS_Z_LOSS": True,
                                                "REDUCE": False, "DENOMINATOR_MODE": 0, "BLOCK": BLOCK}),
    }  # fmt: skip
    sizes = {}
    for name, (fn, constexprs) in variants.items():
        signature = {}
        for arg in fn.arg_names:
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = "*i64" if arg == "labels_ptr" else "*fp32"
            else:
                signature[arg] = "fp32" if arg in floats else "i32"
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        sizes[name] = len(compiled.asm["cubin"])
    return sizes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 (TRITON_INTERPRET=0)")
    args = parser.parse_args(argv)
    if args.compile_only:
        for name, size in compile_for_sm90().items():
            print(f"{name:20s} compiled for sm_90 ({size} bytes of cubin)")
        return
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    with one_rank_group("nccl" if gpu else "gloo") as group:
        for case, largest in compare(group, device):
            print(f"{str(case):48s} kernel path == package path, largest |difference| {largest:.2e}")
        if not gpu:
            return
        print("host time per call of the combine step (64 rows, one NCCL rank), us:")
        for reduction in ("none", "mean"):
            options = kernels.Options()
            lse_local, z_label, sum_z, labels = statistics(64, 1000, options, device)
            call = (lse_local, z_label, sum_z, labels, options, reduction, None, group, 1000, 1000)
            package = per_call_us(lambda: package_path(*call), args.calls)
            kernel = per_call_us(lambda: kernel_path(*call), args.calls)
            print(f"  {reduction:5s} package path {package:7.1f}   two kernels {kernel:7.1f}")


if __name__ == "__main__":
    main()
