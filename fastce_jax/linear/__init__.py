"""The LM-head engine, public and loss-neutral: engine.py, the chunk loop every fused linear loss runs on (its
budget, a chunk's rows and matmul, the gradients' accumulation, the loop driver run_chunks). It imports
fastce_jax/core/ only; the losses plug their row kernels into it (losses/*/linear_chunks.py).
"""

__all__ = []
