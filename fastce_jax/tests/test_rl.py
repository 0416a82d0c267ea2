"""The RL keywords of fastce_jax (issue 37): temperature, token_weights, a differentiable entropy output and
log_probs, against the float64 reference (shared_tests/reference.py plus tests/rl_checks.py's entropy gradient)
and the package's jnp reference backend; the bad-input errors, each naming its argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import contract

# ----------------------------------------------------------------------------------------------------------------
# Option checks.
# ----------------------------------------------------------------------------------------------------------------


def options(**kw):
    base = dict(
        ignore_index=-100, reduction="mean", logit_softcapping=0.0, logit_scaling=0.0, label_smoothing=0.0,
        z_loss=0.0, backend="auto",
    )  # fmt: skip
    return contract.check_options(**dict(base, **kw))


def test_temperature_one_leaves_the_options():
    assert options(temperature=1.0) == options() == contract.Options()
    assert options(temperature=1, logit_softcapping=30.0) == contract.Options(logit_softcapping=30.0)


def test_temperature_folds_into_scaling_and_softcap():
    assert options(temperature=0.5) == contract.Options(logit_scaling=2.0)
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
    assert contract.check_token_weights(None, (2, 3)) is None
    w = contract.check_token_weights(np.ones((2, 3), np.float16), (2, 3))
    assert w.dtype == jnp.float32 and w.shape == (2, 3)
    with pytest.raises(ValueError, match="token_weights"):
        contract.check_token_weights(np.ones((3, 2), np.float32), (2, 3))
    with pytest.raises(ValueError, match="token_weights"):
        contract.check_token_weights(np.ones((6,), np.float32), (2, 3))
    with pytest.raises(TypeError, match="token_weights"):
        contract.check_token_weights(np.ones((2, 3), np.int32), (2, 3))
    with pytest.raises(TypeError, match="token_weights"):
        contract.check_token_weights(np.ones((2, 3), bool), (2, 3))


def test_token_weights_refuse_a_gradient():
    def f(w):
        return jnp.sum(contract.check_token_weights(w, (2, 3)))

    with pytest.raises(ValueError, match="token_weights"):
        jax.grad(f)(jnp.ones((2, 3)))
    assert float(f(jnp.ones((2, 3)))) == 6.0


def test_shifted_token_weights():
    w = jnp.arange(8.0).reshape(2, 4)
    np.testing.assert_array_equal(contract.shifted_token_weights(w, 1), [[1, 2, 3, 0], [5, 6, 7, 0]])
    np.testing.assert_array_equal(contract.shifted_token_weights(w, 9), np.zeros((2, 4)))
    assert contract.shifted_token_weights(w, 0) is w
