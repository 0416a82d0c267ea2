"""Per-token log-probabilities (and entropies) at a sampling temperature, for RL objectives: ``log_probs`` and its
``negated_losses`` (the record LogProbOutput is core/outputs.py's). The fused-linear counterpart,
``linear_log_probs``, lives in linear_api.py; both end in ``negated_losses``."""

from __future__ import annotations

from ...core.outputs import LogProbOutput
from .api import cross_entropy

__all__ = ["log_probs", "negated_losses"]


def log_probs(
    logits,
    tokens,
    *,
    temperature=1.0,
    return_entropy=False,
    ignore_index=-100,
    logit_softcapping=0.0,
    logit_scaling=0.0,
    shift=0,
    backend="auto",
    validate_labels=False,
):
    """float32 log p(token_t) under softmax(z), z = softcap(scale * x) / temperature, for logits (..., V) and
    integer tokens (...): the log-probability of each sampled token at the sampling temperature.

    Shaped like tokens (with ``shift`` = k: like ``tokens[..., k:]``, position t scored against token t + k);
    0.0 where the token is ``ignore_index``, NaN for a token outside [0, V). ``return_entropy=True`` returns
    ``LogProbOutput(logprobs, entropy)`` with the entropy of softmax(z) per token (0 where ignored). Both are
    differentiable (jax.grad / vjp through any downstream objective: a clipped importance ratio, a KL to a
    reference policy, an entropy bonus), under jit and vmap; a call that is not differentiated keeps nothing for a
    backward. It is ``-cross_entropy(logits, tokens, reduction="none", ...)``: the same kernels, checks and
    ``backend`` rules (float64 logits computed in float64).
    """
    out = cross_entropy(
        logits,
        tokens,
        reduction="none",
        temperature=temperature,
        return_entropy=return_entropy,
        ignore_index=ignore_index,
        logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling,
        shift=shift,
        backend=backend,
        validate_labels=validate_labels,
    )
    return negated_losses(out, return_entropy)


def negated_losses(out, return_entropy):
    """log_probs' result from cross_entropy(reduction="none")'s (a loss, or CrossEntropyOutput with the entropy):
    0 - loss, not -loss, so that an ignored token's 0.0 stays +0.0."""
    if not return_entropy:
        return 0.0 - out
    return LogProbOutput(0.0 - out.loss, out.entropy)
