"""fastce_jax: fused cross-entropy for JAX (Pallas kernels on the Triton backend).

    from fastce_jax import cross_entropy, linear_cross_entropy
    loss = cross_entropy(logits, labels)            # mean over non-ignored tokens
    loss, grads = jax.value_and_grad(lambda x: cross_entropy(x, labels))(logits)
    loss = linear_cross_entropy(hidden, lm_head_weight, labels)   # from hidden states, no (N, V) logits
    loss = jsd(student_logits, teacher_logits, beta=0.5)     # distillation: generalized JSD / forward, reverse KL

The loss contract is CONTRACT.md. Layers: contract.py (options, checks, jnp formulas), kernels/ (the Pallas
kernels and their launchers), ops.py (the op layer every kernel call goes through: custom_partitioning of sharded
logits), cross_entropy.py, linear/ (the fused linear loss), jsd.py and linear/jsd.py (distillation), unsloth.py,
optax_losses.py (optax's integer-label loss on the kernels).
"""

from .contract import CrossEntropyOutput
from .cross_entropy import cross_entropy, cross_entropy_reference
from .jsd import jsd
from .linear import DEFAULT_WORKSPACE_BYTES, linear_cross_entropy, linear_jsd, linear_log_probs
from .log_probs import LogProbOutput, log_probs
from .optax_losses import softmax_cross_entropy_with_integer_labels
from .unsloth import fast_cross_entropy_loss
from .versions import warn_if_untested

warn_if_untested()  # once per process, on a jax or jaxlib release outside the tested range (versions.py)

__all__ = [
    "CrossEntropyOutput",
    "LogProbOutput",
    "cross_entropy",
    "cross_entropy_reference",
    "fast_cross_entropy_loss",
    "jsd",
    "linear_cross_entropy",
    "linear_jsd",
    "linear_log_probs",
    "log_probs",
    "softmax_cross_entropy_with_integer_labels",
    "DEFAULT_WORKSPACE_BYTES",
]
__version__ = "0.1.0"
