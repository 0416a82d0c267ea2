"""Side-by-side benchmark of fastce against the cross-entropy implementations users would otherwise use.

`python -m bench` measures on a GPU and prints a table (see `python -m bench --help`); on a machine without
a GPU it runs a small interpreted correctness-and-timing demo of the fastce kernels instead.
"""

# Every implementation the benchmark knows, in table order (each runs in a worker process of its own, bench/runner.py).
TORCH_IMPLS = ("fastce_torch", "torch_eager_fp32", "torch_eager", "torch_compile", "liger")
JAX_IMPLS = ("fastce_jax", "fastce_jax_noalias", "xla")
ALL_IMPLS = TORCH_IMPLS + JAX_IMPLS
