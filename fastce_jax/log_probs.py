"""Per-token log-probabilities (and entropies) at a sampling temperature, for RL objectives: ``log_probs`` and its
``LogProbOutput``. The fused-linear counterpart, ``linear_log_probs``, lives in linear/api.py."""

from __future__ import annotations

from typing import NamedTuple

import jax


class LogProbOutput(NamedTuple):
    """What ``log_probs`` / ``linear_log_probs`` return with return_entropy=True: float32 log p(token) and the
    entropy of softmax(z) per token, both shaped like the (shifted) tokens, 0 where the token is ignored; both
    differentiable."""

    logprobs: jax.Array
    entropy: jax.Array
