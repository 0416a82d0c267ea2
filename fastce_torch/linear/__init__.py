"""The LM-head engine, loss-neutral (it imports core/ only): engine.py (the chunk loop over rows, its settings, the
logits matmul, the gradients' buffers and products, the kept rows) and scale.py (the gradients' scaling by a reduced
loss's upstream). Each loss plugs its row kernels into it: losses/*/linear_chunks.py. The chunking's documented names
(the default workspace budget, the rows-per-chunk rule) are here too, at the import path users have."""

from .engine import DEFAULT_WORKSPACE_BYTES, ROWS_MULTIPLE, rows_per_chunk

__all__ = ["DEFAULT_WORKSPACE_BYTES", "ROWS_MULTIPLE", "rows_per_chunk"]
