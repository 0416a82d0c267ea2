"""Every custom_partitioning of fastce_jax, in one place:

- layout.py: the loss-neutral helpers (the plan of a sharded operand, shard_index, the vmap rule).
- partitioning.py: the op layer every cross-entropy kernel launch goes through (rows and vocabulary sharded, the
  vocab-parallel combine, the jvp rules of higher-order autodiff).
- linear_sharded.py: the fused linear cross-entropy's chunk loop under sharded heads.

jsd's launches partition by rows only (losses/jsd/autograd.py, with layout.py's helpers).
"""

__all__ = []
