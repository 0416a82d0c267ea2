"""Float64 NumPy reference of the policy objectives (linear_policy_loss, TRL's GRPOTrainer._compute_loss at the
token level) and of their gradient, for both packages' tests.

The policy loss is elementwise in the per-token log-probability logp_t (at the temperature) and entropy H_t:
loss = sum_t (w_t l_t + e_t H_t), with the per-token loss l_t (the clipped surrogate or CISPO, plus the KL term) and
the normalisation weights w_t, e_t fixed before the pass (`normalisers`). `policy_loss` gives the loss, TRL's
metrics and the upstreams g_logp_t = d loss / d logp_t, g_H_t = d loss / d H_t in closed form; `linear_policy_loss`
turns them into d logits with `reference.log_probs(..., upstream_logprobs=, upstream_entropy=)` and into d hidden /
d weight / d bias with `reference.chain_through_head`.

Conventions (the packages follow them):
  r_t = exp(logp_t - old_t) (old defaults to logp itself, detached: r = 1);
  cispo: l = -min(r, eps_high) A logp with the clamped ratio a constant; else l = -min(r' A, clamp(r, 1 - eps_low,
  1 + eps_high) A) with r' = min(r, delta) when delta is given; torch.minimum's derivative (a tie splits the
  gradient in half; clamp passes it on its closed range); plus beta (exp(ref - logp) - (ref - logp) - 1).
  Reduction weights w_t (mask m, ignored tokens always 0): grpo m / (B clamp(sum_t m_b, 1)); bnpo m / clamp(sum m,
  1); dr_grpo m / (B max_completion_length); dapo / cispo m / normaliser (num_items_in_batch if given, else
  clamp(sum m, 1)). Entropy bonus e_t = -entropy_coef m / clamp(sum m, 1).
  Tokens of weight 0 take no part (their terms are dropped, not multiplied by 0: a NaN advantage on a masked token
  changes nothing); a NaN advantage on a kept token makes the loss NaN and that token's gradient row NaN only.
  Metrics: masked means (sum m x / clamp(sum m, 1)) of the per-token KL (0 when beta == 0), the entropy, and the clip
  indicators low = (r' < 1 - eps_low) & (A < 0), high = (r' > 1 + eps_high) & (A > 0), region = low | high (r' the
  ratio after the delta clamp, as TRL logs it; NaN compares as False); cispo: low = 0, high = (r > eps_high) &
  (A > 0) (TRL's cispo_clip_ratio), region = high.
It imports neither package; it needs NumPy and shared_tests/reference.py only.
"""

from dataclasses import dataclass

import numpy as np

from shared_tests.reference import Options, chain_through_head, head_logits, log_probs

__all__ = [
    "LOSS_TYPES",
    "LinearPolicyResult",
    "PolicyOptions",
    "PolicyResult",
    "linear_policy_loss",
    "normalisers",
    "policy_loss",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
DEFAULT_CE = Options()


@dataclass(frozen=True)
class PolicyOptions:
    loss_type: str = "grpo"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None  # None: epsilon_low
    delta: float | None = None
    beta: float = 0.0
    entropy_coef: float = 0.0
    max_completion_length: int | None = None
    num_items_in_batch: float | None = None

    @property
    def eps_high(self):
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    def as_kwargs(self):
        """The options as the packages' keywords (those that differ from the defaults)."""
        defaults = PolicyOptions()
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if getattr(self, k) != getattr(defaults, k)}


@dataclass
class PolicyResult:
    loss: float  # the reduced loss
    kl: float  # masked mean of the per-token KL (0.0 when beta == 0)
    entropy: float  # masked mean of the entropy
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_region: float
    g_logp: np.ndarray  # (B, T) d loss / d logp_t (0 where the token's weight is 0)
    g_entropy: np.ndarray  # (B, T) d loss / d H_t
    token_loss: np.ndarray  # (B, T) the per-token loss l_t (before the weights)
    weights: np.ndarray  # (B, T) w_t
    ratio: np.ndarray  # (B, T) r_t


def normalisers(mask, opts):
    """(w, e): the per-token weights of l_t and of H_t, float64 (B, T); mask already holds 0 at ignored tokens."""
    m = np.asarray(mask, np.float64)
    batch = m.shape[0]
    total = max(float(m.sum()), 1.0)
    if opts.loss_type == "grpo":
        w = m / (batch * np.maximum(m.sum(-1, keepdims=True), 1.0))
    elif opts.loss_type == "bnpo":
        w = m / total
    elif opts.loss_type == "dr_grpo":
        assert opts.max_completion_length is not None, "dr_grpo needs max_completion_length"
        w = m / (batch * opts.max_completion_length)
    elif opts.loss_type in ("dapo", "cispo"):
        den = total if opts.num_items_in_batch is None else max(float(opts.num_items_in_batch), 1.0)
        w = m / den
    else:
        raise ValueError(opts.loss_type)
    e = -opts.entropy_coef * m / total
    return w, e


