"""`python -m bench`: fastce against the cross-entropy implementations users would otherwise use (GPU), or an
interpreted correctness demo (CPU); the implementations it knows, and how a fastce one is loaded."""

import importlib

from .progress import Unavailable

# Every implementation the benchmark knows, in table order (each runs in a worker process of its own, bench/runner.py).
TORCH_IMPLS = ("fastce_torch", "torch_eager_fp32", "torch_eager", "torch_compile", "liger")
JAX_IMPLS = ("fastce_jax", "fastce_jax_noalias", "xla")
ALL_IMPLS = TORCH_IMPLS + JAX_IMPLS


def fastce_loss(package_name, backend="auto", **options):
    """(logits, labels) -> loss with fastce_torch's or fastce_jax's cross_entropy (options: its keywords)."""
    try:
        cross_entropy = importlib.import_module(package_name).cross_entropy
    except ModuleNotFoundError as exc:
        if exc.name != package_name:
            raise  # the package is there but broken: a real failure
        raise Unavailable(f"{package_name} is not installed") from exc
    return lambda logits, labels: cross_entropy(logits, labels, backend=backend, **options)
