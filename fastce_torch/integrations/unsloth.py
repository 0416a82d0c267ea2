"""Unsloth's entry points by name, so that moving from Unsloth's cross-entropy kernel is one changed import:

    from fastce_torch import fast_cross_entropy_loss, patch_loss_functions

Same signature and meaning as `unsloth.kernels.cross_entropy_loss`; fastce's guarantees (CONTRACT.md) on top.
"""

from ..losses.cross_entropy.api import cross_entropy
from .transformers import patch_transformers

__all__ = ["fast_cross_entropy_loss", "patch_loss_functions"]


def fast_cross_entropy_loss(logits, labels, logit_softcapping=0, logit_scaling=0, n_items=None, **options):
    """Sum of the token losses of logits (batch, seq_len, V) against labels (batch, seq_len), divided by n_items.

    As in Unsloth: the caller shifts the labels, -100 is ignored, n_items (a number or a 0-d tensor, e.g.
    transformers' num_items_in_batch) defaults to the number of non-ignored labels, logit_scaling (Cohere) multiplies
    the logits before logit_softcapping (Gemma 2) applies `cap * tanh(x / cap)`; 0 disables either.

    Where fastce differs, on purpose: a batch whose labels are all -100 gives 0 (not 0/0 = NaN) with a zero gradient;
    a label outside [0, V) gives NaN (its row is never read out of bounds); n_items <= 0 and a negative
    logit_softcapping raise ValueError; the gradient is written into the logits' buffer only when the logits are an
    intermediate tensor (never a leaf). The default n_items is counted in the kernel, so nothing synchronises.
    Further keywords go to `fastce_torch.cross_entropy` (z_loss, label_smoothing, ignore_index, backend,
    inplace_backward, validate_labels).
    """
    logits_shape, labels_shape = tuple(getattr(logits, "shape", ())), tuple(getattr(labels, "shape", ()))
    if len(logits_shape) != 3 or labels_shape != logits_shape[:2]:
        raise ValueError(
            f"fast_cross_entropy_loss takes logits (batch, seq_len, vocab) and labels (batch, seq_len), got logits "
            f"{logits_shape} and labels {labels_shape}; fastce_torch.cross_entropy takes any (..., V)"
        )
    # The 3-D logits go to cross_entropy as they are: it flattens them itself, as a view wherever one exists.
    return cross_entropy(
        logits,
        labels,
        reduction="mean" if n_items is None else "sum",
        n_items=n_items,
        logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling,
        **options,
    )


def patch_loss_functions(torch_compile=True):
    """Unsloth's name for `patch_transformers()`: every transformers causal-LM loss (and the Trainer) uses fastce.

    torch_compile is accepted for compatibility and changes nothing here: Unsloth wraps its loss in torch.compile
    to fuse the ops around the kernel, whereas fastce's loss is already one kernel launch each way (the default
    n_items included), and a model compiled by the caller reaches it through fastce's custom ops without a
    graph break. Undo with `fastce_torch.unpatch_transformers()`.
    """
    del torch_compile
    patch_transformers()
