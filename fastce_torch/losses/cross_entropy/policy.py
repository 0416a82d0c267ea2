"""The policy objectives' formulas (TRL 1.16 GRPOTrainer._compute_loss at the token level), for
linear_policy_loss (linear_policy.py): the option record and its checks, the per-token loss and its closed-form
derivative in log p, the per-token normalisation weights and the logged metrics. Every preset is elementwise in the
per-token log-probability log p_t (at the temperature) and entropy H_t once the weights are fixed: loss =
sum_t (w_t l_t + e_t H_t), so the derivative g_logp_t = w_t dl_t/dlogp_t, g_H_t = e_t is known inside the chunk
pass (plain torch here, so that it also runs inside a custom op).

Per token (r = exp(logp - old), old the caller's old log-probs or logp itself, detached: r = 1):
  cispo: l = -min(r, eps_high) A logp, the clamped ratio a constant;
  else:  l = -min(r' A, clamp(r, 1 - eps_low, 1 + eps_high) A), r' = min(r, delta) when delta is given;
  plus beta (exp(ref - logp) - (ref - logp) - 1).
The derivative is torch.minimum's (a tie splits the gradient in half) and torch.clamp's (it passes the gradient on
its closed range), so the kernel path's closed form equals autograd through the formula (the reference path).
Weights (mask m, 0 at ignored tokens): grpo m / (B clamp(sum_t m_b, 1)); bnpo m / clamp(sum m, 1);
dr_grpo m / (B max_completion_length); dapo and cispo m / normaliser, the normaliser num_items_in_batch when given
(clamped at 1; TRL divides its own by the processes and the accumulation steps: pass the one you want) else
clamp(sum m, 1). Entropy bonus e = -entropy_coef m / clamp(sum m, 1). A token of weight 0 takes no part (its terms
are dropped, so a NaN advantage there changes nothing). The reference in float64: shared_tests/reference_policy.py.
"""

import math
from typing import NamedTuple

import torch

