"""One folder per loss, each with the same modules: forward.py and backward.py (the row kernels), launch.py (their
launchers and tuned settings), autograd.py (the autograd Functions and torch.library custom ops), api.py (the public
function), linear_chunks.py, linear_autograd.py and linear_api.py (the loss on the LM-head engine, linear/engine.py).
cross_entropy/ also holds log_probs.py and linear_dispatch.py; jsd/ its options.py and reference.py. No loss imports
another loss's module."""

__all__ = []
