"""Compile every kernel variant for the H200 (sm_90) without a GPU: `python -m fastce_torch.compile_check`.

Triton's interpreter checks none of the GPU's rules (power-of-two blocks, supported ops, layouts); the real
compiler down to PTX and SASS does. Run with TRITON_INTERPRET=0 (fastce_torch turns the interpreter on by default
on machines without a GPU).
"""

import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .core.launch import INTERPRETED
from .distributed.combine import (
    VOCAB_PARALLEL_BLOCK,
    vocab_parallel_loss_kernel,
    vocab_parallel_maxima_kernel,
    vocab_parallel_rescale_kernel,
)
from .linear.scale import SCALE_BLOCK, scale_unless_one_kernel
from .losses.cross_entropy.backward import backward_kernel
from .losses.cross_entropy.forward import forward_kernel
from .losses.cross_entropy.launch import (
    BACKWARD_BLOCK,
    BACKWARD_WARPS,
    FORWARD_BLOCK,
    FORWARD_WARPS,
    GROUPS_BLOCK,
    ROWS_PER_GROUP,
)
from .losses.jsd.backward import jsd_backward_kernel
from .losses.jsd.forward import jsd_finish_kernel, jsd_mixture_kernel, jsd_partials_kernel
from .losses.jsd.launch import (
    JSD_BACKWARD_BLOCK,
    JSD_BACKWARD_WARPS,
    JSD_FINISH_WARPS,
    JSD_FORWARD_BLOCK,
    JSD_FORWARD_WARPS,
)

__all__ = [
    "FLAG_SETS",
    "FLOAT_SCALARS",
    "H200",
    "JSD_FLOAT_SCALARS",
    "POINTER",
    "check_mixture_log",
    "compile_for_h200",
    "jsd_signature",
    "jsd_variants",
    "main",
    "signature",
    "variants",
    "vocab_parallel_variants",
]

H200 = GPUTarget("cuda", 90, 32)
POINTER = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}


def compile_for_h200(fn, signature, constexprs, num_warps):
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=H200, options={"num_warps": num_warps})


FLAG_SETS = [(False,) * 4, (True,) * 4] + [tuple(i == j for j in range(4)) for i in range(4)]
FLOAT_SCALARS = {"scaling", "softcap", "label_smoothing", "z_loss", "denominator_value", "width"}


