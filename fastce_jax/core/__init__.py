"""What every loss of fastce_jax shares; imports nothing above core/.

- options.py: the Options and Extras records, the constants, every argument check, the reduction's divisor and the
  "auto" backend's route.
- reference.py: the contract's formulas in jnp (traced by the kernels too) and the jnp reference.
- outputs.py: the output records (CrossEntropyOutput, LogProbOutput) and the extra outputs' reduction.
- token_inputs.py: token_weights, where= and shift.
- versions.py: the tested jax releases and the warning outside them.
- kernel_helpers.py: the Pallas helpers shared by more than one loss's kernels.
- launch.py: the loss-neutral host side of a pallas_call (quiet_triton, same_variance, launch).
"""

__all__ = []
