"""The per-token inputs beside the logits and labels, in JAX terms: token_weights (w_t scaling token t's loss),
where= (a mask folded into the labels) and shift (position t scored against label t + shift), their checks and how
each is folded into the labels or results; the same module and names as fastce_torch's core/token_inputs.py."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from .options import as_array, constant_weight, ignore_value
from .outputs import CrossEntropyOutput

__all__ = [
    "check_token_weights",
    "masked_labels",
    "shifted_token_weights",
    "check_shift",
    "shifted_labels",
    "keep_positions",
]


def check_token_weights(token_weights, labels_shape: tuple):
    """Per-token weights (advantages, masks): None, or a floating-point array shaped exactly like labels, returned as
    float32 (float64 when given in float64) carrying no gradient (differentiating with respect to it raises
    ValueError naming token_weights)."""
    if token_weights is None:
        return None
    token_weights = as_array(token_weights, "token_weights")
    if not jnp.issubdtype(jnp.dtype(token_weights.dtype), jnp.floating):
        raise TypeError(f"token_weights must be a floating-point array, got {token_weights.dtype}")
    if tuple(token_weights.shape) != tuple(labels_shape):
        raise ValueError(
            f"token_weights shape {tuple(token_weights.shape)} must equal labels' shape {tuple(labels_shape)}"
        )
    if jnp.dtype(token_weights.dtype) != jnp.float64:
        token_weights = jnp.asarray(token_weights).astype(jnp.float32)
    return constant_weight(jnp.asarray(token_weights), "token_weights")


def masked_labels(labels, where, ignore_index: int):
    """optax's ``where=`` (a bool array shaped like labels; False = leave the token out) folded into the labels:
    ignore_index where False (loss 0, gradient 0, not counted by "mean"), O(N) integers and no kernel pass. None:
    the labels unchanged. Host labels and mask stay on the host (validate_labels reads them)."""
    if where is None:
        return labels
    where = as_array(where, "where")
    if jnp.dtype(where.dtype) != jnp.bool_:
        raise TypeError(f"where must be a bool array shaped like labels (False leaves a token out), got {where.dtype}")
    if tuple(where.shape) != tuple(labels.shape):
        raise ValueError(f"where shape {tuple(where.shape)} must equal labels' shape {tuple(labels.shape)}")
    if ignore_value(labels.dtype, ignore_index) is None:
        raise ValueError(f"where marks left-out tokens with ignore_index ({ignore_index}), which {labels.dtype} "
                         "labels cannot hold; pass an ignore_index in the labels' range")  # fmt: skip
    xp = np if isinstance(labels, np.ndarray) and isinstance(where, np.ndarray) else jnp
    return xp.where(where, labels, xp.asarray(ignore_index, labels.dtype))


def shifted_token_weights(token_weights, shift: int):
    """token_weights aligned with shifted_labels: w[..., shift:] followed by `shift` zeros (the padded
    positions are ignored rows anyway)."""
    if token_weights is None or not shift:
        return token_weights
    kept = token_weights[..., shift:]
    pad = jnp.zeros((*token_weights.shape[:-1], token_weights.shape[-1] - kept.shape[-1]), token_weights.dtype)
    return jnp.concatenate((kept, pad), axis=-1)


def check_shift(shift) -> int:
    """shift as an int: True is 1, False 0; position t of the sequence (labels' last axis) is then scored against
    label t + shift."""
    if not isinstance(shift, numbers.Integral):
        raise TypeError(f"shift must be a non-negative int (True means 1), got {shift!r}")
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    return int(shift)


def shifted_labels(labels, shift: int, ignore_index: int):
    """labels[..., shift:] followed by `shift` ignore_index columns (all ignore_index when shift >= the sequence
    length), and the length of the kept part. The kernels then run on the full, unsliced logits: their last `shift`
    positions are ignored rows (a zero gradient), so the loss equals that of (logits[..., :-shift, :],
    labels[..., shift:]) without slicing the logits (a logits-sized copy, and a padded gradient). O(N) integers."""
    if labels.ndim < 1:
        raise ValueError("shift needs labels with a sequence axis (their last), got 0-d labels")
    if ignore_value(labels.dtype, ignore_index) is None:
        raise ValueError(
            f"shift pads the labels with ignore_index ({ignore_index}), which {labels.dtype} labels cannot hold; "
            "pass an ignore_index in int32's range"
        )
    xp = np if isinstance(labels, np.ndarray) else jnp  # host labels stay on the host (validate_labels reads them)
    kept = labels[..., shift:]
    pad = xp.full((*labels.shape[:-1], labels.shape[-1] - kept.shape[-1]), ignore_index, labels.dtype)
    return xp.concatenate((kept, pad), axis=-1), kept.shape[-1]


def keep_positions(result, kept, reduction: str):
    """A shifted call's result restricted to its first ``kept`` positions (labels' last axis): the loss for "none",
    and the per-token fields of a CrossEntropyOutput (lse always, the others for "none"); unchanged when kept is
    None."""
    if kept is None:
        return result
    if not isinstance(result, CrossEntropyOutput):
        return result[..., :kept] if reduction == "none" else result
    fields = result._fields if reduction == "none" else ("lse",)
    return result._replace(**{f: getattr(result, f)[..., :kept] for f in fields if getattr(result, f) is not None})
