"""Pallas (Triton backend) kernels of the distillation loss (``fastce_jax.jsd``, ``linear_jsd``), and their launchers.

With u_s = z_s / T, u_t = z_t / T (z: the soft-capped logits; the temperature is folded into the transform's
options, jsd_contract.JsdOptions), ls = log softmax(u_s), lt = log softmax(u_t) over the student's V columns:
beta = 0 is KL(p_t || p_s), beta = 1 is KL(p_s || p_t), otherwise, with lm = log((1 - beta) p_s + beta p_t),
beta KL(p_t || m) + (1 - beta) KL(p_s || m) (TRL's generalized JSD).

The forward splits each row's V columns into S contiguous segments (``forward_segments``: S grows until N * S
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
* ``jsd_backward_kernel``, grid (N, cdiv(V, BLOCK)): one tile of d loss / d student logits in one pass, times the
  row's upstream factor: p_s - p_t (beta = 0), p_s (ls - lt - kl_s) (beta = 1), (1 - beta) p_s (ls - lm - kl_s)
  (mixture), then d u / d x (1 / T and the soft-capping's 1 - tanh^2); in base 2 as the forward, with the
  mixture's one log per element shared with its pass 2. The teacher gets no gradient.

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

from ..contract import fold_temperature, ignore_value, transform
from ..jsd_contract import FORWARD_KL, MIXTURE, REVERSE_KL, JsdOptions
from .common import cdiv, dz_dx, next_pow2
from .launch import _launch, _same_variance, quiet_triton

# Untuned first values (two logits arrays per tile, so half the CE forward's 4096-wide tile); the bench tool
# sweeps them by setting these module constants.
FORWARD_BLOCK, FORWARD_WARPS = 2048, 4
BACKWARD_BLOCK, BACKWARD_WARPS = 2048, 4
FINISH_WARPS = 1  # the finish kernel touches a few (S,) partials per row
# Programs the forward aims for (forward_segments): fastce_torch's JSD_FORWARD_PROGRAMS, 4 waves of the H200's 132
# SMs x 4 resident 8-warp programs. These programs have 4 warps with the same 16 float32 per thread per tile, so
# about 8 are resident per SM: 2 waves. Not tuned yet.
FORWARD_PROGRAMS = 4 * 132 * 4
FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number

LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)


class JsdConfig(NamedTuple):
    """Tiles of the kernels for one vocabulary size: the forward walks its segments of a row in ``forward_block``
    columns and splits rows until it has ``forward_programs`` programs (forward_segments), the backward gives each
    program ``backward_block`` columns of one row."""

    forward_block: int
    forward_warps: int
    backward_block: int
    backward_warps: int
    forward_programs: int


def jsd_config(vocab: int) -> JsdConfig:
    """The tiles for V = vocab (V alone decides; the forward's segments depend on N too, forward_segments)."""
    block, backward_block = min(FORWARD_BLOCK, next_pow2(vocab)), min(BACKWARD_BLOCK, next_pow2(vocab))
    return JsdConfig(block, FORWARD_WARPS, backward_block, BACKWARD_WARPS, FORWARD_PROGRAMS)


def forward_segments(n_rows: int, vocab: int, block: int, programs: int) -> tuple[int, int]:
    """(S, width): the forward splits each row into S segments of width columns (a multiple of block; the last
    one ragged), one program each (the name and rule of fastce_torch's forward_segments).

    Why: one program per row leaves the GPU idle below a few thousand rows. linear_jsd's chunk at the default
    256 MiB workspace is ~384 rows of a 150k vocabulary, ~3 programs per SM of the H200's 132, and its forward
    measured 2.0 TB/s there against 2.9 TB/s at 1536 rows. So S grows until N * S reaches ``programs``
    (FORWARD_PROGRAMS), at most one tile per segment; from N = programs rows on, S = 1. A row's values depend on
    S only through the order of its float32 sums."""
    tiles = cdiv(vocab, block)
    wanted = max(1, min(cdiv(programs, max(n_rows, 1)), tiles))
    per_segment = cdiv(tiles, wanted)
    return cdiv(tiles, per_segment), per_segment * block


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


def _mixture_log2(ls, lt, beta, one_minus_beta, ptx: bool):
    """(p_s, p_t, lm) of base-2 log-probabilities ls, lt with lm = log2((1 - beta) p_s + beta p_t): two exp2 and one
    log per element (the mixture's pass 2 and the backward share it). The mixture is floored at float32's smallest
    normal number (a select: the GPU's max would drop a NaN, and a NaN row must stay NaN): where it underflows (to 0
    where flushed) both terms are below any sum's resolution, and lm stays finite (no p * inf)."""
    p_s, p_t = jnp.exp2(ls), jnp.exp2(lt)
    mixture = one_minus_beta * p_s + beta * p_t
    return p_s, p_t, _log2(jnp.where(mixture < FLOAT32_TINY, FLOAT32_TINY, mixture), ptx)


def _split_refs(refs, has_labels: bool, has_beta: bool):
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
    y_ref, _, outs = _split_refs(refs, ignore_index is not None, False)
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
    y_ref, beta_ref, (ms_ref, ss_ref, mt_ref, st_ref, kl_t_ref, kl_s_ref) = _split_refs(
        refs, ignore_index is not None, True
    )
    base, n_tiles = _segment(width, block, vocab, y_ref, ignore_index)
    lse_s, lse_t = _row_lse2(ms_ref, ss_ref, n_seg)[0], _row_lse2(mt_ref, st_ref, n_seg)[0]
    beta, one_minus_beta = beta_ref[0], beta_ref[1]

    def divergences(k, carry):
        kl_t, kl_s = carry
        u_s, u_t = _segment_tile(xs_ref, xt_ref, base, k, block, vocab, opts)
        ls, lt = u_s - lse_s, u_t - lse_t
        p_s, p_t, lm = _mixture_log2(ls, lt, beta, one_minus_beta, ptx)  # one log per element, both terms
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
    y_ref, beta_ref, (loss_ref, lse_s_ref, lse_t_ref, kl_ref) = _split_refs(
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


def jsd_backward_kernel(
    xs_ref, xt_ref, lse_s_ref, lse_t_ref, kl_ref, g_ref, *refs, vocab: int, block: int, opts: JsdOptions, ignore_index,
    ptx: bool,
):  # fmt: skip
    """Grid (N, cdiv(V, block)): one tile of one row's d loss / d student logits, times the row's upstream g.

    In base 2 as the forward (ls2 = (u - lse) log2(e), exp2, and for a mixture one log per element: _mixture_log2;
    ptx: the GPU's lg2.approx); the log-ratios come back to natural units (ln 2) in the row's factor. u itself stays
    natural, so the soft-capping's derivative (dz_dx, from u) is exactly 0 where tanh saturates.
    xs_ref, xt_ref: the tile of student and teacher logits (block,); lse_s_ref, lse_t_ref, kl_ref, g_ref: the
    row's statistics from the forward (natural units) and its upstream factor (0-d); refs: the label (0-d) when
    ``ignore_index`` is not None, the beta operand (4,) for a mixture, then dx_ref (the output tile). An ignored
    row loads nothing and writes zeros.
    """
    y_ref, beta_ref, (dx_ref,) = _split_refs(refs, ignore_index is not None, opts.kind == MIXTURE)
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
        p_s, _, lm = _mixture_log2(ls, lt, beta_ref[0], beta_ref[1], ptx)
        d = jnp.where(p_s == 0.0, 0.0, p_s * (ls - lm - kl_ref[...] * LOG2E))
        g = g * (beta_ref[1] * LN2)
    du = dz_dx(u_s, opts.student)  # 1 / T and the soft-capping's derivative, from u alone
    d = d * g if du is None else d * g * du
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


def _base2(opts: JsdOptions) -> JsdOptions:
    """opts with both transforms giving u2 = u log2(e): the exact algebra of a temperature of ln 2 (folded into
    the scaling and soft-capping constants, contract.fold_temperature), so base 2 costs no extra multiply."""
    return opts._replace(student=fold_temperature(opts.student, LN2), teacher=fold_temperature(opts.teacher, LN2))


def jsd_forward(student, teacher, labels, beta, opts: JsdOptions, *, interpret: bool, config: JsdConfig | None = None):
    """(loss, lse_s, lse_t, kl_s), float32 (N,) each, of student logits (N, V) and teacher logits (N, V_t >= V);
    labels (N,) or None (every row counts); beta: beta_operand(beta) for a mixture, else None.

    Launches the partials kernel, for a mixture the mixture kernel, then the finish kernel; between them
    float32 partials of N * S * (5 or 6) floats: N * S < N + config.forward_programs, so at most 192 KiB at
    N = 8192 (S = 1) and 60 KiB for linear_jsd's ~384-row chunks: outside its workspace budget."""
    n, vocab = student.shape
    config = jsd_config(vocab) if config is None else config
    block = config.forward_block
    n_seg, width = forward_segments(n, vocab, block, config.forward_programs)
    extra, ignore = _optional_operands(labels, beta, opts)
    (student, teacher, *extra), mat = _same_variance(student, teacher, *extra)
    labels, beta = extra[: ignore is not None], extra[ignore is not None :]  # each () or a 1-tuple
    mixture = opts.kind == MIXTURE
    part = jax.ShapeDtypeStruct((n, n_seg), jnp.float32, manual_axis_type=mat)
    # Each program's segment of both rows (the last block runs past V, and past V_t for a wider teacher: masked).
    segment = pl.BlockSpec((None, width), lambda i, j: (i, j))
    per_row = [pl.BlockSpec((None,), lambda i, j: (i,))] * len(labels)
    per_part = pl.BlockSpec((None, None), lambda i, j: (i, j))
    row_parts = pl.BlockSpec((None, n_seg), lambda i, j: (i, 0))
    static = dict(vocab=vocab, width=width, block=block, opts=_base2(opts), ignore_index=ignore)
    params = plgpu.CompilerParams(num_warps=config.forward_warps, num_stages=1)
    n_statistics = 4 if mixture else 5  # m_s, s_s, m_t, s_t (and acc)
    partials = pl.pallas_call(
        functools.partial(jsd_partials_kernel, **static),
        grid=(n, n_seg),
        in_specs=[segment, segment, *per_row],
        out_specs=[per_part] * n_statistics,
        out_shape=[part] * n_statistics,
        compiler_params=params,
        interpret=interpret,
        name="fastce_jsd_partials",
    )
    mixture_pass = pl.pallas_call(
        functools.partial(jsd_mixture_kernel, n_seg=n_seg, ptx=not interpret, **static),
        grid=(n, n_seg),
        in_specs=[segment, segment, *per_row, pl.BlockSpec((4,), lambda i, j: (0,))] + [row_parts] * 4,
        out_specs=[per_part] * 2,
        out_shape=[part] * 2,
        compiler_params=params,
        interpret=interpret,
        name="fastce_jsd_mixture",
    )
    n_parts = n_statistics + 2 * mixture
    finish = pl.pallas_call(
        functools.partial(jsd_finish_kernel, n_seg=n_seg, opts=opts, ignore_index=ignore),
        grid=(n,),
        in_specs=[pl.BlockSpec((None, n_seg), lambda i: (i, 0))] * n_parts
        + [pl.BlockSpec((None,), lambda i: (i,))] * len(labels)
        + [pl.BlockSpec((4,), lambda i: (0,))] * mixture,
        out_specs=[pl.BlockSpec((None,), lambda i: (i,))] * 4,
        out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32, manual_axis_type=mat)] * 4,
        compiler_params=plgpu.CompilerParams(num_warps=FINISH_WARPS, num_stages=1),
        interpret=interpret,
        name="fastce_jsd_finish",
    )
    with quiet_triton(interpret):
        parts = tuple(_launch(partials, (student, teacher, *labels), mat, interpret))
        if mixture:
            parts += tuple(_launch(mixture_pass, (student, teacher, *labels, *beta, *parts), mat, interpret))
        return tuple(_launch(finish, (*parts, *labels, *beta), mat, interpret))


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
        functools.partial(
            jsd_backward_kernel, vocab=vocab, block=block, opts=opts, ignore_index=ignore, ptx=not interpret
        ),
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
