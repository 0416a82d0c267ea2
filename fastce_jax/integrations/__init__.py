"""The framework drop-ins: optax_losses.py (optax's softmax_cross_entropy_with_integer_labels on the kernels) and
unsloth.py (Unsloth's fast_cross_entropy_loss by name). fastce_jax.optax_losses and fastce_jax.unsloth keep the
import paths users have.
"""

__all__ = []
