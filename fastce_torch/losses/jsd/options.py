"""jsd / linear_jsd's options in plain torch: the distillation options record (JsdOptions, the custom ops' option
arguments in its order), the checks of every argument and the reduction's divisor (row_divisor); the same names and
messages as fastce_jax's (shared_tests/test_jsd.py compares the two packages' messages)."""

from typing import NamedTuple

import torch

from ...core.options import (
    BACKENDS,
    FLOAT32_MAX,
    FLOAT32_TINY,
    FLOAT_DTYPE_ERROR,
    INPUT_DTYPES,
    REDUCTIONS,
    check_labels,
    check_temperature,
    dtype_name,
)

__all__ = [
    "BETA_RANGE",
    "BETA_TYPE",
    "BIAS_SHAPE",
    "INVERSE_TEMPERATURE_RANGE",
    "LAST_DIMENSION",
    "LEADING_SHAPE",
    "SOFTCAPPING_RANGE",
    "SOFTCAPPING_TYPE",
    "TEACHER_VOCABULARY",
    "WEIGHT_SHAPE",
    "JsdOptions",
    "check_floating",
    "check_head",
    "check_heads",
    "check_jsd_labels",
    "check_jsd_options",
    "check_leading_shape",
    "check_logits",
    "check_softcapping",
    "check_vocabularies",
    "row_divisor",
]

# The messages of bad arguments, word for word those of fastce_jax's losses/jsd/options.py.
BETA_TYPE = "beta must be a Python float in [0, 1], got {!r}"
BETA_RANGE = "beta must be in [0, 1], got {}"
INVERSE_TEMPERATURE_RANGE = "temperature={} puts 1 / temperature outside float32's normal range"
SOFTCAPPING_TYPE = "{} must be a Python float, got {!r}"
SOFTCAPPING_RANGE = "{} must be >= 0 (0 disables it) and finite in float32's normal range, got {}"
LAST_DIMENSION = "{name} must have shape (..., {dim}) with {dim} >= 1, got {shape}"
LEADING_SHAPE = "{name} must have {student}'s leading shape {lead}, got {shape}"
TEACHER_VOCABULARY = (
    "{name} has {teacher} classes, fewer than the student's {student}: the teacher's vocabulary must hold the "
    "student's (a larger, padded teacher head is compared on its first {student} classes)"
)
WEIGHT_SHAPE = "{name} must have shape (V, H) = (V, {hidden}) with V >= 1 (the lm_head layout), got {shape}"
BIAS_SHAPE = "{name} must have shape (V,) = ({vocab},), got {shape}"


class JsdOptions(NamedTuple):
    """jsd / linear_jsd's checked options, as the kernels and custom ops take them."""

    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    student_softcapping: float = 0.0
    teacher_softcapping: float = 0.0


def check_softcapping(value, name):
    """A softcapping keyword as a float: 0 (off) or in float32's normal range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(SOFTCAPPING_TYPE.format(name, value))
    value = float(value)
    if not (value == 0.0 or FLOAT32_TINY <= value <= FLOAT32_MAX):
        raise ValueError(SOFTCAPPING_RANGE.format(name, value))
    return value


def check_jsd_options(beta, temperature, ignore_index, reduction, student_softcapping, teacher_softcapping, backend):
    """Checks jsd / linear_jsd's keywords (in fastce_jax's order) and returns JsdOptions: beta a real number in
    [0, 1], ignore_index an int, reduction and backend as cross_entropy's, temperature > 0 with 1 / temperature in
    float32's normal range (the kernels multiply by it), each softcapping 0 (off) or in float32's normal range."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(BETA_TYPE.format(beta))
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:  # NaN fails too
        raise ValueError(BETA_RANGE.format(beta))
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    temperature = check_temperature(temperature)
    if not FLOAT32_TINY <= 1.0 / temperature <= FLOAT32_MAX:
        raise ValueError(INVERSE_TEMPERATURE_RANGE.format(temperature))
    student_cap = check_softcapping(student_softcapping, "student_softcapping")
    teacher_cap = check_softcapping(teacher_softcapping, "teacher_softcapping")
    return JsdOptions(beta, temperature, ignore_index, student_cap, teacher_cap)


