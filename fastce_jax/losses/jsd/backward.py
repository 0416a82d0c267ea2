"""The backward kernel of the distillation loss: ``jsd_backward_kernel``, grid (N, cdiv(V, BLOCK)), one tile of
d loss / d student logits in one pass, times the row's upstream factor: p_s - p_t (beta = 0), p_s (ls - lt - kl_s)
(beta = 1), (1 - beta) p_s (ls - lm - kl_s) (mixture), then d u / d x (1 / T and the soft-capping's 1 - tanh^2); in
base 2 as the forward (forward.py), with the mixture's one log per element shared with its pass 2. The teacher gets
no gradient; launch.py may alias the output with the student logits.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.kernel_helpers import dz_dx
from ...core.reference import transform
from .forward import LN2, LOG2E, mixture_log2, split_refs
from .options import FORWARD_KL, MIXTURE, REVERSE_KL, JsdOptions

__all__ = ["jsd_backward_kernel"]


def jsd_backward_kernel(
    xs_ref, xt_ref, lse_s_ref, lse_t_ref, kl_ref, g_ref, *refs, vocab: int, block: int, opts: JsdOptions, ignore_index,
    ptx: bool,
):  # fmt: skip
    """Grid (N, cdiv(V, block)): one tile of one row's d loss / d student logits, times the row's upstream g.

    In base 2 as the forward (ls2 = (u - lse) log2(e), exp2, and for a mixture one log per element:
    forward.mixture_log2; ptx: the GPU's lg2.approx); the log-ratios come back to natural units (ln 2) in the row's
    factor. u itself stays natural, so the soft-capping's derivative (dz_dx, from u) is exactly 0 where tanh
    saturates.
    xs_ref, xt_ref: the tile of student and teacher logits (block,); lse_s_ref, lse_t_ref, kl_ref, g_ref: the
    row's statistics from the forward (natural units) and its upstream factor (0-d); refs: the label (0-d) when
    ``ignore_index`` is not None, the beta operand (4,) for a mixture, then dx_ref (the output tile). An ignored
    row loads nothing and writes zeros.
    """
    y_ref, beta_ref, (dx_ref,) = split_refs(refs, ignore_index is not None, opts.kind == MIXTURE)
    cols = pl.program_id(1) * block + jnp.arange(block, dtype=jnp.int32)
    mask = cols < vocab
    read = mask if y_ref is None else mask & (y_ref[...] != ignore_index)
    x_s = plgpu.load(xs_ref.at[pl.ds(0, block)], mask=read, other=0.0).astype(jnp.float32)
    x_t = plgpu.load(xt_ref.at[pl.ds(0, block)], mask=read, other=0.0).astype(jnp.float32)
    u_s = transform(x_s, opts.student)
    ls = (u_s - lse_s_ref[...]) * LOG2E
    lt = (transform(x_t, opts.teacher) - lse_t_ref[...]) * LOG2E
    g = g_ref[...]
    if opts.kind == FORWARD_KL:
        d = jnp.exp2(ls) - jnp.exp2(lt)
    elif opts.kind == REVERSE_KL:
        p_s = jnp.exp2(ls)
        d = jnp.where(p_s == 0.0, 0.0, p_s * (ls - lt - kl_ref[...] * LOG2E))
        g = g * LN2
    else:
        p_s, _, lm = mixture_log2(ls, lt, beta_ref[0], beta_ref[1], ptx)
        d = jnp.where(p_s == 0.0, 0.0, p_s * (ls - lm - kl_ref[...] * LOG2E))
        g = g * (beta_ref[1] * LN2)
    du = dz_dx(u_s, opts.student)  # 1 / T and the soft-capping's derivative, from u alone
    d = d * g if du is None else d * g * du
    if y_ref is not None:
        d = jnp.where(y_ref[...] == ignore_index, 0.0, d)
    plgpu.store(dx_ref.at[pl.ds(0, block)], d.astype(dx_ref.dtype), mask=mask)
