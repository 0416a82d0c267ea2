"""The generalized Jensen-Shannon divergence (forward and reverse KL at its ends) for distillation: options.py
(JsdOptions and the checks), reference.py (the formula in plain torch), forward.py / backward.py (the row kernels),
launch.py (their launchers), autograd.py (JsdFunction and the custom ops), api.py (jsd); on the LM-head engine
linear_chunks.py (the per-chunk work), linear_autograd.py (the Functions and custom ops) and linear_api.py
(linear_jsd)."""

__all__ = []
