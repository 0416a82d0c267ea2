"""Liger-Kernel's distillation losses (liger-kernel 0.8.5) by name, computed by fastce_torch.jsd / linear_jsd.

Import them from fastce_torch.liger:

    # from liger_kernel.transformers import LigerJSD, LigerFusedLinearJSD
    from fastce_torch.liger import LigerJSD, LigerFusedLinearJSD

beta (LigerJSD) / jsd_beta (LigerFusedLinearJSD) is fastce's beta unchanged: Liger's generalized JSD,
beta * KL(P || M) + (1 - beta) * KL(Q || M) with M = beta * P + (1 - beta) * Q, P the teacher and Q the student,
forward KL(P || Q) at beta = 0 and reverse KL(Q || P) at beta = 1, is TRL's, which fastce's jsd computes.
shift_labels: fastce's labels (a mask: ignore_index rows count for nothing). The loss is the mean over the counted
rows (Liger has no reduction argument; all rows ignored gives 0). temperature (fused linear): the same
softmax(logits / T) on both sides, no T^2 factor, as Liger.

Different on purpose (LigerJSD / liger_jsd): Liger takes log-probabilities and uses them as they are; fastce's jsd
takes logits and normalises them (log_softmax), which leaves log-probabilities unchanged, so the loss is the same.
The gradient with respect to log_q then differs from Liger's by a multiple of exp(log_q) per row, the direction
that log_softmax's backward removes: the gradient on the logits before the caller's log_softmax is the same.
Unnormalised inputs are normalised (Liger computes with them as given). The teacher gets no gradient (as in Liger).
Precision (fused linear): Liger 0.8.5 projects both models in float32, so the drop-in always passes
logits_dtype="float32" (bf16/fp16 heads: float32 logits from the bf16/fp16 operands; a no-op for float32 heads);
accum_dtype=torch.float32 is accumulate_in_float32=True (the student weight's gradient summed over the chunks in
float32, rounded once to its dtype). Refused: any other accum_dtype than None, float32 or the weight's dtype.
"""

import torch

from ..losses.jsd.api import jsd as fastce_jsd
from ..losses.jsd.linear_api import linear_jsd as fastce_linear_jsd

__all__ = [
    "LigerFusedLinearJSD",
    "LigerFusedLinearJSDFunction",
    "LigerJSD",
    "LigerJSDFunction",
    "liger_fused_linear_jsd",
    "liger_jsd",
]

FASTCE_OPTIONS = {"backend", "student_softcapping", "teacher_softcapping"}
LINEAR_FASTCE_OPTIONS = FASTCE_OPTIONS | {"workspace_bytes", "student_bias", "teacher_bias"}


def _fastce_options(options, allowed, entry):
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(
            f"unexpected keyword(s) {', '.join(unknown)}: past Liger's own arguments, fastce_torch.liger takes only "
            f"these fastce_torch.{entry} keywords: {', '.join(sorted(allowed))}"
        )
    return options


def _accumulation(accum_dtype, student_weight=None):
    """Liger's accum_dtype as fastce's keywords: None (or the weight's dtype) is the default, float32 is
    accumulate_in_float32=True."""
    if accum_dtype is None or (student_weight is not None and accum_dtype == student_weight.dtype):
        return {}
    if not (isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point):
        raise TypeError(f"accum_dtype must be None or a floating torch.dtype, got {accum_dtype!r}")
    if accum_dtype == torch.float32:
        return {"accumulate_in_float32": True}
    if student_weight is None:  # the module's check, before the weight is known
        return {}
    raise NotImplementedError(
        f"accum_dtype={accum_dtype}: fastce_torch.linear_jsd has no such accumulation option; pass accum_dtype=None "
        f"(the student weight's gradient is accumulated as fastce's linear_jsd does, in {student_weight.dtype})"
    )


