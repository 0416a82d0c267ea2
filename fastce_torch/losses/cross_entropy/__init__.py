"""The cross-entropy (and the log-probabilities on it): forward.py / backward.py (the row kernels), launch.py (their
launchers), autograd.py (CrossEntropyFunction and the custom ops), api.py (cross_entropy, CrossEntropyLoss,
cross_entropy_reference), log_probs.py (log_probs); on the LM-head engine linear_chunks.py (the per-chunk work),
linear_autograd.py (the Functions and custom ops), linear_dispatch.py (their dispatch for an unsharded head) and
linear_api.py (linear_cross_entropy, linear_log_probs)."""

__all__ = []
