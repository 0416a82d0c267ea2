"""The backward kernel: ``backward_kernel``, grid (N, cdiv(V, BLOCK)), recomputes z and p = exp(z - lse) and writes
dL/dx in one pass, optionally into the logits' own buffer (launch.py aliases them). An ignored row's load is fully
masked (no memory traffic); it writes zeros.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.kernel_helpers import dz_dx
from ...core.reference import transform

__all__ = ["backward_kernel", "weighted_backward_kernel"]


def backward_kernel(
    x_ref,
    y_ref,
    lse_ref,
    g_ref,
    *refs,
    vocab,
    vocab_total,
    block,
    ignore_index,
    options,
    vocab_parallel,
    lse_cotangent=False,
    entropy_cotangent=False,
    weight_refs=None,
):
    """Grid (N, cdiv(V, block)): one tile of one row's dL/dx, in one pass.

    x_ref: the tile of logits (block,); y_ref, lse_ref, g_ref: the row's label, lse (the global one when
    vocab-parallel) and upstream factor (0-d). refs: vocab-parallel only, start_ref (1,), the first global column
    held here; with lse_cotangent, glse_ref (0-d), the row's cotangent of lse; then dx_ref (the output tile).
    vocab: this shard's columns; vocab_total: the whole vocabulary (equal unless vocab-parallel); block: tile
    width; ignore_index: as in forward_kernel; options: Options; vocab_parallel: which of the two ref layouts;
    lse_cotangent: add glse * d lse / dx = glse * p * dz/dx (the returned z_loss's gradient flows through lse).
    entropy_cotangent: after glse_ref come gh_ref and mz_ref (0-d each): the row's cotangent of its entropy H and
    mz = sum_j p_j z_j = lse - H (the global one when vocab-parallel); adds gh * dH/dx = gh * p_j (mz - z_j) * dz/dx.
    weight_refs: class weights (`weighted_backward_kernel`): (the row's w[y] (0-d), the weights' tile (block,) and
    their sum (1,), the last two None without smoothing): dL/dz_j = w[y] ((1 - eps)(p_j - [j == y])
    + 2 z_loss lse p_j) + (eps / V)(W p_j - w_j). None: the plain kernel.
    """
    refs = list(refs)
    start_ref = refs.pop(0) if vocab_parallel else None
    glse_ref = refs.pop(0) if lse_cotangent else None
    gh_ref, mz_ref = (refs.pop(0), refs.pop(0)) if entropy_cotangent else (None, None)
    (dx_ref,) = refs
    y_col = y_ref[...] - start_ref[0] if vocab_parallel else y_ref[...]
    cols = pl.program_id(1) * block + jnp.arange(block, dtype=jnp.int32)
    mask = cols < vocab
    y = y_ref[...]
    # An ignored row loads nothing (all lanes masked); its gradient is 0 below.
    read = mask if ignore_index is None else mask & (y != ignore_index)
    x = plgpu.load(x_ref.at[pl.ds(0, block)], mask=read, other=0.0).astype(jnp.float32)
    lse = lse_ref[...]
    z = transform(x, options)
    p = jnp.exp(z - lse)
    p_lse = p
    smoothing = options.label_smoothing
    if weight_refs is not None:
        wy_ref, w_ref, wsum_ref = weight_refs
        w_y = wy_ref[...]
        if options.z_loss != 0.0:
            coefficient = w_y * (1.0 - smoothing + 2.0 * options.z_loss * lse)
        else:
            coefficient = w_y * (1.0 - smoothing)
        if smoothing != 0.0:
            coefficient = coefficient + smoothing / vocab_total * wsum_ref[0]
        d = p * coefficient - jnp.where(cols == y_col, w_y * (1.0 - smoothing), 0.0)
        if smoothing != 0.0:
            d = d - smoothing / vocab_total * plgpu.load(w_ref.at[pl.ds(0, block)], mask=mask, other=0.0)
    else:
        if options.z_loss != 0.0:
            p = p * (1.0 + 2.0 * options.z_loss * lse)
        d = p - jnp.where(cols == y_col, 1.0 - smoothing, 0.0)
        if smoothing != 0.0:
            d = d - smoothing / vocab_total
    if lse_cotangent:
        # Per row: g * (loss's d/dz) + glse * p, so the upstream factor applies to the loss's part only.
        d = d * g_ref[...] + p_lse * glse_ref[...]
    elif entropy_cotangent:
        d = d * g_ref[...]
    if entropy_cotangent:
        # dH/dz_j = p_j (mz - z_j); a -inf z (p_j = 0) adds 0, not 0 * inf.
        d = d + jnp.where(z == -jnp.inf, 0.0, p_lse * (mz_ref[...] - z)) * gh_ref[...]
    dz = dz_dx(z, options)
    if dz is not None:
        d = d * dz
    if not (lse_cotangent or entropy_cotangent):
        d = d * g_ref[...]
    # Out-of-range label: the whole gradient row is NaN, like its loss.
    d = jnp.where((y >= 0) & (y < vocab_total), d, jnp.nan)
    if ignore_index is not None:
        d = jnp.where(y == ignore_index, 0.0, d)
    plgpu.store(dx_ref.at[pl.ds(0, block)], d.astype(dx_ref.dtype), mask=mask)


def weighted_backward_kernel(x_ref, y_ref, lse_ref, g_ref, wy_ref, *refs, smoothing, **static):
    """backward_kernel with class weights: after g_ref, the row's w[y] (0-d) and, with smoothing, the weights'
    tile (block,) and their sum (1,)."""
    refs = list(refs)
    w_ref, wsum_ref = (refs.pop(0), refs.pop(0)) if smoothing else (None, None)
    return backward_kernel(x_ref, y_ref, lse_ref, g_ref, *refs, weight_refs=(wy_ref, w_ref, wsum_ref), **static)
