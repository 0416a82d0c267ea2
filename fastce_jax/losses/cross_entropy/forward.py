"""The forward kernels: per-chunk partial statistics, then one finish program per row.

* ``forward_kernel``, grid (N rows, C chunks): walks one chunk of one row in BLOCK-wide tiles and writes the chunk's
  partial (max m, sum exp(z - m), sum z). A row whose label is ignore_index walks no tiles (its logits are never
  read).
* ``finish_kernel``, grid (N,): combines a row's C partials into lse, reads the label logit with one masked scalar
  load, writes the token's loss and lse (or, vocab-parallel, this shard's statistics).

Static options arrive through functools.partial (launch.py); a zero option removes its code entirely (also avoiding
0 * inf = NaN with -inf logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.kernel_helpers import INT32_MAX, cdiv, next_pow2
from ...core.reference import outputs_from_statistics, token_loss_from_statistics, transform, weighted_token_loss

__all__ = ["forward_kernel", "weighted_forward_kernel", "weighted_finish_kernel", "finish_kernel"]


def forward_kernel(
    x_ref,
    y_ref,
    m_ref,
    s_ref,
    sz_ref,
    *refs,
    vocab,
    chunk,
    block,
    ignore_index,
    options,
    need_sum_z,
    extras=(False, False),
    w_ref=None,
):
    """Grid (N rows, C chunks): one chunk of one row's partial statistics.

    x_ref: the row's chunk of logits (chunk,), the last chunk may run past V; y_ref: the row's label (0-d);
    m_ref, s_ref, sz_ref: outputs (0-d), the chunk's max m of z, sum exp(z - m) and sum z; refs: the extra outputs
    (0-d) that ``extras`` asks for, in this order: idx_ref, the first column holding m (int32, global in the row);
    t_ref, sum exp(z - m) z with -inf logits contributing 0 (the entropy's partial).
    vocab: V; chunk: columns per chunk; block: tile width of the walk; ignore_index: the label that reads nothing
    (None: no label of the labels' dtype can equal it); options: Options (the transform's fields are read);
    need_sum_z: whether sum z is computed (label smoothing), else it stays 0; extras: (argmax, entropy), whether
    those partials are computed (all False: the plain kernel, refs is empty).
    w_ref: class weights' chunk (chunk,) (`weighted_forward_kernel`): sum z becomes sum_c w_c z_c, a class of
    weight 0 adding nothing even at z = -inf; None: the plain kernel.
    """
    want_argmax, want_entropy = extras
    base = pl.program_id(1) * chunk
    # Python ints stay int32 here even with jax_enable_x64 (explicit int32).
    n_tiles = cdiv(jnp.minimum(vocab - base, chunk), jnp.int32(block))
    if ignore_index is not None:
        # An ignored row reads nothing: its partial stays (-inf, 0, 0), so its lse
        # is -inf, which finish and backward never use (they write 0 there).
        n_tiles = jnp.where(y_ref[...] == ignore_index, 0, n_tiles)
    neg_inf = jnp.float32(-jnp.inf)

    def body(k, carry):
        m, s, sz = carry[:3]
        start = k * block
        cols = base + start + jnp.arange(block, dtype=jnp.int32)
        mask = cols < vocab
        x = plgpu.load(x_ref.at[pl.ds(start, block)], mask=mask, other=-jnp.inf).astype(jnp.float32)
        # Re-mask after the transform: softcap maps the -inf filler to -softcap.
        z = jnp.where(mask, transform(x, options), neg_inf)
        # One exp per element: take the tile max first, rescale the scalar sum.
        tile_max = jnp.max(z)
        m_new = jnp.maximum(m, tile_max)
        # A tile (and everything so far) at -inf: shift by 0, not by -inf, so
        # exp(-inf - -inf) = NaN never appears; +inf/NaN rows still give NaN.
        m_safe = jnp.where(m_new == neg_inf, 0.0, m_new)
        out = []
        if want_entropy:
            rescale, e = jnp.exp(m - m_safe), jnp.exp(z - m_safe)
            s = s * rescale + jnp.sum(e)
            out.append(carry[-1] * rescale + jnp.sum(jnp.where(z == neg_inf, 0.0, e * z)))
        else:
            s = s * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(z - m_safe))
        if need_sum_z and w_ref is not None:
            w = plgpu.load(w_ref.at[pl.ds(start, block)], mask=mask, other=0.0)
            sz = sz + jnp.sum(jnp.where(w == 0.0, 0.0, w * z))
        elif need_sum_z:
            sz = sz + jnp.sum(jnp.where(mask, z, 0.0))
        if want_argmax:
            # The tile's first column at its max (masked columns are -inf and come last); a strictly larger max
            # replaces the running one, an equal one keeps the earlier column (argmax's first index on ties).
            first = jnp.min(jnp.where(mask & (z == tile_max), cols, jnp.int32(INT32_MAX)))
            out.insert(0, jnp.where(tile_max > m, first, carry[3]))
        return (m_new, s, sz, *out)

    zero = jnp.float32(0.0)
    init = (neg_inf, zero, zero) + ((base,) if want_argmax else ()) + ((zero,) if want_entropy else ())
    m, s, sz, *partials = jax.lax.fori_loop(0, n_tiles, body, init)
    # 0-d blocks: one scalar per (row, chunk) in the [N, C] partial buffers.
    plgpu.store(m_ref, m)
    plgpu.store(s_ref, s)
    plgpu.store(sz_ref, sz)
    for ref, value in zip(refs, partials):
        plgpu.store(ref, value)


def weighted_forward_kernel(x_ref, y_ref, w_ref, *refs, **static):
    """forward_kernel with class weights: w_ref, the weights' chunk, is its third input."""
    return forward_kernel(x_ref, y_ref, *refs, w_ref=w_ref, **static)


def weighted_finish_kernel(m_ref, s_ref, sz_ref, y_ref, x_ref, wy_ref, wsum_ref, *refs, **static):
    """finish_kernel with class weights: wy_ref, the row's w[y] (0-d), and wsum_ref, sum_c w_c (1,), after x_ref."""
    return finish_kernel(m_ref, s_ref, sz_ref, y_ref, x_ref, *refs, weight_refs=(wy_ref, wsum_ref), **static)


def finish_kernel(
    m_ref,
    s_ref,
    sz_ref,
    y_ref,
    x_ref,
    *refs,
    vocab,
    n_chunks,
    options,
    vocab_parallel,
    extras=(False, False),
    weight_refs=None,
):
    """Grid (N,): a row's C partials combined into its lse, and its loss.

    m_ref, s_ref, sz_ref: the row's partials (C,); y_ref: its label (0-d); x_ref: its logits (V,), of which only
    the label's column is read. refs: vocab-parallel only, start_ref (1,), the first global column held here; then
    the extra partials (C,) that ``extras`` asks for (idx_ref, t_ref, as forward_kernel writes them); then the
    outputs (0-d). Default outputs: loss_ref, lse_ref, then accuracy_ref and entropy_ref where asked for.
    Vocab-parallel outputs (this shard's statistics): lse_ref, z_label_ref, sum_z_ref, then max_ref and
    argmax_ref (the largest z here and the first global column holding it) and mean_z_ref (sum_j p_j z_j over
    this shard's softmax) where asked for.
    vocab: V (this shard's columns); n_chunks: C; options: Options (the loss is
    core.reference.token_loss_from_statistics, the formula of the jnp paths, accuracy and entropy
    core.reference.outputs_from_statistics); vocab_parallel: which of the two ref layouts; extras: (argmax, entropy) as
    in forward_kernel. weight_refs: (w[y] of the row, sum of the weights) for the weighted loss
    (core.reference.weighted_token_loss; sz_ref then holds sum_c w_c z_c), or None.
    """
    want_argmax, want_entropy = extras
    refs = list(refs)
    start_ref = refs.pop(0) if vocab_parallel else None
    idx_ref = refs.pop(0) if want_argmax else None
    t_ref = refs.pop(0) if want_entropy else None
    c_pad = next_pow2(n_chunks)
    cmask = jnp.arange(c_pad) < n_chunks
    m = plgpu.load(m_ref.at[pl.ds(0, c_pad)], mask=cmask, other=-jnp.inf)
    s = plgpu.load(s_ref.at[pl.ds(0, c_pad)], mask=cmask, other=0.0)
    big_m = jnp.max(m)
    m_safe = jnp.where(big_m == -jnp.inf, 0.0, big_m)
    mean_z = argmax = None
    if want_entropy:
        rescale = jnp.exp(m - m_safe)
        total = jnp.sum(s * rescale)
        lse = m_safe + jnp.log(total)
        t = plgpu.load(t_ref.at[pl.ds(0, c_pad)], mask=cmask, other=0.0)
        # No column counted (an ignored row, an all -inf row): mean 0, not 0 / 0.
        mean_z = jnp.where(total > 0.0, jnp.sum(t * rescale) / total, 0.0)
    else:
        lse = m_safe + jnp.log(jnp.sum(s * jnp.exp(m - m_safe)))
    if want_argmax:
        idx = plgpu.load(idx_ref.at[pl.ds(0, c_pad)], mask=cmask, other=INT32_MAX)
        argmax = jnp.min(jnp.where(m == big_m, idx, INT32_MAX))

    y = y_ref[...]
    if vocab_parallel:
        lse_ref, z_label_ref, sum_z_ref, *extra_refs = refs
        start = start_ref[0]
        in_range = (y >= start) & (y < start + vocab)
        y_local = y - start
    else:
        loss_ref, lse_ref, *extra_refs = refs
        in_range = (y >= 0) & (y < vocab)
        y_local = y
    # The one read of the label logit: a masked scalar load whose address is
    # clamped as well, so a bad label never touches memory.
    y_safe = jnp.where(in_range, y_local, 0)
    x_y = plgpu.load(x_ref.at[y_safe], mask=in_range, other=0.0)
    z_y = transform(x_y.astype(jnp.float32), options)
    smoothing = options.label_smoothing
    sum_z = None
    if smoothing != 0.0:
        sum_z = jnp.sum(plgpu.load(sz_ref.at[pl.ds(0, c_pad)], mask=cmask, other=0.0))

    if vocab_parallel:
        plgpu.store(lse_ref, lse)
        plgpu.store(z_label_ref, jnp.where(in_range, z_y, 0.0))
        plgpu.store(sum_z_ref, jnp.float32(0.0) if sum_z is None else sum_z)
        global_argmax = jnp.where(argmax == INT32_MAX, argmax, argmax + start) if want_argmax else None
        extra = ((big_m, global_argmax) if want_argmax else ()) + ((mean_z,) if want_entropy else ())
    else:
        if weight_refs is None:
            plgpu.store(loss_ref, token_loss_from_statistics(lse, z_y, sum_z, y, options, vocab))
        else:
            wy_ref, wsum_ref = weight_refs
            w_sum = wsum_ref[0] if smoothing != 0.0 else None
            loss = weighted_token_loss(lse, z_y, sum_z, wy_ref[...], w_sum, y, options, vocab)
            plgpu.store(loss_ref, loss)
        plgpu.store(lse_ref, lse)
        accuracy, entropy = outputs_from_statistics(lse, argmax, mean_z, y, options, vocab)
        extra = tuple(v for v in (accuracy, entropy) if v is not None)
    for ref, value in zip(extra_refs, extra, strict=True):
        plgpu.store(ref, value)
