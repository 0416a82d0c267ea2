"""The forward kernels of the distillation loss (``fastce_jax.jsd``, ``linear_jsd``), and the kernel helpers the
backward kernel (backward.py) shares.

With u_s = z_s / T, u_t = z_t / T (z: the soft-capped logits; the temperature is folded into the transform's
options, options.JsdOptions), ls = log softmax(u_s), lt = log softmax(u_t) over the student's V columns:
beta = 0 is KL(p_t || p_s), beta = 1 is KL(p_s || p_t), otherwise, with lm = log((1 - beta) p_s + beta p_t),
beta KL(p_t || m) + (1 - beta) KL(p_s || m) (TRL's generalized JSD).

The forward splits each row's V columns into S contiguous segments (launch.forward_segments: S grows until N * S
programs fill the GPU; S = 1 for large N) and works in base 2 (u2 = u log2(e), folded into the transforms'
constants; exp2, and lse and the KLs converted back once per row):
* ``jsd_partials_kernel``, grid (N, S), pass 1: one program walks one segment in BLOCK-wide tiles, keeping the
  running max and sum of 2^(u2 - max) of both models (rescaled as the max moves, as forward.py does) and, for beta
  in {0, 1}, the running sum_j e_j (u2_a - u2_b) weighted by the exponentials of the distribution the KL is taken
  under (KL(p_t || p_s) = E_t[u_t - u_s] - lse_t + lse_s needs no second pass). It writes these per-segment float32
  partials, (N, S) each.
* ``jsd_mixture_kernel``, grid (N, S), the mixture's pass 2 (0 < beta < 1): each program merges its row's S
  statistics into lse_s, lse_t, then sums over its segment the terms of KL(p_t || m) and KL(p_s || m), with one
  log per element (the GPU's lg2.approx): lm2 = log2((1 - beta) 2^ls2 + beta 2^lt2), shared by both terms.
* ``jsd_finish_kernel``, grid (N,): merges a row's S partials into its loss, lse_s, lse_t and kl_s (natural log
  units), the row constant of the gradient (the loss for beta = 1, KL(p_s || m) for a mixture, the loss for beta
  = 0 where it is unused). A row whose label is ignore_index reads no logits (its loss and kl_s are 0).

Terms whose probability is 0 (a -inf logit, or an exponential that underflows) contribute 0: a ``where``, never
0 * inf. NaN or +inf in a row's logits make that row's loss and gradient NaN. The teacher's logits may be wider
than the student's (a padded head): only its first V columns are read. beta reaches the mixture kernels at run
time (a (4,) operand of options.beta_terms), so every beta in (0, 1) shares one compiled kernel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.kernel_helpers import cdiv, next_pow2
from ...core.options import FLOAT32_TINY
from ...core.reference import transform
from .options import FORWARD_KL, MIXTURE, REVERSE_KL, JsdOptions

__all__ = [
    "LOG2E",
    "LN2",
    "mixture_log2",
    "split_refs",
    "jsd_partials_kernel",
    "jsd_mixture_kernel",
    "jsd_finish_kernel",
]

LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)


# ----------------------------------------------------------------------------------------------------------------
# Kernel helpers (traced inside the kernels).
# ----------------------------------------------------------------------------------------------------------------


def _transformed_tile(ref, start, block: int, mask, options):
    """u of one tile (float32), -inf in the lanes past the row (masked again after the transform: soft-capping
    maps the -inf filler to -cap)."""
    x = plgpu.load(ref.at[pl.ds(start, block)], mask=mask, other=-jnp.inf).astype(jnp.float32)
    return jnp.where(mask, transform(x, options), -jnp.inf)


def _online(m, s, u):
    """The running max m and sum s of 2^(u - m) (base 2: u is u2) with tile u added: (max, sum, the tile's
    2^(u - max), the factor the earlier sums were rescaled by). A max still at -inf shifts by 0, so no -inf - -inf
    = NaN appears; NaN and +inf stay NaN (through the sum, whatever the GPU's max does with a NaN)."""
    m_new = jnp.maximum(m, jnp.max(u))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    rescale = jnp.exp2(m - m_safe)
    e = jnp.exp2(u - m_safe)
    return m_new, s * rescale + jnp.sum(e), e, rescale


def _weighted(p, value):
    """sum_j p_j value_j over the lanes where p_j > 0 (p = 0 contributes 0, even where value is infinite)."""
    return jnp.sum(jnp.where(p == 0.0, 0.0, p * value))


def _log2(x, ptx: bool):
    """log2 x (float32). ptx: the GPU's lg2.approx.f32, one MUFU instruction (relative error about 2^-22; NaN stays
    NaN, 0 gives -inf), where jnp.log is libdevice's logf, about 20 instructions (the mixture's pass 2 was compute
    bound); Pallas' interpreter runs no PTX (ptx False)."""
    if not ptx:
        return jnp.log(x) * LOG2E
    (y,) = plgpu.elementwise_inline_asm(
        "lg2.approx.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )  # fmt: skip
    return y


def mixture_log2(ls, lt, beta, one_minus_beta, ptx: bool):
    """(p_s, p_t, lm) of base-2 log-probabilities ls, lt with lm = log2((1 - beta) p_s + beta p_t): two exp2 and one
    log per element (the mixture's pass 2 and the backward share it). The mixture is floored at float32's smallest
    normal number (a select: the GPU's max would drop a NaN, and a NaN row must stay NaN): where it underflows (to 0
    where flushed) both terms are below any sum's resolution, and lm stays finite (no p * inf)."""
    p_s, p_t = jnp.exp2(ls), jnp.exp2(lt)
    mixture = one_minus_beta * p_s + beta * p_t
    return p_s, p_t, _log2(jnp.where(mixture < FLOAT32_TINY, FLOAT32_TINY, mixture), ptx)


def split_refs(refs, has_labels: bool, has_beta: bool):
    """(label ref or None, beta ref or None, the remaining refs) of a kernel's optional inputs."""
    refs = list(refs)
    y_ref = refs.pop(0) if has_labels else None
    beta_ref = refs.pop(0) if has_beta else None
    return y_ref, beta_ref, refs


# ----------------------------------------------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------------------------------------------


def _segment(width: int, block: int, vocab: int, y_ref, ignore_index):
    """(first column of this program's segment, its number of tiles): the last segment may be ragged; an ignored
    row walks none (reads nothing)."""
    base = pl.program_id(1) * jnp.int32(width)
    n_tiles = cdiv(jnp.minimum(vocab - base, jnp.int32(width)), jnp.int32(block))
    if y_ref is not None:
        n_tiles = jnp.where(y_ref[...] == ignore_index, jnp.int32(0), n_tiles)
    return base, n_tiles


def _segment_tile(xs_ref, xt_ref, base, k, block: int, vocab: int, opts: JsdOptions):
    """(u2_s, u2_t) of tile k of a segment starting at column base (the refs hold the segment)."""
    start = k * block
    mask = base + start + jnp.arange(block, dtype=jnp.int32) < vocab
    return (
        _transformed_tile(xs_ref, start, block, mask, opts.student),
        _transformed_tile(xt_ref, start, block, mask, opts.teacher),
    )


def _row_lse2(m_ref, s_ref, n_seg: int):
    """(lse in base 2, sum of 2^(u2 - the row max), each segment's rescale factor 2^(m_j - the row max)) from one
    model's S partials (m_ref, s_ref: (S,)). A NaN or +inf in the row reaches the sum (as NaN), whatever the GPU's
    max does with it."""
    pad = next_pow2(n_seg)
    live = jnp.arange(pad, dtype=jnp.int32) < n_seg
    m = plgpu.load(m_ref.at[pl.ds(0, pad)], mask=live, other=-jnp.inf)
    s = plgpu.load(s_ref.at[pl.ds(0, pad)], mask=live, other=0.0)
    top = jnp.max(m)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    rescale = jnp.exp2(m - top)
    total = jnp.sum(s * rescale)
    return top + jnp.log(total) * LOG2E, total, rescale


def _sum_parts(ref, n_seg: int, rescale=None):
    """The sum of a row's S partials (ref: (S,)), each times its rescale factor when given."""
    pad = next_pow2(n_seg)
    parts = plgpu.load(ref.at[pl.ds(0, pad)], mask=jnp.arange(pad, dtype=jnp.int32) < n_seg, other=0.0)
    return jnp.sum(parts if rescale is None else parts * rescale)


def jsd_partials_kernel(xs_ref, xt_ref, *refs, vocab: int, width: int, block: int, opts: JsdOptions, ignore_index):
    """Grid (N, S), pass 1: one segment of one row's partials (0-d outputs, base 2).

    xs_ref, xt_ref: the segment of student and teacher logits (width columns; the lanes past V are masked); refs:
    the row's label (0-d) when ``ignore_index`` is not None, then the outputs m_s, s_s, m_t, s_t (running max of
    u2 and sum of 2^(u2 - max) per model) and, for beta in {0, 1}, acc (sum_j 2^(u2_a - m_a) (u2_a - u2_b) with a
    the distribution the KL is taken under). opts: the kind and the base-2 transforms (``_base2``).
    """
    y_ref, _, outs = split_refs(refs, ignore_index is not None, False)
    base, n_tiles = _segment(width, block, vocab, y_ref, ignore_index)

    def statistics(k, carry):
        m_s, s_s, m_t, s_t, acc = carry
        u_s, u_t = _segment_tile(xs_ref, xt_ref, base, k, block, vocab, opts)
        m_s, s_s, e_s, r_s = _online(m_s, s_s, u_s)
        m_t, s_t, e_t, r_t = _online(m_t, s_t, u_t)
        if opts.kind == FORWARD_KL:
            acc = acc * r_t + _weighted(e_t, u_t - u_s)
        elif opts.kind == REVERSE_KL:
            acc = acc * r_s + _weighted(e_s, u_s - u_t)
        return m_s, s_s, m_t, s_t, acc

    neg_inf, zero = jnp.float32(-jnp.inf), jnp.float32(0.0)
    partials = jax.lax.fori_loop(0, n_tiles, statistics, (neg_inf, zero, neg_inf, zero, zero))
    for ref, value in zip(outs, partials):  # a mixture has no acc output
        plgpu.store(ref, value)


def jsd_mixture_kernel(
    xs_ref, xt_ref, *refs, vocab: int, width: int, n_seg: int, block: int, opts: JsdOptions, ignore_index, ptx: bool
):  # fmt: skip
    """Grid (N, S), the mixture's pass 2: one segment of one row's sums of the terms of KL(p_t || m) and
    KL(p_s || m), in base 2 (0-d outputs).

    xs_ref, xt_ref: as jsd_partials_kernel; refs: the label (0-d) when ``ignore_index`` is not None, the beta
    operand (4,) (beta_terms), the row's pass-1 partials m_s, s_s, m_t, s_t ((S,) each), then the outputs kl_t,
    kl_s. n_seg: S; ptx: the log as the GPU's lg2.approx (compiled kernels; _log2).
    """
    y_ref, beta_ref, (ms_ref, ss_ref, mt_ref, st_ref, kl_t_ref, kl_s_ref) = split_refs(
        refs, ignore_index is not None, True
    )
    base, n_tiles = _segment(width, block, vocab, y_ref, ignore_index)
    lse_s, lse_t = _row_lse2(ms_ref, ss_ref, n_seg)[0], _row_lse2(mt_ref, st_ref, n_seg)[0]
    beta, one_minus_beta = beta_ref[0], beta_ref[1]

    def divergences(k, carry):
        kl_t, kl_s = carry
        u_s, u_t = _segment_tile(xs_ref, xt_ref, base, k, block, vocab, opts)
        ls, lt = u_s - lse_s, u_t - lse_t
        p_s, p_t, lm = mixture_log2(ls, lt, beta, one_minus_beta, ptx)  # one log per element, both terms
        return kl_t + _weighted(p_t, lt - lm), kl_s + _weighted(p_s, ls - lm)

    zero = jnp.float32(0.0)
    kl_t, kl_s = jax.lax.fori_loop(0, n_tiles, divergences, (zero, zero))
    plgpu.store(kl_t_ref, kl_t)
    plgpu.store(kl_s_ref, kl_s)


def jsd_finish_kernel(ms_ref, ss_ref, mt_ref, st_ref, *refs, n_seg: int, opts: JsdOptions, ignore_index):
    """Grid (N,): one row's S partials merged into its loss, lse_s, lse_t and kl_s (0-d outputs, natural log
    units, as the backward reads them).

    ms_ref, ss_ref, mt_ref, st_ref: the row's pass-1 statistics (S,); refs: acc (S,) for beta in {0, 1} or the
    pass-2 sums kl_t, kl_s (S,) for a mixture, the label (0-d) when ``ignore_index`` is not None, the beta operand
    (4,) for a mixture, then the four outputs.
    """
    refs = list(refs)
    sums = [refs.pop(0) for _ in range(2 if opts.kind == MIXTURE else 1)]
    y_ref, beta_ref, (loss_ref, lse_s_ref, lse_t_ref, kl_ref) = split_refs(
        refs, ignore_index is not None, opts.kind == MIXTURE
    )
    lse_s, total_s, rescale_s = _row_lse2(ms_ref, ss_ref, n_seg)
    lse_t, total_t, rescale_t = _row_lse2(mt_ref, st_ref, n_seg)
    if opts.kind == FORWARD_KL:
        loss = kl = (_sum_parts(sums[0], n_seg, rescale_t) / total_t + lse_s - lse_t) * LN2
    elif opts.kind == REVERSE_KL:
        loss = kl = (_sum_parts(sums[0], n_seg, rescale_s) / total_s - lse_s + lse_t) * LN2
    else:
        kl_t, kl = (_sum_parts(ref, n_seg) * LN2 for ref in sums)
        loss = beta_ref[0] * kl_t + beta_ref[1] * kl
    if y_ref is not None:
        ignored = y_ref[...] == ignore_index
        loss, kl = jnp.where(ignored, 0.0, loss), jnp.where(ignored, 0.0, kl)
    plgpu.store(loss_ref, loss)
    plgpu.store(lse_s_ref, lse_s * LN2)
    plgpu.store(lse_t_ref, lse_t * LN2)
    plgpu.store(kl_ref, kl)
