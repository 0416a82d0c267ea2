"""The LM-head engine, loss-neutral (it imports core/ only): engine.py (the chunk loop over rows, its settings, the
logits matmul, the gradients' buffers and products, the kept rows) and scale.py (the gradients' scaling by a reduced
loss's upstream). Each loss plugs its row kernels into it: losses/*/linear_chunks.py."""

__all__ = []
