"""Pallas (Triton backend) kernels for fused cross-entropy, and their launchers.

Three kernels, as in CONTRACT.md "Kernel design":

* ``_forward_kernel``, grid (N rows, C chunks): walks one chunk of one row in
  BLOCK-wide tiles and writes the chunk's partial (max m, sum exp(z - m), sum z).
  A row whose label is ignore_index walks no tiles (its logits are never read).
* ``_finish_kernel``, grid (N,): combines a row's C partials into lse, reads the
  label logit with one masked scalar load, writes the token's loss and lse.
* ``_backward_kernel``, grid (N, cdiv(V, BLOCK)): recomputes z and p = exp(z - lse)
  and writes dL/dx in one pass, optionally into the logits' own buffer.  An
  ignored row's load is fully masked (no memory traffic); it writes zeros.

All launchers take 2-D logits (N, V) and 1-D labels (N,); reshaping, argument
checks, reductions and the custom_vjp live in ``cross_entropy.py`` (options and formulas in ``contract.py``).

64-bit offsets.  The Triton lowering (jax/_src/pallas/triton/lowering.py,
``_compute_offsets_from_indices``) computes every load/store offset in int64
whenever the *whole* operand is larger than 2**32 bytes, and it casts the block
start indices (our row index from the index_map, an int32 program id) to that
type *before* multiplying by the row stride.  So a squeezed row dim
``(None, W)`` with index_map ``(i, j)`` gives the 64-bit product ``i * V`` for
N*V > 2**31 elements (in bf16/f16 that is > 2**32 bytes; in f32 the switch
already happens at 2**30 elements).  Below the threshold every offset is < 2**31
and int32 is exact.  The in-row parts (``j * W`` from a Blocked dim, our
``pl.ds`` starts and the label) are < V + W, far below 2**31.  Hence the logits
are passed as a plain (N, V) array; no flat view or manual int64 product is
needed.  ``tests/test_lowering.py`` checks the emitted Triton IR for i64
offsets on a >2**31-element abstract input.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .contract import (
    Options,
    ignore_value,
    label_weights,
    outputs_from_statistics,
    token_loss_from_statistics,
    transform,
    weighted_token_loss,
)

# jax 0.11 deprecates the Pallas Triton backend and warns each time a Triton
# pallas_call is *lowered*.  See ``quiet_triton`` for how it is filtered.
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


# From the H200 sweeps (bench/tools/tune.py, bench/NOTES.md): forward tiles of 4096 beat 2048 and 8192; 2 warps
# were 3-4% faster than 4 and 8 warps 10%+ slower; 3 stages no faster than 1 (the loop has no dot). Rows are split
# into chunks of 16384 columns whatever N is (batch invariance; vmap and the flattened call agree bitwise).
FORWARD_BLOCK, FORWARD_WARPS, FORWARD_STAGES = 4096, 2, 1
FINISH_WARPS = 1  # the finish kernel touches C + 2 scalars per row
BACKWARD_BLOCK, BACKWARD_WARPS, BACKWARD_STAGES = 2048, 4, 1  # one tile per program: nothing to pipeline
CHUNK = 16384
_INT32_MAX = 2**31 - 1  # the argmax partials' filler: larger than any column


def _ignore_triton_deprecation_globally() -> None:
    # The deprecation is raised while the *enclosing* jit lowers, which happens
    # after our launcher has returned, with no fastce_jax frame on the stack: a
    # catch_warnings around the pallas_call cannot see it.  So every compiled
    # (non-interpret) launch makes sure a process filter for exactly this
    # message and category is installed (again, when a user's catch_warnings
    # block that was open at the first launch dropped it on exit).  Interpret
    # mode (CPU) never lowers to Triton and never installs it.
    for action, message, category, _, _ in warnings.filters:
        if (
            action == "ignore"
            and category is DeprecationWarning
            and getattr(message, "pattern", None) == TRITON_DEPRECATION
        ):
            return
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


@contextlib.contextmanager
def quiet_triton(interpret: bool):
    """Silences the Triton deprecation around our own pallas_call sites and around
    the entry points' eager calls of their jitted kernel paths (which lower on the
    call, after tracing returned: the block must span the call); under an outer
    jit see ``_ignore_triton_deprecation_globally``.
    """
    if not interpret:
        _ignore_triton_deprecation_globally()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        yield


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _cdiv(a, b):
    """Ceiling division of ints or int32 scalars (traced inside kernels)."""
    return (a + b - 1) // b


# ----------------------------------------------------------------------------
# Tile settings.  forward_config / backward_config read the module constants
# above when called (bench/tools/tune.py sweeps them); the launchers take a
# config= to override them.
# ----------------------------------------------------------------------------


class ForwardConfig(NamedTuple):
    """Tiles of the forward and finish kernels: each row is split into chunks of ``chunk`` columns (one program
    each), walked in ``block``-wide tiles; ``n_chunks`` is cdiv(V, chunk) for the V the config was made for (the
    launcher derives it from the logits it is given)."""

    block: int
    chunk: int
    n_chunks: int
    warps: int
    stages: int = 1
    finish_warps: int = 1


class BackwardConfig(NamedTuple):
    """Tiles of the backward kernel: one program per ``block`` columns of a row."""

    block: int
    warps: int
    stages: int = 1


def forward_config(vocab: int) -> ForwardConfig:
    """The forward kernel's tiles for V = vocab; V alone decides (batch invariance)."""
    block = min(FORWARD_BLOCK, _next_pow2(vocab))
    chunk = max(block, min(CHUNK, _next_pow2(vocab)))
    return ForwardConfig(block, chunk, _cdiv(vocab, chunk), FORWARD_WARPS, FORWARD_STAGES, FINISH_WARPS)


