"""fastce_jax.linear_cross_entropy's differentiable entropy output and linear_log_probs (issue 37), and the RL
keywords on sharded heads (4 host devices), against a float64 NumPy reference (linear_rl_checks.py). CPU: the
chunked path with the Pallas kernels in interpret mode, tiny shapes, several chunks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fastce_jax import linear_cross_entropy, linear_log_probs

from .linear_rl_checks import compare, dot_generals, expected, run
from .test_linear_cross_entropy import LOSS_TOL, ROWS, assert_close, grad_tol, make_inputs


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """The chunk matmuls at float32 precision (a GPU may use TF32): the tolerances are for float32 products."""
    with jax.default_matmul_precision("float32"):
        yield


# ----------------------------------------------------------------------------
# The differentiable entropy output
# ----------------------------------------------------------------------------

ENTROPY_CASES = {
    "alone": dict(g_loss=0.0),
    "weights": dict(temperature=0.8, token_weights=True, class_weight=True),
}


# With the loss, every option: shared_tests/test_entropy_grad.py's linear cases (both packages); here the entropy
# alone and with token and class weights.
@pytest.mark.parametrize(
    "case, reduction", [(case, reduction) for case in ("alone", "weights") for reduction in ("mean", "none")]
)
def test_entropy_gradient(put, case, reduction):
    kw = dict(ENTROPY_CASES[case])
    hidden, weight, bias, labels = make_inputs(put, 21, 16, 50, seed=13)
    rng = np.random.default_rng(13)
    per_token = reduction == "none"
    g_loss = kw.pop("g_loss", rng.uniform(0.5, 2.0, labels.shape) if per_token else 1.3)
    g_entropy = rng.uniform(-1.0, 1.0, labels.shape) if per_token else -0.37
    ref_kw = dict(kw)
    if kw.pop("token_weights", False):
        ref_kw["token_weights"] = rng.uniform(-1.0, 2.0, labels.shape)
        kw["token_weights"] = put(ref_kw["token_weights"], jnp.float32)
    if kw.pop("class_weight", False):
        ref_kw["class_weight"] = rng.uniform(0.2, 2.0, 50)
        kw["class_weight"] = put(ref_kw["class_weight"], jnp.float32)
    out, grads = run(
        put, hidden, weight, labels, bias=bias, reduction=reduction, g_loss=g_loss, g_entropy=g_entropy, **kw
    )
    want = expected(
        hidden, weight, labels, bias=bias, reduction=reduction, g_loss=g_loss, g_entropy=g_entropy, **ref_kw
    )
    compare(out, grads, want, entropy=True)


def test_entropy_gradient_reference_backend(put):
    hidden, weight, bias, labels = make_inputs(put, 12, 8, 30, seed=14)
    y = put(labels, jnp.int32)

    def f(h, w, b):
        out = linear_cross_entropy(h, w, y, bias=b, backend="reference", return_entropy=True, temperature=0.7)
        return out.loss - 0.5 * out.entropy

    grads = jax.grad(f, argnums=(0, 1, 2))(hidden, weight, bias)
    want = expected(hidden, weight, labels, bias=bias, temperature=0.7, g_entropy=-0.5)
    for got, ref in zip(grads, want[2:]):
        assert_close(got, ref, what="grad", **grad_tol(ref, 2e-4))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_entropy_not_differentiated_costs_nothing(put, reduction):
    """A returned entropy that is not differentiated adds no matmul (no recomputing pass for "mean"); a
    differentiated one adds the recomputing pass for "mean" only (the per-token backward recomputes anyway)."""
    hidden, weight, _, labels = make_inputs(put, 24, 8, 30, seed=15)
    y = put(labels, jnp.int32)

    def objective(with_entropy_grad):
        def f(h, w):
            out = linear_cross_entropy(
                h, w, y, reduction=reduction, backend="kernel", chunk_rows=ROWS, return_entropy=True
            )
            total = jnp.sum(out.loss)
            return total + 0.1 * jnp.sum(out.entropy) if with_entropy_grad else total

        return jax.grad(f, argnums=(0, 1))

    base = len(dot_generals(objective(False), hidden, weight))
    with_entropy = len(dot_generals(objective(True), hidden, weight))
    assert base == (6 if reduction == "mean" else 8), base  # "none": 1 + 1 forward, 3 + 3 backward
    assert with_entropy == (base + 6 if reduction == "mean" else base), with_entropy


def test_entropy_gradient_under_jit_and_vmap(put):
    batch, n, dim, vocab = 2, 10, 8, 30
    rng = np.random.default_rng(16)
    hidden = put(rng.standard_normal((batch, n, dim)), jnp.float32)
    weight = put(rng.standard_normal((vocab, dim)) * 0.5, jnp.float32)
    labels = rng.integers(0, vocab, (batch, n))
    labels[1, :3] = -100

    def one(h, w, y):
        out = linear_cross_entropy(
            h, w, y, backend="kernel", chunk_rows=4, return_entropy=True, temperature=0.7, reduction="none"
        )
        return jnp.sum(out.loss) - 0.01 * jnp.sum(out.entropy)

    step = jax.jit(jax.vmap(jax.value_and_grad(one, argnums=(0, 1)), in_axes=(0, None, 0)))
    _, (dh, dw) = step(hidden, weight, put(labels, jnp.int32))
    for b in range(batch):
        want = expected(
            hidden[b], weight, labels[b], reduction="none", temperature=0.7, g_loss=np.ones(n),
            g_entropy=np.full(n, -0.01),
        )  # fmt: skip
        assert_close(dh[b], want[2], what="dhidden", **grad_tol(want[2], 2e-4))
        assert_close(dw[b], want[3], what="dweight", **grad_tol(want[3], 2e-4))


@pytest.mark.parametrize("reduction", ["none"])
def test_entropy_gradient_second_order(put, reduction):
    """A gradient penalty on d(loss - 0.3 entropy)/d hidden, differentiated again through the kernels (the
    launches' jvp rules), equals the reference backend's."""
    hidden, weight, _, labels = make_inputs(put, 12, 8, 30, seed=22)
    y = put(labels, jnp.int32)

    def penalty_grads(backend):
        def f(h, w):
            out = linear_cross_entropy(
                h, w, y, backend=backend, chunk_rows=5, reduction=reduction, return_entropy=True, temperature=0.7
            )
            return jnp.sum(out.loss) - 0.3 * jnp.sum(out.entropy)

        def penalty(h, w):
            g = jax.grad(f)(h, w)
            return jnp.sum(g * g)

        return jax.grad(penalty, argnums=(0, 1))(hidden, weight)

    for got, want in zip(penalty_grads("kernel"), penalty_grads("reference")):
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(want)))
        )


# ----------------------------------------------------------------------------
# linear_log_probs
# ----------------------------------------------------------------------------


def test_linear_log_probs_values(put):
    """-(the per-token loss) at the temperature; +0.0 where ignored, NaN for a token outside [0, V)."""
    hidden, weight, bias, labels = make_inputs(put, 16, 8, 30, seed=17)
    labels[5] = 30
    lp = linear_log_probs(
        hidden, weight, put(labels, jnp.int32), bias=bias, temperature=0.7, backend="kernel", chunk_rows=ROWS
    )
    want = expected(hidden, weight, labels, bias=bias, reduction="none", temperature=0.7)[0]
    assert lp.dtype == jnp.float32 and lp.shape == labels.shape
    assert_close(lp, -want, what="logprobs", **LOSS_TOL)
    ignored = np.asarray(lp)[labels == -100]
    assert ignored.size and np.all(ignored == 0.0) and not np.any(np.signbit(ignored))
    out = linear_log_probs(hidden, weight, put(labels, jnp.int32), bias=bias, backend="reference", temperature=0.7)
    assert_close(out, -want, what="reference backend", **LOSS_TOL)


def test_linear_log_probs_policy_gradient(put):
    """A clipped-ratio objective with per-token advantages and an entropy bonus through LogProbOutput, under jit,
    with shift=1: the gradients are the float64 chain rule's."""
    hidden, weight, _, labels = make_inputs(put, 24, 16, 40, seed=18, lead=(2, 12))
    rng = np.random.default_rng(18)
    advantages = rng.uniform(-1.0, 1.0, (2, 11))
    old = rng.uniform(-0.3, 0.3, (2, 11))  # old-policy log-probs, as offsets from the current ones
    y = put(labels, jnp.int32)
    sliced_h, sliced_y = hidden[:, :-1].reshape(-1, 16), labels[:, 1:].reshape(-1)
    lp64 = -expected(sliced_h, weight, sliced_y, reduction="none", temperature=0.7)[0]
    old_lp = lp64.reshape(2, 11) + old

    def objective(h, w):
        out = linear_log_probs(
            h, w, y, temperature=0.7, return_entropy=True, shift=1, backend="kernel", chunk_rows=ROWS
        )
        ratio = jnp.exp(out.logprobs - old_lp)
        clipped = jnp.clip(ratio, 0.8, 1.2)
        kept = sliced_y.reshape(2, 11) != -100
        pg = -jnp.minimum(ratio * advantages, clipped * advantages)
        return jnp.sum(jnp.where(kept, pg, 0.0)) - 0.01 * jnp.sum(out.entropy), out

    (_, out), (dh, dw) = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(hidden, weight)
    assert out.logprobs.shape == (2, 11) and out.entropy.shape == (2, 11)
    ratio = np.exp(lp64.reshape(2, 11) - old_lp)
    unclipped = ratio * advantages <= np.clip(ratio, 0.8, 1.2) * advantages
    d_lp = np.where(unclipped | ((ratio > 0.8) & (ratio < 1.2)), -ratio * advantages, 0.0)
    d_lp = np.where(sliced_y.reshape(2, 11) != -100, d_lp, 0.0)
    want = expected(
        sliced_h, weight, sliced_y, reduction="none", temperature=0.7, g_loss=-d_lp.reshape(-1),
        g_entropy=np.full(22, -0.01),
    )  # fmt: skip
    dh_kept = np.asarray(dh)[:, :-1].reshape(-1, 16)
    assert_close(dh_kept, want[2], what="dhidden", **grad_tol(want[2], 2e-4))
    assert not np.asarray(dh)[:, -1].any()
    assert_close(dw, want[3], what="dweight", **grad_tol(want[3], 2e-4))
    assert_close(out.entropy, want[1].reshape(2, 11), what="entropy", **LOSS_TOL)


def test_linear_log_probs_plain_call_saves_nothing(put):
    """Not differentiated: the forward chunk loop only (one matmul per chunk, no backward kernel), and only the
    outputs leave the computation."""
    hidden, weight, _, labels = make_inputs(put, 24, 8, 30, seed=19)
    y = put(labels, jnp.int32)

    def plain(h, w):
        return linear_log_probs(h, w, y, return_entropy=True, backend="kernel", chunk_rows=ROWS)

    closed = jax.make_jaxpr(plain)(hidden, weight)
    assert len(closed.out_avals) == 2
    assert len(dot_generals(plain, hidden, weight)) == 2  # chunk 0 and the loop body
    assert "fastce_backward" not in str(closed)


def test_linear_log_probs_bad_arguments(put):
    hidden, weight, _, labels = make_inputs(put, 8, 8, 20, seed=20)
    with pytest.raises(ValueError, match="tokens"):
        linear_log_probs(hidden, weight, put(labels[:7], jnp.int32))
    with pytest.raises(TypeError, match="tokens"):
        linear_log_probs(hidden, weight, put(labels, jnp.float32))
    with pytest.raises(TypeError, match="return_entropy"):
        linear_log_probs(hidden, weight, put(labels, jnp.int32), return_entropy=1)
    with pytest.raises(ValueError, match="temperature"):
        linear_log_probs(hidden, weight, put(labels, jnp.int32), temperature=0.0)
    with pytest.raises(ValueError, match="logits_dtype"):
        linear_log_probs(hidden, weight, put(labels, jnp.int32), logits_dtype="bf16")


# ----------------------------------------------------------------------------
# Sharded heads (distributed/linear_sharded.py): 4 host devices, in test_sharding.py's child process (SHARDED_ELSEWHERE)
# ----------------------------------------------------------------------------

SHARDED_LAYOUTS = {  # (mesh shape and axes, hidden spec, weight spec)
    "rows": ((4,), ("d",), P("d", None), P(None, None)),
    "vocab": ((4,), ("d",), P(None, None), P("d", None)),
    "2d": ((2, 2), ("r", "v"), P("r", None), P("v", None)),
}


@pytest.mark.parametrize("layout", list(SHARDED_LAYOUTS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_sharded_head_temperature_token_weights_entropy(layout, reduction):
    """Under jit, rows and / or vocabulary sharded: temperature, token weights and the entropy's gradient (with a
    differentiated z_loss output) equal the float64 reference, and the gradients keep the inputs' shardings."""
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices (test_sharding.py's test_sharded_suite_on_4_cpu_devices runs it)")
    shape, axes, h_spec, w_spec = SHARDED_LAYOUTS[layout]
    mesh = Mesh(np.array(devices[:4]).reshape(shape), axes)
    put = lambda x, dtype: jnp.asarray(x, dtype)  # noqa: E731
    hidden, weight, bias, labels = make_inputs(put, 24, 8, 40, seed=21)
    rng = np.random.default_rng(21)
    tw = rng.uniform(-1.0, 2.0, labels.shape)
    per_token = reduction == "none"
    g_loss = rng.uniform(0.5, 2.0, labels.shape) if per_token else 1.3
    g_entropy = rng.uniform(-1.0, 1.0, labels.shape) if per_token else -0.4
    h = jax.device_put(hidden, NamedSharding(mesh, h_spec))
    w = jax.device_put(weight, NamedSharding(mesh, w_spec))
    b = jax.device_put(bias, NamedSharding(mesh, P(w_spec[0])))
    rows = NamedSharding(mesh, P(h_spec[0]))
    y = jax.device_put(jnp.asarray(labels, jnp.int32), rows)
    weights = jax.device_put(jnp.asarray(tw, jnp.float32), rows)
    opts = dict(temperature=0.7, label_smoothing=0.1, logit_softcapping=6.0)

    def objective(h, w, b):
        out = linear_cross_entropy(
            h, w, y, bias=b, reduction=reduction, backend="kernel", chunk_rows=5, token_weights=weights,
            return_entropy=True, **opts,
        )  # fmt: skip
        return jnp.sum(out.loss * g_loss) + jnp.sum(out.entropy * g_entropy), out

    (_, out), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True))(h, w, b)
    want = expected(
        hidden, weight, labels, bias=bias, reduction=reduction, token_weights=tw, g_loss=g_loss, g_entropy=g_entropy,
        **opts,
    )  # fmt: skip
    compare(out, grads, want, entropy=True)
    for got, like in zip(grads, (h, w, b)):
        assert got.sharding.is_equivalent_to(like.sharding, got.ndim), (got.sharding, like.sharding)


@pytest.mark.parametrize("layout", ["vocab", "2d"])
def test_sharded_head_float32_logits(layout):
    """bf16 operands with logits_dtype="float32" on a vocabulary-sharded head: the loss to float32 accuracy of the
    float64 one, the gradients in bf16."""
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices (test_sharding.py's test_sharded_suite_on_4_cpu_devices runs it)")
    shape, axes, h_spec, w_spec = SHARDED_LAYOUTS[layout]
    mesh = Mesh(np.array(devices[:4]).reshape(shape), axes)
    put = lambda x, dtype: jnp.asarray(x, dtype)  # noqa: E731
    hidden, weight, _, labels = make_inputs(put, 24, 16, 40, seed=23, dtype=jnp.bfloat16)
    h = jax.device_put(hidden, NamedSharding(mesh, h_spec))
    w = jax.device_put(weight, NamedSharding(mesh, w_spec))
    y = jax.device_put(jnp.asarray(labels, jnp.int32), NamedSharding(mesh, P(h_spec[0])))

    def objective(h, w):
        return linear_cross_entropy(h, w, y, backend="kernel", chunk_rows=5, temperature=0.7, logits_dtype="float32")

    loss, grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))(h, w)
    want = expected(hidden, weight, labels, temperature=0.7)
    assert_close(loss, want[0], what="loss", rtol=2e-5, atol=2e-5)
    for got, ref in zip(grads, want[2:4]):
        assert got.dtype == jnp.bfloat16
        assert_close(got, ref, what="grad", **grad_tol(ref, 5e-2))
