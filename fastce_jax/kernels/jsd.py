"""Pallas (Triton backend) kernels of the distillation loss (``fastce_jax.jsd``, ``linear_jsd``), and their launchers.

With u_s = z_s / T, u_t = z_t / T (z: the soft-capped logits; the temperature is folded into the transform's
options, jsd_contract.JsdOptions), ls = log softmax(u_s), lt = log softmax(u_t) over the student's V columns:
beta = 0 is KL(p_t || p_s), beta = 1 is KL(p_s || p_t), otherwise, with lm = log((1 - beta) p_s + beta p_t),
beta KL(p_t || m) + (1 - beta) KL(p_s || m) (TRL's generalized JSD).

* ``jsd_forward_kernel``, grid (N,): one program walks one row in BLOCK-wide tiles. Pass 1 keeps the running max and
  sum of exponentials of u_s and u_t (rescaled as the max moves, as forward.py does) and, for beta in {0, 1}, the
  running sum sum_j e_j (u_a - u_b) weighted by the exponentials of the distribution the KL is taken under, which
  gives the KL with no second pass: KL(p_t || p_s) = E_t[u_t - u_s] - lse_t + lse_s. A mixture (0 < beta < 1)
  needs both lse first: pass 2 sums KL(p_t || m) and KL(p_s || m). Writes per row the loss, lse_s, lse_t and
  kl_s, the row constant of the gradient (the loss for beta = 1, KL(p_s || m) for a mixture, the loss for beta = 0
  where it is unused). A row whose label is ignore_index reads nothing (its loss and kl_s are 0).
* ``jsd_backward_kernel``, grid (N, cdiv(V, BLOCK)): one tile of d loss / d student logits in one pass, times the
  row's upstream factor: p_s - p_t (beta = 0), p_s (ls - lt - kl_s) (beta = 1), (1 - beta) p_s (ls - lm - kl_s)
  (mixture), then d u / d x (1 / T and the soft-capping's 1 - tanh^2). The teacher gets no gradient.

Terms whose probability is 0 (a -inf logit, or an exponential that underflows) contribute 0: a ``where``, never
0 * inf. NaN or +inf in a row's logits make that row's loss and gradient NaN. The teacher's logits may be wider
than the student's (a padded head): only its first V columns are read. beta reaches the mixture kernels at run
time (``beta_terms``), so every beta in (0, 1) shares one compiled kernel.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..contract import ignore_value, transform
from ..jsd_contract import FORWARD_KL, MIXTURE, REVERSE_KL, JsdOptions
from .common import cdiv, dz_dx, next_pow2
from .launch import _launch, _same_variance, quiet_triton

# Untuned first values (two logits arrays per tile, so half the CE forward's 4096-wide tile); the bench tool
# sweeps them by setting these module constants.
FORWARD_BLOCK, FORWARD_WARPS = 2048, 4
BACKWARD_BLOCK, BACKWARD_WARPS = 2048, 4


class JsdConfig(NamedTuple):
    """Tiles of the two kernels for one vocabulary size: the forward walks a row in ``forward_block`` columns,
    the backward gives each program ``backward_block`` columns of one row."""

    forward_block: int
    forward_warps: int
    backward_block: int
    backward_warps: int


def jsd_config(vocab: int) -> JsdConfig:
    """The tiles for V = vocab (V alone decides: a row's result does not depend on the batch)."""
    return JsdConfig(
        min(FORWARD_BLOCK, next_pow2(vocab)), FORWARD_WARPS, min(BACKWARD_BLOCK, next_pow2(vocab)), BACKWARD_WARPS
    )


def beta_terms(beta: float):
    """(beta, 1 - beta, log beta, log(1 - beta)), float64 on the host: the mixture's constants, which the kernels
    read at run time (as float32) and the jnp reference uses as they are."""
    return (beta, 1.0 - beta, math.log(beta), math.log1p(-beta))


def beta_operand(beta: float) -> np.ndarray:
    """beta_terms as the kernels' float32 (4,) operand."""
    return np.asarray(beta_terms(beta), np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Kernel helpers (traced inside the kernels).
# ----------------------------------------------------------------------------------------------------------------


def _transformed_tile(ref, start, block: int, mask, options):
    """u of one tile (float32), -inf in the lanes past the row (masked again after the transform: soft-capping
    maps the -inf filler to -cap)."""
    x = plgpu.load(ref.at[pl.ds(start, block)], mask=mask, other=-jnp.inf).astype(jnp.float32)
    return jnp.where(mask, transform(x, options), -jnp.inf)


def _online(m, s, u):
    """The running max m and sum s of exp(u - m) with tile u added: (max, sum, the tile's exp(u - max), the
    factor the earlier sums were rescaled by). A max still at -inf shifts by 0, so no -inf - -inf = NaN appears;
    NaN and +inf stay NaN."""
    m_new = jnp.maximum(m, jnp.max(u))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    rescale = jnp.exp(m - m_safe)
    e = jnp.exp(u - m_safe)
    return m_new, s * rescale + jnp.sum(e), e, rescale


def _lse(m, s):
    return jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(s)


def _log_mixture(ls, lt, log_one_minus_beta, log_beta):
    """lm = log((1 - beta) p_s + beta p_t) from the log-probabilities (no underflow of the mixture itself). Where
    both are -inf it is NaN, which the callers never select (both probabilities are 0 there)."""
    a = log_one_minus_beta + ls
    b = log_beta + lt
    # Selects, not maximum / minimum: the GPU's max and min return the other operand for a NaN, and a NaN row must
    # stay NaN (a NaN a or b fails the comparison and lands in lo or hi either way).
    a_higher = a >= b
    hi = jnp.where(a_higher, a, b)
    lo = jnp.where(a_higher, b, a)
    return hi + jnp.log1p(jnp.exp(lo - hi))


def _weighted(p, value):
    """sum_j p_j value_j over the lanes where p_j > 0 (p = 0 contributes 0, even where value is infinite)."""
    return jnp.sum(jnp.where(p == 0.0, 0.0, p * value))


def _split_refs(refs, opts: JsdOptions, has_labels: bool):
    """(label ref or None, beta ref or None, the remaining refs) of a kernel's optional inputs."""
    refs = list(refs)
    y_ref = refs.pop(0) if has_labels else None
    beta_ref = refs.pop(0) if opts.kind == MIXTURE else None
    return y_ref, beta_ref, refs


# ----------------------------------------------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------------------------------------------


def jsd_forward_kernel(xs_ref, xt_ref, *refs, vocab: int, block: int, opts: JsdOptions, ignore_index):
    """Grid (N,): one row's loss, lse_s, lse_t and kl_s (0-d outputs).

    xs_ref, xt_ref: the row's student and teacher logits (at least V columns; the lanes past V are masked); refs:
    the row's label (0-d) when ``ignore_index`` is not None, the beta operand (4,) for a mixture (beta_terms),
    then the four outputs. vocab: V, the student's columns; block: tile width; opts: the kind and the two
    transforms.
    """
    y_ref, beta_ref, (loss_ref, lse_s_ref, lse_t_ref, kl_ref) = _split_refs(refs, opts, ignore_index is not None)
    n_tiles = jnp.int32(cdiv(vocab, block))
    ignored = None
    if y_ref is not None:
        ignored = y_ref[...] == ignore_index
        n_tiles = jnp.where(ignored, jnp.int32(0), n_tiles)  # an ignored row reads nothing

    def tile(k):
        start = k * block
        mask = start + jnp.arange(block, dtype=jnp.int32) < vocab
        return _transformed_tile(xs_ref, start, block, mask, opts.student), _transformed_tile(
            xt_ref, start, block, mask, opts.teacher
        )

    def statistics(k, carry):
        m_s, s_s, m_t, s_t, acc = carry
        u_s, u_t = tile(k)
        m_s, s_s, e_s, r_s = _online(m_s, s_s, u_s)
        m_t, s_t, e_t, r_t = _online(m_t, s_t, u_t)
        # beta in {0, 1}: sum_j e_j (u_a - u_b) under the distribution the KL is taken over, rescaled with its sum.
        if opts.kind == FORWARD_KL:
            acc = acc * r_t + _weighted(e_t, u_t - u_s)
        elif opts.kind == REVERSE_KL:
            acc = acc * r_s + _weighted(e_s, u_s - u_t)
        return m_s, s_s, m_t, s_t, acc

    neg_inf, zero = jnp.float32(-jnp.inf), jnp.float32(0.0)
    m_s, s_s, m_t, s_t, acc = jax.lax.fori_loop(0, n_tiles, statistics, (neg_inf, zero, neg_inf, zero, zero))
    lse_s, lse_t = _lse(m_s, s_s), _lse(m_t, s_t)
    if opts.kind == FORWARD_KL:
        loss = kl = acc / s_t + lse_s - lse_t
    elif opts.kind == REVERSE_KL:
        loss = kl = acc / s_s - lse_s + lse_t
    else:
        beta, one_minus_beta, log_beta, log_one_minus_beta = (beta_ref[i] for i in range(4))

        def divergences(k, carry):
            kl_t, kl_s = carry
            u_s, u_t = tile(k)
            ls, lt = u_s - lse_s, u_t - lse_t
            lm = _log_mixture(ls, lt, log_one_minus_beta, log_beta)
            return kl_t + _weighted(jnp.exp(lt), lt - lm), kl_s + _weighted(jnp.exp(ls), ls - lm)

        kl_t, kl = jax.lax.fori_loop(0, n_tiles, divergences, (zero, zero))
        loss = beta * kl_t + one_minus_beta * kl
    if ignored is not None:
        loss, kl = jnp.where(ignored, 0.0, loss), jnp.where(ignored, 0.0, kl)
    plgpu.store(loss_ref, loss)
    plgpu.store(lse_s_ref, lse_s)
    plgpu.store(lse_t_ref, lse_t)
    plgpu.store(kl_ref, kl)


def jsd_backward_kernel(
    xs_ref, xt_ref, lse_s_ref, lse_t_ref, kl_ref, g_ref, *refs, vocab: int, block: int, opts: JsdOptions, ignore_index
):
    """Grid (N, cdiv(V, block)): one tile of one row's d loss / d student logits, times the row's upstream g.

    xs_ref, xt_ref: the tile of student and teacher logits (block,); lse_s_ref, lse_t_ref, kl_ref, g_ref: the
    row's statistics from the forward and its upstream factor (0-d); refs: the label (0-d) when ``ignore_index``
    is not None, the beta operand (4,) for a mixture, then dx_ref (the output tile). An ignored row loads nothing
    and writes zeros.
    """
    y_ref, beta_ref, (dx_ref,) = _split_refs(refs, opts, ignore_index is not None)
    cols = pl.program_id(1) * block + jnp.arange(block, dtype=jnp.int32)
    mask = cols < vocab
    read = mask if y_ref is None else mask & (y_ref[...] != ignore_index)
    x_s = plgpu.load(xs_ref.at[pl.ds(0, block)], mask=read, other=0.0).astype(jnp.float32)
    x_t = plgpu.load(xt_ref.at[pl.ds(0, block)], mask=read, other=0.0).astype(jnp.float32)
    u_s = transform(x_s, opts.student)
    ls = u_s - lse_s_ref[...]
    lt = transform(x_t, opts.teacher) - lse_t_ref[...]
    p_s = jnp.exp(ls)
    if opts.kind == FORWARD_KL:
        d = p_s - jnp.exp(lt)
    elif opts.kind == REVERSE_KL:
        d = jnp.where(p_s == 0.0, 0.0, p_s * (ls - lt - kl_ref[...]))
    else:
        lm = _log_mixture(ls, lt, beta_ref[3], beta_ref[2])
        d = beta_ref[1] * jnp.where(p_s == 0.0, 0.0, p_s * (ls - lm - kl_ref[...]))
    d = d * g_ref[...]
    du = dz_dx(u_s, opts.student)  # 1 / T and the soft-capping's derivative, from u alone
    if du is not None:
        d = d * du
    if y_ref is not None:
        d = jnp.where(y_ref[...] == ignore_index, 0.0, d)
    plgpu.store(dx_ref.at[pl.ds(0, block)], d.astype(dx_ref.dtype), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers: 2-D logits (N, V) and (N, V_t >= V), labels (N,) or None.
# ----------------------------------------------------------------------------------------------------------------


def _optional_operands(labels, beta, opts: JsdOptions):
    """(operands, the label value a row is ignored at or None): the labels only when some row can be ignored (no
    label of their dtype may equal ignore_index: then they are not needed), beta only for a mixture."""
    ignore = None if labels is None else ignore_value(labels.dtype, opts.ignore_index)
    operands = () if ignore is None else (labels,)
    if opts.kind == MIXTURE:
        if beta is None:
            raise ValueError("a mixture (0 < beta < 1) needs the beta operand (beta_operand(beta))")
        operands += (jnp.asarray(beta, jnp.float32),)
    return operands, ignore


def jsd_forward(student, teacher, labels, beta, opts: JsdOptions, *, interpret: bool, config: JsdConfig | None = None):
    """(loss, lse_s, lse_t, kl_s), float32 (N,) each, of student logits (N, V) and teacher logits (N, V_t >= V);
    labels (N,) or None (every row counts); beta: beta_operand(beta) for a mixture, else None."""
    n, vocab = student.shape
    config = jsd_config(vocab) if config is None else config
    block = config.forward_block
    extra, ignore = _optional_operands(labels, beta, opts)
    operands, mat = _same_variance(student, teacher, *extra)
    # The whole row as one block, padded to whole tiles (the lanes past V are masked in the kernel).
    row = pl.BlockSpec((None, cdiv(vocab, block) * block), lambda i: (i, 0))
    scalar = pl.BlockSpec((None,), lambda i: (i,))
    in_specs = [row, row] + [scalar] * (ignore is not None)
    in_specs += [pl.BlockSpec((4,), lambda i: (0,))] * (opts.kind == MIXTURE)
    call = pl.pallas_call(
        functools.partial(jsd_forward_kernel, vocab=vocab, block=block, opts=opts, ignore_index=ignore),
        grid=(n,),
        in_specs=in_specs,
        out_specs=[scalar] * 4,
        out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32, manual_axis_type=mat)] * 4,
        compiler_params=plgpu.CompilerParams(num_warps=config.forward_warps, num_stages=1),
        interpret=interpret,
        name="fastce_jsd_forward",
    )
    with quiet_triton(interpret):
        return tuple(_launch(call, operands, mat, interpret))


def jsd_backward(
    student, teacher, labels, beta, lse_s, lse_t, kl, g, opts: JsdOptions, *, inplace: bool, interpret: bool,
    config: JsdConfig | None = None,
):  # fmt: skip
    """d loss / d student logits (N, V) in the student's dtype, the row's loss gradient times g (N,); lse_s, lse_t,
    kl: the forward's per-row statistics. inplace: the output aliases the student logits (each program reads its
    tile before writing it; XLA copies when the logits are still needed)."""
    n, vocab = student.shape
    config = jsd_config(vocab) if config is None else config
    block = config.backward_block
    extra, ignore = _optional_operands(labels, beta, opts)
    rows = tuple(a.astype(jnp.float32) for a in (lse_s, lse_t, kl, g))
    operands, mat = _same_variance(student, teacher, *rows, *extra)
    tile = pl.BlockSpec((None, block), lambda i, j: (i, j))
    scalar = pl.BlockSpec((None,), lambda i, j: (i,))
    in_specs = [tile, tile] + [scalar] * (4 + (ignore is not None))
    in_specs += [pl.BlockSpec((4,), lambda i, j: (0,))] * (opts.kind == MIXTURE)
    call = pl.pallas_call(
        functools.partial(jsd_backward_kernel, vocab=vocab, block=block, opts=opts, ignore_index=ignore),
        grid=(n, cdiv(vocab, block)),
        in_specs=in_specs,
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(student.shape, student.dtype, manual_axis_type=mat),
        input_output_aliases={0: 0} if inplace else {},
        compiler_params=plgpu.CompilerParams(num_warps=config.backward_warps, num_stages=1),
        interpret=interpret,
        name="fastce_jsd_backward",
    )
    with quiet_triton(interpret):
        return _launch(call, operands, mat, interpret)
