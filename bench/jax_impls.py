"""The JAX implementations under test, each (logits, labels) -> mean loss, and their inputs; import after
bench.jax_setup.configure() (no preallocation of the GPU that torch also needs)."""

import jax
import jax.numpy as jnp

from . import fastce_loss
from .shapes import IGNORE_INDEX

JAX_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def make_inputs(shape, seed=0):
    key_x, key_y = jax.random.split(jax.random.key(seed))
    logits = jax.random.normal(key_x, (shape.N, shape.V), JAX_DTYPES[shape.dtype])
    labels = jax.random.randint(key_y, (shape.N,), 0, shape.V, dtype=jnp.int32)
    labels = labels.at[::7].set(IGNORE_INDEX)
    return logits, labels


def xla_loss():
    """XLA's own: float32 upcast, logsumexp and take_along_axis (optax's formula), mean over kept tokens."""

    def loss(logits, labels):
        z = logits.astype(jnp.float32)
        keep = labels != IGNORE_INDEX
        safe = jnp.where(keep, labels, 0)
        lse = jax.nn.logsumexp(z, axis=-1)
        z_label = jnp.take_along_axis(z, safe[:, None], axis=-1)[:, 0]
        per_token = jnp.where(keep, lse - z_label, 0.0)
        return per_token.sum() / jnp.maximum(keep.sum(), 1)

    return loss


# fastce_jax_noalias: inplace_backward=False (the backward's gradient never aliases the logits).
LOADERS = {"fastce_jax": lambda: fastce_loss("fastce_jax"), "xla": xla_loss,
           "fastce_jax_noalias": lambda: fastce_loss("fastce_jax", inplace_backward=False)}  # fmt: skip
