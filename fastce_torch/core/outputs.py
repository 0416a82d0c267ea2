"""The output records and the extra outputs of the contract in plain torch (CONTRACT.md, "Extra outputs"):
CrossEntropyOutput (what the return_* keywords return), LogProbOutput (log_probs' with the entropy) and
PolicyLossOutput (linear_policy_loss's), the
CrossEntropyOutput of per-token statistics (the kernels' and the reference's), its cut to the kept positions of a
shift, and the token-weighted reduction of a call made with reduction="none"."""

from typing import NamedTuple

import torch

from .options import label_weights, loss_divisor
from .reference import row_extras, softmax_mean, transform
from .token_inputs import apply_token_weights

__all__ = [
    "CrossEntropyOutput",
    "LogProbOutput",
    "PolicyLossOutput",
    "extra_outputs",
    "reference_outputs",
    "unshifted",
    "weighted_output",
]


class CrossEntropyOutput(NamedTuple):
    """What cross_entropy / linear_cross_entropy return when any return_* keyword is True (None where not asked):
    loss as without them (z-loss term included); z_loss the z-loss term reduced like the loss (differentiable);
    lse the per-token logsumexp of the transformed logits (-inf where ignored); accuracy per token ("none") or the
    fraction of non-ignored rows whose argmax is the label; entropy of softmax(transformed logits) reduced like the
    loss. lse, accuracy and entropy carry no gradient. CONTRACT.md, "Extra outputs"."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    accuracy: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


class LogProbOutput(NamedTuple):
    """What log_probs / linear_log_probs return with return_entropy=True: float32 log-probabilities of the tokens
    at the temperature (0.0 where the token is ignore_index, NaN outside [0, V)) and the entropy of each position's
    distribution (0 where ignored), both shaped like the tokens (after a shift) and both differentiable."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


class PolicyLossOutput(NamedTuple):
    """What linear_policy_loss returns: the loss (differentiable) and TRL's logged metrics, detached float32 masked
    means over the mask: the per-token KL to the reference policy (0.0 when beta == 0), the entropy, and the
    fractions of tokens whose ratio is clipped below (with a negative advantage), above (with a positive one) and
    either (cispo: low 0, high TRL's cispo_clip_ratio)."""

    loss: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clip_ratio_low: torch.Tensor
    clip_ratio_high: torch.Tensor
    clip_ratio_region: torch.Tensor


def extra_outputs(
    loss, lse, argmax, mean_z, labels, options, extras, reduction, n_items, vocab, weight=None, entropy_grad=False
):
    """CrossEntropyOutput from the loss and per-token (lse, argmax, mean of z under softmax) of flat rows (N,),
    shaped like `labels`. z_loss is differentiable through lse (when lse requires grad); the entropy, lse - mean_z,
    through both with entropy_grad (mean_z then carries its true derivative: the caller's backward turns the pair
    of upstreams (a, b) into a + b on the lse and -b on the entropy, whose gradient is p (mz - z)), else detached. lse
    and accuracy carry no gradient. O(N) framework ops. weight: class weights (V,) or None: z_loss is then the loss's
    weighted term (w[y] z_loss lse^2, over the loss's weighted divisor); lse, accuracy and entropy ignore them."""
    ignore_index = options.ignore_index
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < vocab)
    shape = labels.shape
    lse = lse.view(shape)
    # A row holding +inf has no logsumexp (torch's gives +inf there, the kernels NaN): NaN in every output.
    lse = torch.where(lse.detach() == float("inf"), float("nan"), lse)
    bad_row = torch.isnan(lse.detach())
    live_lse = lse if entropy_grad else lse.detach()
    out = dict(loss=loss)
    divisor = loss_divisor(labels, reduction, n_items, ignore_index, lse.dtype)

    def reduced(values):
        return values if divisor is None else values.sum() / divisor

    if extras.z_loss:
        kept_lse = torch.where(ignored, 0.0, lse)  # ignored rows' lse is -inf: no inf * 0 in the gradient
        z_term = (options.z_loss * kept_lse * kept_lse) * torch.where(in_range | ignored, 1.0, float("nan")).to(
            lse.dtype
        )
        if weight is not None:
            z_term = z_term * label_weights(labels, weight.to(z_term.dtype), vocab)
            z_divisor = loss_divisor(labels, reduction, n_items, ignore_index, lse.dtype, weight)
            out["z_loss"] = z_term if z_divisor is None else z_term.sum() / z_divisor
        else:
            out["z_loss"] = reduced(z_term)
    lse = lse.detach()
    if extras.lse:
        out["lse"] = torch.where(ignored, -float("inf"), lse)
    if extras.accuracy:
        hit = (argmax.view(shape) == labels).to(lse.dtype)
        hit = torch.where(in_range & ~bad_row, hit, float("nan"))
        hit = torch.where(ignored, 0.0, hit)
        if divisor is not None:
            hit = hit.sum() / (~ignored).sum().clamp_min(1).to(hit.dtype)
        out["accuracy"] = hit
    if extras.entropy:
        live_mean_z = mean_z if entropy_grad else mean_z.detach()
        entropy = torch.where(bad_row, float("nan"), live_lse - live_mean_z.view(shape))
        out["entropy"] = reduced(torch.where(ignored, 0.0, entropy))
    return CrossEntropyOutput(**out)


