"""fastce_torch: fused cross-entropy, log-probabilities and distillation losses for PyTorch (Triton kernels behind
torch.autograd.Function and torch.library custom ops). The public API only: the losses (losses/*/api.py and
linear_api.py, on the LM-head engine of linear/), the integrations' patches (integrations/) and the fused linear
loss's default workspace budget."""

import os
import sys

import torch

# Without a GPU the Triton kernels can only run in Triton's interpreter, and that must be chosen before triton is
# first imported (its standard library is decorated at import). Compiled kernels could not run here anyway.
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .core.outputs import CrossEntropyOutput, LogProbOutput, PolicyLossOutput  # noqa: E402
from .core.versions import warn_if_untested  # noqa: E402
from .integrations.transformers import fastce_for_causal_lm_loss, patch_transformers, unpatch_transformers  # noqa: E402
from .integrations.trl import patch_trl, unpatch_trl  # noqa: E402
from .integrations.unsloth import fast_cross_entropy_loss, patch_loss_functions  # noqa: E402
from .linear.engine import DEFAULT_WORKSPACE_BYTES  # noqa: E402
from .losses.cross_entropy.api import CrossEntropyLoss, cross_entropy, cross_entropy_reference  # noqa: E402
from .losses.cross_entropy.linear_api import linear_cross_entropy, linear_log_probs  # noqa: E402
from .losses.cross_entropy.linear_policy import linear_policy_loss, linear_token_objective  # noqa: E402
from .losses.cross_entropy.log_probs import log_probs  # noqa: E402
from .losses.jsd.api import jsd  # noqa: E402
from .losses.jsd.linear_api import linear_jsd  # noqa: E402

warn_if_untested()  # once per process, on a torch or Triton release outside the tested range (core/versions.py)

# What users call: the losses (cross-entropy; the distillation losses jsd / linear_jsd), their output record, the
# integration patches (and the loss function the transformers patch installs), and the fused linear loss's default
# workspace budget (its `workspace_bytes` keyword).
__all__ = [
    "cross_entropy",
    "cross_entropy_reference",
    "CrossEntropyLoss",
    "CrossEntropyOutput",
    "LogProbOutput",
    "log_probs",
    "linear_cross_entropy",
    "linear_log_probs",
    "linear_policy_loss",
    "linear_token_objective",
    "PolicyLossOutput",
    "jsd",
    "linear_jsd",
    "DEFAULT_WORKSPACE_BYTES",
    "patch_transformers",
    "unpatch_transformers",
    "fastce_for_causal_lm_loss",
    "patch_trl",
    "unpatch_trl",
    "fast_cross_entropy_loss",
    "patch_loss_functions",
]
__version__ = "0.2.0"
