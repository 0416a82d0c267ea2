"""The cross-entropy loss (CONTRACT.md): forward.py and backward.py (the Pallas kernels), launch.py (their launchers
and tiles), autograd.py (the custom_vjp and the jitted kernel path), api.py (cross_entropy, cross_entropy_reference),
log_probs.py (log_probs), and the fused linear loss: linear_chunks.py (its per-chunk work on the LM-head engine),
linear_autograd.py (its custom_vjps), linear_api.py (linear_cross_entropy, linear_log_probs).
"""

__all__ = []
