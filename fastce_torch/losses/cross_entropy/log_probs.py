"""Per-token log-probabilities for RL objectives (policy gradient, PPO / GRPO importance ratios, KL to a reference):
`log_probs` (its LogProbOutput is core/outputs.py), on cross_entropy(reduction="none") (log p(token) = -loss). The
fused-linear counterpart, `linear_log_probs`, lives in linear_api.py; both end in `negated_losses`."""

import torch

from ...core.options import is_dtensor
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
    process_group=None,
    vocab_start=None,
):
    """log p(token_t) at the temperature, p = softmax(softcap(scaling * logits) / temperature): float32 (float64 for
    float64 logits) shaped like tokens (with shift=k like tokens[..., k:]: position t scores token t + k), 0.0 where
    the token is ignore_index, NaN for a token outside [0, V). return_entropy=True: LogProbOutput(logprobs,
    entropy), the entropy of each position's distribution (0 where ignored). Both differentiable through any
    downstream objective (an importance ratio, a KL to a reference policy), the entropy's gradient added in the
    loss's backward pass. cross_entropy(reduction="none") underneath: the same kernels, keywords and errors
    (process_group / vocab_start: vocab-parallel logits). With gradients off (torch.no_grad, inference_mode,
    logits not requiring grad) nothing is kept for a backward."""
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy must be a bool, got {return_entropy!r}")
    result = cross_entropy(
        logits, tokens, ignore_index=ignore_index, reduction="none", logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling, backend=backend, validate_labels=validate_labels, process_group=process_group,
        vocab_start=vocab_start, shift=shift, return_entropy=return_entropy, temperature=temperature,
    )  # fmt: skip
    return negated_losses(result, tokens, shift, ignore_index, return_entropy)


def negated_losses(out, tokens, shift, ignore_index, return_entropy):
    """log_probs' / linear_log_probs' result from the loss's reduction="none" output (a loss, or CrossEntropyOutput
    with the entropy): -loss where the (shifted) token is kept, 0.0 where it is ignore_index. A DTensor loss with
    plain tokens gets the ignored mask placed like the loss."""
    loss = out.loss if return_entropy else out
    ignored = (tokens[..., int(shift) :] if shift else tokens) == ignore_index
    if is_dtensor(loss) and not is_dtensor(ignored):  # DTensor logits, plain tokens
        from torch.distributed.tensor import DTensor

        ignored = DTensor.from_local(ignored, loss.device_mesh, loss.placements, run_check=False)
    # Negated where kept, 0.0 (not -0.0) where ignored: a where, not 0 - loss, which a compiler may fold to -loss.
    logprobs = torch.where(ignored, 0.0, -loss)
    return LogProbOutput(logprobs, out.entropy) if return_entropy else logprobs
