"""fastce_jax.softmax_cross_entropy_with_integer_labels (fastce_jax/integrations/optax_losses.py) against optax.

1. optax's own test class, SoftmaxCrossEntropyWithIntegerLabelsTest (optax/losses/_classification_test.py, which
   the optax wheel ships: imported from the installed optax, nothing of it copied here; an optax without that module
   skips with the reason), run in full with the function it calls replaced by fastce_jax's, once with
   backend="auto" (what a user gets: the jnp reference on CPU arrays, the compiled kernels on a GPU) and once with
   backend="kernel" (the Pallas kernels, interpret mode on the CPU). Its test_gradient checks forward and reverse
   mode; the kernels have no forward mode (a custom_vjp), so on the kernel path it is expected to raise JAX's
   TypeError (strict xfail: it fails if forward mode starts working) and its reverse-mode half runs on its own.
2. What optax's class does not reach, against optax's own function (the semantics copied) and the float64
   reference (the values): labels counted from the end and out of range, a per-class mask that leaves the label
   out, the float32 result of bf16 logits, gradients, bad arguments.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastce_jax
from shared_tests import reference, tolerances

_classification_test = pytest.importorskip(
    "optax.losses._classification_test",
    reason="this optax does not ship its test modules (optax/losses/_classification_test.py)",
)
_classification = _classification_test._classification
OPTAX = _classification.softmax_cross_entropy_with_integer_labels  # optax's own, before any replacement

FORWARD_MODE = (
    "fastce's kernels are a jax.custom_vjp, which has no forward mode (CONTRACT.md): optax's test_gradient checks "
    "jvp as well as vjp; the reverse half runs in test_gradient_reverse_mode"
)


class _Fastce(_classification_test.SoftmaxCrossEntropyWithIntegerLabelsTest):
    __test__ = False  # the subclasses below run it, one per backend
    backend = "auto"

    def setUp(self):
        super().setUp()
        ours = functools.partial(fastce_jax.softmax_cross_entropy_with_integer_labels, backend=self.backend)
        _classification.softmax_cross_entropy_with_integer_labels = ours
        self.addCleanup(setattr, _classification, "softmax_cross_entropy_with_integer_labels", OPTAX)

    def test_fastce_is_what_runs(self):
        f = _classification.softmax_cross_entropy_with_integer_labels
        assert f.func is fastce_jax.softmax_cross_entropy_with_integer_labels
        assert f.keywords == {"backend": self.backend}

    def test_gradient_reverse_mode(self):
        """optax's test_gradient in reverse mode only (the kernels' derivative)."""
        f = _classification.softmax_cross_entropy_with_integer_labels
        jax.test_util.check_grads(lambda x: f(x, self.ts), (self.ys,), order=1, modes=["rev"])
        loss_fn = lambda *args, **kw: jnp.sum(f(*args, **kw))  # noqa: E731
        gs = jax.grad(loss_fn)(self.ys, labels=self.ts, where=self.mask)
        assert jnp.all(jnp.isfinite(gs)) and jnp.all(gs[1] == 0.0)


class TestOptaxIntegerLabelsAuto(_Fastce):
    __test__ = True

    # A string: evaluated when the test runs, so collection does not start JAX's GPU backend.
    @pytest.mark.xfail("jax.default_backend() == 'gpu'", raises=TypeError, strict=True, reason=FORWARD_MODE)
    def test_gradient(self):
        super().test_gradient()


class TestOptaxIntegerLabelsKernel(_Fastce):
    __test__ = True
    backend = "kernel"

    @pytest.mark.xfail(raises=TypeError, strict=True, reason=FORWARD_MODE)
    def test_gradient(self):
        super().test_gradient()


# --- beyond optax's class ------------------------------------------------------------------------------------------
# One logits shape (12 rows, 11 classes) throughout: the kernels are traced and compiled once per shape and dtype.


def inputs(dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    logits = (2.0 * jax.random.normal(keys[0], (12, 11))).astype(dtype)
    return logits, jax.random.randint(keys[1], (12,), 0, 11)


def ours(*args, **kwargs):
    return fastce_jax.softmax_cross_entropy_with_integer_labels(*args, backend="kernel", **kwargs)


def assert_like_optax(got, want, rtol=2e-6):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=rtol, atol=rtol)


def test_labels_from_the_end_and_out_of_range_as_optax():
    """optax's gather wraps [-V, 0) and fills NaN beyond: the same here, and the values are the float64
    reference's."""
    logits, labels = inputs()
    labels = labels.at[:6].set(jnp.array([-1, -11, 10, 11, -12, jnp.iinfo(jnp.int32).min]))
    got = ours(logits, labels)
    assert_like_optax(got, OPTAX(logits, labels))
    wrapped = np.asarray(labels).copy()
    wrapped[:2] += 11  # in range from the end; 11, -12 and INT32_MIN stay out of range (NaN)
    ref = reference.expected(np.asarray(logits, np.float64), wrapped, "none")
    tolerances.assert_loss(np.asarray(got, np.float64), ref, "losses", dtype=got.dtype)


