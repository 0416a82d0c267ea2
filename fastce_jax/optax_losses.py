"""Compatibility module: ``fastce_jax.optax_losses`` as users import it today. The code lives in
fastce_jax/integrations/optax_losses.py."""

from .integrations.optax_losses import softmax_cross_entropy_with_integer_labels

__all__ = ["softmax_cross_entropy_with_integer_labels"]
