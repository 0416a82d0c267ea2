"""The RL keywords of fastce_jax (issue 37): temperature, token_weights, a differentiable entropy output and
log_probs, against the float64 reference (shared_tests/reference.py plus tests/rl_checks.py's entropy gradient)
and the package's jnp reference backend; the bad-input errors, each naming its argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import LogProbOutput, cross_entropy, log_probs
from fastce_jax.core import token_inputs
from fastce_jax.core.options import Options, check_options

from .checks import assert_grad, assert_loss
from .rl_checks import expected_rl

# ----------------------------------------------------------------------------------------------------------------
# Option checks.
# ----------------------------------------------------------------------------------------------------------------


def options(**kw):
    base = dict(
        ignore_index=-100, reduction="mean", logit_softcapping=0.0, logit_scaling=0.0, label_smoothing=0.0,
        z_loss=0.0, backend="auto",
    )  # fmt: skip
    return check_options(**dict(base, **kw))


def test_temperature_one_leaves_the_options():
    assert options(temperature=1.0) == options() == Options()
    assert options(temperature=1, logit_softcapping=30.0) == Options(logit_softcapping=30.0)


def test_temperature_folds_into_scaling_and_softcap():
    assert options(temperature=0.5) == Options(logit_scaling=2.0)
    folded = options(temperature=0.7, logit_scaling=1.3, logit_softcapping=30.0)
    assert folded.logit_scaling == 1.3 / 0.7 and folded.logit_softcapping == 30.0 / 0.7
    # The algebra: softcap_c(s x) / T == softcap_{c/T}((s/T) x).
    x = np.linspace(-40.0, 40.0, 101)
    direct = 30.0 * np.tanh(1.3 * x / 30.0) / 0.7
    np.testing.assert_allclose(
        folded.logit_softcapping * np.tanh(folded.logit_scaling * x / folded.logit_softcapping), direct, rtol=1e-14
    )


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_bad_temperature_values(bad):
    with pytest.raises(ValueError, match="temperature"):
        options(temperature=bad)


@pytest.mark.parametrize("bad", [True, False, "0.7", None, np.bool_(True), jnp.float32(0.7)])
def test_bad_temperature_types(bad):
    with pytest.raises(TypeError, match="temperature"):
        options(temperature=bad)


def test_token_weights_checks():
    assert token_inputs.check_token_weights(None, (2, 3)) is None
    w = token_inputs.check_token_weights(np.ones((2, 3), np.float16), (2, 3))
    assert w.dtype == jnp.float32 and w.shape == (2, 3)
    with pytest.raises(ValueError, match="token_weights"):
        token_inputs.check_token_weights(np.ones((3, 2), np.float32), (2, 3))
    with pytest.raises(ValueError, match="token_weights"):
        token_inputs.check_token_weights(np.ones((6,), np.float32), (2, 3))
    with pytest.raises(TypeError, match="token_weights"):
        token_inputs.check_token_weights(np.ones((2, 3), np.int32), (2, 3))
    with pytest.raises(TypeError, match="token_weights"):
        token_inputs.check_token_weights(np.ones((2, 3), bool), (2, 3))


def test_token_weights_refuse_a_gradient():
    def f(w):
        return jnp.sum(token_inputs.check_token_weights(w, (2, 3)))

    with pytest.raises(ValueError, match="token_weights"):
        jax.grad(f)(jnp.ones((2, 3)))
    assert float(f(jnp.ones((2, 3)))) == 6.0


def test_shifted_token_weights():
    w = jnp.arange(8.0).reshape(2, 4)
    np.testing.assert_array_equal(token_inputs.shifted_token_weights(w, 1), [[1, 2, 3, 0], [5, 6, 7, 0]])
    np.testing.assert_array_equal(token_inputs.shifted_token_weights(w, 9), np.zeros((2, 4)))
    assert token_inputs.shifted_token_weights(w, 0) is w


# ----------------------------------------------------------------------------------------------------------------
# cross_entropy with temperature, token_weights and a differentiated entropy, against float64.
# ----------------------------------------------------------------------------------------------------------------

CASES = {
    "temperature": dict(temperature=0.7),
    "softcap_scaling_temperature": dict(temperature=0.7, logit_softcapping=7.0, logit_scaling=1.3),
    "all": dict(temperature=1.5, label_smoothing=0.1, z_loss=1e-3, logit_softcapping=7.0, logit_scaling=1.3),
    "ignore5": dict(temperature=0.5, ignore_index=5),
}


def make(n=8, v=160, dtype=jnp.float32, seed=0, ignore_index=-100):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, v)) * 2.0, dtype)
    y = rng.integers(0, v, n).astype(np.int32)
    y[[1, 4]] = ignore_index
    x = x.at[2, :5].set(-jnp.inf)  # -inf padding: a finite loss, entropy and gradient
    tw = rng.uniform(-1.0, 2.0, n).astype(np.float32)  # advantages: some negative
    return x, y, tw


def run(x, y, reduction, backend, upstream, entropy_upstream, **kw):
    """(loss, entropy, d/dx of <upstream, loss> + <entropy_upstream, entropy>) of cross_entropy."""

    def f(logits):
        out = cross_entropy(logits, jnp.asarray(y), reduction=reduction, backend=backend, return_entropy=True, **kw)
        return jnp.sum(out.loss * upstream) + jnp.sum(out.entropy * entropy_upstream), out

    (_, out), grad = jax.value_and_grad(f, has_aux=True)(x)
    return out.loss, out.entropy, grad


def check_rl(x, y, reduction, backend, tw=None, n_items=None, **opts):
    n = len(y)
    rng = np.random.default_rng(n)
    upstream = rng.uniform(0.5, 1.5, n).astype(np.float32) if reduction == "none" else np.float32(1.0)
    entropy_upstream = rng.uniform(-1.0, 1.0, n).astype(np.float32) if reduction == "none" else np.float32(-0.3)
    kw = dict(opts, token_weights=None if tw is None else jnp.asarray(tw), n_items=n_items)
    loss, entropy, grad = run(x, y, reduction, backend, upstream, entropy_upstream, **kw)
    assert loss.dtype == entropy.dtype == jnp.float32 and grad.dtype == x.dtype
    exp = expected_rl(
        x, y, reduction, upstream=upstream, n_items=n_items, token_weights=tw, entropy_upstream=entropy_upstream,
        **opts,
    )  # fmt: skip
    assert_loss(loss, exp.loss)
    assert_loss(entropy, exp.entropy, "entropy")
    assert_grad(grad, exp.loss)
    return loss, entropy, grad


# The kernels with temperature alone, or with soft-capping and scaling, and every reduction: shared_tests'
# test_token_weights.py and test_entropy_grad.py (both packages); here every option with token weights and the
# entropy's gradient in one call, and the jnp reference backend over every case.
BACKEND_CASES = [(case, "reference") for case in CASES] + [("all", "kernel"), ("ignore5", "kernel")]


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("case, backend", BACKEND_CASES)
def test_temperature_token_weights_entropy(case, reduction, backend):
    opts = CASES[case]
    x, y, tw = make(seed=len(case), ignore_index=opts.get("ignore_index", -100))
    if case == "ignore5":
        y[0] = 5  # ignore_index inside the vocabulary
    check_rl(x, y, reduction, backend, tw, **opts)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_n_items_token_weights(reduction):
    x, y, tw = make(seed=3)
    check_rl(x, y, reduction, "kernel", tw, n_items=13, temperature=0.9)


def test_bf16_inputs():
    x, y, tw = make(seed=4, dtype=jnp.bfloat16)
    check_rl(x, y, "none", "kernel", tw, temperature=0.7, logit_softcapping=10.0)
    check_rl(x, y, "mean", "kernel", tw, temperature=0.7)


def test_no_temperature_is_todays_call():
    x, y, tw = make(seed=5)
    base = cross_entropy(x, y, backend="kernel", reduction="none", logit_scaling=0.5)
    np.testing.assert_array_equal(
        cross_entropy(x, y, backend="kernel", reduction="none", logit_scaling=0.5, temperature=1.0), base
    )
    # temperature T == logit_scaling 1/T exactly when 1/T is what the fold computes
    np.testing.assert_array_equal(
        cross_entropy(x, y, backend="kernel", reduction="none", temperature=2.0),
        cross_entropy(x, y, backend="kernel", reduction="none", logit_scaling=0.5),
    )


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_class_weights_and_token_weights(smoothing):
    x, y, tw = make(seed=6)
    w = np.random.default_rng(6).uniform(0.2, 2.0, x.shape[1]).astype(np.float32)
    opts = dict(label_smoothing=smoothing, temperature=0.8, z_loss=1e-3)
    for reduction in ("none", "mean"):
        n = len(y)
        upstream = np.ones(n, np.float32) if reduction == "none" else np.float32(1.0)
        g_h = np.full(n, 0.5, np.float32) if reduction == "none" else np.float32(0.5)
        loss, entropy, grad = run(x, y, reduction, "kernel", upstream, g_h, token_weights=tw, weight=w, **opts)
        exp = expected_rl(
            x, y, reduction, upstream=upstream, token_weights=tw, entropy_upstream=g_h, weight=w, **opts
        )  # fmt: skip
        assert_loss(loss, exp.loss)
        assert_loss(entropy, exp.entropy, "entropy")
        assert_grad(grad, exp.loss)


def test_shift_aligns_token_weights_with_labels():
    x, y, tw = make(n=8, seed=7)
    x3, y2, tw2 = x.reshape(2, 4, -1), y.reshape(2, 4), tw.reshape(2, 4)
    for reduction in ("none", "mean"):

        def shifted(logits):
            out = cross_entropy(
                logits, y2, shift=1, token_weights=tw2, reduction=reduction, backend="kernel", return_entropy=True,
                temperature=0.6,
            )  # fmt: skip
            return jnp.sum(out.loss) + 0.5 * jnp.sum(out.entropy)

        def sliced(logits):
            out = cross_entropy(
                logits[:, :-1], y2[:, 1:], token_weights=tw2[:, 1:], reduction=reduction, backend="reference",
                return_entropy=True, temperature=0.6,
            )  # fmt: skip
            return jnp.sum(out.loss) + 0.5 * jnp.sum(out.entropy)

        a, ga = jax.value_and_grad(shifted)(x3)
        b, gb = jax.value_and_grad(sliced)(x3)
        np.testing.assert_allclose(a, b, rtol=1e-5)
        # The entropy's term p_j (mz - z_j) cancels where z_j is near mz: float32 rounding there is absolute, on the
        # scale of the row's largest gradient (compiled kernels and XLA round it differently).
        np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(gb))))
        assert float(jnp.max(jnp.abs(ga[:, -1]))) == 0.0


def test_z_loss_output_is_weighted_like_the_loss():
    x, y, tw = make(seed=8)
    for backend in ("kernel", "reference"):
        out = cross_entropy(
            x, y, z_loss=1e-2, token_weights=tw, reduction="none", backend=backend, return_z_loss=True,
            return_lse=True, return_entropy=True, return_accuracy=True,
        )  # fmt: skip
        plain = cross_entropy(
            x, y, z_loss=1e-2, reduction="none", backend=backend, return_z_loss=True, return_lse=True,
            return_entropy=True, return_accuracy=True,
        )  # fmt: skip
        kept = y != -100
        np.testing.assert_allclose(out.z_loss, np.where(kept, plain.z_loss * tw, 0.0), rtol=1e-6)
        np.testing.assert_allclose(out.loss, np.where(kept, plain.loss * tw, 0.0), rtol=1e-6)
        for name in ("lse", "entropy", "accuracy"):  # not weighted
            np.testing.assert_array_equal(getattr(out, name), getattr(plain, name))

        def f(logits):
            o = cross_entropy(logits, y, z_loss=1e-2, token_weights=tw, backend=backend, return_z_loss=True)
            return o.loss + 3.0 * o.z_loss

        def g(logits):
            o = cross_entropy(logits, y, z_loss=1e-2, backend="reference", return_z_loss=True, reduction="none")
            count = np.sum(kept)
            return jnp.sum(jnp.where(kept, (o.loss + 3.0 * o.z_loss) * tw, 0.0)) / count

        np.testing.assert_allclose(jax.grad(f)(x), jax.grad(g)(x), rtol=2e-5, atol=1e-7)


def test_nan_token_weight():
    x, y, tw = make(seed=9)
    tw[0] = np.nan
    tw[1] = np.nan  # an ignored token: loss 0 whatever its weight
    for backend in ("kernel", "reference"):
        loss = cross_entropy(x, y, token_weights=tw, reduction="none", backend=backend)
        assert np.isnan(loss[0]) and float(loss[1]) == 0.0 and np.isfinite(np.asarray(loss[2:])).all()
        assert np.isnan(cross_entropy(x, y, token_weights=tw, backend=backend))
        grad = jax.grad(lambda a: cross_entropy(a, y, token_weights=tw, reduction="sum", backend=backend))(x)
        assert np.isnan(grad[0]).all() and (np.asarray(grad[1]) == 0.0).all() and np.isfinite(grad[2:]).all()


def test_entropy_gradient_alone_and_not_differentiated():
    x, y, _ = make(seed=10)

    def entropy(backend):
        return lambda a: cross_entropy(a, y, backend=backend, return_entropy=True, temperature=0.8).entropy

    g = jax.grad(entropy("kernel"))(x)
    exp = expected_rl(x, y, "mean", upstream=0.0, entropy_upstream=1.0, temperature=0.8)
    assert_grad(g, exp.loss)
    g_reference = jax.grad(entropy("reference"))(x)  # atol: the cancellation in p_j (mz - z_j), as above
    np.testing.assert_allclose(g, g_reference, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(g_reference))))

    def loss_only(a):
        return cross_entropy(a, y, backend="kernel", return_entropy=True).loss

    def both(a):
        out = cross_entropy(a, y, backend="kernel", return_entropy=True)
        return out.loss + out.entropy

    # A returned but not differentiated entropy runs the default backward kernel (4 operands); differentiated,
    # the entropy variant (2 more per-row operands).
    assert backward_operands(jax.make_jaxpr(jax.grad(loss_only))(x)) == [4]
    assert backward_operands(jax.make_jaxpr(jax.jit(jax.grad(loss_only)))(x)) == [4]
    assert backward_operands(jax.make_jaxpr(jax.grad(both))(x)) == [6]
    assert backward_operands(jax.make_jaxpr(loss_only)(x)) == []


def backward_operands(closed):
    """The operand count of every backward pallas_call in a jaxpr (nested jaxprs included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            name = eqn.params.get("name", eqn.params.get("name_and_src_info"))  # the key differs by jax release
            if eqn.primitive.name == "pallas_call" and "fastce_backward" in str(name):
                found.append(len(eqn.invars))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else [value]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return found


def test_jit_vmap_and_second_order():
    x, y, tw = make(seed=11)
    xb, yb, twb = x.reshape(2, 4, -1), y.reshape(2, 4), tw.reshape(2, 4)

    def objective(backend):
        def f(a, labels, w):
            out = cross_entropy(
                a, labels, backend=backend, return_entropy=True, token_weights=w, temperature=0.7, reduction="sum"
            )
            return out.loss - 0.01 * out.entropy

        return f

    grad_kernel = jax.jit(jax.vmap(jax.grad(objective("kernel"))))(xb, yb, twb)
    grad_ref = jax.vmap(jax.grad(objective("reference")))(xb, yb, twb)
    np.testing.assert_allclose(grad_kernel, grad_ref, rtol=1e-5, atol=1e-7)
    # Through the kernels' jvp rules (grad of grad): the reference's second derivative, entropy included.
    v = jnp.asarray(np.random.default_rng(0).standard_normal(x.shape), jnp.float32)

    def hvp(backend):
        f = objective(backend)
        return jax.jvp(jax.grad(lambda a: f(a, y, tw)), (x,), (v,))[1]

    np.testing.assert_allclose(hvp("kernel"), hvp("reference"), rtol=1e-4, atol=1e-6)


def test_float64_logits():
    """float64 logits are computed in float64 by the reference (any backend): temperature, token weights and the
    entropy's gradient within RTOL64 of the float64 expectation."""
    x, y, tw = make(seed=18)
    with jax.enable_x64(True):
        x64 = jnp.asarray(np.asarray(x, np.float64))  # float32 values: the float64 expectation reads them exactly
        loss, entropy, grad = run(
            x64, y, "mean", "kernel", np.float64(1.0), np.float64(-0.2), temperature=0.7, logit_softcapping=6.0,
            token_weights=jnp.asarray(tw),
        )  # fmt: skip
        assert loss.dtype == entropy.dtype == grad.dtype == jnp.float64
        exp = expected_rl(
            x64, y, "mean", token_weights=tw, entropy_upstream=-0.2, temperature=0.7, logit_softcapping=6.0
        )
        np.testing.assert_allclose(loss, exp.loss.loss, rtol=1e-12)
        np.testing.assert_allclose(entropy, exp.entropy.loss, rtol=1e-12)
        np.testing.assert_allclose(grad, exp.loss.grad, rtol=1e-10, atol=1e-14)


def test_token_weights_errors():
    x, y, tw = make(seed=12)
    with pytest.raises(ValueError, match="token_weights"):
        cross_entropy(x, y, token_weights=tw[:-1])
    with pytest.raises(TypeError, match="token_weights"):
        cross_entropy(x, y, token_weights=np.ones(len(y), np.int32))
    with pytest.raises(ValueError, match="token_weights"):
        jax.grad(lambda w: cross_entropy(x, y, token_weights=w, backend="kernel"))(jnp.asarray(tw))
    with pytest.raises(ValueError, match="token_weights"):
        jax.grad(lambda w: cross_entropy(x, y, token_weights=w, backend="reference"))(jnp.asarray(tw))
    with pytest.raises(ValueError, match="temperature"):
        cross_entropy(x, y, temperature=0.0)
    with pytest.raises(TypeError, match="temperature"):
        cross_entropy(x, y, temperature=True)


# ----------------------------------------------------------------------------------------------------------------
# log_probs.
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_log_probs_values(backend):
    x, y, _ = make(seed=13)
    y[5] = x.shape[1] + 3  # out of range: NaN
    opts = dict(temperature=0.7, logit_softcapping=9.0)
    lp = log_probs(x, y, backend=backend, **opts)
    assert lp.dtype == jnp.float32 and lp.shape == y.shape
    exp = expected_rl(x, y, "none", **opts)
    assert_loss(-lp, exp.loss, "logprobs")
    assert not np.signbit(np.asarray(lp[1])) and float(lp[1]) == 0.0  # +0.0 where ignored
    assert np.isnan(lp[5])
    out = log_probs(x, y, backend=backend, return_entropy=True, **opts)
    assert isinstance(out, LogProbOutput)
    np.testing.assert_array_equal(out.logprobs, lp)
    assert_loss(out.entropy, exp.entropy, "entropy")
    assert float(out.entropy[1]) == 0.0


def test_log_probs_shift_and_leading_shape():
    x, y, _ = make(n=8, seed=14)
    x3, y2 = x.reshape(2, 4, -1), y.reshape(2, 4)
    out = log_probs(x3, y2, shift=1, return_entropy=True, backend="kernel", temperature=0.9)
    ref = log_probs(x3[:, :-1], y2[:, 1:], return_entropy=True, backend="reference", temperature=0.9)
    assert out.logprobs.shape == out.entropy.shape == (2, 3)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.entropy, ref.entropy, rtol=1e-6, atol=1e-6)


