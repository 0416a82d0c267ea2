"""Compatibility module: ``fastce_jax.unsloth`` as users import it today. The code lives in
fastce_jax/integrations/unsloth.py."""

from .integrations.unsloth import fast_cross_entropy_loss

__all__ = ["fast_cross_entropy_loss"]
