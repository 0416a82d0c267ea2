"""The fused linear cross-entropy: `linear_cross_entropy` (api.py) over the chunk loop (chunks.py), its autograd
Functions and custom ops (autograd.py), their dispatch for an unsharded head (unsharded.py) and the sharded heads
(sharded.py); the fused linear distillation loss `linear_jsd` (jsd.py) on the same chunk helpers."""

from .api import linear_cross_entropy, linear_log_probs
from .chunks import DEFAULT_WORKSPACE_BYTES, ROWS_MULTIPLE, rows_per_chunk

__all__ = ["linear_cross_entropy", "linear_log_probs", "DEFAULT_WORKSPACE_BYTES", "ROWS_MULTIPLE", "rows_per_chunk"]
