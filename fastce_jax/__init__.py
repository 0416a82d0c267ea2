"""fastce_jax: fused cross-entropy for JAX (Pallas kernels on the Triton backend).

    from fastce_jax import cross_entropy, linear_cross_entropy
    loss = cross_entropy(logits, labels)            # mean over non-ignored tokens
    loss, grads = jax.value_and_grad(lambda x: cross_entropy(x, labels))(logits)
    loss = linear_cross_entropy(hidden, lm_head_weight, labels)   # from hidden states, no (N, V) logits
    loss = jsd(student_logits, teacher_logits, beta=0.5)     # distillation: generalized JSD / forward, reverse KL

The loss contract is CONTRACT.md. Layout: core/ (options and checks, the jnp formulas and reference, the output
records, per-token inputs, versions, the loss-neutral launch helpers), losses/cross_entropy/ and losses/jsd/ (one
folder per loss: its kernels, launchers, custom_vjp and public functions, its fused linear variant), linear/ (the
LM-head engine every fused linear loss runs on), distributed/ (custom_partitioning of sharded logits and heads),
integrations/ (optax's integer-label loss on the kernels, Unsloth's name). optax_losses.py, unsloth.py and
versions.py are compatibility modules for the import paths users have.
"""

from . import optax_losses, unsloth, versions  # noqa: F401  (compatibility modules, reachable as before)
from .core.outputs import CrossEntropyOutput, LogProbOutput, PolicyLossOutput
from .core.versions import warn_if_untested
from .integrations.optax_losses import softmax_cross_entropy_with_integer_labels
from .integrations.unsloth import fast_cross_entropy_loss
from .linear.engine import DEFAULT_WORKSPACE_BYTES
from .losses.cross_entropy.api import cross_entropy, cross_entropy_reference
from .losses.cross_entropy.linear_api import linear_cross_entropy, linear_log_probs
from .losses.cross_entropy.linear_policy import linear_policy_loss, linear_token_objective
from .losses.cross_entropy.log_probs import log_probs
from .losses.jsd.api import jsd
from .losses.jsd.linear_api import linear_jsd

warn_if_untested()  # once per process, on a jax or jaxlib release outside the tested range (core/versions.py)

__all__ = [
    "CrossEntropyOutput",
    "LogProbOutput",
    "PolicyLossOutput",
    "cross_entropy",
    "cross_entropy_reference",
    "fast_cross_entropy_loss",
    "jsd",
    "linear_cross_entropy",
    "linear_jsd",
    "linear_log_probs",
    "linear_policy_loss",
    "linear_token_objective",
    "log_probs",
    "softmax_cross_entropy_with_integer_labels",
    "DEFAULT_WORKSPACE_BYTES",
]
__version__ = "0.2.0"
