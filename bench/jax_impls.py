"""The JAX implementations under test, their inputs, and how they are timed.

Import this module only after bench.jax_setup.configure() (it must set XLA_PYTHON_CLIENT_PREALLOCATE=false
before jax is first imported, or JAX grabs 75% of the GPU that torch also needs).

Compiled programs (jax.jit, compiled once per shape, outside timing):
  fwd    = jit(loss)(logits, labels)
  fwdbwd = jit(value_and_grad(loss), donate_argnums=0)(logits, labels) -> (loss, grad)
  fwdbwd_undonated = jit(value_and_grad(loss))(logits, labels), the same logits every call
Donating the logits is the training situation (the logits are an intermediate of the step), and it is what
lets fastce_jax's backward alias its output to the logits buffer instead of copying the input first. Each
timed fwdbwd call feeds the previous call's gradient back in as the next logits (finite values, same work).
Not donated is what a plain jax.grad caller gets when the logits are an argument of the jitted function: an
output aliased to a live input (fastce_jax's inplace_backward=True) makes XLA copy the logits before the
backward kernel (one more read and write of N*V); fastce_jax_noalias (inplace_backward=False) writes a fresh
gradient buffer instead.
Timing is on the host: K calls queued back to back, one block_until_ready at the end, time / K; the median of
several such batches. Dispatch overlaps the GPU work, but small shapes are still somewhat overstated compared
with torch's CUDA-event times.
Peak extra memory = temp_size_in_bytes of the compiled fwdbwd (XLA's scratch; excludes inputs and outputs).
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from .progress import fastce_loss

IGNORE_INDEX = -100
JAX_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def make_inputs(shape, seed=0):
    key_x, key_y = jax.random.split(jax.random.key(seed))
    logits = jax.random.normal(key_x, (shape.N, shape.V), JAX_DTYPES[shape.dtype])
    labels = jax.random.randint(key_y, (shape.N,), 0, shape.V, dtype=jnp.int32)
    labels = labels.at[::7].set(IGNORE_INDEX)
    return logits, labels


def fastce_jax_loss(backend="auto"):
    return fastce_loss("fastce_jax", backend)


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


def fastce_jax_noalias_loss():
    """fastce_jax with inplace_backward=False: the backward's gradient never aliases the logits."""
    return fastce_loss("fastce_jax", inplace_backward=False)


LOADERS = {"fastce_jax": fastce_jax_loss, "fastce_jax_noalias": fastce_jax_noalias_loss, "xla": xla_loss}


def host_time_ms(call, batch_target_ms=50.0, batches=7) -> float:
    """Median over batches of (wall time of K queued calls + one block_until_ready) / K."""
    jax.block_until_ready(call())
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    one_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
    k = int(min(1000, max(5, batch_target_ms / one_ms)))
    per_call = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(k):
            out = call()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) * 1e3 / k)
    return statistics.median(per_call)


def compile_programs(loss_fn, logits, labels):
    """(fwd, fwdbwd with the logits donated, fwdbwd without donation), compiled."""
    fwd = jax.jit(loss_fn).lower(logits, labels).compile()
    fwdbwd = jax.jit(jax.value_and_grad(loss_fn), donate_argnums=0).lower(logits, labels).compile()
    fwdbwd_undonated = jax.jit(jax.value_and_grad(loss_fn)).lower(logits, labels).compile()
    return fwd, fwdbwd, fwdbwd_undonated


def measure(loss_fn, shape, batch_target_ms=50.0) -> dict:
    logits, labels = make_inputs(shape)
    fwd, fwdbwd, fwdbwd_undonated = compile_programs(loss_fn, logits, labels)
    memory = fwdbwd.memory_analysis()
    loss = float(fwd(logits, labels))
    fwd_ms = host_time_ms(lambda: fwd(logits, labels), batch_target_ms)
    # Before the donated program consumes the logits; each call's outputs die with the next call.
    fwdbwd_undonated_ms = host_time_ms(lambda: fwdbwd_undonated(logits, labels), batch_target_ms)
    state = {"logits": logits}
    del logits  # fwdbwd donates it: the state dict holds the only reference from here on

    def step():
        _, state["logits"] = fwdbwd(state["logits"], labels)
        return state["logits"]

    fwdbwd_ms = host_time_ms(step, batch_target_ms)
    if not np.isfinite(np.asarray(state["logits"][0, :8], dtype=np.float32)).all():
        raise FloatingPointError("gradient fed back as logits became non-finite")
    del state
    return {
        "fwd_ms": fwd_ms,
        "fwdbwd_ms": fwdbwd_ms,
        "fwdbwd_undonated_ms": fwdbwd_undonated_ms,
        "peak_extra_bytes": int(memory.temp_size_in_bytes),
        "peak_extra_kind": "xla_temp_size",
        "loss": loss,
    }


def has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False
