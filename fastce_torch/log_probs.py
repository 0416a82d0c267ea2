"""Per-token log-probabilities for RL objectives (policy gradient, PPO / GRPO importance ratios, KL to a reference):
`log_probs` and its `LogProbOutput`, on cross_entropy(reduction="none") (log p(token) = -loss)."""

from typing import NamedTuple

import torch


class LogProbOutput(NamedTuple):
    """What log_probs / linear_log_probs return with return_entropy=True: float32 log-probabilities of the tokens
    at the temperature (0.0 where the token is ignore_index, NaN outside [0, V)) and the entropy of each position's
    distribution (0 where ignored), both shaped like the tokens (after a shift) and both differentiable."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
