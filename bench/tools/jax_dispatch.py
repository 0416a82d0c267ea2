"""Per-call host time of fastce_jax on tiny inputs, eager against jitted:
`PYTHONPATH=. python -m bench.tools.jax_dispatch`.

Rows: cross_entropy (forward), jax.value_and_grad of it, and linear_cross_entropy (forward and value_and_grad),
each called eagerly (a fresh Python call per step, as in a notebook or an un-jitted training loop) and through
jax.jit. Inputs are tiny (the kernels' own time is negligible), so the numbers are the host cost of one call:
tracing and lowering when a call misses the caches, dispatch when it hits them. Each row: the first call (trace +
compile), then the minimum over repeats of the mean over `--number` calls, every result blocked on. Beside each, the
same computation in plain jax.numpy ("plain ..." rows: logsumexp minus the label's logit, mean; `h @ w.T` first for
the linear rows), what any JAX loss costs per call in that mode (jax.value_and_grad outside jit traces the function on
every call, whatever the function). On a machine
without a GPU, backend="kernel" runs Pallas interpret mode (much slower kernels, the same host-side caching).
"""

import argparse
import timeit

import jax
import jax.numpy as jnp
import numpy as np

import fastce_jax


def _inputs(rows, vocab, dim, seed=0):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.standard_normal((rows, vocab)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, vocab, rows), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((rows, dim)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((vocab, dim)) * 0.1, jnp.float32)
    return logits, labels, hidden, weight


def _time(fn, args, number, repeat):
    """(first call seconds, steady per-call seconds) of fn(*args), each result blocked on."""
    start = timeit.default_timer()
    jax.block_until_ready(fn(*args))
    first = timeit.default_timer() - start
    times = timeit.repeat(lambda: jax.block_until_ready(fn(*args)), number=number, repeat=repeat)
    return first, min(times) / number


def rows(backend, rows_, vocab, dim):
    logits, labels, hidden, weight = _inputs(rows_, vocab, dim)

    def ce(x):
        return fastce_jax.cross_entropy(x, labels, backend=backend)

    def lce(h, w):
        return fastce_jax.linear_cross_entropy(h, w, labels, backend=backend)

    def plain_ce(x):
        label_logits = jnp.take_along_axis(x, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(x, axis=-1) - label_logits)

    def plain_lce(h, w):
        return plain_ce(h @ w.T)

    cases = {
        "cross_entropy": (ce, (logits,)),
        "plain cross_entropy": (plain_ce, (logits,)),
        "grad plain cross_entropy": (jax.value_and_grad(plain_ce), (logits,)),
        "grad cross_entropy": (jax.value_and_grad(ce), (logits,)),
        "linear_cross_entropy": (lce, (hidden, weight)),
        "grad linear_cross_entropy": (jax.value_and_grad(lce, argnums=(0, 1)), (hidden, weight)),
        "plain linear + cross_entropy": (plain_lce, (hidden, weight)),
        "grad plain linear + cross_entropy": (jax.value_and_grad(plain_lce, argnums=(0, 1)), (hidden, weight)),
    }
    for name, (fn, args) in cases.items():
        yield name, "eager", fn, args
        yield name, "jit", jax.jit(fn), args


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].rstrip(":"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--backend", default="kernel", choices=("auto", "kernel", "reference"))
    parser.add_argument("--number", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    print(
        f"fastce_jax {fastce_jax.__version__}, jax {jax.__version__}, {jax.default_backend()}, "
        f"{args.rows}x{args.vocab} (hidden {args.dim}), backend={args.backend!r}"
    )
    print(f"{'call':<36}{'mode':<7}{'first call ms':>15}{'per call us':>14}")
    for name, mode, fn, fn_args in rows(args.backend, args.rows, args.vocab, args.dim):
        first, steady = _time(fn, fn_args, args.number, args.repeat)
        print(f"{name:<36}{mode:<7}{first * 1e3:>15.1f}{steady * 1e6:>14.1f}")


if __name__ == "__main__":
    main()
