"""Float64 NumPy reference of the loss contract (CONTRACT.md), loss AND analytic gradient.

Written from the contract's formula only: it imports neither fastce_torch nor fastce_jax, and the gradient is the
closed form dL/dz_j = p_j (1 + 2 z_loss lse) - (1 - eps) [j == y] - eps / V, chained through softcapping,
scaling and the temperature, not autodiff; likewise the entropy's dH/dz_j = p_j (mz - z_j) and the log-probabilities'
(test_reference.py checks each against central finite differences and float64 torch autograd).

Besides the values it returns the magnitudes that bound a float32 implementation's rounding error (see
`error_scales`); tolerances.py turns them into the one tolerance model every test in the repository uses.
This is the only float64 reference in the repository: the package tests and bench's CPU demo import it
(`from shared_tests.reference import ...`, run from the repository root); it needs NumPy only.
"""

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Options:
    ignore_index: int = -100
    logit_softcapping: float = 0.0
    logit_scaling: float = 0.0
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    temperature: float = 1.0

    def as_kwargs(self):
        """The options as the packages' keywords; temperature only when it is not 1 (the default)."""
        kwargs = dict(
            ignore_index=self.ignore_index,
            logit_softcapping=self.logit_softcapping,
            logit_scaling=self.logit_scaling,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
        )
        if self.temperature != 1.0:
            kwargs["temperature"] = self.temperature
        return kwargs


@dataclass
class Result:
    reduction: str  # "mean", "sum" or "none", as asked
    token_loss: np.ndarray  # (N,) per-token loss (times its token weight): 0 where ignored, NaN for bad labels / rows
    loss: np.ndarray  # the reduced loss (0-d), or token_loss reshaped like labels for "none"
    grad: np.ndarray  # (..., V) d loss / d logits, upstream included
    lse: np.ndarray  # (N,)
    upstream: np.ndarray  # (N,) d loss / d token_loss_t (1/denominator, 1, or the caller's cotangent)
    #                        token_loss_t already holds the token weight: d loss / d loss_t = upstream_t * w_t
    loss_scale: np.ndarray  # (N,) per-token magnitude that bounds the float32 loss error (see error_scales)
    grad_scale: np.ndarray  # (..., V) per-element magnitude that bounds the float32 gradient error
    grad_terms: np.ndarray  # (..., V) T * |s| * |g|: the gradient's size before the softcap factor 1 - t^2


def transform(x, opts):
    """z(x) = softcap(scale x) / T, literally: Cohere scaling (when != 0), then Gemma-2 softcapping (when > 0), then
    the sampling temperature (the packages fold T into the two options instead: exact algebra, other roundings)."""
    z = x * opts.logit_scaling if opts.logit_scaling != 0.0 else x
    if opts.logit_softcapping > 0.0:
        z = opts.logit_softcapping * np.tanh(z / opts.logit_softcapping)
    return z / opts.temperature if opts.temperature != 1.0 else z


def dz_dx(x, opts):
    s = opts.logit_scaling if opts.logit_scaling != 0.0 else 1.0
    d = np.full_like(x, s / opts.temperature)
    if opts.logit_softcapping > 0.0:
        t = np.tanh(x * s / opts.logit_softcapping)
        d = d * (1.0 - t * t)  # tanh(+-inf) = +-1: padding at -inf has derivative exactly 0
    return d


