"""Compile every kernel variant for the H200 (sm_90) without a GPU: `python -m fastce_torch.compile_check`.

Triton's interpreter checks none of the GPU's rules (power-of-two blocks, supported ops, layouts); the real
compiler down to PTX and SASS does. Run with TRITON_INTERPRET=0 (fastce_torch turns the interpreter on by default
on machines without a GPU).
"""

import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import kernels
from .kernels import BACKWARD_BLOCK, BACKWARD_WARPS, FORWARD_BLOCK, FORWARD_WARPS, GROUPS_BLOCK, ROWS_PER_GROUP

H200 = GPUTarget("cuda", 90, 32)
POINTER = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}


def compile_for_h200(fn, signature, constexprs, num_warps):
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=H200, options={"num_warps": num_warps})


FLAG_SETS = [(False,) * 4, (True,) * 4] + [tuple(i == j for j in range(4)) for i in range(4)]


def variants():
    # Every dtype with no option, each option alone and all of them; 64-bit strides (huge tensors) on one set.
    for dtype, flag_set in itertools.product(POINTER, FLAG_SETS):
        scaling, softcap, smoothing, z_loss = flag_set
        index = "i64" if flag_set == FLAG_SETS[1] else "i32"
        logits = POINTER[dtype]
        flags = dict(HAS_SCALING=scaling, HAS_SOFTCAP=softcap, HAS_SMOOTHING=smoothing, HAS_Z_LOSS=z_loss)
        for block, warps in ((FORWARD_BLOCK, FORWARD_WARPS), (1024, FORWARD_WARPS)):
            reductions = ((False, 0), (True, 0), (True, 1), (True, 2)) if flag_set == FLAG_SETS[0] else ((True, 0),)
            for reduce, denominator in reductions:
                yield (
                    kernels._forward_kernel,
                    dict(
                        logits_ptr=logits,
                        logits_batch_stride=index,
                        logits_row_stride=index,
                        rows_per_batch="i32",
                        labels_ptr="*i64",
                        loss_ptr="*fp32",
                        lse_ptr="*fp32",
                        max_ptr="*fp32",
                        sumexp_ptr="*fp32",
                        sumz_ptr="*fp32",
                        arrivals_ptr="*i32",
                        group_partials_ptr="*fp32",
                        reduced_ptr="*fp32",
                        denominator_out_ptr="*fp32",
                        n_items_ptr="*fp32",
                        n_rows="i32",
                        V="i32",
                        chunk_width="i32",
                        n_chunks="i32",
                        ignore_index="i32",
                        scaling="fp32",
                        softcap="fp32",
                        label_smoothing="fp32",
                        z_loss="fp32",
                        denominator_value="fp32",
                    ),
                    dict(
                        BLOCK=block,
                        CHUNKS_BLOCK=4,
                        REDUCE=reduce,
                        DENOMINATOR=denominator,
                        GROUPS_BLOCK=GROUPS_BLOCK,
                        ROWS_PER_GROUP=ROWS_PER_GROUP,
                        **flags,
                    ),
                    warps,
                )
        yield (
            kernels._backward_kernel,
            dict(
                logits_ptr=logits,
                logits_batch_stride=index,
                logits_row_stride=index,
                grad_ptr=logits,
                grad_batch_stride=index,
                grad_row_stride=index,
                rows_per_batch="i32",
                labels_ptr="*i64",
                lse_ptr="*fp32",
                grad_loss_ptr="*fp32",
                grad_loss_stride="i32",
                denominator_ptr="*fp32",
                V="i32",
                ignore_index="i32",
                scaling="fp32",
                softcap="fp32",
                label_smoothing="fp32",
                z_loss="fp32",
            ),
            dict(BLOCK=BACKWARD_BLOCK, HAS_DENOMINATOR=flag_set == FLAG_SETS[0], **flags),
            BACKWARD_WARPS,
        )
    for pointer, index in itertools.product(POINTER.values(), ("i32", "i64")):  # linear_cross_entropy's gradients
        yield (
            kernels._scale_unless_one_kernel,
            dict(ptr=pointer, n_elements=index, factor_ptr="*fp32"),
            dict(BLOCK=kernels.SCALE_BLOCK),
            4,
        )


def main():
    if kernels.INTERPRETED:
        raise SystemExit("Triton is in interpreter mode: run with TRITON_INTERPRET=0 to compile for the GPU")
    count = 0
    for fn, signature, constexprs, num_warps in variants():
        compiled = compile_for_h200(fn, signature, constexprs, num_warps)
        assert "sm_90" in compiled.asm["ptx"] or ".target sm_90" in compiled.asm["ptx"], fn.__name__
        count += 1
    print(f"compiled {count} kernel variants for sm_90")


if __name__ == "__main__":
    main()
