"""Timing and memory of one JAX implementation on one shape (import after bench.jax_setup.configure()): fwd, fwdbwd
donated (each gradient fed back as the next logits) and not donated, host-timed; memory is XLA's temp size."""

import statistics
import time

import jax
import numpy as np

from .jax_impls import make_inputs


def bench_ms(call, batch_target_ms=50.0, batches=7) -> float:
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


def peak_extra_bytes(compiled) -> int:
    """XLA's scratch for one call of a compiled program (inputs and outputs excluded)."""
    return int(compiled.memory_analysis().temp_size_in_bytes)


def measure(loss_fn, shape, batch_target_ms=50.0) -> dict:
    logits, labels = make_inputs(shape)
    fwd = jax.jit(loss_fn).lower(logits, labels).compile()
    fwdbwd = jax.jit(jax.value_and_grad(loss_fn), donate_argnums=0).lower(logits, labels).compile()
    fwdbwd_undonated = jax.jit(jax.value_and_grad(loss_fn)).lower(logits, labels).compile()
    peak = peak_extra_bytes(fwdbwd)
    loss = float(fwd(logits, labels))
    fwd_ms = bench_ms(lambda: fwd(logits, labels), batch_target_ms)
    # Before the donated program consumes the logits; each call's outputs die with the next call.
    fwdbwd_undonated_ms = bench_ms(lambda: fwdbwd_undonated(logits, labels), batch_target_ms)
    state = {"logits": logits}
    del logits  # fwdbwd donates it: the state dict holds the only reference from here on

    def step():
        _, state["logits"] = fwdbwd(state["logits"], labels)
        return state["logits"]

    fwdbwd_ms = bench_ms(step, batch_target_ms)
    if not np.isfinite(np.asarray(state["logits"][0, :8], dtype=np.float32)).all():
        raise FloatingPointError("gradient fed back as logits became non-finite")
    del state
    times = {"fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms, "fwdbwd_undonated_ms": fwdbwd_undonated_ms}
    return times | {"peak_extra_bytes": peak, "peak_extra_kind": "xla_temp_size", "loss": loss}


def has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False
