"""What every loss shares, importing nothing above core/: options.py (the Options record, the constants, every
argument check, the reduction's divisor, the routing helpers), reference.py (the contract's formulas in plain torch),
outputs.py (the output records and the extra outputs), token_inputs.py (token_weights, where=, shift), versions.py
(the tested releases), guards.py (autograd guards), custom_ops.py (the torch.library plumbing of every custom op),
kernel_helpers.py (the @triton.jit helpers more than one kernel uses), launch.py (the loss-neutral host side of a
launch) and launch_cache.py (the reproduction of Triton 3.6.0's launch path; deletable)."""

__all__ = []