def unshifted(output, kept, reduction):
    """A CrossEntropyOutput of shifted labels cut to the kept positions (shift=): per-token fields only."""
    if kept is None:
        return output
    fields = output._asdict()
    for name, value in fields.items():
        if value is not None and (name == "lse" or reduction == "none"):
            fields[name] = value[..., :kept]
    return CrossEntropyOutput(**fields)


def reference_outputs(logits, labels, options, extras, reduction, n_items, loss, weight=None):
    """CrossEntropyOutput of the plain-torch path (the loss already computed by it)."""
    z = transform(logits, options, labels)
    lse = torch.logsumexp(z, dim=-1)
    with torch.no_grad():
        argmax, mean_z = row_extras(z.detach())
    if extras.entropy:  # a differentiable entropy: mz with its gradient, NaN-free at -inf
        mean_z = softmax_mean(z)[1].squeeze(-1)
    return extra_outputs(
        loss, lse.reshape(-1), argmax.reshape(-1), mean_z.reshape(-1), labels, options, extras, reduction, n_items,
        logits.shape[-1], weight, extras.entropy,
    )  # fmt: skip


def weighted_output(result, labels, token_weights, reduction, n_items, ignore_index, weight=None):
    """The loss (or CrossEntropyOutput) of a call made with reduction="none", token-weighted and then reduced as
    `reduction` asks (CONTRACT.md, token_weights): loss and z_loss per token times w_t (ignored tokens 0), then
    divided like the loss (n_items, the kept count or the class weights' divisor; never the weights' sum); lse,
    accuracy and entropy unweighted, reduced as extra_outputs reduces them. O(N) framework ops."""
    output = result if isinstance(result, CrossEntropyOutput) else CrossEntropyOutput(result)
    fields = output._asdict()
    for name in ("loss", "z_loss"):
        if fields[name] is not None:
            fields[name] = apply_token_weights(fields[name], labels, token_weights, ignore_index)
    if reduction != "none":
        dtype = fields["loss"].dtype
        divisor = loss_divisor(labels, reduction, n_items, ignore_index, dtype, weight)
        plain_divisor = loss_divisor(labels, reduction, n_items, ignore_index, dtype)
        kept = (labels != ignore_index).sum().clamp_min(1).to(dtype)
        for name, by in (("loss", divisor), ("z_loss", divisor), ("accuracy", kept), ("entropy", plain_divisor)):
            if fields[name] is not None:
                fields[name] = fields[name].sum() / by
    if isinstance(result, CrossEntropyOutput):
        return CrossEntropyOutput(**fields)
    return fields["loss"]
