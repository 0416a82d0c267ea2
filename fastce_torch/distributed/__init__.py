"""The vocabulary split over ranks, in one place: vocab_parallel.py (cross_entropy with process_group=: per-shard
statistics, the collectives, the eager autograd.Function), vocab_parallel_traced.py (the same under torch.compile:
custom ops around functional collectives), combine.py (the kernels around the two all-reduces), dtensor.py (DTensor
logits sharded on the vocabulary) and linear_sharded.py (linear_cross_entropy's column-parallel and DTensor heads)."""

__all__ = []
