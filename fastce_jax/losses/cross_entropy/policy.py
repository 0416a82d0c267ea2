"""The policy-gradient presets of ``linear_policy_loss`` (linear_policy.py): their per-token formulas, the option
record and its checks, the per-token normalisation weights, and the logged metrics, in jnp.

The formulas are TRL 1.16's ``GRPOTrainer._compute_loss`` at the token level. Per token, with r = exp(logp - old):
cispo: l = -min(r, eps_high).detach() * A * logp; the others: l = -min(r' A, clip(r, 1 - eps_low, 1 + eps_high) A)
with r' = min(r, delta) when delta is given; plus beta * (exp(ref - logp) - (ref - logp) - 1). The reductions
(grpo: the mean over sequences of each sequence's masked mean; bnpo: the masked mean; dr_grpo: the masked sum over
B * max_completion_length; dapo / cispo: the masked sum over a normaliser) and TRL's entropy bonus
(-entropy_coef * the masked mean of H) are all per-token weights known before the pass (``token_weights``), so the
loss is sum_t (w_t l_t + e_t H_t) and its derivative in (logp_t, H_t) is taken inside each chunk
(``PolicyObjective``, differentiated by jax.vjp).

Tokens outside the mask (and ignored tokens, always outside it) take no part: their inputs are replaced by zeros
before the formula and their terms dropped (a select, so no NaN or inf of theirs reaches the loss or a gradient). A
NaN advantage of a kept token makes that token's term (so the loss) NaN, and the gradient of its own row; TRL's
comparisons treat it as not clipped in the metrics.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "LOSS_TYPES",
    "PolicyOptions",
    "check_policy_options",
    "check_normaliser",
    "token_terms",
    "token_weights",
    "PolicyObjective",
    "policy_metrics",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


class PolicyOptions(NamedTuple):
    """The preset's static settings (hashable: part of the jit key)."""

    loss_type: str = "grpo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    entropy_coef: float = 0.0
    max_completion_length: int | None = None
    has_old: bool = False  # old_log_probs given; else the current log-probs, detached (ratio 1)


def _finite_real(value, name: str, *, minimum=None, positive=False) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python float, got {value!r}")
    value = float(value)
    if not np.isfinite(value) or (minimum is not None and value < minimum) or (positive and value <= 0.0):
        bound = " > 0" if positive else f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{name} must be finite{bound}, got {value}")
    return value


def check_policy_options(
    *, loss_type, epsilon_low, epsilon_high, delta, beta, entropy_coef, max_completion_length, has_old
) -> PolicyOptions:
    """The checked PolicyOptions; epsilon_high None means epsilon_low."""
    if not isinstance(loss_type, str) or loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    epsilon_low = _finite_real(epsilon_low, "epsilon_low", minimum=0.0)
    epsilon_high = epsilon_low if epsilon_high is None else _finite_real(epsilon_high, "epsilon_high", minimum=0.0)
    delta = None if delta is None else _finite_real(delta, "delta", positive=True)
    beta = _finite_real(beta, "beta")
    entropy_coef = _finite_real(entropy_coef, "entropy_coef")
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool)
        or not isinstance(max_completion_length, numbers.Integral)
        or max_completion_length < 1
    ):
        raise ValueError(f"max_completion_length must be a positive int or None, got {max_completion_length!r}")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError(
            'loss_type="dr_grpo" needs max_completion_length (its normaliser is B * max_completion_length)'
        )
    return PolicyOptions(
        loss_type, epsilon_low, epsilon_high, delta, beta, entropy_coef,
        None if max_completion_length is None else int(max_completion_length), bool(has_old),
    )  # fmt: skip


def check_normaliser(num_items_in_batch):
    """num_items_in_batch: None, a Python number > 0, or a scalar array (traced values are not checked)."""
    if num_items_in_batch is None:
        return None
    if isinstance(num_items_in_batch, (bool, np.bool_)):
        raise TypeError(f"num_items_in_batch must be a number or a scalar array, got {num_items_in_batch!r}")
    if isinstance(num_items_in_batch, numbers.Real):
        return jnp.asarray(_finite_real(num_items_in_batch, "num_items_in_batch", positive=True), jnp.float32)
    value = jnp.asarray(num_items_in_batch)
    if value.ndim != 0:
        raise ValueError(f"num_items_in_batch must be a scalar, got shape {tuple(value.shape)}")
    return value.astype(jnp.float32)