def signature(fn, logits_type, index_type):
    """Argument types from the kernel's own parameter names, so a new parameter cannot be missed: the logits and
    gradient pointers carry the dtype, labels are int64, counters int32, other pointers float32; strides take
    index_type (64-bit for huge tensors), the option scalars float32, other scalars int32."""
    types = {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            continue
        if name in ("logits_ptr", "grad_ptr", "tensor_ptr"):
            types[name] = logits_type
        elif name == "labels_ptr":
            types[name] = "*i64"
        elif name == "arrivals_ptr":
            types[name] = "*i32"
        elif name.endswith("_ptr"):
            types[name] = "*fp32"
        elif "stride" in name:
            types[name] = index_type
        else:
            types[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return types


def variants():
    # Every dtype with no option, each option alone and all of them; 64-bit strides (huge tensors) and the
    # vocab-parallel mode on the all-options set; the extra outputs (OUTPUTS) with no option and all of them,
    # per-token and reduced; class weights (HAS_WEIGHT) with no option, smoothing alone and all of them; the entropy
    # gradient (HAS_ENTROPY_GRAD) with no option and all of them, plain, vocab-parallel and weighted.
    for dtype, flag_set in itertools.product(POINTER, FLAG_SETS):
        scaling, softcap, smoothing, z_loss = flag_set
        all_options = flag_set == FLAG_SETS[1]
        index = "i64" if all_options else "i32"
        logits = POINTER[dtype]
        flags = dict(HAS_SCALING=scaling, HAS_SOFTCAP=softcap, HAS_SMOOTHING=smoothing, HAS_Z_LOSS=z_loss)
        for block, warps in ((FORWARD_BLOCK, FORWARD_WARPS), (1024, FORWARD_WARPS)):
            modes = ((False, 0), (True, 0), (True, 1), (True, 2)) if flag_set == FLAG_SETS[0] else ((True, 0),)
            modes = [(reduce, denominator, False, False) for reduce, denominator in modes]
            if all_options:
                modes.append((False, 0, True, False))
            if flag_set in FLAG_SETS[:2]:
                modes += [(False, 0, False, True), (True, 0, False, True)]
            modes = [mode + (False,) for mode in modes]
            if flag_set in FLAG_SETS[:2] or flag_set == FLAG_SETS[4]:  # class weights: none, all, smoothing alone
                modes += [(False, 0, False, False, True), (True, 0, False, False, True), (True, 0, False, True, True)]
            for reduce, denominator, vocab_parallel, outputs, weighted in modes:
                constexprs = dict(
                    BLOCK=block,
                    CHUNKS_BLOCK=4,
                    REDUCE=reduce,
                    DENOMINATOR=denominator,
                    GROUPS_BLOCK=GROUPS_BLOCK,
                    ROWS_PER_GROUP=ROWS_PER_GROUP,
                    VOCAB_PARALLEL=vocab_parallel,
                    OUTPUTS=outputs,
                    HAS_WEIGHT=weighted,
                    **flags,
                )
                yield forward_kernel, signature(forward_kernel, logits, index), constexprs, warps
        backward_modes = [(False, False, False), (True, False, False)] if all_options else [(False, False, False)]
        if flag_set in FLAG_SETS[:2] or flag_set == FLAG_SETS[4]:
            backward_modes.append((False, True, False))
        if flag_set in FLAG_SETS[:2]:  # the entropy gradient: no option, all of them, vocab-parallel, weighted
            backward_modes += [(False, False, True), (True, False, True), (False, True, True)]
        for vocab_parallel, weighted, entropy_grad in backward_modes:
            constexprs = dict(
                BLOCK=BACKWARD_BLOCK,
                HAS_DENOMINATOR=flag_set == FLAG_SETS[0],
                VOCAB_PARALLEL=vocab_parallel,
                HAS_WEIGHT=weighted,
                HAS_ENTROPY_GRAD=entropy_grad,
                **flags,
            )
            yield (
                backward_kernel,
                signature(backward_kernel, logits, index),
                constexprs,
                BACKWARD_WARPS,
            )
        if flag_set == FLAG_SETS[0]:  # linear_cross_entropy's gradient scaling, once per dtype
            scale = scale_unless_one_kernel
            yield scale, signature(scale, logits, index), dict(BLOCK=SCALE_BLOCK), 4
    yield from vocab_parallel_variants()
    yield from jsd_variants()


def vocab_parallel_variants():
    # The vocab-parallel combine kernels: with and without the width check, every option and reduction mode.
    block = VOCAB_PARALLEL_BLOCK
    maxima, rescale = vocab_parallel_maxima_kernel, vocab_parallel_rescale_kernel
    for check in (False, True):
        yield maxima, signature(maxima, "*fp32", "i32"), dict(CHECK_WIDTHS=check, BLOCK=block), 4
    yield rescale, signature(rescale, "*fp32", "i32"), dict(BLOCK=block), 4
    loss = vocab_parallel_loss_kernel
    for check, smoothing, z_loss, reduce, mode in itertools.product(
        (False, True), (False, True), (False, True), (False, True), (0, 1, 2)
    ):
        if not reduce and mode:
            continue
        constexprs = dict(CHECK_WIDTHS=check, HAS_SMOOTHING=smoothing, HAS_Z_LOSS=z_loss, REDUCE=reduce,
                          DENOMINATOR_MODE=mode, BLOCK=block)  # fmt: skip
        yield loss, signature(loss, "*fp32", "i32"), constexprs, 4


JSD_FLOAT_SCALARS = {"beta", "one_minus_beta", "inv_temperature", "log2e_over_temperature", "s_softcap", "t_softcap"}


def jsd_signature(fn, student_type, teacher_type, grad_type="*fp32", index_type="i32"):
    """The distillation kernels' argument types from their parameter names (as `signature`): the student, teacher
    and gradient pointers carry their dtypes, labels int64, other pointers float32, strides index_type, the option
    scalars float32, the other scalars int32."""
    pointers = {"student_ptr": student_type, "teacher_ptr": teacher_type, "grad_ptr": grad_type, "labels_ptr": "*i64"}
    types = {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            continue
        if name in pointers:
            types[name] = pointers[name]
        elif name.endswith("_ptr"):
            types[name] = "*fp32"
        elif "stride" in name:
            types[name] = index_type
        else:
            types[name] = "fp32" if name in JSD_FLOAT_SCALARS else "i32"
    return types


def jsd_variants():
    # jsd / linear_jsd: every MODE (forward KL, reverse KL, mixture) without and with both soft-cappings in bf16;
    # the mixture with one soft-capping at a time and without labels; the plain mixture for the other dtypes and a
    # mixed pair (a float32 student against a bf16 teacher). Each with the forward's pass-1 partials kernel (and its
    # pass-2 kernel for the mixture) and the backward kernel; 64-bit strides (huge tensors) on the mixture with both
    # soft-cappings. The finish kernel for every MODE with and without labels, at 1 segment and at 64 (V = 151936
    # in tiles of 4096: 38 segments at most).
    bf16 = POINTER["bfloat16"]
    cases = [(mode, bf16, bf16, caps, True) for mode in range(3) for caps in ((False, False), (True, True))]
    cases += [
        (2, bf16, bf16, (True, False), True),
        (2, bf16, bf16, (False, True), True),
        (2, bf16, bf16, (False,) * 2, False),
    ]
    cases += [(2, POINTER[d], POINTER[d], (False, False), True) for d in ("float32", "float16")]
    cases += [(2, POINTER["float32"], bf16, (False, False), True)]
    for mode, student, teacher, (s_cap, t_cap), labels in cases:
        flags = dict(HAS_LABELS=labels, S_SOFTCAP=s_cap, T_SOFTCAP=t_cap)
        index = "i64" if mode == 2 and s_cap and t_cap else "i32"
        partials, backward = jsd_partials_kernel, jsd_backward_kernel
        types = jsd_signature(partials, student, teacher, index_type=index)
        yield partials, types, dict(BLOCK=JSD_FORWARD_BLOCK, MODE=mode, **flags), JSD_FORWARD_WARPS
        if mode == 2:
            mixture = jsd_mixture_kernel
            types = jsd_signature(mixture, student, teacher, index_type=index)
            yield mixture, types, dict(BLOCK=JSD_FORWARD_BLOCK, SEGMENTS_BLOCK=64, **flags), JSD_FORWARD_WARPS
        types = jsd_signature(backward, student, teacher, student, index)
        yield backward, types, dict(BLOCK=JSD_BACKWARD_BLOCK, MODE=mode, **flags), JSD_BACKWARD_WARPS
    finish = jsd_finish_kernel
    for mode, labels, segments_block in itertools.product(range(3), (False, True), (1, 64)):
        constexprs = dict(SEGMENTS_BLOCK=segments_block, MODE=mode, HAS_LABELS=labels)
        yield finish, jsd_signature(finish, bf16, bf16), constexprs, JSD_FINISH_WARPS


def check_mixture_log(fn, constexprs, compiled):
    """The mixture's backward takes its one log per element as the GPU's lg2.approx (_mixture_log2), not libdevice's
    logf (about 25 instructions per element: the backward was compute bound)."""
    if fn is jsd_backward_kernel and constexprs["MODE"] == 2:
        assert "lg2.approx.f32" in compiled.asm["ptx"], "the mixture backward lost its lg2.approx"
        assert "__nv_log" not in compiled.asm["llir"], "the mixture backward calls libdevice's log"


def main():
    if INTERPRETED:
        raise SystemExit("Triton is in interpreter mode: run with TRITON_INTERPRET=0 to compile for the GPU")
    count = 0
    for fn, signature, constexprs, num_warps in variants():
        compiled = compile_for_h200(fn, signature, constexprs, num_warps)
        assert "sm_90" in compiled.asm["ptx"] or ".target sm_90" in compiled.asm["ptx"], fn.__name__
        check_mixture_log(fn, constexprs, compiled)
        count += 1
    print(f"compiled {count} kernel variants for sm_90")


if __name__ == "__main__":
    main()