def grpo_objective(backend, old, advantages, mask):
    """A clipped importance-ratio objective with a KL-like penalty and an entropy bonus, through log_probs."""

    def f(logits, tokens):
        out = log_probs(logits, tokens, return_entropy=True, temperature=0.7, backend=backend)
        ratio = jnp.exp(out.logprobs - old)
        clipped = jnp.minimum(ratio * advantages, jnp.clip(ratio, 0.8, 1.2) * advantages)
        kl = jnp.exp(old - out.logprobs) - (old - out.logprobs) - 1.0
        per_token = -clipped + 0.04 * kl - 0.01 * out.entropy
        return jnp.sum(per_token * mask) / jnp.sum(mask)

    return f


def test_log_probs_gradient_through_an_objective():
    x, y, tw = make(seed=15)
    mask = (y != -100).astype(np.float32)
    old = np.asarray(log_probs(x, y, temperature=0.7, backend="reference")) + 0.05 * np.cos(np.arange(len(y)))
    old = jnp.asarray(np.where(mask > 0, old, 0.0), jnp.float32)
    value_k, grad_k = jax.jit(jax.value_and_grad(grpo_objective("kernel", old, tw, mask)))(x, y)
    value_r, grad_r = jax.value_and_grad(grpo_objective("reference", old, tw, mask))(x, y)
    np.testing.assert_allclose(value_k, value_r, rtol=1e-5)
    np.testing.assert_allclose(grad_k, grad_r, rtol=1e-4, atol=1e-7)
    # under vmap too: each batch element its own objective
    xb, yb, batch = x.reshape(2, 4, -1), y.reshape(2, 4), (old.reshape(2, 4), tw.reshape(2, 4), mask.reshape(2, 4))

    def vmapped(backend):
        return jax.vmap(jax.grad(lambda a, t, o, w, m: grpo_objective(backend, o, w, m)(a, t)))(xb, yb, *batch)

    np.testing.assert_allclose(vmapped("kernel"), vmapped("reference"), rtol=1e-4, atol=1e-7)


