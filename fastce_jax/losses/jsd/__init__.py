"""The distillation loss (generalized JSD, forward and reverse KL; CONTRACT.md): options.py (JsdOptions, the checks,
beta's constants, the reduction), reference.py (the jnp reference), forward.py and backward.py (the Pallas kernels),
launch.py (their launchers and tiles), autograd.py (the ops and the custom_vjp), api.py (jsd), and the fused linear
loss: linear_chunks.py (its chunk loops on the LM-head engine), linear_autograd.py (its custom_vjps),
linear_api.py (linear_jsd).
"""

__all__ = []