def logsumexp_rows(z):
    """lse per row with the contract's conventions: a row containing NaN or +inf gives NaN; a row whose every
    entry is -inf would give -inf (the max-shift is 0 there instead of -inf, which would make -inf - -inf = NaN)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = np.max(z, axis=-1, keepdims=True) if z.shape[-1] else np.zeros(z.shape[:-1] + (1,))
        shift = np.where(np.isfinite(m), m, 0.0)
        lse = shift[:, 0] + np.log(np.sum(np.exp(z - shift), axis=-1))
    bad = np.isnan(z).any(axis=-1) | (z == np.inf).any(axis=-1)
    return np.where(bad, np.nan, lse)


def denominator(labels, reduction, n_items, ignore_index, weight=None):
    """What the summed loss is divided by. n_items (a number) wins, for "mean" and "sum" alike; "mean" otherwise
    divides by the number of non-ignored tokens (out-of-range labels count: they are not ignored), at least 1 so
    that an all-ignored batch gives 0 with a zero gradient; "sum" divides by nothing.
    With class weights, "mean" divides by sum_t w[y_t] over the non-ignored tokens (F.cross_entropy's weighted
    mean; an out-of-range label has no class weight and adds 0), replaced by 1 when that sum is exactly 0."""
    if n_items is not None:
        return float(n_items)
    if reduction == "mean":
        if weight is not None:
            w = np.asarray(weight, np.float64)
            valid = (labels != ignore_index) & (labels >= 0) & (labels < w.shape[0])
            total = float(np.sum(np.where(valid, w[np.where(valid, labels, 0)], 0.0))) if w.shape[0] else 0.0
            return total if total != 0.0 else 1.0
        return float(max(1, int(np.sum(labels != ignore_index))))
    return 1.0


def expected(logits, labels, reduction="none", n_items=None, upstream=None, weight=None, token_weights=None, **options):
    """The reference result every package test compares with: `cross_entropy` on host arrays (pass exactly the
    values the kernels read, i.e. logits already rounded to their dtype), the options as keywords; n_items may be a
    0-d array of any framework (anything with `.item()`)."""
    if n_items is not None and hasattr(n_items, "item"):
        n_items = n_items.item()
    return cross_entropy(
        logits,
        np.asarray(labels),
        reduction=reduction,
        n_items=n_items,
        upstream=upstream,
        opts=Options(**options),
        weight=weight,
        token_weights=token_weights,
    )


def token_factor(token_weights, y, ignored):
    """The token weights as a flat float64 factor (ones without them); ignored rows take no part (0, even NaN)."""
    if token_weights is None:
        return np.ones(y.shape)
    w = np.asarray(token_weights, np.float64)
    assert w.size == y.size, f"token_weights {w.shape} do not match {y.size} labels"
    return np.where(ignored, 0.0, w.reshape(-1))


def cross_entropy(
    logits,
    labels,
    *,
    reduction="mean",
    n_items=None,
    upstream=None,
    opts=Options(),
    weight=None,
    token_weights=None,
):
    """The contract in float64.

    logits (..., V) any float array (converted to float64: pass the values the kernels see, i.e. already rounded
    to the kernel's dtype); labels (...) integers (any width: no wrapping); upstream: for reduction="none", the
    cotangent of the per-token losses (shape of labels), default ones.
    weight: None, or class weights (V,) with F.cross_entropy's semantics: per token
    (1 - eps) w[y] (lse - z_y) + (eps / V) sum_c w_c (lse - z_c) + w[y] z_loss lse^2 (the z-loss term weighted
    like the label's term; a class of weight 0 takes no part, even where its z is -inf), "mean" divided by
    sum_t w[y_t] (`denominator`); d/dz_j = w[y] ((1 - eps)(p_j - [j == y]) + 2 z_loss lse p_j)
    + (eps / V)(W p_j - w_j), W = sum_c w_c.
    token_weights: None, or per-token weights u (shape of labels, may be negative): loss_t becomes u_t loss_t (its
    z-loss term included) before the reduction, whose denominator does not change; "none" returns u_t loss_t; the
    gradient row is multiplied by u_t. A NaN weight makes its token's loss NaN; ignored rows stay 0.
    """
    x = np.asarray(logits, dtype=np.float64)
    y_full = np.asarray(labels).astype(np.int64)  # int64 holds every label either package accepts
    lead, vocab = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, vocab)
    y = y_full.reshape(-1)
    eps, zl = opts.label_smoothing, opts.z_loss
    w = None if weight is None else np.asarray(weight, dtype=np.float64)

    ignored = y == opts.ignore_index
    in_range = (y >= 0) & (y < vocab)
    # Ignored rows take no part in any arithmetic (their loss and gradient are exactly 0 even if they hold NaN).
    x = np.where(ignored[:, None], 0.0, x)
    z = transform(x, opts)
    lse = logsumexp_rows(z)
    y_safe = np.where(in_range, y, 0)
    z_y = np.take_along_axis(z, y_safe[:, None], axis=-1)[:, 0] if x.shape[0] else np.zeros(0)
    # The label's class weight per token (1 without weights; 0 where there is no class to read).
    w_y = np.ones(y.shape) if w is None else np.where(in_range, w[y_safe] if vocab else 0.0, 0.0)

    with np.errstate(invalid="ignore", over="ignore"):
        # Terms with a zero coefficient are left out rather than multiplied by 0: with -inf padding, mean(z) is
        # -inf and 0 * inf would turn a finite loss into NaN. The same reading as both packages' kernels.
        token = np.zeros_like(lse)
        if eps != 1.0:
            token = token + (1.0 - eps) * w_y * (lse - z_y)
        if eps != 0.0:
            if w is None:
                token = token + eps * (lse - np.mean(z, axis=-1))
            else:
                smooth = np.where(w[None, :] == 0.0, 0.0, w[None, :] * (lse[:, None] - z))
                token = token + eps / vocab * np.sum(smooth, axis=-1)
        if zl != 0.0:
            token = token + zl * w_y * lse * lse
    token = np.where(in_range, token, np.nan)
    u = token_factor(token_weights, y, ignored)
    with np.errstate(invalid="ignore"):
        token = np.where(ignored, 0.0, token * u)

    # Per-token upstream factor d loss / d token_t.
    if reduction == "none":
        g = np.ones(y.shape) if upstream is None else np.asarray(upstream, np.float64).reshape(-1)
        loss = token.reshape(lead)
    else:
        den = denominator(y, reduction, n_items, opts.ignore_index, w)
        g = np.full(y.shape, 1.0 / den)
        loss = np.asarray(np.sum(token) / den)
    g_row = g * u  # d loss / d loss_t: the upstream times the token's weight

    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(z - lse[:, None])
        onehot = (np.arange(vocab)[None, :] == y_safe[:, None]) & in_range[:, None]
        if w is None:
            dl_dz = p * (1.0 + 2.0 * zl * lse[:, None]) - (1.0 - eps) * onehot
            if eps != 0.0:
                dl_dz = dl_dz - eps / vocab
        else:
            wy = w_y[:, None]
            dl_dz = (
                p * (wy * (1.0 - eps + 2.0 * zl * lse[:, None]) + eps / vocab * np.sum(w)) - (1.0 - eps) * wy * onehot
            )
            if eps != 0.0:
                dl_dz = dl_dz - eps / vocab * w[None, :]
        grad = dl_dz * dz_dx(x, opts) * g_row[:, None]
    grad = np.where(in_range[:, None], grad, np.nan)  # a bad label's whole gradient row is NaN, like its loss
    grad = np.where(ignored[:, None], 0.0, grad)

    loss_scale, grad_scale, grad_terms = error_scales(z, lse, p, onehot, g_row, opts, w)
    loss_scale = loss_scale * np.abs(np.nan_to_num(u))  # the weighted loss's error is |u_t| times the loss's
    return Result(
        reduction=reduction,
        token_loss=token,
        loss=loss,
        grad=grad.reshape((*lead, vocab)),
        lse=lse,
        upstream=g,
        loss_scale=loss_scale,
        grad_scale=grad_scale.reshape((*lead, vocab)),
        grad_terms=grad_terms.reshape((*lead, vocab)),
    )


@dataclass
class Outputs:
    """What a call with return_z_loss / return_lse / return_accuracy / return_entropy returns besides the loss.

    Reduced outputs follow `reduction`: "none" gives one value per token (shaped like labels), "mean" / "sum" one
    number. Ignored rows (label == ignore_index) take no part: 0 in every per-token output except lse, which is
    -inf there, and they are not counted. A row with an out-of-range label (its loss is NaN) is NaN in z_loss and
    accuracy (both need a valid row of the loss); lse and entropy depend on the logits only and stay finite there.
    A row holding NaN or +inf is NaN in all four.
    """

    z_loss: np.ndarray  # z_loss * lse^2 per token, reduced like the loss ("mean": / denominator, "sum": / n_items)
    lse: np.ndarray  # per token, of the transformed logits; -inf where ignored (never reduced)
    accuracy: np.ndarray  # per token 1.0 / 0.0 (argmax of the transformed logits, first index on ties == label);
    #                        "mean" and "sum": the fraction over non-ignored rows (0 when there are none)
    entropy: np.ndarray  # -sum_j p_j log p_j of softmax(transformed logits), reduced like the loss


def outputs(logits, labels, *, reduction="mean", n_items=None, opts=Options(), weight=None, token_weights=None):
    """The contract's extra outputs in float64 (see Outputs); the arguments as cross_entropy's. With class weights
    only z_loss changes: w[y] z_loss lse^2 per token (the loss's z-loss term), reduced by the loss's (weighted)
    denominator; lse, accuracy and entropy ignore the weights (entropy's "mean" divides by the unweighted
    count). Token weights likewise multiply the z_loss output only (the loss's term)."""
    if n_items is not None and hasattr(n_items, "item"):
        n_items = n_items.item()
    x = np.asarray(logits, dtype=np.float64)
    y_full = np.asarray(labels).astype(np.int64)
    lead, vocab = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, vocab)
    y = y_full.reshape(-1)
    ignored = y == opts.ignore_index
    in_range = (y >= 0) & (y < vocab)
    z = transform(np.where(ignored[:, None], 0.0, x), opts)
    lse = logsumexp_rows(z)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p = np.exp(z - lse[:, None])
        # p log p with p = 0 (a -inf logit) contributes 0, not 0 * -inf.
        entropy = lse - np.sum(np.where(p > 0, p * z, 0.0), axis=-1)
        entropy = np.where(np.isnan(lse), np.nan, entropy)
        z_term = np.where(in_range, opts.z_loss * lse * lse, np.nan)
        if weight is not None:
            w = np.asarray(weight, np.float64)
            z_term = z_term * np.where(in_range, w[np.where(in_range, y, 0)] if vocab else 0.0, 1.0)
        z_term = z_term * token_factor(token_weights, y, ignored)
    bad_row = np.isnan(lse)
    if x.shape[0] and vocab:
        hit = (np.argmax(z, axis=-1) == y).astype(np.float64)
    else:
        hit = np.zeros(y.shape)
    hit = np.where(in_range & ~bad_row, hit, np.nan)
    per_token = dict(
        z_loss=np.where(ignored, 0.0, z_term),
        lse=np.where(ignored, -np.inf, lse),
        accuracy=np.where(ignored, 0.0, hit),
        entropy=np.where(ignored, 0.0, entropy),
    )
    if reduction == "none":
        return Outputs(**{k: v.reshape(lead) for k, v in per_token.items()})
    den = denominator(y, reduction, n_items, opts.ignore_index)
    loss_den = den if weight is None else denominator(y, reduction, n_items, opts.ignore_index, weight)
    kept = max(1, int(np.sum(~ignored)))
    return Outputs(
        z_loss=np.asarray(np.sum(per_token["z_loss"]) / loss_den),
        lse=per_token["lse"].reshape(lead),
        accuracy=np.asarray(np.sum(per_token["accuracy"]) / kept),
        entropy=np.asarray(np.sum(per_token["entropy"]) / den),
    )


def entropy_grad(logits, labels, *, reduction="none", n_items=None, upstream=None, opts=Options()):
    """d (entropy output) / d logits, times the upstream: the entropy reduced like `outputs` ("none": per token,
    times upstream (shape of labels, default ones); "mean": / the unweighted count or n_items; "sum": / n_items).
    dH/dz_j = p_j (mz - z_j) with mz = sum_j p_j z_j = lse - H, then times dz/dx. Ignored rows: 0; a NaN / +inf
    row: NaN; an out-of-range label does not matter (the entropy depends on the logits only); -inf logits: 0.
    Returns (grad shaped like logits, grad_scale, grad_terms): the error magnitudes as in `error_scales`, here
    M_t p_j (1 + |mz - z_j|) |s| / T |g_t| (mz and z_j - mz carry an absolute error ~ eps32 M_t, p_j a relative one)."""
    if n_items is not None and hasattr(n_items, "item"):
        n_items = n_items.item()
    x = np.asarray(logits, dtype=np.float64)
    lead, vocab = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, vocab)
    y = np.asarray(labels).astype(np.int64).reshape(-1)
    ignored = y == opts.ignore_index
    x = np.where(ignored[:, None], 0.0, x)
    z = transform(x, opts)
    lse = logsumexp_rows(z)
    if reduction == "none":
        g = np.ones(y.shape) if upstream is None else np.asarray(upstream, np.float64).reshape(-1)
    else:
        g = np.full(y.shape, 1.0 / denominator(y, reduction, n_items, opts.ignore_index))
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(z - lse[:, None])
        live = p > 0  # p_j = 0 (a -inf logit) contributes 0, not 0 * inf
        mz = np.sum(np.where(live, p * z, 0.0), axis=-1)
        spread = np.where(live, mz[:, None] - z, 0.0)
        grad = np.where(live, p * spread, 0.0) * dz_dx(x, opts) * g[:, None]
        grad = np.where(np.isnan(lse)[:, None], np.nan, grad)
        m = error_scales(z, lse, p, np.zeros_like(z, bool), g, replace(opts, z_loss=0.0))[0]  # M_t
        s = (abs(opts.logit_scaling) if opts.logit_scaling != 0.0 else 1.0) / opts.temperature
        terms = np.where(live, p * (1.0 + np.abs(spread)), 0.0) * s * np.abs(np.nan_to_num(g))[:, None]
    grad = np.where(ignored[:, None], 0.0, grad)
    terms = np.where(ignored[:, None] | ~np.isfinite(terms), 0.0, terms)
    shape = (*lead, vocab)
    return grad.reshape(shape), (m[:, None] * terms).reshape(shape), terms.reshape(shape)


@dataclass
class Differentiated:
    """One call's loss and extra outputs with the gradient of a linear objective of them (`differentiated`)."""

    loss: Result  # the loss; grad: d objective / d logits, grad_scale: its error magnitude (every term's added)
    z_loss: np.ndarray  # the z_loss output, reduced like the loss
    entropy: Result  # the entropy output as a Result: loss its value, loss_scale 2 M_t (z_j - lse and mz round)
    lse: np.ndarray  # per scored token; -inf where ignored


def differentiated(
    logits, labels, *, reduction="mean", n_items=None, opts=Options(), weight=None, token_weights=None, shift=0,
    upstream=(1.0, 0.0, 0.0),
):  # fmt: skip
    """cross_entropy's loss, z_loss and entropy outputs (`outputs`) and the gradient of
    <g, loss> + <g_z, z_loss output> + <g_h, entropy output>, (g, g_z, g_h) = upstream: numbers for "mean" / "sum",
    numbers or arrays shaped like the scored labels for "none"; a term whose cotangent is all zero is left out. The
    z_loss output's gradient is the loss's with the z-loss minus the one without; the entropy's is `entropy_grad`.
    shift=k scores position t against label t + k (token weights go with the labels); the gradient of the last k
    positions is 0."""
    full = np.asarray(logits, np.float64)
    x, y = shifted(full, labels, shift)
    u = None if token_weights is None else np.asarray(token_weights, np.float64)[..., shift:]
    none = reduction == "none"
    kw = dict(reduction=reduction, n_items=n_items, weight=weight, token_weights=u)

    def cotangent(g):  # (the upstream argument of a "none" call, the factor of a reduced one)
        return (np.broadcast_to(np.asarray(g, np.float64), y.shape), 1.0) if none else (None, float(g))

    g_loss, g_z, g_h = (cotangent(g) for g in upstream)
    ce = cross_entropy(x, y, upstream=g_loss[0], opts=opts, **kw)
    grad, scale = np.zeros(x.shape), np.zeros(x.shape)
    if np.any(np.asarray(upstream[0]) != 0):
        grad, scale = grad + g_loss[1] * ce.grad, scale + abs(g_loss[1]) * ce.grad_scale
    if np.any(np.asarray(upstream[1]) != 0):
        with_z = cross_entropy(x, y, upstream=g_z[0], opts=opts, **kw)
        without = cross_entropy(x, y, upstream=g_z[0], opts=replace(opts, z_loss=0.0), **kw)
        grad, scale = grad + g_z[1] * (with_z.grad - without.grad), scale + abs(g_z[1]) * with_z.grad_scale
    if np.any(np.asarray(upstream[2]) != 0):
        h_grad, h_scale, _ = entropy_grad(x, y, reduction=reduction, n_items=n_items, upstream=g_h[0], opts=opts)
        grad, scale = grad + g_h[1] * h_grad, scale + abs(g_h[1]) * h_scale
    if shift:  # back to the full logits' shape: the last `shift` positions have no label
        grad, scale = (
            np.concatenate([a, np.zeros((*a.shape[:-2], shift, a.shape[-1]))], axis=-2) for a in (grad, scale)
        )
    out = outputs(x, y, opts=opts, **kw)
    per_token = outputs(x, y, reduction="none", opts=opts).entropy.reshape(-1)
    m = cross_entropy(x, y, reduction="none", opts=replace(opts, z_loss=0.0)).loss_scale  # M_t
    ignored = y.reshape(-1) == opts.ignore_index
    h_upstream = (
        np.ones(y.size) if none else np.full(y.size, 1.0 / denominator(y, reduction, n_items, opts.ignore_index))
    )
    entropy = replace(
        ce, token_loss=per_token, loss=out.entropy, upstream=h_upstream, loss_scale=np.where(ignored, 0.0, 2 * m)
    )
    return Differentiated(replace(ce, grad=grad, grad_scale=scale), out.z_loss, entropy, out.lse)


@dataclass
class LogProbResult:
    """`log_probs` in float64: the values and the gradient of sum_t (g_t logprob_t + h_t entropy_t)."""

    logprobs: np.ndarray  # shaped like tokens[..., shift:]: z_y - lse, 0.0 where ignored, NaN for a bad token
    entropy: np.ndarray  # the same shape: -sum_j p_j log p_j, 0 where ignored
    grad: np.ndarray  # shaped like logits (the last `shift` positions 0): d objective / d logits
    logprob_scale: np.ndarray  # per token M_t: |logprob error| <~ eps32 M_t (error_scales' loss scale)
    grad_scale: np.ndarray  # shaped like grad: the gradient's error magnitude (error_scales', entropy's added)
    grad_terms: np.ndarray  # shaped like grad: the gradient's size before the softcap factor


def shifted(logits, tokens, shift):
    """(logits[..., :kept, :], tokens[..., shift:]): position t scored against token t + shift."""
    tokens = np.asarray(tokens)
    if not shift:
        return np.asarray(logits), tokens
    kept = tokens[..., shift:].shape[-1]
    return np.asarray(logits)[..., :kept, :], tokens[..., shift:]


def log_probs(logits, tokens, *, opts=Options(), shift=0, upstream_logprobs=None, upstream_entropy=None):
    """log p(token_t) of softmax(z), z = softcap(scale x) / T, and the entropy per token, with the gradient of
    sum_t (g_t logprob_t + h_t entropy_t) (g: upstream_logprobs, default ones; h: upstream_entropy, default 0),
    both shaped like tokens[..., shift:]. opts may not hold label smoothing or a z-loss (log_probs has neither)."""
    assert opts.label_smoothing == 0.0 and opts.z_loss == 0.0, "log_probs has no label smoothing or z-loss"
    full = np.asarray(logits, np.float64)
    x, y = shifted(full, tokens, shift)
    g = np.ones(y.shape) if upstream_logprobs is None else np.asarray(upstream_logprobs, np.float64)
    h = np.zeros(y.shape) if upstream_entropy is None else np.asarray(upstream_entropy, np.float64)
    # logprob = -loss of cross_entropy(reduction="none"): its gradient with upstream -g is d(g . logprob).
    ce = cross_entropy(x, y, reduction="none", upstream=-g, opts=opts)
    ignored = y == opts.ignore_index
    out = outputs(x, y, reduction="none", opts=opts)
    ent_grad, ent_scale, ent_terms = entropy_grad(x, y, upstream=h, opts=opts)

    def pad(values):  # back to the full logits' shape: the last `shift` positions have no token, so 0
        padded = np.zeros(full.shape)
        padded[..., : x.shape[-2], :] = values
        return padded

    return LogProbResult(
        logprobs=np.where(ignored, 0.0, -ce.loss),
        entropy=out.entropy,
        grad=pad(ce.grad + ent_grad) if shift else ce.grad + ent_grad,
        logprob_scale=ce.loss_scale.reshape(y.shape),
        grad_scale=pad(ce.grad_scale + ent_scale) if shift else ce.grad_scale + ent_scale,
        grad_terms=pad(ce.grad_terms + ent_terms) if shift else ce.grad_terms + ent_terms,
    )


def error_scales(z, lse, p, onehot, g, opts, weight=None):
    """Magnitudes that bound the rounding error of a float32 implementation (up to a constant times eps32).

    M_t = 1 + |lse_t| + max_j |z_tj| (+ softcap t / T): the absolute error of z_j - lse_t in float32 is ~ eps32 * M_t
    (z itself is computed with absolute error ~ eps32 * max(|z|, t) and lse with ~ eps32 * (|lse| + log-sum
    accumulation)), and p_j = exp(z_j - lse) inherits that as a relative error.
      loss:  error ~ eps32 * M_t * (1 + 2 |z_loss| |lse_t|)   (the z-loss term doubles lse's relative error)
      grad:  error ~ eps32 * M_t * T_tj * |s| * |g_t|, with T_tj = p_j (1 + 2 |z_loss| |lse|) + (1 - eps)[j == y]
             + eps / V, the sum of the absolute values of dL/dz's terms: no cancellation credit, so the label
             column with p_y ~ 1 (dL/dz ~ 0, but p_y still carries its error) is covered. |s| / T bounds dz/dx; the
             softcap factor 1 - t^2 <= 1 is computed with absolute (not relative) error, so it gets no credit.
    Class weights: every term is multiplied by at most max_c |w_c| (the smoothing term's W p_j + w_j by
    max |w| (p_j + 1)), so both scales are multiplied by max(1, max_c |w_c|): one bound for every row.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        finite_z = np.where(np.isfinite(z), np.abs(z), 0.0)
        zmax = finite_z.max(axis=-1) if z.shape[-1] and z.shape[0] else np.zeros(z.shape[0])
        lse_abs = np.where(np.isfinite(lse), np.abs(lse), 0.0)
        m = 1.0 + lse_abs + zmax + opts.logit_softcapping / opts.temperature
        zl = abs(opts.z_loss)
        loss_scale = m * (1.0 + 2.0 * zl * lse_abs)
        s = (abs(opts.logit_scaling) if opts.logit_scaling != 0.0 else 1.0) / opts.temperature
        vocab = z.shape[-1]
        t = (
            np.where(np.isfinite(p), p, 0.0) * (1.0 + 2.0 * zl * lse_abs[:, None])
            + (1.0 - opts.label_smoothing) * onehot
            + opts.label_smoothing / max(vocab, 1)
        )
        if weight is not None and weight.size:
            w_max = max(1.0, float(np.max(np.abs(weight))))
            loss_scale = loss_scale * w_max
            t = (t + opts.label_smoothing * np.where(np.isfinite(p), p, 0.0)) * w_max
        grad_terms = t * s * np.abs(np.where(np.isfinite(g), g, 0.0))[:, None]
        grad_scale = m[:, None] * grad_terms
    return loss_scale, grad_scale, grad_terms


@dataclass
class LinearResult:
    """The contract of linear_cross_entropy: cross_entropy of logits = hidden @ weight.T (+ bias), in float64."""

    logits: Result  # the loss and d loss / d logits (see Result), of the float64 logits
    grad_hidden: np.ndarray  # (..., H)
    grad_weight: np.ndarray  # (V, H)
    grad_bias: np.ndarray | None  # (V,) or None without a bias
    logits_abs: np.ndarray  # (N, V) |hidden| @ |weight|.T + |bias|: the magnitude of each logit's products


def linear_cross_entropy(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    reduction="mean",
    n_items=None,
    upstream=None,
    opts=Options(),
    class_weight=None,
    token_weights=None,
):
    """hidden (..., H), weight (V, H) (nn.Linear's layout), bias (V,) or None: logits = hidden @ weight.T + bias in
    float64, then `cross_entropy` above; the gradients of hidden, weight and bias by the chain rule through the
    product (d hidden = G @ weight, d weight = G.T @ hidden, d bias = sum of G's rows, G = d loss / d logits)."""
    logits, logits_abs, h, w, b, lead = head_logits(hidden, weight, bias)
    result = cross_entropy(
        logits.reshape(*lead, w.shape[0]),
        labels,
        reduction=reduction,
        n_items=n_items,
        upstream=upstream,
        opts=opts,
        weight=class_weight,
        token_weights=token_weights,
    )
    grad_hidden, grad_weight, grad_bias = chain_through_head(result.grad, h, w, b, lead)
    return LinearResult(result, grad_hidden, grad_weight, grad_bias, logits_abs)


def head_logits(hidden, weight, bias):
    """logits = hidden @ weight.T + bias in float64, flat rows (N, V), with |hidden| @ |weight|.T + |bias| (the size
    of each logit's products: its rounding error in a lower precision), hidden's rows (N, H) and leading shape."""
    h_full = np.asarray(hidden, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    lead, width = h_full.shape[:-1], h_full.shape[-1]
    h = h_full.reshape(-1, width)
    logits = h @ w.T
    logits_abs = np.abs(h) @ np.abs(w).T
    b = None
    if bias is not None:
        b = np.asarray(bias, dtype=np.float64)
        logits = logits + b
        logits_abs = logits_abs + np.abs(b)
    return logits, logits_abs, h, w, b, lead


def chain_through_head(grad_logits, h, w, b, lead):
    """d hidden = G @ weight, d weight = G.T @ hidden, d bias = the sum of G's rows (G = d objective / d logits)."""
    grad = grad_logits.reshape(-1, w.shape[0])
    with np.errstate(invalid="ignore", over="ignore"):
        grad_hidden = (grad @ w).reshape(*lead, h.shape[-1])
        grad_weight = grad.T @ h
        grad_bias = None if b is None else grad.sum(axis=0)
    return grad_hidden, grad_weight, grad_bias


@dataclass
class LinearLogProbResult:
    """linear_log_probs in float64: log_probs of logits = hidden @ weight.T (+ bias)."""

    logits: LogProbResult  # the values and d objective / d logits
    grad_hidden: np.ndarray  # (..., H)
    grad_weight: np.ndarray  # (V, H)
    grad_bias: np.ndarray | None
    logits_abs: np.ndarray  # (N, V) |hidden| @ |weight|.T + |bias|


def linear_log_probs(
    hidden, weight, tokens, *, bias=None, opts=Options(), shift=0, upstream_logprobs=None, upstream_entropy=None
):
    """`log_probs` of hidden @ weight.T + bias (float64 logits, whatever logits_dtype the packages use: the exact
    value both the bf16 and the float32 logits approximate); shift along hidden's second-to-last dimension."""
    logits, logits_abs, h, w, b, lead = head_logits(hidden, weight, bias)
    result = log_probs(
        logits.reshape(*lead, w.shape[0]),
        tokens,
        opts=opts,
        shift=shift,
        upstream_logprobs=upstream_logprobs,
        upstream_entropy=upstream_entropy,
    )
    return LinearLogProbResult(result, *chain_through_head(result.grad, h, w, b, lead), logits_abs)