def token_terms(logp, old, adv, ref, po: PolicyOptions):
    """(per-token loss l (the KL term included), per-token KL or None, ratio r) of TRL's token-level formulas."""
    old = jax.lax.stop_gradient(logp) if old is None else old
    ratio = jnp.exp(logp - old)
    if po.loss_type == "cispo":
        loss = -jax.lax.stop_gradient(jnp.minimum(ratio, po.epsilon_high)) * adv * logp
    else:
        clipped = jnp.clip(ratio, 1.0 - po.epsilon_low, 1.0 + po.epsilon_high)
        unclipped = ratio if po.delta is None else jnp.minimum(ratio, po.delta)
        loss = -jnp.minimum(unclipped * adv, clipped * adv)
    kl = None
    if po.beta != 0.0:
        kl = jnp.exp(ref - logp) - (ref - logp) - 1.0
        loss = loss + po.beta * kl
    return loss, kl, ratio


def token_weights(mask, po: PolicyOptions, normaliser=None):
    """(w, e) (B, T) float32: the loss is sum_t (w_t l_t + e_t H_t). mask (B, T) float32, 0 outside the tokens that
    count; normaliser: dapo / cispo's (num_items_in_batch; None: mask.sum()), clamped to >= 1 as TRL does."""
    total = jnp.maximum(jnp.sum(mask), 1.0)
    if po.loss_type == "grpo":
        w = mask / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0) / mask.shape[0]
    elif po.loss_type == "bnpo":
        w = mask / total
    elif po.loss_type == "dr_grpo":
        w = mask / float(mask.shape[0] * po.max_completion_length)
    else:
        w = mask / (total if normaliser is None else jnp.maximum(normaliser, 1.0))
    e = -po.entropy_coef * mask / total
    return w.astype(jnp.float32), e.astype(jnp.float32)


class PolicyObjective(NamedTuple):
    """The per-token objective of a preset, ``objective(logp, H, old, adv, ref, w, e, mask)`` on a chunk's 1-D
    vectors: w l + e H where mask != 0, else 0 (hashable: a static argument of the pass)."""

    po: PolicyOptions

    def __call__(self, logp, entropy, old, adv, ref, w, e, mask):
        po = self.po
        keep = mask != 0
        zero = jnp.zeros((), logp.dtype)
        safe = [jnp.where(keep, x.astype(logp.dtype), zero) for x in (old, adv, ref)]
        logp = jnp.where(keep, logp, zero)
        old, adv, ref = safe
        loss, _, _ = token_terms(logp, old if po.has_old else None, adv, ref, po)
        value = w * loss
        if po.entropy_coef != 0.0:
            value = value + e * jnp.where(keep, entropy, zero)
        return jnp.where(keep, value, zero)


def _masked_mean(x, mask):
    """TRL's global_masked_mean: sum(x * mask) / max(sum(mask), 1), the tokens outside the mask selected away."""
    keep = mask != 0
    return jnp.sum(jnp.where(keep, x * mask, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def policy_metrics(logp, entropy, old, adv, ref, mask, po: PolicyOptions):
    """(kl, entropy, clip_ratio_low, clip_ratio_high, clip_ratio_region): float32 scalars, detached, masked means
    over mask as TRL logs them (kl 0 when beta == 0; the clip indicators of the ratio after the delta clamp).
    cispo: high is TRL's cispo_clip_ratio ((r > eps_high) & (A > 0)), low 0, region = high."""
    logp, entropy = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(entropy)
    old = logp if old is None else old
    _, kl, ratio = token_terms(logp, old, adv, ref, po._replace(beta=1.0 if po.beta != 0.0 else 0.0))
    kl_mean = jnp.zeros((), jnp.float32) if kl is None else _masked_mean(kl, mask)
    if po.loss_type == "cispo":
        high = (ratio > po.epsilon_high) & (adv > 0)
        low = jnp.zeros_like(high)
    else:  # the ratio after the delta clamp, as TRL logs it
        ratio = ratio if po.delta is None else jnp.minimum(ratio, po.delta)
        low = (ratio < 1.0 - po.epsilon_low) & (adv < 0)
        high = (ratio > 1.0 + po.epsilon_high) & (adv > 0)
    out = (
        kl_mean,
        _masked_mean(entropy, mask),
        *(_masked_mean(c.astype(jnp.float32), mask) for c in (low, high, low | high)),
    )
    return tuple(jax.lax.stop_gradient(v.astype(jnp.float32)) for v in out)
