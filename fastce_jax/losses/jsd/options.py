"""jsd / linear_jsd's options in JAX terms: the distillation options record (JsdOptions, static: part of the jit
and kernel cache keys), the checks of every argument, beta's kind and its constants (beta_terms) and the reduction
over the counted rows (counted_rows, reduce_rows); the same module, names and messages as fastce_torch's
losses/jsd/options.py (shared_tests/test_jsd.py compares the two packages' messages)."""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from ...core.options import (
    FLOAT32_TINY,
    Options,
    check_float_array,
    check_index_reduction_backend,
    check_labels,
    check_temperature,
    fold_temperature,
    ignore_value,
)

__all__ = [
    "FLOAT32_MAX",
    "BETA_TYPE",
    "BETA_RANGE",
    "INVERSE_TEMPERATURE_RANGE",
    "SOFTCAPPING_TYPE",
    "SOFTCAPPING_RANGE",
    "LAST_DIMENSION",
    "LEADING_SHAPE",
    "TEACHER_VOCABULARY",
    "WEIGHT_SHAPE",
    "BIAS_SHAPE",
    "FORWARD_KL",
    "REVERSE_KL",
    "MIXTURE",
    "JsdOptions",
    "check_softcapping",
    "check_jsd_options",
    "beta_terms",
    "check_logits",
    "check_leading_shape",
    "check_vocabularies",
    "check_head",
    "check_heads",
    "check_jsd_labels",
    "counted_rows",
    "reduce_rows",
]

FLOAT32_MAX = float(np.finfo(np.float32).max)

# The messages of bad arguments, word for word those of fastce_torch's losses/jsd/options.py.
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

FORWARD_KL, REVERSE_KL, MIXTURE = "forward_kl", "reverse_kl", "mixture"  # beta = 0, beta = 1, 0 < beta < 1


class JsdOptions(NamedTuple):
    """jsd / linear_jsd's static options: which divergence (beta's kind; a mixture's beta itself is a run-time
    operand), ignore_index, and each side's transform u = softcap(x) / T as an Options record with the temperature
    folded in (fold_temperature)."""

    kind: str
    ignore_index: int
    student: Options
    teacher: Options


def check_softcapping(value, name: str) -> float:
    """A softcapping keyword as a float: 0 (off) or in float32's normal range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(SOFTCAPPING_TYPE.format(name, value))
    value = float(value)
    if not (value == 0.0 or FLOAT32_TINY <= value <= FLOAT32_MAX):
        raise ValueError(SOFTCAPPING_RANGE.format(name, value))
    return value


def check_jsd_options(
    *, beta, temperature, ignore_index, reduction, student_softcapping, teacher_softcapping, backend
) -> tuple[JsdOptions, float]:
    """(JsdOptions, beta as a float) of jsd / linear_jsd's keywords; each bad one raises naming itself."""
    if isinstance(beta, (bool, np.bool_)) or not isinstance(beta, numbers.Real):
        raise TypeError(BETA_TYPE.format(beta))
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:  # NaN fails too
        raise ValueError(BETA_RANGE.format(beta))
    check_index_reduction_backend(ignore_index, reduction, backend)
    temperature = check_temperature(temperature)
    if not FLOAT32_TINY <= 1.0 / temperature <= FLOAT32_MAX:
        raise ValueError(INVERSE_TEMPERATURE_RANGE.format(temperature))
    sides = []
    for name, cap in (("student_softcapping", student_softcapping), ("teacher_softcapping", teacher_softcapping)):
        sides.append(fold_temperature(Options(logit_softcapping=check_softcapping(cap, name)), temperature))
    kind = FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXTURE
    return JsdOptions(kind, int(ignore_index), *sides), beta


def beta_terms(beta: float):
    """(beta, 1 - beta, log beta, log(1 - beta)), float64 on the host: the mixture's constants, which the kernels
    read at run time (as float32) and the jnp reference uses as they are."""
    return (beta, 1.0 - beta, math.log(beta), math.log1p(-beta))


# --- the arrays -----------------------------------------------------------------------------------------------------


