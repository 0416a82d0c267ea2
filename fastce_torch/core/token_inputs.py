"""The per-token inputs beside the logits and labels, in plain torch: token_weights (w_t scaling token t's loss),
where= (a mask folded into the labels) and shift (position t scored against label t + shift), their checks and how
each is folded into the labels or losses; the same module and names as fastce_jax's token_inputs."""

import torch

__all__ = [
    "TOKEN_WEIGHTS_GRAD_UNSUPPORTED",
    "apply_token_weights",
    "check_shift",
    "check_token_weights",
    "masked_labels",
    "shifted_labels",
    "shifted_token_weights",
]

TOKEN_WEIGHTS_GRAD_UNSUPPORTED = (
    "token_weights requires grad: fastce computes no gradient for the token weights (advantages, masks); pass "
    "token_weights.detach()"
)


def check_token_weights(token_weights, labels):
    """token_weights: None, or a floating tensor shaped exactly like `labels` (before any shift) on labels' device,
    not requiring grad. Negative weights (advantages) are allowed; NaN shows as that token's NaN loss."""
    if token_weights is None:
        return None
    if not isinstance(token_weights, torch.Tensor) or not token_weights.is_floating_point():
        raise TypeError(
            "token_weights must be a floating-point tensor shaped like labels, got "
            f"{getattr(token_weights, 'dtype', type(token_weights))}"
        )
    if tuple(token_weights.shape) != tuple(labels.shape):
        raise ValueError(
            f"token_weights must have labels' shape {tuple(labels.shape)}, got {tuple(token_weights.shape)}"
        )
    if token_weights.device != labels.device:
        raise ValueError(f"token_weights are on {token_weights.device} but labels on {labels.device}")
    if token_weights.requires_grad:
        raise ValueError(TOKEN_WEIGHTS_GRAD_UNSUPPORTED)
    return token_weights


def masked_labels(labels, where, ignore_index):
    """optax's `where=` (a bool tensor shaped like labels on their device; False = leave the token out) folded into
    the labels: ignore_index where False (loss 0, gradient 0, not counted by "mean"), O(N) integers, no kernel
    pass. None: the labels unchanged."""
    if where is None:
        return labels
    if not isinstance(where, torch.Tensor) or where.dtype != torch.bool:
        raise TypeError(
            "where must be a bool tensor shaped like labels (False leaves the token out), got "
            f"{getattr(where, 'dtype', type(where))}"
        )
    if tuple(where.shape) != tuple(labels.shape):
        raise ValueError(f"where must have labels' shape {tuple(labels.shape)}, got {tuple(where.shape)}")
    if where.device != labels.device:
        raise ValueError(f"where is on {where.device} but labels on {labels.device}")
    if hasattr(where, "placements") != hasattr(labels, "placements"):  # one DTensor, one plain tensor
        raise ValueError("where must be a DTensor placed like labels when labels is one, a plain tensor otherwise")
    info = torch.iinfo(labels.dtype)
    if not info.min <= ignore_index <= info.max:
        raise ValueError(
            f"where marks left-out tokens with ignore_index ({ignore_index}), which {labels.dtype} labels cannot "
            "hold; pass int64 labels"
        )
    return torch.where(where, labels, ignore_index)


def shifted_token_weights(token_weights, shift):
    """token_weights[..., shift:] followed by `shift` zeros: aligned with shifted_labels' labels (w[..., t]
    goes with label[..., t]; the first `shift` weights are unused)."""
    kept = token_weights[..., shift:]
    pad = token_weights.new_zeros((*token_weights.shape[:-1], token_weights.shape[-1] - kept.shape[-1]))
    return torch.cat((kept, pad), dim=-1)


def apply_token_weights(token_losses, labels, token_weights, ignore_index):
    """w_t * loss_t per token (the losses' dtype; ignored tokens stay 0 whatever their weight), before the
    reduction. token_weights None: the losses unchanged."""
    if token_weights is None:
        return token_losses
    weighted = token_weights.to(token_losses.dtype).reshape(token_losses.shape) * token_losses
    return torch.where(labels.reshape(token_losses.shape) == ignore_index, 0.0, weighted)


def check_shift(shift, labels):
    """shift as an int: True is 1, False 0; position t of the sequence (labels' last dimension) is then scored
    against label t + shift."""
    if not isinstance(shift, int):
        raise TypeError(f"shift must be a non-negative int (True means 1), got {shift!r}")
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    if shift and labels.dim() < 1:
        raise ValueError("shift needs labels with a sequence dimension (their last), got 0-d labels")
    return int(shift)


def shifted_labels(labels, shift, ignore_index):
    """labels[..., shift:] followed by `shift` ignore_index columns (all ignore_index when shift >= the sequence
    length), and the length of the kept part. The kernels then run on the full, unsliced logits: their last `shift`
    positions are ignored rows, never read and given a zero gradient, so the loss equals that of
    (logits[..., :-shift, :], labels[..., shift:]) with no logits-sized slice or gradient. O(N) integers."""
    info = torch.iinfo(labels.dtype)
    if not info.min <= ignore_index <= info.max:
        raise ValueError(
            f"shift pads the labels with ignore_index ({ignore_index}), which {labels.dtype} labels cannot hold; "
            "pass int64 labels"
        )
    kept = labels[..., shift:]
    pad = labels.new_full((*labels.shape[:-1], labels.shape[-1] - kept.shape[-1]), ignore_index)
    return torch.cat((kept, pad), dim=-1), kept.shape[-1]