def test_per_class_where_leaving_the_label_out():
    """A per-class mask that drops some labels' own class: optax subtracts that logit from the kept classes'
    logsumexp; rows with no kept class give 0; the gradient is optax's too."""
    logits, labels = inputs(seed=1)
    where = jax.random.bernoulli(jax.random.PRNGKey(2), 0.5, logits.shape).at[:2].set(False)  # rows 0, 1: none
    where = where.at[2, labels[2]].set(False).at[2, 0].set(True).at[3, labels[3]].set(True)
    weights = jnp.linspace(0.5, 1.5, 12)
    values = {}
    for name, f in (("fastce", ours), ("optax", OPTAX)):
        values[name] = jax.value_and_grad(lambda x: jnp.sum(f(x, labels, where=where) * weights))(logits)
        values[name + " losses"] = f(logits, labels, where=where)
    assert_like_optax(values["fastce losses"], values["optax losses"])
    assert np.all(np.asarray(values["fastce losses"])[:2] == 0)
    np.testing.assert_allclose(values["fastce"][1], values["optax"][1], rtol=1e-5, atol=1e-6)


def test_bf16_logits_give_float32_losses_and_bf16_gradients():
    logits, labels = inputs(dtype=jnp.bfloat16, seed=3)
    where = jnp.arange(12) % 3 != 0
    got = ours(logits, labels, where=where)
    assert got.dtype == jnp.float32
    x = np.asarray(logits.astype(jnp.float32), np.float64)
    ref = reference.expected(x, np.where(where, labels, -100), "none")
    tolerances.assert_loss(np.asarray(got, np.float64), ref, "losses", dtype=got.dtype)
    grad = jax.grad(lambda x: jnp.sum(ours(x, labels, where=where)))(logits)
    assert grad.dtype == jnp.bfloat16 and np.all(np.asarray(grad)[~np.asarray(where)] == 0)
    assert np.all(np.any(np.asarray(grad)[np.asarray(where)] != 0, axis=-1))


@pytest.mark.parametrize(
    "kwargs,error,name",
    [
        (dict(axis=1.0), ValueError, "axis"),
        (dict(axis=2), ValueError, "axis"),
        (dict(axis=(1, 1)), ValueError, "axis"),
        (dict(where=jnp.ones(12, jnp.int32)), TypeError, "where"),
        (dict(where=jnp.ones(5, bool)), ValueError, "where"),
        (dict(labels=jnp.ones(12, jnp.float32)), TypeError, "labels"),
        (dict(labels=jnp.ones(5, jnp.int32)), ValueError, "labels"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, name):
    logits, labels = inputs()
    kwargs = {"labels": labels, **kwargs}
    with pytest.raises(error, match=name):
        ours(logits, **kwargs)