def backward_config(vocab: int) -> BackwardConfig:
    """The backward kernel's tiles for V = vocab."""
    return BackwardConfig(min(BACKWARD_BLOCK, _next_pow2(vocab)), BACKWARD_WARPS, BACKWARD_STAGES)


# ----------------------------------------------------------------------------
# Kernels.  Static options arrive through functools.partial; a zero option
# removes its code entirely (also avoiding 0 * inf = NaN with -inf logits).
# ----------------------------------------------------------------------------


def _dz_dx(z, options: Options):
    """dz/dx written with z only, so the backward needs no second tanh (None when z = x)."""
    d = None
    if options.logit_softcapping > 0.0:
        t = z * (1.0 / options.logit_softcapping)
        d = 1.0 - t * t
    if options.logit_scaling != 0.0:
        d = options.logit_scaling if d is None else d * options.logit_scaling
    return d


def _forward_kernel(
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
    w_ref: class weights' chunk (chunk,) (`_weighted_forward_kernel`): sum z becomes sum_c w_c z_c, a class of
    weight 0 adding nothing even at z = -inf; None: the plain kernel.
    """
    want_argmax, want_entropy = extras
    base = pl.program_id(1) * chunk
    # Python ints stay int32 here even with jax_enable_x64 (explicit int32).
    n_tiles = _cdiv(jnp.minimum(vocab - base, chunk), jnp.int32(block))
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
            first = jnp.min(jnp.where(mask & (z == tile_max), cols, jnp.int32(_INT32_MAX)))
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


def _weighted_forward_kernel(x_ref, y_ref, w_ref, *refs, **static):
    """_forward_kernel with class weights: w_ref, the weights' chunk, is its third input."""
    return _forward_kernel(x_ref, y_ref, *refs, w_ref=w_ref, **static)


def _weighted_finish_kernel(m_ref, s_ref, sz_ref, y_ref, x_ref, wy_ref, wsum_ref, *refs, **static):
    """_finish_kernel with class weights: wy_ref, the row's w[y] (0-d), and wsum_ref, sum_c w_c (1,), after x_ref."""
    return _finish_kernel(m_ref, s_ref, sz_ref, y_ref, x_ref, *refs, weight_refs=(wy_ref, wsum_ref), **static)


def _finish_kernel(
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
    the extra partials (C,) that ``extras`` asks for (idx_ref, t_ref, as _forward_kernel writes them); then the
    outputs (0-d). Default outputs: loss_ref, lse_ref, then accuracy_ref and entropy_ref where asked for.
    Vocab-parallel outputs (this shard's statistics): lse_ref, z_label_ref, sum_z_ref, then max_ref and
    argmax_ref (the largest z here and the first global column holding it) and mean_z_ref (sum_j p_j z_j over
    this shard's softmax) where asked for.
    vocab: V (this shard's columns); n_chunks: C; options: Options (the loss is contract.token_loss_from_statistics,
    the formula of the jnp paths, accuracy and entropy contract.outputs_from_statistics); vocab_parallel: which of
    the two ref layouts; extras: (argmax, entropy) as in _forward_kernel. weight_refs: (w[y] of the row, sum of
    the weights) for the weighted loss (contract.weighted_token_loss; sz_ref then holds sum_c w_c z_c), or None.
    """
    want_argmax, want_entropy = extras
    refs = list(refs)
    start_ref = refs.pop(0) if vocab_parallel else None
    idx_ref = refs.pop(0) if want_argmax else None
    t_ref = refs.pop(0) if want_entropy else None
    c_pad = _next_pow2(n_chunks)
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
        idx = plgpu.load(idx_ref.at[pl.ds(0, c_pad)], mask=cmask, other=_INT32_MAX)
        argmax = jnp.min(jnp.where(m == big_m, idx, _INT32_MAX))

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
        global_argmax = jnp.where(argmax == _INT32_MAX, argmax, argmax + start) if want_argmax else None
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


def _backward_kernel(
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
    weight_refs=None,
):
    """Grid (N, cdiv(V, block)): one tile of one row's dL/dx, in one pass.

    x_ref: the tile of logits (block,); y_ref, lse_ref, g_ref: the row's label, lse (the global one when
    vocab-parallel) and upstream factor (0-d). refs: vocab-parallel only, start_ref (1,), the first global column
    held here; with lse_cotangent, glse_ref (0-d), the row's cotangent of lse; then dx_ref (the output tile).
    vocab: this shard's columns; vocab_total: the whole vocabulary (equal unless vocab-parallel); block: tile
    width; ignore_index: as in _forward_kernel; options: Options; vocab_parallel: which of the two ref layouts;
    lse_cotangent: add glse * d lse / dx = glse * p * dz/dx (the returned z_loss's gradient flows through lse).
    weight_refs: class weights (`_weighted_backward_kernel`): (the row's w[y] (0-d), the weights' tile (block,) and
    their sum (1,), the last two None without smoothing): dL/dz_j = w[y] ((1 - eps)(p_j - [j == y])
    + 2 z_loss lse p_j) + (eps / V)(W p_j - w_j). None: the plain kernel.
    """
    refs = list(refs)
    start_ref = refs.pop(0) if vocab_parallel else None
    glse_ref = refs.pop(0) if lse_cotangent else None
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
    dz = _dz_dx(z, options)
    if dz is not None:
        d = d * dz
    if not lse_cotangent:
        d = d * g_ref[...]
    # Out-of-range label: the whole gradient row is NaN, like its loss.
    d = jnp.where((y >= 0) & (y < vocab_total), d, jnp.nan)
    if ignore_index is not None:
        d = jnp.where(y == ignore_index, 0.0, d)
    plgpu.store(dx_ref.at[pl.ds(0, block)], d.astype(dx_ref.dtype), mask=mask)


def _weighted_backward_kernel(x_ref, y_ref, lse_ref, g_ref, wy_ref, *refs, smoothing, **static):
    """_backward_kernel with class weights: after g_ref, the row's w[y] (0-d) and, with smoothing, the weights'
    tile (block,) and their sum (1,)."""
    refs = list(refs)
    w_ref, wsum_ref = (refs.pop(0), refs.pop(0)) if smoothing else (None, None)
    return _backward_kernel(x_ref, y_ref, lse_ref, g_ref, *refs, weight_refs=(wy_ref, w_ref, wsum_ref), **static)


# ----------------------------------------------------------------------------
# Launchers.
# ----------------------------------------------------------------------------


def _vary(x, axes: frozenset):
    """x, made varying over the manual mesh axes ``axes`` it does not vary over yet."""
    missing = tuple(sorted(axes - jax.typeof(x).manual_axis_type.varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _same_variance(*arrays):
    """The arrays, each made varying over every manual mesh axis any of them varies
    over, and that common ManualAxisType for the outputs' ShapeDtypeStruct.

    Inside a ``jax.shard_map`` with check_vma=True a pallas_call's out_shape must
    say over which manual axes its outputs vary; the outputs depend on every
    input, so they vary like their union.  Outside shard_map the type is empty
    and ignored.
    """
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))
    return tuple(_vary(a, varying) for a in arrays), jax.sharding.ManualAxisType(varying=varying)


def _launch(call, operands, mat, interpret: bool):
    """call(*operands), a pallas_call whose outputs vary like ``mat``."""
    if interpret and mat.varying:
        # Pallas' interpreter evaluates the kernel body with shard_map's
        # varying-axes checks on, although the body was traced with them off,
        # so the first comparison of a loaded block with a constant fails
        # ("eq requires varying manual axes to match"); the compiled kernels
        # do not go through it.
        raise NotImplementedError(
            "fastce_jax's kernels in Pallas interpret mode (no GPU) cannot run inside jax.shard_map with "
            "check_vma=True (a limitation of Pallas' interpreter); on CPU use backend='auto' or 'reference', "
            "or check_vma=False.  On a GPU the compiled kernels work with check_vma=True."
        )
    return call(*operands)


def _vocab_start_operand(vocab_start):
    """vocab_start (a Python int or a traced scalar such as axis_index * V_local)
    as a (1,) int32 operand: the kernels read it at run time."""
    return jnp.asarray(vocab_start, dtype=jnp.int32).reshape(1)


def forward(
    logits,
    labels,
    options: Options,
    *,
    interpret: bool,
    vocab_start=None,
    vocab_total: int | None = None,
    config: ForwardConfig | None = None,
    extras=(False, False),
    weight=None,
):
    """Per-token statistics of logits (N, V), labels (N,).

    Default: (loss, lse), both float32 (N,).  Vocab-parallel mode (vocab_start
    given): logits holds global columns [vocab_start, vocab_start + V) of a
    vocabulary of vocab_total, labels are global ids, and the result is this
    shard's float32 (N,) (lse_local, z_label_local, sum_z_local): the logsumexp
    of its columns, the transformed label logit where this shard owns the label
    (else 0), and the sum of its transformed logits (0 without label smoothing).
    config: the tiles (default ``forward_config(V)``).
    extras: (argmax, entropy), the extra outputs' partials to compute (the default computes none, so its kernels
    are the plain ones). Default mode then appends accuracy and / or entropy per token (float32 (N,),
    contract.outputs_from_statistics); vocab-parallel mode appends (max_local, argmax_local) (float32, int32: this
    shard's largest z and the first global column holding it) and / or mean_z_local (sum_j p_j z_j over this
    shard's softmax).
    weight: class weights, a float32 (V,) array, or None (the plain kernels); not in vocab-parallel mode.
    """
    n, vocab = logits.shape
    vocab_parallel = vocab_start is not None
    if vocab_parallel and vocab_total is None:
        raise ValueError("vocab_start needs vocab_total (the global vocabulary size)")
    if weight is not None and vocab_parallel:
        raise NotImplementedError("class weights are not supported in vocab-parallel mode")
    config = forward_config(vocab) if config is None else config
    n_chunks = _cdiv(vocab, config.chunk)
    ignore = ignore_value(labels.dtype, options.ignore_index)
    want_argmax, want_entropy = extras = tuple(bool(e) for e in extras)
    f32 = jnp.float32
    operands = (logits, labels) + ((_vocab_start_operand(vocab_start),) if vocab_parallel else ())
    operands, mat = _same_variance(*operands)
    logits, labels = operands[:2]
    part = jax.ShapeDtypeStruct((n, n_chunks), f32, manual_axis_type=mat)
    extra_parts = ([jax.ShapeDtypeStruct((n, n_chunks), jnp.int32, manual_axis_type=mat)] if want_argmax else []) + (
        [part] if want_entropy else []
    )
    part_spec = pl.BlockSpec((None, None), lambda i, j: (i, j))
    # Class weights: the forward reads them per chunk only for the smoothing term's sum_c w_c z_c; the finish
    # kernel reads w[y] per row and sum_c w_c.
    weighted_sum = weight is not None and options.label_smoothing != 0.0
    fwd_inputs = (logits, labels)
    fwd_specs = [pl.BlockSpec((None, config.chunk), lambda i, j: (i, j)), pl.BlockSpec((None,), lambda i, j: (i,))]
    if weighted_sum:
        # Padded to whole chunks, so the last chunk's block lies inside the array (its extra lanes are masked).
        padded = jnp.pad(weight.astype(jnp.float32), (0, n_chunks * config.chunk - vocab))
        fwd_inputs += (_same_variance(padded, logits)[0][0],)
        fwd_specs.append(pl.BlockSpec((config.chunk,), lambda i, j: (j,)))
    fwd = pl.pallas_call(
        functools.partial(
            _weighted_forward_kernel if weighted_sum else _forward_kernel,
            vocab=vocab,
            chunk=config.chunk,
            block=config.block,
            ignore_index=ignore,
            options=options,
            need_sum_z=options.label_smoothing != 0.0,
            **({"extras": extras} if any(extras) else {}),
        ),
        grid=(n, n_chunks),
        in_specs=fwd_specs,
        out_specs=[part_spec] * (3 + len(extra_parts)),
        out_shape=[part] * 3 + extra_parts,
        compiler_params=plgpu.CompilerParams(num_warps=config.warps, num_stages=config.stages),
        interpret=interpret,
        name="fastce_forward",
    )
    row_spec = pl.BlockSpec((None,), lambda i: (i,))
    parts_spec = pl.BlockSpec((None, n_chunks), lambda i: (i, 0))
    extra_specs = [pl.BlockSpec((1,), lambda i: (0,))] if vocab_parallel else []
    n_out = 3 if vocab_parallel else 2
    if vocab_parallel:
        out_dtypes = [f32] * 3 + ([f32, jnp.int32] if want_argmax else []) + ([f32] if want_entropy else [])
    else:
        out_dtypes = [f32] * (n_out + want_argmax + want_entropy)
    weight_specs, weight_inputs = [], ()
    if weight is not None:
        weight_specs = [row_spec, pl.BlockSpec((1,), lambda i: (0,))]
        w_label = label_weights(labels, weight.astype(jnp.float32), vocab)
        weight_inputs = _same_variance(w_label, jnp.sum(weight.astype(jnp.float32)).reshape(1), logits)[0][:2]
    finish = pl.pallas_call(
        functools.partial(
            _weighted_finish_kernel if weight is not None else _finish_kernel,
            vocab=vocab,
            n_chunks=n_chunks,
            options=options,
            vocab_parallel=vocab_parallel,
            **({"extras": extras} if any(extras) else {}),
        ),
        grid=(n,),
        in_specs=[parts_spec] * 3
        + [row_spec, pl.BlockSpec((None, vocab), lambda i: (i, 0))]
        + weight_specs
        + extra_specs
        + [parts_spec] * len(extra_parts),
        out_specs=[row_spec] * len(out_dtypes),
        out_shape=[jax.ShapeDtypeStruct((n,), dt, manual_axis_type=mat) for dt in out_dtypes],
        compiler_params=plgpu.CompilerParams(num_warps=config.finish_warps, num_stages=1),
        interpret=interpret,
        name="fastce_finish",
    )
    with quiet_triton(interpret):
        m, s, sz, *partials = _launch(fwd, fwd_inputs, mat, interpret)
        finish_inputs = (m, s, sz, labels, logits, *weight_inputs, *operands[2:], *partials)
        return tuple(_launch(finish, finish_inputs, mat, interpret))


def backward(
    logits,
    labels,
    lse,
    g,
    options: Options,
    *,
    inplace: bool,
    interpret: bool,
    vocab_start=None,
    vocab_total: int | None = None,
    config: BackwardConfig | None = None,
    g_lse=None,
    weight=None,
):
    """dL/dlogits (N, V) in logits' dtype; g is the per-token upstream (N,).

    Vocab-parallel mode (vocab_start given, see ``forward``): lse is the global
    logsumexp, labels are global ids, the label's column here is
    label - vocab_start, a label outside [0, vocab_total) gives a NaN row and
    label smoothing spreads eps / vocab_total over every column.
    config: the tiles (default ``backward_config(V)``).
    g_lse: None, or the per-token cotangent of lse (N,) (the returned z_loss's gradient flows through lse): its
    term g_lse * p * dz/dx is added (a variant of the kernel; None runs the plain one).
    weight: class weights (V,) as in ``forward``, or None.
    """
    n, vocab = logits.shape
    vocab_parallel = vocab_start is not None
    if vocab_parallel and vocab_total is None:
        raise ValueError("vocab_start needs vocab_total (the global vocabulary size)")
    if weight is not None and vocab_parallel:
        raise NotImplementedError("class weights are not supported in vocab-parallel mode")
    config = backward_config(vocab) if config is None else config
    row_spec = pl.BlockSpec((None,), lambda i, j: (i,))
    tile_spec = pl.BlockSpec((None, config.block), lambda i, j: (i, j))
    operands = (logits, labels, lse, g.astype(jnp.float32))
    weight_specs = []
    smoothing = options.label_smoothing != 0.0
    if weight is not None:
        weight = weight.astype(jnp.float32)
        operands += (label_weights(labels, weight, vocab),)
        weight_specs.append(row_spec)
        if smoothing:
            n_tiles = _cdiv(vocab, config.block)
            operands += (jnp.pad(weight, (0, n_tiles * config.block - vocab)), jnp.sum(weight).reshape(1))
            weight_specs += [pl.BlockSpec((config.block,), lambda i, j: (j,)), pl.BlockSpec((1,), lambda i, j: (0,))]
    operands += (_vocab_start_operand(vocab_start),) if vocab_parallel else ()
    operands += (g_lse.astype(jnp.float32),) if g_lse is not None else ()
    operands, mat = _same_variance(*operands)
    bwd = pl.pallas_call(
        functools.partial(
            _backward_kernel if weight is None else functools.partial(_weighted_backward_kernel, smoothing=smoothing),
            vocab=vocab,
            vocab_total=vocab_total if vocab_parallel else vocab,
            block=config.block,
            ignore_index=ignore_value(labels.dtype, options.ignore_index),
            options=options,
            vocab_parallel=vocab_parallel,
            **({"lse_cotangent": True} if g_lse is not None else {}),
        ),
        grid=(n, _cdiv(vocab, config.block)),
        in_specs=[tile_spec, row_spec, row_spec, row_spec]
        + weight_specs
        + ([pl.BlockSpec((1,), lambda i, j: (0,))] if vocab_parallel else [])
        + ([row_spec] if g_lse is not None else []),
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct(logits.shape, logits.dtype, manual_axis_type=mat),
        # Each program reads its tile before writing the same tile, so the
        # gradient may overwrite the logits residual (XLA copies when it can't).
        input_output_aliases={0: 0} if inplace else {},
        compiler_params=plgpu.CompilerParams(num_warps=config.warps, num_stages=config.stages),
        interpret=interpret,
        name="fastce_backward",
    )
    with quiet_triton(interpret):
        return _launch(bwd, operands, mat, interpret)


def uses_int64_offsets(n_rows: int, vocab: int, dtype) -> bool:
    """Whether Pallas-Triton emits 64-bit offsets for an (n_rows, vocab) operand
    (mirrors the lowering's rule; documented for the 64-bit-offset test)."""
    return n_rows * vocab * jnp.dtype(dtype).itemsize > 2**32