__all__ = [
    "LOSS_TYPES",
    "PolicyOptions",
    "check_num_items",
    "check_policy_options",
    "masked_mean",
    "normalisation_weights",
    "policy_metrics",
    "token_loss",
    "token_loss_and_slope",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
CISPO = LOSS_TYPES.index("cispo")


class PolicyOptions(NamedTuple):
    """The per-token formula's settings, as the custom op takes them: loss_type the index into LOSS_TYPES, delta
    inf when not given (min(r, inf) = r)."""

    loss_type: int = 0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float = math.inf
    beta: float = 0.0
    entropy_coef: float = 0.0


def _number(value, name, minimum=None, positive=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite Python number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return float(value)


def check_policy_options(loss_type, epsilon_low, epsilon_high, delta, beta, entropy_coef, max_completion_length):
    """PolicyOptions from linear_policy_loss's keywords (ValueError / TypeError naming the keyword)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    epsilon_low = _number(epsilon_low, "epsilon_low", minimum=0.0)
    epsilon_high = epsilon_low if epsilon_high is None else _number(epsilon_high, "epsilon_high", minimum=0.0)
    delta = math.inf if delta is None else _number(delta, "delta", positive=True)
    if loss_type == "dr_grpo" and (
        isinstance(max_completion_length, bool)
        or not isinstance(max_completion_length, int)
        or max_completion_length < 1
    ):
        raise ValueError(
            f'loss_type="dr_grpo" needs max_completion_length, a positive int, got {max_completion_length!r}'
        )
    return PolicyOptions(
        LOSS_TYPES.index(loss_type),
        epsilon_low,
        epsilon_high,
        delta,
        _number(beta, "beta"),
        _number(entropy_coef, "entropy_coef"),
    )


def check_num_items(num_items_in_batch):
    """The dapo / cispo normaliser: None, a Python number or a one-element tensor (TypeError naming it)."""
    if num_items_in_batch is None or (isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() == 1):
        return num_items_in_batch
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)):
        raise TypeError(
            f"num_items_in_batch must be None, a number or a one-element tensor, got {num_items_in_batch!r:.80}"
        )
    return float(num_items_in_batch)


def normalisation_weights(mask, loss_type, max_completion_length, num_items_in_batch, entropy_coef):
    """(w, e) (B, T): the weights of l_t and of H_t in the loss; mask (B, T) float, 0 at ignored tokens."""
    batch = mask.shape[0]
    total = mask.sum().clamp(min=1.0)
    if loss_type == "grpo":
        w = mask / (batch * mask.sum(-1, keepdim=True).clamp(min=1.0))
    elif loss_type == "bnpo":
        w = mask / total
    elif loss_type == "dr_grpo":
        w = mask / (batch * max_completion_length)
    else:  # dapo, cispo
        if num_items_in_batch is None:
            w = mask / total
        else:
            count = torch.as_tensor(num_items_in_batch, device=mask.device).to(mask.dtype).reshape(())
            w = mask / count.clamp(min=1.0)
    return w, -entropy_coef * mask / total


def _surrogate(logp, advantages, old, options):
    """(r, r', l without the KL term, dl/dlogp) per token."""
    r = torch.exp(logp - old)
    if options.loss_type == CISPO:
        clamped = torch.clamp(r, max=options.epsilon_high)
        return r, r, -clamped * advantages * logp, -clamped * advantages
    low, high = 1.0 - options.epsilon_low, 1.0 + options.epsilon_high
    r1 = torch.clamp(r, max=options.delta)
    dr1 = torch.where(r <= options.delta, r, 0.0)
    r2 = torch.clamp(r, low, high)
    dr2 = torch.where((r >= low) & (r <= high), r, 0.0)
    x1, x2 = r1 * advantages, r2 * advantages
    dx1, dx2 = dr1 * advantages, dr2 * advantages
    slope = torch.where(x1 < x2, dx1, torch.where(x1 > x2, dx2, 0.5 * (dx1 + dx2)))
    slope = torch.where(torch.isnan(x1) | torch.isnan(x2), float("nan"), slope)
    return r, r1, -torch.minimum(x1, x2), -slope


def token_loss_and_slope(logp, advantages, old, ref, options):
    """(l_t, dl_t / dlogp_t) per token in closed form (the kernel path: no autograd); old, ref: tensors or None."""
    old = logp if old is None else old
    _, _, loss, slope = _surrogate(logp, advantages, old, options)
    if options.beta != 0.0:
        d = ref - logp
        loss = loss + options.beta * (torch.exp(d) - d - 1.0)
        slope = slope + options.beta * (1.0 - torch.exp(d))
    return loss, slope


def token_loss(logp, advantages, old, ref, options):
    """l_t as TRL writes it, differentiable by autograd (the reference path); old None: logp detached."""
    r = torch.exp(logp - (logp.detach() if old is None else old))
    if options.loss_type == CISPO:
        loss = -torch.clamp(r, max=options.epsilon_high).detach() * advantages * logp
    else:
        r2 = torch.clamp(r, 1.0 - options.epsilon_low, 1.0 + options.epsilon_high)
        r1 = torch.clamp(r, max=options.delta)
        loss = -torch.min(r1 * advantages, r2 * advantages)
    if options.beta != 0.0:
        d = ref - logp
        loss = loss + options.beta * (torch.exp(d) - d - 1.0)
    return loss


def masked_mean(values, mask):
    """sum m x / clamp(sum m, 1), float32, terms of weight 0 dropped."""
    total = torch.where(mask != 0, mask * values, 0.0).sum()
    return (total / mask.sum().clamp(min=1.0)).float()


def policy_metrics(logp, entropy, advantages, old, ref, mask, options):
    """(kl, entropy, clip_ratio_low, clip_ratio_high, clip_ratio_region): detached float32 masked means over mask,
    as TRL logs them (kl 0 when beta == 0; cispo: low 0 and high its cispo_clip_ratio; NaN is not clipped)."""
    with torch.no_grad():
        logp, entropy = logp.detach(), entropy.detach()
        r, r1, _, _ = _surrogate(logp, advantages, logp if old is None else old, options)
        if options.loss_type == CISPO:
            high = (r > options.epsilon_high) & (advantages > 0)
            low = torch.zeros_like(high)
        else:
            low = (r1 < 1.0 - options.epsilon_low) & (advantages < 0)
            high = (r1 > 1.0 + options.epsilon_high) & (advantages > 0)
        if options.beta != 0.0:
            d = ref - logp
            kl = masked_mean(torch.exp(d) - d - 1.0, mask)
        else:
            kl = torch.zeros((), dtype=torch.float32, device=logp.device)
        indicators = [masked_mean(x.to(mask.dtype), mask) for x in (low, high, low | high)]
        return (kl, masked_mean(entropy, mask), *indicators)