# --- the arrays ---------------------------------------------------------------------------------------------------


def check_floating(tensor, name, dtypes=None):
    """A floating-point tensor; with `dtypes`, of one of them."""
    floating = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
    if not floating or (dtypes is not None and tensor.dtype not in dtypes):
        raise TypeError(FLOAT_DTYPE_ERROR.format(name=name, dtype=dtype_name(tensor)))


def check_logits(student_logits, teacher_logits):
    """student (..., V) with V >= 1 and teacher (..., V_t) with V_t >= V: floating, on one device, the same leading
    shape."""
    check_floating(student_logits, "student_logits")
    check_floating(teacher_logits, "teacher_logits")
    if student_logits.dim() < 1 or student_logits.shape[-1] < 1:
        raise ValueError(LAST_DIMENSION.format(name="student_logits", dim="V", shape=tuple(student_logits.shape)))
    if teacher_logits.device != student_logits.device:
        raise ValueError(f"teacher_logits is on {teacher_logits.device} but student_logits on {student_logits.device}")
    check_leading_shape(student_logits, teacher_logits, "student_logits", "teacher_logits")
    check_vocabularies(student_logits.shape[-1], teacher_logits.shape[-1], "teacher_logits")


def check_leading_shape(student, teacher, student_name, teacher_name):
    if teacher.dim() != student.dim() or teacher.shape[:-1] != student.shape[:-1]:
        lead = tuple(student.shape[:-1])
        raise ValueError(
            LEADING_SHAPE.format(name=teacher_name, student=student_name, lead=lead, shape=tuple(teacher.shape))
        )


def check_vocabularies(vocab_student, vocab_teacher, teacher_name):
    if vocab_teacher < vocab_student:
        raise ValueError(TEACHER_VOCABULARY.format(name=teacher_name, teacher=vocab_teacher, student=vocab_student))


def check_head(hidden, weight, bias, side):
    """One model's hidden (..., H) with H >= 1, weight (V, H) with V >= 1 and bias (V,) or None: float32, bfloat16,
    float16 or float64 tensors on hidden's device, each bad one naming itself."""
    for name, tensor in ((f"{side}_hidden", hidden), (f"{side}_weight", weight), (f"{side}_bias", bias)):
        if tensor is None and name.endswith("bias"):
            continue
        check_floating(tensor, name, INPUT_DTYPES)
        if tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device} but {side}_hidden on {hidden.device}")
    if hidden.dim() < 1 or hidden.shape[-1] < 1:
        raise ValueError(LAST_DIMENSION.format(name=f"{side}_hidden", dim="H", shape=tuple(hidden.shape)))
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(WEIGHT_SHAPE.format(name=f"{side}_weight", hidden=hidden.shape[-1], shape=tuple(weight.shape)))
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(BIAS_SHAPE.format(name=f"{side}_bias", vocab=weight.shape[0], shape=tuple(bias.shape)))


def check_heads(student, teacher):
    """linear_jsd's (hidden, weight, bias) of each model: each head checked, the same leading shape, the teacher's
    vocabulary at least the student's."""
    check_head(*student, "student")
    check_head(*teacher, "teacher")
    if teacher[0].device != student[0].device:
        raise ValueError(f"teacher_hidden is on {teacher[0].device} but student_hidden on {student[0].device}")
    check_leading_shape(student[0], teacher[0], "student_hidden", "teacher_hidden")
    check_vocabularies(student[1].shape[0], teacher[1].shape[0], "teacher_weight")


def check_jsd_labels(labels, student, name):
    """labels: None (every row counts) or an int32/int64 tensor with the leading shape of `name` (`student`)."""
    if labels is not None:
        check_labels(labels, name, student.shape, student.device)


def row_divisor(labels, n_rows, reduction, ignore_index, device):
    """The reduction's divisor as a 0-d float32 device tensor (no host synchronisation): the counted rows, at least
    1, for "mean"; 1 for "sum"; None for "none"."""
    if reduction == "none":
        return None
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=device)
    if labels is None:
        return torch.full((), float(max(n_rows, 1)), dtype=torch.float32, device=device)
    return (labels != ignore_index).sum().clamp_min(1).to(torch.float32)
