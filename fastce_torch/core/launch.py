"""Triton kernels for the fused cross-entropy (see CONTRACT.md for the math), their launchers (`forward`,
`backward`) and launch configuration (`forward_config`, `backward_config`), with the tuned constants.

Two kernels, each reading the logits once (and _scale_unless_one_kernel, for linear_cross_entropy's gradients):
  _forward_kernel   (forward.py) grid (N, C): one program walks one chunk of one row, one exp per element, keeping
                    the running max, sum of exp and sum of z; the row's last chunk combines the chunks' partials and
                    writes the per-token loss and logsumexp, and for "mean"/"sum" the batch is reduced in-kernel.
  _backward_kernel  (backward.py) grid (N, cdiv(V, BLOCK)): recomputes z, writes the gradient in one pass, in place
                    when the caller passes the logits buffer as the gradient buffer.
Rows whose label is ignore_index are never read: their partials are empty and their gradient is written as zeros.
Row offsets are 64-bit, so N*V beyond 2**31 elements is fine.
Vocab-parallel mode (VOCAB_PARALLEL, a constexpr: the single-device path compiles without it): the logits are one
rank's columns [vocab_start, vocab_start + V) of a vocabulary of vocab_total; the forward writes per row the local
logsumexp, the transformed label logit (0 unless this slice holds the label) and the local sum of z, for the caller
to combine across ranks (combine.py); the backward takes the global logsumexp and places the label at column
label - vocab_start.
Extra outputs (OUTPUTS, a constexpr: the default variants compile without it, bench/tools/same_ptx.py checks that
their instructions are unchanged): the forward also keeps per chunk the first column of the largest z and
sum_j e^(z_j - max) z_j, combines them like the other partials and writes per row the argmax and the mean of z
(accuracy and entropy in cross_entropy's CrossEntropyOutput); `lse_backward` is the z_loss output's gradient.
The entropy output's gradient (HAS_ENTROPY_GRAD, a constexpr of the backward kernel; `backward(..., grad_entropy=,
mean_z=)`) adds g_H p_j (mz - z_j) dz/dx in the backward's one pass; the variants without it are unchanged.

Modules: common.py (the @triton.jit helpers), forward.py and backward.py (the kernels), combine.py (the
vocab-parallel combine kernels and their three host-side steps), launch.py (the host side: configs, capture guard,
scratch layout, launch functions), launch_cache.py (the reproduction of Triton 3.6.0's launch path; deletable),
jsd_forward.py and jsd.py (the distillation kernels of jsd / linear_jsd; jsd.py has their launchers).
This package re-exports what the other layers call, and forgets the launchers' variants (forget_launches, and after
a fork).
"""

import os

from . import combine, jsd, launch
from .combine import (
    VOCAB_PARALLEL_BLOCK,
    VocabParallelStatistics,
    vocab_parallel_loss,
    vocab_parallel_rescale,
    vocab_parallel_statistics,
)
from .launch import (
    BACKWARD_BLOCK,
    BACKWARD_WARPS,
    CHUNK,
    FIRST_LAUNCH_IN_CAPTURE,
    FORWARD_BLOCK,
    FORWARD_STAGES,
    FORWARD_WARPS,
    GROUPS_BLOCK,
    INTERPRETED,
    LAUNCH_CACHE_VARIABLE,
    ROWS_PER_GROUP,
    SCALE_BLOCK,
    BackwardConfig,
    ForwardConfig,
    Options,
    backward,
    backward_config,
    class_weight_operands,
    denominator_operands,
    forward,
    forward_config,
    launch_cache,
    launch_cache_enabled,
    lse_backward,
    on_device,
    row_layout,
    rows_overlap,
    scale_unless_one,
)

__all__ = [
    "BACKWARD_BLOCK",
    "BACKWARD_WARPS",
    "CHUNK",
    "FIRST_LAUNCH_IN_CAPTURE",
    "FORWARD_BLOCK",
    "FORWARD_STAGES",
    "FORWARD_WARPS",
    "GROUPS_BLOCK",
    "INTERPRETED",
    "LAUNCH_CACHE_VARIABLE",
    "ROWS_PER_GROUP",
    "SCALE_BLOCK",
    "VOCAB_PARALLEL_BLOCK",
    "BackwardConfig",
    "ForwardConfig",
    "Options",
    "VocabParallelStatistics",
    "backward",
    "backward_config",
    "class_weight_operands",
    "denominator_operands",
    "forget_launches",
    "forward",
    "forward_config",
    "launch_cache",
    "launch_cache_enabled",
    "lse_backward",
    "on_device",
    "row_layout",
    "rows_overlap",
    "scale_unless_one",
    "vocab_parallel_loss",
    "vocab_parallel_rescale",
    "vocab_parallel_statistics",
]


def _launchers():
    # Looked up at each call, so a launcher replaced by a test is the one forgotten.
    return (
        launch.forward_launcher, launch.backward_launcher, launch.scale_launcher, combine.maxima_launcher,
        combine.rescale_launcher, combine.vocab_parallel_loss_launcher, jsd.partials_launcher, jsd.mixture_launcher,
        jsd.finish_launcher, jsd.backward_launcher,
    )  # fmt: skip


def forget_launches():
    """Forget which kernel variants have run (the capture guard's record and the launch cache): the next launch of
    each variant takes Triton's generic path again, as in a fresh process."""
    launch._launched.clear()
    for launcher in _launchers():
        launcher.forget()


def _forget_variants_after_fork():
    # A forked child cannot use its parent's CUDA context: its first launch must take Triton's generic path (and
    # torch.cuda's checks), not a cached launcher whose device getter skips them.
    for launcher in _launchers():
        launcher.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_variants_after_fork)
