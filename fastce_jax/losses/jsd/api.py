"""The public ``jsd``: TRL's generalized Jensen-Shannon divergence between a student's and a teacher's logits,
forward KL at beta = 0 and reverse KL at beta = 1 (CONTRACT.md). The argument checks are options.py's, the jnp
reference reference.py's, the kernel path autograd.py's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ...core.launch import quiet_triton
from ...core.options import INTERPRETED, route
from . import autograd
from .launch import beta_operand, jsd_config
from .options import MIXTURE, check_jsd_labels, check_jsd_options, check_logits
from .reference import reference_loss, reference_terms

__all__ = ["jsd"]


def jsd(
    student_logits,
    teacher_logits,
    labels=None,
    *,
    beta=0.5,
    temperature=1.0,
    ignore_index=-100,
    reduction="mean",
    student_softcapping=0.0,
    teacher_softcapping=0.0,
    backend="auto",
):
    """TRL's generalized Jensen-Shannon divergence between the student's and the teacher's next-token
    distributions, per token, reduced.

    With p_s = softmax(z_s / T), p_t = softmax(z_t / T) (z: the logits after soft-capping, c * tanh(x / c), c = 0
    off): beta = 0 is KL(p_t || p_s) (forward KL), beta = 1 is KL(p_s || p_t) (reverse KL), and 0 < beta < 1 is
    beta KL(p_t || m) + (1 - beta) KL(p_s || m) with m = (1 - beta) p_s + beta p_t.

    Args:
      student_logits: float32/bfloat16/float16/float64 (..., V).
      teacher_logits: (..., V_t), the same leading shape, V_t >= V: a wider (padded) teacher head is compared on
        its first V columns, its softmax taken over them (exact when its extra columns are -inf or carry no
        mass); the other columns are never read.
      labels: None (every token counts) or int32/int64 (...): only a mask, tokens whose label is ``ignore_index``
        count for nothing (loss 0, gradient 0, their logits never read); other values are not read.
      beta: a float in [0, 1]. temperature: T > 0. student_softcapping, teacher_softcapping: c >= 0 (0: off).
      reduction: "mean" (over the counted tokens; 0 when none is counted), "sum" or "none" (per token, the
        leading shape).
      backend: "auto" (the kernels for GPU arrays, the jnp reference elsewhere; under a trace in a process with a
        GPU backend decided when lowered), "kernel" (the Pallas kernels always; interpret mode off GPU) or
        "reference" (plain jnp, every transform). float64 student logits are computed in float64 by the reference.

    The loss is float32 (float64 for float64 student logits); a NaN in a token's logits makes that token's loss
    and gradient NaN only. The student gets the gradient (in its dtype); the teacher is a constant
    (``stop_gradient``: its gradient is zero). jit, grad and vmap work; a call that is not differentiated keeps
    nothing for a backward.
    """
    opts, beta = check_jsd_options(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        student_softcapping=student_softcapping, teacher_softcapping=teacher_softcapping, backend=backend,
    )  # fmt: skip
    student, teacher = check_logits(student_logits, teacher_logits)
    labels = check_jsd_labels(labels, student.shape[:-1], opts.ignore_index, "student_logits")
    path = route(student, backend)
    student, teacher = jnp.asarray(student), jnp.asarray(teacher)
    labels = None if labels is None else jnp.asarray(labels)
    if jnp.float64 in (student.dtype, teacher.dtype) or math.prod(student.shape[:-1]) == 0:
        path = "reference"  # the kernels compute in float32; an empty grid has no kernel
    if path == "reference":
        return reference_loss(student, teacher, labels, reference_terms(beta, opts, student.dtype), opts, reduction)
    vocab = student.shape[-1]
    st = autograd.JsdLaunch(opts, path == INTERPRETED, labels is not None, jsd_config(vocab), jax.device_count() > 1)
    operand = beta_operand(beta) if opts.kind == MIXTURE else None
    with quiet_triton(interpret=path == INTERPRETED):
        return autograd.kernel_loss(student, teacher, labels, operand, st=st, mode=path, reduction=reduction)
