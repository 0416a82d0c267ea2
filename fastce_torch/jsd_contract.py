"""jsd / linear_jsd's contract in plain torch: the distillation options record (JsdOptions, the custom ops' option
arguments in its order) and the checks of their keywords; the same module, names and messages as fastce_jax's
jsd_contract."""

from typing import NamedTuple

from .contract import BACKENDS, FLOAT32_MAX, FLOAT32_TINY, REDUCTIONS, check_temperature


class JsdOptions(NamedTuple):
    """jsd / linear_jsd's checked options, as the kernels and custom ops take them."""

    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    student_softcapping: float = 0.0
    teacher_softcapping: float = 0.0


def check_jsd_options(beta, temperature, ignore_index, reduction, student_softcapping, teacher_softcapping, backend):
    """Checks jsd / linear_jsd's keywords (in fastce_jax's order, with its messages) and returns JsdOptions: beta a
    real number in [0, 1], ignore_index an int, reduction and backend as cross_entropy's, temperature > 0 with
    1 / temperature in float32's normal range (the kernels multiply by it), each softcapping 0 (off) or in float32's
    normal range."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"beta must be a Python float in [0, 1], got {beta!r}")
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:  # NaN fails too
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    temperature = check_temperature(temperature)
    if not FLOAT32_TINY <= 1.0 / temperature <= FLOAT32_MAX:
        raise ValueError(f"temperature={temperature} puts 1 / temperature outside float32's normal range")
    caps = []
    for name, value in (("student_softcapping", student_softcapping), ("teacher_softcapping", teacher_softcapping)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a real number, got {value!r}")
        value = float(value)
        if not (value == 0.0 or FLOAT32_TINY <= value <= FLOAT32_MAX):
            raise ValueError(f"{name} must be >= 0 (0 disables it) and finite in float32's normal range, got {value}")
        caps.append(value)
    return JsdOptions(beta, temperature, ignore_index, *caps)
