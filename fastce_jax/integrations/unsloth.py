"""Unsloth's loss entry point by name, the JAX twin of `fastce_torch.fast_cross_entropy_loss`:

    from fastce_jax import fast_cross_entropy_loss

Same signature and meaning as `unsloth.kernels.cross_entropy_loss.fast_cross_entropy_loss`; fastce's guarantees
(CONTRACT.md) on top. There is no `patch_loss_functions` here: it patches PyTorch transformers.
"""

from ..losses.cross_entropy.api import cross_entropy

__all__ = ["fast_cross_entropy_loss"]


def fast_cross_entropy_loss(logits, labels, logit_softcapping=0, logit_scaling=0, n_items=None, **options):
    """Sum of the token losses of logits (batch, seq_len, V) against labels (batch, seq_len), divided by n_items.

    As in Unsloth: the caller shifts the labels, -100 is ignored, n_items (a number or a 0-d array, possibly
    traced) defaults to the number of non-ignored labels, logit_scaling (Cohere) multiplies the logits before
    logit_softcapping (Gemma 2) applies ``cap * tanh(x / cap)``; 0 disables either.

    Where fastce differs, on purpose: a batch whose labels are all -100 gives 0 (not 0/0 = NaN) with a zero
    gradient; a label outside [0, V) gives NaN (its row is never read out of bounds); n_items <= 0 and a negative
    logit_softcapping raise ValueError. Further keywords go to `fastce_jax.cross_entropy` (z_loss,
    label_smoothing, ignore_index, backend, inplace_backward, validate_labels).
    """
    logits_shape, labels_shape = tuple(getattr(logits, "shape", ())), tuple(getattr(labels, "shape", ()))
    if len(logits_shape) != 3 or labels_shape != logits_shape[:2]:
        raise ValueError(
            f"fast_cross_entropy_loss takes logits (batch, seq_len, vocab) and labels (batch, seq_len), got logits "
            f"{logits_shape} and labels {labels_shape}; fastce_jax.cross_entropy takes any (..., V)"
        )
    return cross_entropy(
        logits,
        labels,
        reduction="mean" if n_items is None else "sum",
        n_items=n_items,
        logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling,
        **options,
    )