def test_log_probs_plain_call_keeps_no_residuals():
    """Not differentiated, log_probs traces the custom_vjp's primal function only: no backward, no residual
    outputs (the jitted call's only outputs are the log-probs and entropy)."""
    x, y, _ = make(seed=16)

    def plain(a):
        return log_probs(a, y, return_entropy=True, backend="kernel")

    closed = jax.make_jaxpr(plain)(x)
    assert backward_operands(closed) == []
    assert [v.aval.shape for v in closed.jaxpr.outvars] == [y.shape, y.shape]
    text = str(closed)
    assert "custom_vjp_call" in text and "fastce_backward" not in text
    # the jit the kernels run under returns the per-token outputs only (no logits-sized residual)
    for eqn in closed.jaxpr.eqns:
        for sub in eqn.params.values():
            if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "outvars"):
                assert all(v.aval.shape != x.shape for v in sub.jaxpr.outvars)


def test_log_probs_errors():
    x, y, _ = make(seed=17)
    for bad in (0.0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            log_probs(x, y, temperature=bad)
    with pytest.raises(TypeError, match="temperature"):
        log_probs(x, y, temperature=True)
    with pytest.raises(TypeError, match="return_entropy"):
        log_probs(x, y, return_entropy=1)
    with pytest.raises(ValueError, match="labels"):
        log_probs(x, y[:-1])
    with pytest.raises(ValueError):
        bad = y.copy()
        bad[0] = 10_000
        log_probs(x, bad, validate_labels=True)
