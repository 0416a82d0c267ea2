"""GPU-only checks (run with --gpu): compiled memory and N*V > 2**31."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import cross_entropy

from .checks import assert_grad, assert_loss, expected

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("donate", [False, True])
def test_value_and_grad_temp_memory(device, record_property, capsys, donate):
    n, v = 8192, 256000
    x = jax.ShapeDtypeStruct((n, v), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((n,), jnp.int32)
    step = jax.jit(jax.value_and_grad(lambda a, b: cross_entropy(a, b)), donate_argnums=(0,) if donate else ())
    lowered = step.trace(x, y).lower()
    assert "__gpu$xla.gpu.triton" in lowered.as_text()  # auto picked the kernels
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    grad_bytes = n * v * 2
    record_property("temp_size_in_bytes", temp)
    with capsys.disabled():
        print(
            f"\n[fastce_jax] value_and_grad {n}x{v} bf16 donate={donate}: "
            f"temp {temp / 2**20:.1f} MiB vs gradient {grad_bytes / 2**20:.1f} "
            "MiB"
        )
    assert temp <= grad_bytes


def test_more_than_2_31_elements(device):
    n, v = 8192, 262147
    assert n * v > 2**31
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(kx, (n, v), jnp.bfloat16), device)
    y = np.array(jax.random.randint(ky, (n,), 0, v, jnp.int32))  # writable copy
    y[-1] = v - 1  # the very last element of the array
    y[-2] = -100
    labels = jax.device_put(y, device)

    @jax.jit
    def run(logits, labels):
        loss, vjp = jax.vjp(lambda a: cross_entropy(a, labels, reduction="none"), logits)
        return loss, vjp(jnp.ones_like(loss))[0]

    loss, g = run(x, labels)
    rows = np.array([0, 1, n // 2, n - 3, n - 2, n - 1])
    ref = expected(x[rows], y[rows])
    assert_loss(loss[rows], ref)
    assert_grad(g[rows], ref)
