"""A float64 reference for the RL keywords written out literally in torch autograd (temperature as
softcap(scale * x) / T, token weights, a differentiable entropy), independent of the host-side folding the package
does: every field of CrossEntropyOutput, reduced as the contract says."""

import torch


def literal(
    logits, labels, *, reduction="mean", temperature=1.0, token_weights=None, ignore_index=-100,
    logit_softcapping=0.0, logit_scaling=0.0, label_smoothing=0.0, z_loss=0.0, n_items=None, weight=None, shift=0,
):  # fmt: skip
    """dict(loss, z_loss, entropy) of float64 logits (tracked by autograd when they require grad)."""
    x = logits
    if shift:
        x, labels = x[..., :-shift, :], labels[..., shift:]
        token_weights = None if token_weights is None else token_weights[..., shift:]
    z = x.double()
    if logit_scaling:
        z = logit_scaling * z
    if logit_softcapping:
        z = logit_softcapping * torch.tanh(z / logit_softcapping)
    z = z / temperature
    vocab = z.shape[-1]
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < vocab)
    safe = torch.where(in_range, labels, 0).long()
    lse = torch.logsumexp(z, -1)
    z_label = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    w_label = 1.0 if weight is None else weight.double()[safe]
    class_w = torch.ones(vocab, dtype=torch.float64) if weight is None else weight.double()
    spread = torch.where(class_w == 0, 0.0, class_w * (lse.unsqueeze(-1) - z)).sum(-1)
    z_term = w_label * z_loss * lse * lse
    loss = w_label * (1 - label_smoothing) * (lse - z_label) + label_smoothing / vocab * spread + z_term
    p = torch.softmax(z, -1)
    entropy = lse - (p * torch.where(p > 0, z, 0.0)).sum(-1)
    loss = torch.where(in_range | ignored, loss, float("nan"))  # a label outside [0, V): NaN
    loss, z_term, entropy = (torch.where(ignored, 0.0, t) for t in (loss, z_term, entropy))
    if token_weights is not None:
        loss, z_term = (torch.where(ignored, 0.0, token_weights.double() * t) for t in (loss, z_term))
    if reduction == "none":
        return dict(loss=loss, z_loss=z_term, entropy=entropy)
    kept = (~ignored).sum().clamp_min(1).double()
    if n_items is not None:
        divisor = plain = torch.as_tensor(float(n_items), dtype=torch.float64)
    elif reduction == "sum":
        divisor = plain = torch.ones((), dtype=torch.float64)
    else:
        plain = kept
        divisor = kept if weight is None else torch.where(ignored, 0.0, w_label).sum()
        divisor = torch.where(divisor == 0, 1.0, divisor)
    return dict(loss=loss.sum() / divisor, z_loss=z_term.sum() / divisor, entropy=entropy.sum() / plain)
