"""Host side of the distillation loss's kernels: tile configurations (JsdConfig, jsd_config, the forward's row
segments) and the launchers ``jsd_forward`` (the partials kernel, for a mixture the mixture kernel, then the finish
kernel: forward.py) and ``jsd_backward`` (backward.py), on 2-D logits (N, V) and (N, V_t >= V), labels (N,) or None.
The loss-neutral part of a launch (quiet_triton, same_variance, launch) is fastce_jax/core/launch.py's; the ops
around the launchers (custom_partitioning, vmap, custom_vjp) are autograd.py's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.kernel_helpers import cdiv, next_pow2
from ...core.launch import launch, quiet_triton, same_variance
from ...core.options import fold_temperature, ignore_value
from .backward import jsd_backward_kernel
from .forward import LN2, jsd_finish_kernel, jsd_mixture_kernel, jsd_partials_kernel
from .options import MIXTURE, JsdOptions, beta_terms

__all__ = [
    "FORWARD_BLOCK",
    "FORWARD_WARPS",
    "BACKWARD_BLOCK",
    "BACKWARD_WARPS",
    "FINISH_WARPS",
    "FORWARD_PROGRAMS",
    "JsdConfig",
    "jsd_config",
    "forward_segments",
    "beta_operand",
    "jsd_forward",
    "jsd_backward",
]

# Untuned first values (two logits arrays per tile, so half the CE forward's 4096-wide tile); the bench tool
# sweeps them by setting these module constants.
FORWARD_BLOCK, FORWARD_WARPS = 2048, 4
BACKWARD_BLOCK, BACKWARD_WARPS = 2048, 4
FINISH_WARPS = 1  # the finish kernel touches a few (S,) partials per row
# Programs the forward aims for (forward_segments): fastce_torch's JSD_FORWARD_PROGRAMS, 4 waves of the H200's 132
# SMs x 4 resident 8-warp programs. These programs have 4 warps with the same 16 float32 per thread per tile, so
# about 8 are resident per SM: 2 waves. Not tuned yet.
FORWARD_PROGRAMS = 4 * 132 * 4


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


def beta_operand(beta: float) -> np.ndarray:
    """beta_terms as the kernels' float32 (4,) operand."""
    return np.asarray(beta_terms(beta), np.float32)


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
    the scaling and soft-capping constants, core.options.fold_temperature), so base 2 costs no extra multiply."""
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
    (student, teacher, *extra), mat = same_variance(student, teacher, *extra)
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
        parts = tuple(launch(partials, (student, teacher, *labels), mat, interpret))
        if mixture:
            parts += tuple(launch(mixture_pass, (student, teacher, *labels, *beta, *parts), mat, interpret))
        return tuple(launch(finish, (*parts, *labels, *beta), mat, interpret))


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
    operands, mat = same_variance(student, teacher, *rows, *extra)
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
        return launch(call, operands, mat, interpret)
