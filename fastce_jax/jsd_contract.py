"""jsd / linear_jsd's contract in JAX terms: the distillation options record (JsdOptions, static: part of the jit
and kernel cache keys) and the checks of their keywords; the same module, names and messages as fastce_torch's
jsd_contract."""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from .contract import BACKENDS, REDUCTIONS, Options, _real, check_temperature, fold_temperature

FORWARD_KL, REVERSE_KL, MIXTURE = "forward_kl", "reverse_kl", "mixture"  # beta = 0, beta = 1, 0 < beta < 1


class JsdOptions(NamedTuple):
    """jsd / linear_jsd's static options: which divergence (beta's kind; a mixture's beta itself is a run-time
    operand), ignore_index, and each side's transform u = softcap(x) / T as an Options record with the temperature
    folded in (fold_temperature)."""

    kind: str
    ignore_index: int
    student: Options
    teacher: Options


def check_jsd_options(
    *, beta, temperature, ignore_index, reduction, student_softcapping, teacher_softcapping, backend
) -> tuple[JsdOptions, float]:
    """(JsdOptions, beta as a float) of jsd / linear_jsd's keywords; each bad one raises naming itself."""
    if isinstance(beta, (bool, np.bool_)) or not isinstance(beta, numbers.Real):
        raise TypeError(f"beta must be a Python float in [0, 1], got {beta!r}")
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:  # NaN fails too
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    temperature = check_temperature(temperature)
    sides = []
    for name, cap in (("student_softcapping", student_softcapping), ("teacher_softcapping", teacher_softcapping)):
        cap = _real(cap, name)
        if cap < 0:
            raise ValueError(f"{name} must be >= 0, got {cap}")
        sides.append(fold_temperature(Options(logit_softcapping=cap), temperature))
    kind = FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXTURE
    return JsdOptions(kind, int(ignore_index), *sides), beta
