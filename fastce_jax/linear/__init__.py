"""Fused linear cross-entropy: the loss of ``cross_entropy(hidden @ weight.T + bias, labels)`` without the (N, V)
logits. ``chunks.py`` holds the chunk loop and its budget (``rows_per_chunk``), ``autograd.py`` the custom_vjps,
``api.py`` the public ``linear_cross_entropy`` and its checks, ``sharded.py`` the custom partitioning of sharded heads;
``jsd.py`` the fused linear distillation loss, ``linear_jsd``, on the same chunk loop helpers. The chunking constants
are read from ``chunks`` when a call is made: change them there.
"""

from .api import linear_cross_entropy, linear_log_probs
from .chunks import DEFAULT_WORKSPACE_BYTES, ROWS_MULTIPLE, chunked_backward, chunked_forward, rows_per_chunk
from .jsd import linear_jsd

__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "ROWS_MULTIPLE",
    "chunked_backward",
    "chunked_forward",
    "linear_cross_entropy",
    "linear_jsd",
    "linear_log_probs",
    "rows_per_chunk",
]
