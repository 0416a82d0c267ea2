"""Side-by-side benchmark of fastce against the cross-entropy implementations users would otherwise use: the
implementations it knows, and how a fastce one is loaded.

`python -m bench` measures on a GPU and prints a table (see `python -m bench --help`); on a machine without
a GPU it runs a small interpreted correctness-and-timing demo of the fastce kernels instead.
"""

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
