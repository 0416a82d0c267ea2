"""Argument checks, validate_labels, the scoped Triton-deprecation filter, and eager calls reusing their trace."""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastce_jax
from fastce_jax import cross_entropy
from fastce_jax.core.launch import TRITON_DEPRECATION, quiet_triton
from fastce_jax.distributed import partitioning


def test_signature_is_the_contract():
    params = inspect.signature(cross_entropy).parameters
    expected = dict(
        ignore_index=-100,
        reduction="mean",
        n_items=None,
        logit_softcapping=0.0,
        logit_scaling=0.0,
        label_smoothing=0.0,
        z_loss=0.0,
        backend="auto",
        inplace_backward=True,
        validate_labels=False,
        shift=0,
        return_z_loss=False,
        return_lse=False,
        return_accuracy=False,
        return_entropy=False,
        weight=None,
        temperature=1.0,
        token_weights=None,
        where=None,
    )
    assert list(params)[:2] == ["logits", "labels"]
    assert {k: p.default for k, p in params.items() if k not in ("logits", "labels")} == expected
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in expected)
    assert fastce_jax.cross_entropy is cross_entropy


X = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
Y = np.array([1, 2, -100, 9], np.int32)

BAD = [
    (dict(logits=X.astype(np.int32)), TypeError, "logits"),
    (dict(logits=X.astype(jnp.float8_e4m3fn)), TypeError, "logits"),  # float64 is accepted (test_transforms.py)
    (dict(labels=Y.astype(np.float32)), TypeError, "labels"),
    (dict(labels=Y.astype(np.uint32)), TypeError, "labels"),
    (dict(labels=Y[:3]), ValueError, "labels"),
    (dict(logits=np.float32(1.0)), ValueError, "logits"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(backend="triton"), ValueError, "backend"),
    (dict(logit_softcapping=-1.0), ValueError, "logit_softcapping"),
    (dict(logit_softcapping=jnp.float32(3.0)), TypeError, "logit_softcapping"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(z_loss=float("nan")), ValueError, "z_loss"),
    (dict(logit_scaling="2"), TypeError, "logit_scaling"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(n_items=0), ValueError, "n_items"),
    (dict(n_items=-3), ValueError, "n_items"),
    (dict(n_items=np.ones(2)), ValueError, "n_items"),
    (dict(n_items="7"), TypeError, "n_items"),
    (dict(inplace_backward=None), TypeError, "inplace_backward"),
    (dict(validate_labels=1), TypeError, "validate_labels"),
]


