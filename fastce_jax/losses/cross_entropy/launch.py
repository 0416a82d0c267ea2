"""Host side of the cross-entropy kernels: tile configurations and the launchers ``forward`` and ``backward``.

All launchers take 2-D logits (N, V) and 1-D labels (N,); reshaping, argument checks, reductions and the custom_vjp
live in ``autograd.py``, ``api.py`` and ``fastce_jax/distributed/partitioning.py`` (options and formulas in
``fastce_jax/core/``); the kernels themselves are in ``forward.py`` and ``backward.py``; the loss-neutral part of a
launch (quiet_triton, same_variance, launch, 64-bit offsets) in ``fastce_jax/core/launch.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.kernel_helpers import cdiv, next_pow2
from ...core.launch import launch, quiet_triton, same_variance
from ...core.options import Options, ignore_value, label_weights
from .backward import backward_kernel, weighted_backward_kernel
from .forward import finish_kernel, forward_kernel, weighted_finish_kernel, weighted_forward_kernel

__all__ = [
    "FORWARD_BLOCK",
    "FORWARD_WARPS",
    "FORWARD_STAGES",
    "FINISH_WARPS",
    "BACKWARD_BLOCK",
    "BACKWARD_WARPS",
    "BACKWARD_STAGES",
    "CHUNK",
    "ForwardConfig",
    "BackwardConfig",
    "forward_config",
    "backward_config",
    "forward",
    "backward",
]

# From the H200 sweeps (bench/tools/tune.py, bench/NOTES.md): forward tiles of 4096 beat 2048 and 8192; 2 warps
# were 3-4% faster than 4 and 8 warps 10%+ slower; 3 stages no faster than 1 (the loop has no dot). Rows are split
# into chunks of 16384 columns whatever N is (batch invariance; vmap and the flattened call agree bitwise).
FORWARD_BLOCK, FORWARD_WARPS, FORWARD_STAGES = 4096, 2, 1
FINISH_WARPS = 1  # the finish kernel touches C + 2 scalars per row
BACKWARD_BLOCK, BACKWARD_WARPS, BACKWARD_STAGES = 2048, 4, 1  # one tile per program: nothing to pipeline
CHUNK = 16384


# ----------------------------------------------------------------------------
# Tile settings.  forward_config / backward_config read the module constants
# above when called (bench/tools/tune.py sweeps them; set them on this module,
# fastce_jax.losses.cross_entropy.launch: nothing re-exports them); the
# launchers take a config= to override them.
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
    block = min(FORWARD_BLOCK, next_pow2(vocab))
    chunk = max(block, min(CHUNK, next_pow2(vocab)))
    return ForwardConfig(block, chunk, cdiv(vocab, chunk), FORWARD_WARPS, FORWARD_STAGES, FINISH_WARPS)


def backward_config(vocab: int) -> BackwardConfig:
    """The backward kernel's tiles for V = vocab."""
    return BackwardConfig(min(BACKWARD_BLOCK, next_pow2(vocab)), BACKWARD_WARPS, BACKWARD_STAGES)


# ----------------------------------------------------------------------------
# Launchers.  Static options reach the kernels through functools.partial.
# ----------------------------------------------------------------------------


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
    core.reference.outputs_from_statistics); vocab-parallel mode appends (max_local, argmax_local) (float32, int32:
    this shard's largest z and the first global column holding it) and / or mean_z_local (sum_j p_j z_j over this
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
    n_chunks = cdiv(vocab, config.chunk)
    ignore = ignore_value(labels.dtype, options.ignore_index)
    want_argmax, want_entropy = extras = tuple(bool(e) for e in extras)
    f32 = jnp.float32
    operands = (logits, labels) + ((_vocab_start_operand(vocab_start),) if vocab_parallel else ())
    operands, mat = same_variance(*operands)
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
        fwd_inputs += (same_variance(padded, logits)[0][0],)
        fwd_specs.append(pl.BlockSpec((config.chunk,), lambda i, j: (j,)))
    fwd = pl.pallas_call(
        functools.partial(
            weighted_forward_kernel if weighted_sum else forward_kernel,
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
        weight_inputs = same_variance(w_label, jnp.sum(weight.astype(jnp.float32)).reshape(1), logits)[0][:2]
    finish = pl.pallas_call(
        functools.partial(
            weighted_finish_kernel if weight is not None else finish_kernel,
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
        m, s, sz, *partials = launch(fwd, fwd_inputs, mat, interpret)
        finish_inputs = (m, s, sz, labels, logits, *weight_inputs, *operands[2:], *partials)
        return tuple(launch(finish, finish_inputs, mat, interpret))


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
    g_entropy=None,
    mz=None,
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
    g_entropy, mz: None (both), or the per-token cotangent of the entropy output H (N,) and mz = lse - H (N,)
    (sum_j p_j z_j; vocab-parallel: from the global lse and H): the term g_entropy * p_j (mz - z_j) * dz/dx is added
    (another variant of the kernel, combinable with g_lse and weight).
    """
    n, vocab = logits.shape
    if (g_entropy is None) != (mz is None):
        raise ValueError("g_entropy and mz go together (the entropy's cotangent and lse - entropy per row)")
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
            n_tiles = cdiv(vocab, config.block)
            operands += (jnp.pad(weight, (0, n_tiles * config.block - vocab)), jnp.sum(weight).reshape(1))
            weight_specs += [pl.BlockSpec((config.block,), lambda i, j: (j,)), pl.BlockSpec((1,), lambda i, j: (0,))]
    operands += (_vocab_start_operand(vocab_start),) if vocab_parallel else ()
    operands += (g_lse.astype(jnp.float32),) if g_lse is not None else ()
    with_entropy = g_entropy is not None
    operands += (g_entropy.astype(jnp.float32), mz.astype(jnp.float32)) if with_entropy else ()
    operands, mat = same_variance(*operands)
    bwd = pl.pallas_call(
        functools.partial(
            backward_kernel if weight is None else functools.partial(weighted_backward_kernel, smoothing=smoothing),
            vocab=vocab,
            vocab_total=vocab_total if vocab_parallel else vocab,
            block=config.block,
            ignore_index=ignore_value(labels.dtype, options.ignore_index),
            options=options,
            vocab_parallel=vocab_parallel,
            **({"lse_cotangent": True} if g_lse is not None else {}),
            **({"entropy_cotangent": True} if with_entropy else {}),
        ),
        grid=(n, cdiv(vocab, config.block)),
        in_specs=[tile_spec, row_spec, row_spec, row_spec]
        + weight_specs
        + ([pl.BlockSpec((1,), lambda i, j: (0,))] if vocab_parallel else [])
        + ([row_spec] if g_lse is not None else [])
        + [row_spec] * (2 * with_entropy),
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
        return launch(bwd, operands, mat, interpret)