class LigerJSDFunction:
    """liger_kernel.ops.LigerJSDFunction's `apply`: the loss in the input's dtype (as Liger)."""

    @staticmethod
    def apply(_input, target, shift_labels=None, beta=0.5, ignore_index=-100, jsd_impl=None, jsd_mode=None, **options):
        if jsd_impl is not None or jsd_mode is not None:
            raise NotImplementedError(
                f"jsd_impl={jsd_impl!r}, jsd_mode={jsd_mode!r} choose among Liger's own kernels; fastce has one "
                "implementation: pass None for both"
            )
        options = _fastce_options(options, FASTCE_OPTIONS, "jsd")
        loss = fastce_jsd(_input, target, shift_labels, beta=beta, ignore_index=ignore_index, **options)
        return loss.to(_input.dtype)


class LigerFusedLinearJSDFunction:
    """liger_kernel.ops.LigerFusedLinearJSDFunction's `apply`: a float32 scalar loss (as Liger)."""

    @staticmethod
    def apply(
        student_input,
        student_weight,
        teacher_input,
        teacher_weight,
        shift_labels=None,
        jsd_beta=0.5,
        ignore_index=-100,
        temperature=1.0,
        accum_dtype=None,
        jsd_impl=None,
        jsd_mode=None,
        **options,
    ):
        if jsd_impl is not None or jsd_mode is not None:
            raise NotImplementedError(
                f"jsd_impl={jsd_impl!r}, jsd_mode={jsd_mode!r} choose among Liger's own kernels; fastce has one "
                "implementation: pass None for both"
            )
        options = _fastce_options(options, LINEAR_FASTCE_OPTIONS, "linear_jsd")
        options.update(_accumulation(accum_dtype, student_weight))
        options["logits_dtype"] = "float32"  # Liger's projection is float32 (no-op for float32 heads)
        return fastce_linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight, shift_labels, beta=jsd_beta,
            temperature=temperature, ignore_index=ignore_index, **options,
        )  # fmt: skip


def liger_jsd(input, target, shift_labels=None, beta=0.5, ignore_index=-100, **fastce_options):
    """liger_kernel.transformers.functional.liger_jsd: student (input) and teacher (target) log-probs (BT, V)."""
    return LigerJSDFunction.apply(input, target, shift_labels, beta, ignore_index, None, None, **fastce_options)


def liger_fused_linear_jsd(
    student_input,
    student_weight,
    teacher_input,
    teacher_weight,
    shift_labels=None,
    jsd_beta=0.5,
    ignore_index=-100,
    temperature=1.0,
    accum_dtype=None,
    **fastce_options,
):
    """liger_kernel.transformers.functional.liger_fused_linear_jsd: inputs (BT, H_s) / (BT, H_t), weights (V, H)."""
    return LigerFusedLinearJSDFunction.apply(
        student_input, student_weight, teacher_input, teacher_weight, shift_labels, jsd_beta, ignore_index,
        temperature, accum_dtype, None, None, **fastce_options,
    )  # fmt: skip


class LigerJSD(torch.nn.Module):
    """liger_kernel.transformers.LigerJSD: forward(log_q (student), log_p (teacher), shift_labels=None)."""

    def __init__(self, beta=0.5, ignore_index=-100, **fastce_options):
        super().__init__()
        self.fastce_options = _fastce_options(fastce_options, FASTCE_OPTIONS, "jsd")
        self.beta = beta
        self.ignore_index = ignore_index

    def forward(self, log_q, log_p, shift_labels=None):
        return liger_jsd(log_q, log_p, shift_labels, self.beta, self.ignore_index, **self.fastce_options)


class LigerFusedLinearJSD(torch.nn.Module):
    """liger_kernel.transformers.LigerFusedLinearJSD: forward(student_input, student_weight, teacher_input,
    teacher_weight, shift_labels)."""

    def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype=None, **fastce_options):
        super().__init__()
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        _accumulation(accum_dtype)
        self.fastce_options = _fastce_options(fastce_options, LINEAR_FASTCE_OPTIONS, "linear_jsd")
        self.jsd_beta = jsd_beta
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.accum_dtype = accum_dtype

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels):
        return liger_fused_linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight, shift_labels, self.jsd_beta,
            self.ignore_index, self.temperature, self.accum_dtype, **self.fastce_options,
        )  # fmt: skip
