"""One folder per loss, with the same module names in each (and in fastce_torch): options.py / reference.py (the
loss's own checks and formulas, where it has any beyond fastce_jax/core/), forward.py and backward.py (the Pallas
row kernels), launch.py (their launchers and tiles), autograd.py (the custom_vjp), api.py (the public function),
linear_chunks.py, linear_autograd.py and linear_api.py (the fused linear loss on the LM-head engine,
fastce_jax/linear/engine.py).

- cross_entropy/: cross_entropy, cross_entropy_reference, log_probs, linear_cross_entropy, linear_log_probs.
- jsd/: jsd and linear_jsd (distillation: generalized JSD, forward and reverse KL).

No loss imports another loss's module.
"""

__all__ = []