def check_logits(student_logits, teacher_logits):
    """The two logits arrays, checked: floating, student (..., V) with V >= 1, teacher (..., V_t) with the same
    leading shape and V_t >= V."""
    student = check_float_array(student_logits, "student_logits")
    teacher = check_float_array(teacher_logits, "teacher_logits")
    if student.ndim < 1 or student.shape[-1] < 1:
        raise ValueError(LAST_DIMENSION.format(name="student_logits", dim="V", shape=tuple(student.shape)))
    check_leading_shape(student, teacher, "student_logits", "teacher_logits")
    check_vocabularies(student.shape[-1], teacher.shape[-1], "teacher_logits")
    return student, teacher


def check_leading_shape(student, teacher, student_name: str, teacher_name: str):
    if teacher.ndim != student.ndim or tuple(teacher.shape[:-1]) != tuple(student.shape[:-1]):
        lead = tuple(student.shape[:-1])
        raise ValueError(
            LEADING_SHAPE.format(name=teacher_name, student=student_name, lead=lead, shape=tuple(teacher.shape))
        )


def check_vocabularies(vocab_student: int, vocab_teacher: int, teacher_name: str):
    if vocab_teacher < vocab_student:
        raise ValueError(TEACHER_VOCABULARY.format(name=teacher_name, teacher=vocab_teacher, student=vocab_student))


def check_head(hidden, weight, bias, side: str):
    """One model's (hidden (..., H), weight (V, H), bias (V,) or None) as arrays, and their promoted dtype; each bad
    one raises naming itself."""
    hidden = check_float_array(hidden, f"{side}_hidden")
    weight = check_float_array(weight, f"{side}_weight")
    bias = None if bias is None else check_float_array(bias, f"{side}_bias")
    if hidden.ndim < 1 or hidden.shape[-1] < 1:
        raise ValueError(LAST_DIMENSION.format(name=f"{side}_hidden", dim="H", shape=tuple(hidden.shape)))
    if weight.ndim != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(WEIGHT_SHAPE.format(name=f"{side}_weight", hidden=hidden.shape[-1], shape=tuple(weight.shape)))
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(BIAS_SHAPE.format(name=f"{side}_bias", vocab=weight.shape[0], shape=tuple(bias.shape)))
    dtype = jnp.dtype(jnp.result_type(hidden.dtype, weight.dtype, *(() if bias is None else (bias.dtype,))))
    return (hidden, weight, bias), dtype


def check_heads(student, teacher):
    """linear_jsd's (hidden, weight, bias) of each model: each head checked, the same leading shape, the teacher's
    vocabulary at least the student's. Returns check_head's (arrays, dtype) of each."""
    student, dtype = check_head(*student, "student")
    teacher, teacher_dtype = check_head(*teacher, "teacher")
    check_leading_shape(student[0], teacher[0], "student_hidden", "teacher_hidden")
    check_vocabularies(student[1].shape[0], teacher[1].shape[0], "teacher_weight")
    return (student, dtype), (teacher, teacher_dtype)


def check_jsd_labels(labels, lead: tuple, ignore_index: int, name: str):
    """None (every row counts) or integer labels shaped ``lead``, the leading shape of ``name``."""
    return None if labels is None else check_labels(labels, lead, ignore_index, name)


# --- the reduction ------------------------------------------------------------------------------------------------


def counted_rows(labels, n_rows: int, ignore_index: int, dtype=jnp.float32):
    """The "mean" divisor: the number of rows whose label is not ignore_index (labels None: n_rows), at least 1
    (all ignored gives a mean of 0). Traced: no host synchronisation."""
    ign = None if labels is None else ignore_value(labels.dtype, ignore_index)
    count = n_rows if ign is None else jnp.sum(labels != ign)
    return jnp.maximum(count, 1).astype(dtype)


def reduce_rows(losses, labels, reduction: str, ignore_index: int):
    """The per-row losses reduced: "none" as they are, "sum", or "mean" over the counted rows (counted_rows)."""
    if reduction == "none":
        return losses
    total = jnp.sum(losses)
    if reduction == "sum":
        return total
    return total / counted_rows(labels, losses.size, ignore_index, total.dtype)