def policy_loss(logp, entropy, advantages, *, mask, old_log_probs=None, ref_log_probs=None, opts=PolicyOptions()):
    """The loss, metrics and upstreams from the per-token log-probs and entropies (B, T) (0 at ignored tokens);
    advantages (B,) or (B, T); mask (B, T) float, 0 at ignored tokens."""
    logp = np.asarray(logp, np.float64)
    h = np.asarray(entropy, np.float64)
    m = np.asarray(mask, np.float64)
    a = np.asarray(advantages, np.float64)
    a = np.broadcast_to(a[:, None] if a.ndim == 1 else a, logp.shape)
    old = logp if old_log_probs is None else np.asarray(old_log_probs, np.float64)
    lo, hi = 1.0 - opts.epsilon_low, 1.0 + opts.eps_high
    w, e = normalisers(m, opts)
    kept = w != 0
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.exp(logp - old)
        if opts.loss_type == "cispo":
            c = np.minimum(r, opts.eps_high)
            token = -c * a * logp
            dtoken = -c * a
            clip_low = np.zeros(logp.shape, bool)
            clip_high = (r > opts.eps_high) & (a > 0)
        else:
            r1 = r if opts.delta is None else np.minimum(r, opts.delta)
            dr1 = r if opts.delta is None else np.where(r <= opts.delta, r, 0.0)
            r2 = np.clip(r, lo, hi)
            dr2 = np.where((r >= lo) & (r <= hi), r, 0.0)
            x1, x2 = r1 * a, r2 * a
            token = -np.minimum(x1, x2)
            dx1, dx2 = dr1 * a, dr2 * a
            dtoken = -np.where(x1 < x2, dx1, np.where(x1 > x2, dx2, 0.5 * (dx1 + dx2)))
            dtoken = np.where(np.isnan(x1) | np.isnan(x2), np.nan, dtoken)
            clip_low = (r1 < lo) & (a < 0)
            clip_high = (r1 > hi) & (a > 0)
        kl = np.zeros(logp.shape)
        if opts.beta != 0.0:
            assert ref_log_probs is not None, "beta != 0 needs ref_log_probs"
            d = np.asarray(ref_log_probs, np.float64) - logp
            kl = np.exp(d) - d - 1.0
            token = token + opts.beta * kl
            dtoken = dtoken + opts.beta * (1.0 - np.exp(d))
        terms = np.where(kept, w * token, 0.0)
        g_logp = np.where(kept, w * dtoken, 0.0)
    loss = float(np.sum(terms) + np.sum(np.where(e != 0, e * h, 0.0)))
    count = max(float(m.sum()), 1.0)

    def masked_mean(x):
        return float(np.sum(np.where(m != 0, m * x, 0.0)) / count)

    region = clip_low | clip_high
    return PolicyResult(
        loss=loss,
        kl=masked_mean(kl) if opts.beta != 0.0 else 0.0,
        entropy=masked_mean(h),
        clip_ratio_low=masked_mean(clip_low.astype(np.float64)),
        clip_ratio_high=masked_mean(clip_high.astype(np.float64)),
        clip_ratio_region=masked_mean(region.astype(np.float64)),
        g_logp=g_logp,
        g_entropy=e,
        token_loss=token,
        weights=w,
        ratio=r,
    )


@dataclass
class LinearPolicyResult:
    policy: PolicyResult  # the loss, metrics and upstreams
    logp: np.ndarray  # (B, T) log-probs at the temperature (0 where ignored)
    entropy: np.ndarray  # (B, T)
    grad_logits: np.ndarray  # (B, T, V) d loss / d logits
    grad_hidden: np.ndarray  # (B, T, H)
    grad_weight: np.ndarray  # (V, H)
    grad_bias: np.ndarray | None
    logits_abs: np.ndarray  # (N, V) |hidden| @ |weight|.T + |bias|
    logprob_scale: np.ndarray  # (B, T) M_t: the log-prob's float32 error magnitude (reference.error_scales)
    grad_scale: np.ndarray  # (B, T, V) the logits gradient's error magnitude


def linear_policy_loss(
    hidden,
    weight,
    tokens,
    advantages,
    *,
    bias=None,
    mask=None,
    old_log_probs=None,
    ref_log_probs=None,
    opts=PolicyOptions(),
    ce_opts=DEFAULT_CE,
):
    """The packages' linear_policy_loss in float64: hidden (B, T, H), weight (V, H) (layout "vh"), tokens (B, T);
    ce_opts carries ignore_index, temperature, logit_softcapping, logit_scaling. mask default tokens != ignore_index;
    ignored tokens are always masked out. old_log_probs None: the current log-probs (ratio 1)."""
    tokens = np.asarray(tokens)
    ignored = tokens == ce_opts.ignore_index
    m = (~ignored).astype(np.float64) if mask is None else np.asarray(mask, np.float64)
    m = np.where(ignored, 0.0, m)
    logits, logits_abs, h, w, b, lead = head_logits(hidden, weight, bias)
    logits = logits.reshape(*lead, w.shape[0])
    values = log_probs(logits, tokens, opts=ce_opts)
    pol = policy_loss(
        values.logprobs,
        values.entropy,
        advantages,
        mask=m,
        old_log_probs=old_log_probs,
        ref_log_probs=ref_log_probs,
        opts=opts,
    )
    grads = log_probs(logits, tokens, opts=ce_opts, upstream_logprobs=pol.g_logp, upstream_entropy=pol.g_entropy)
    gh, gw, gb = chain_through_head(grads.grad, h, w, b, lead)
    return LinearPolicyResult(
        policy=pol,
        logp=values.logprobs,
        entropy=values.entropy,
        grad_logits=grads.grad,
        grad_hidden=gh,
        grad_weight=gw,
        grad_bias=gb,
        logits_abs=logits_abs,
        logprob_scale=values.logprob_scale,
        grad_scale=grads.grad_scale,
    )
