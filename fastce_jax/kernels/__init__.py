"""Pallas (Triton backend) kernels for fused cross-entropy, and their launchers.

Three kernels, as in CONTRACT.md "Kernel design": the forward kernel (per-chunk partial statistics) and the finish
kernel (a row's partials into its lse and loss) in ``forward.py``, the one-pass backward kernel in ``backward.py``;
the helpers they share in ``common.py``; tile configurations, the Triton deprecation filter and the host-side
launchers in ``launch.py``; the distillation loss's kernels and launchers (``fastce_jax.jsd``, ``linear_jsd``) in
``jsd.py``, imported as ``kernels.jsd``. This package re-exports what the other layers call
(``kernels.forward(...)``). The tile constants (CHUNK, FORWARD_BLOCK, ...) are read from ``launch`` when a config is
made: change them there (the jsd kernels' from ``kernels.jsd``).
"""

from .launch import (
    TRITON_DEPRECATION,
    BackwardConfig,
    ForwardConfig,
    backward,
    backward_config,
    forward,
    forward_config,
    quiet_triton,
    uses_int64_offsets,
)

__all__ = [
    "TRITON_DEPRECATION",
    "BackwardConfig",
    "ForwardConfig",
    "backward",
    "backward_config",
    "forward",
    "forward_config",
    "quiet_triton",
    "uses_int64_offsets",
]
