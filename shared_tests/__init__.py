"""Shared numerical suite: fastce_torch and fastce_jax against one float64 reference, tensors exchanged
through DLPack."""
