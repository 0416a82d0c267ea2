"""The RL keywords with sharded logits under jit (distributed/partitioning.py's custom_partitioning): temperature,
token_weights and the entropy's gradient (the backward's mz is the global lse - H, both combined in the forward), rows,
vocabulary and both sharded, against float64. Needs several devices: on CPU these run in test_sharding.py's 4-device
child (SHARDED_ELSEWHERE), or directly with XLA_FLAGS=--xla_force_host_platform_device_count=4."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fastce_jax import cross_entropy, log_probs

from .checks import assert_grad, assert_loss
from .rl_checks import expected_rl
from .test_sharding import collectives, devices, make_inputs, mesh_for, put  # noqa: F401 (devices: a fixture)

N_ROWS, VOCAB = 8, 64
OPTS = dict(temperature=0.7, logit_softcapping=7.0, logit_scaling=1.3, z_loss=1e-3, label_smoothing=0.1)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("layout", ["rows", "vocab", "2d"])
def test_sharded_temperature_token_weights_entropy(devices, layout, reduction):  # noqa: F811
    mesh, spec = mesh_for(devices, layout)
    x, y = make_inputs((N_ROWS, VOCAB), seed=21)
    tw = np.random.default_rng(21).uniform(-1.0, 2.0, y.shape).astype(np.float32)
    rows = P(spec[0])
    xs, ys, tws = put(x, mesh, spec), put(y, mesh, rows), put(jnp.asarray(tw), mesh, rows)
    upstream = np.linspace(0.5, 1.5, N_ROWS).astype(np.float32) if reduction == "none" else np.float32(1.0)
    g_h = np.linspace(-1.0, 1.0, N_ROWS).astype(np.float32) if reduction == "none" else np.float32(-0.3)

    @jax.jit
    def f(a, b, w):
        def objective(logits):
            out = cross_entropy(
                logits, b, backend="kernel", reduction=reduction, token_weights=w, return_entropy=True, **OPTS
            )
            return jnp.sum(out.loss * upstream) + jnp.sum(out.entropy * g_h), out

        return jax.value_and_grad(objective, has_aux=True)(a)

    (_, out), grad = f(xs, ys, tws)
    exp = expected_rl(x, y, reduction, upstream=upstream, token_weights=tw, entropy_upstream=g_h, **OPTS)
    assert_loss(out.loss, exp.loss)
    assert_loss(out.entropy, exp.entropy, "entropy")
    assert_grad(grad, exp.loss)
    assert grad.sharding.is_equivalent_to(xs.sharding, 2), (grad.sharding, xs.sharding)
    # O(N) communication: nothing near the logits' size (the entropy's mz is per row, no extra collective in the
    # backward).
    found = collectives(f.lower(xs, ys, tws).compile().as_text())
    assert all(size <= 4 * N_ROWS for _, size in found), found


@pytest.mark.parametrize("layout", ["vocab", "2d"])
def test_sharded_log_probs(devices, layout):  # noqa: F811
    mesh, spec = mesh_for(devices, layout)
    x, y = make_inputs((N_ROWS, VOCAB), seed=22)
    xs, ys = put(x, mesh, spec), put(y, mesh, P(spec[0]))

    def objective(backend):
        def f(a, b):
            out = log_probs(a, b, temperature=0.8, return_entropy=True, backend=backend)
            return jnp.sum(jnp.exp(out.logprobs) * jnp.cos(out.logprobs)) - 0.01 * jnp.sum(out.entropy)

        return f

    value, grad = jax.jit(jax.value_and_grad(objective("kernel")))(xs, ys)
    ref_value, ref_grad = jax.value_and_grad(objective("reference"))(x, y)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)
    assert grad.sharding.is_equivalent_to(xs.sharding, 2)
    plain = jax.jit(lambda a, b: log_probs(a, b, temperature=0.8, backend="kernel"))(xs, ys)
    assert isinstance(plain.sharding, NamedSharding)
    np.testing.assert_allclose(plain, log_probs(x, y, temperature=0.8, backend="reference"), rtol=1e-5, atol=1e-6)