@pytest.mark.parametrize("change,error,name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_raise_naming_the_argument(change, error, name):
    kwargs = dict(logits=X, labels=Y)
    kwargs.update(change)
    logits, labels = kwargs.pop("logits"), kwargs.pop("labels")
    with pytest.raises(error, match=name):
        cross_entropy(logits, labels, **kwargs)
    # Also at trace time, under jit, before any kernel runs.
    if logits.ndim != 2:
        return
    with pytest.raises(error, match=name):
        jax.jit(lambda a, b: cross_entropy(a, b, **kwargs)).trace(logits, labels)


def test_validate_labels():
    y = np.array([[1, 2], [-100, 10]], np.int32)
    x = np.zeros((2, 2, 10), np.float32) + 0.5
    with pytest.raises(ValueError, match=r"labels\[1, 1\] = 10"):
        cross_entropy(x, y, validate_labels=True)
    y[1, 1] = 9
    loss = cross_entropy(x, y, validate_labels=True, backend="kernel")
    assert np.isfinite(float(loss))
    # Traced labels cannot be checked: a clear error, not a silent skip.
    with pytest.raises(ValueError, match="traced"):
        jax.jit(lambda a, b: cross_entropy(a, b, validate_labels=True))(x, y)
    # Only logits are traced under grad: labels still get checked.
    y[0, 0] = -5
    with pytest.raises(ValueError, match=r"labels\[0, 0\] = -5"):
        jax.grad(lambda a: cross_entropy(a, y, validate_labels=True))(x)


def test_empty_batch():
    x = jnp.zeros((0, 10), jnp.bfloat16)
    y = jnp.zeros((0,), jnp.int32)
    assert float(cross_entropy(x, y, backend="kernel")) == 0.0
    assert cross_entropy(x, y, reduction="none", backend="kernel").shape == (0,)
    g = jax.grad(lambda a: cross_entropy(a, y, backend="kernel"))(x)
    assert g.shape == (0, 10) and g.dtype == jnp.bfloat16


MESSAGE = "The Pallas Triton backend is deprecated and will be removed in a future JAX version."


def test_triton_deprecation_filter_is_scoped():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_triton(interpret=True):
            warnings.warn(MESSAGE, DeprecationWarning, stacklevel=1)
            warnings.warn("some other deprecation", DeprecationWarning, stacklevel=1)
        warnings.warn(MESSAGE, DeprecationWarning, stacklevel=1)
    texts = [str(w.message) for w in caught]
    assert texts == ["some other deprecation", MESSAGE]


def test_no_warnings_from_kernels_on_cpu(use_gpu):
    # Interpret mode (a process without GPUs) lowers nothing to Triton, so nothing warns, even with every warning
    # an error. In a GPU process backend="kernel" under a transform runs the compiled kernels (CONTRACT.md), which
    # lower to Triton: that case is test_process_filter_survives_a_users_catch_warnings_block's.
    if use_gpu:
        pytest.skip("a GPU process: the compiled kernels lower to Triton")
    x = jnp.asarray(X, jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.value_and_grad(lambda a: cross_entropy(a, Y, backend="kernel"))(x)


def test_process_filter_survives_a_users_catch_warnings_block():
    """A compiled launch installs the process filter; a user's catch_warnings block open at that moment drops it on
    exit, and the next compiled launch installs it again (jit lowers the kernels after fastce_jax's frames return,
    where only a process filter reaches)."""

    def installed():
        return [f for f in warnings.filters if getattr(f[1], "pattern", None) == TRITON_DEPRECATION]

    with warnings.catch_warnings():
        with quiet_triton(interpret=False):
            pass
        assert len(installed()) == 1
    with quiet_triton(interpret=False):
        pass
    with quiet_triton(interpret=False):
        pass
    assert len(installed()) == 1


@pytest.fixture
def traced(monkeypatch):
    """One entry per trace of the kernels' launcher (partitioning.forward runs only while a call is traced)."""
    calls = []
    launch = partitioning.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(partitioning, "forward", counting)
    return calls


def test_eager_calls_reuse_their_trace(traced):
    """A second eager call with the same shapes and options neither traces nor lowers the kernels again (each
    retrace re-lowers the Pallas kernels: hundreds of milliseconds per eager call)."""
    rng = np.random.default_rng(23)
    # A shape and options no other test uses, so the first call traces here.
    x = jnp.asarray(rng.standard_normal((5, 29)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 29, 5), jnp.int32)
    options = dict(backend="kernel", z_loss=3.25e-3, n_items=4)
    first = cross_entropy(x, y, **options)
    assert len(traced) == 1
    second = cross_entropy(x + 1.0, y, **options)
    assert len(traced) == 1, "the second eager call traced the kernels again"
    np.testing.assert_allclose(float(second), float(cross_entropy(x + 1.0, y, **dict(options, backend="reference"))))
    assert float(first) != float(second)
    cross_entropy(x, y, **dict(options, z_loss=1e-3))  # other options: a trace of their own
    assert len(traced) == 2


def test_eager_linear_calls_reuse_their_trace(traced):
    rng = np.random.default_rng(24)
    h = jnp.asarray(rng.standard_normal((7, 6)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((31, 6)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 31, 7), jnp.int32)
    options = dict(backend="kernel", label_smoothing=0.125, chunk_rows=4)
    fastce_jax.linear_cross_entropy(h, w, y, **options)
    count = len(traced)
    assert count >= 1
    fastce_jax.linear_cross_entropy(h * 2.0, w, y, **options)
    assert len(traced) == count
