"""optax's own tests of `softmax_cross_entropy_with_integer_labels` (SoftmaxCrossEntropyWithIntegerLabelsTest), run
in full against fastce_jax: the function they call is replaced by an adapter onto
`fastce_jax.cross_entropy(..., reduction="none")`.

The optax wheel ships its test modules (optax/losses/_classification_test.py), so the test class is imported from
the installed optax and nothing of it is copied here; an optax without that module skips with the reason. The
adapter maps optax's signature (logits, labels, axis=-1, where=None) onto the contract: any `axis` (an int or a
tuple of axes, flattened into one class axis as optax does) is a transpose and reshape to classes-last; a per-row
`where` (shape of labels) is ignore_index on the masked rows (loss 0, gradient 0, as optax gives them). A per-logit
`where` (shape of logits: classes left out of the softmax) is -inf on the masked logits (the contract gives them
zero probability and zero gradient), with the rows that keep no logit at all ignored (loss 0).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastce_jax

_classification_test = pytest.importorskip(
    "optax.losses._classification_test",
    reason="this optax does not ship its test modules (optax/losses/_classification_test.py)",
)
_classification = _classification_test._classification
_IGNORED = -1  # never a class: optax's labels are in [0, num_classes)


def _classes_last(logits, axis):
    """(logits with the class axes moved last and flattened into one, the batch axes in order) as optax does it."""
    ndim = logits.ndim
    if isinstance(axis, int):
        return jnp.moveaxis(logits, axis, -1)
    if isinstance(axis, tuple):
        class_axes = tuple(a % ndim for a in axis)
        batch_axes = tuple(a for a in range(ndim) if a not in class_axes)
        moved = jnp.transpose(logits, batch_axes + class_axes)
        return moved.reshape(moved.shape[: len(batch_axes)] + (-1,))
    raise TypeError(f"axis must be an int or a tuple of ints, got {type(axis).__name__}")


def adapter(backend):
    def softmax_cross_entropy_with_integer_labels(logits, labels, axis=-1, where=None):
        logits, labels = jnp.asarray(logits), jnp.asarray(labels)
        classes_last = _classes_last(logits, axis)
        if where is not None:
            where = jnp.asarray(where, bool)
            if where.shape == logits.shape:  # per logit: the masked classes leave the softmax
                kept = _classes_last(where, axis)
                classes_last = jnp.where(kept, classes_last, -jnp.inf)
                where = jnp.any(kept, axis=-1)
            elif where.shape != labels.shape:
                raise ValueError(f"where must have the labels' or the logits' shape, got {where.shape}")
            labels = jnp.where(where, labels, _IGNORED)
        return fastce_jax.cross_entropy(classes_last, labels, reduction="none", ignore_index=_IGNORED, backend=backend)

    return softmax_cross_entropy_with_integer_labels


FORWARD_MODE = "the kernels have no forward mode (CONTRACT.md); optax's test_gradient checks forward and reverse"


class _Adapted(_classification_test.SoftmaxCrossEntropyWithIntegerLabelsTest):
    __test__ = False  # the subclasses below run it, one per backend
    backend = "auto"

    def setUp(self):
        super().setUp()
        original = _classification.softmax_cross_entropy_with_integer_labels
        _classification.softmax_cross_entropy_with_integer_labels = adapter(self.backend)
        self.addCleanup(setattr, _classification, "softmax_cross_entropy_with_integer_labels", original)

    def test_the_adapter_is_what_runs(self):
        assert _classification.softmax_cross_entropy_with_integer_labels.__module__ == __name__
        loss = _classification.softmax_cross_entropy_with_integer_labels(self.ys, self.ts)
        np.testing.assert_allclose(loss, fastce_jax.cross_entropy(self.ys, self.ts, reduction="none"), rtol=0)

    def test_gradient_reverse_mode(self):
        """optax's test_gradient in reverse mode only (the kernels' one derivative)."""
        f = _classification.softmax_cross_entropy_with_integer_labels
        jax.test_util.check_grads(lambda x: f(x, self.ts), (self.ys,), order=1, modes=["rev"])
        loss_fn = lambda *args, **kw: jnp.sum(f(*args, **kw))  # noqa: E731
        gs = jax.grad(loss_fn)(self.ys, labels=self.ts, where=self.mask)
        assert jnp.all(jnp.isfinite(gs)) and jnp.all(gs[1] == 0.0)


class TestOptaxIntegerLabelsAuto(_Adapted):
    """backend="auto": what an optax user gets (the jnp reference on CPU arrays, the compiled kernels on a GPU)."""

    __test__ = True

    # A string: evaluated when the test runs, so collection does not start JAX's GPU backend.
    @pytest.mark.xfail("jax.default_backend() == 'gpu'", raises=TypeError, strict=True, reason=FORWARD_MODE)
    def test_gradient(self):
        super().test_gradient()


class TestOptaxIntegerLabelsKernel(_Adapted):
    """backend="kernel": the Pallas kernels (interpret mode on the CPU)."""

    __test__ = True
    backend = "kernel"

    @pytest.mark.xfail(raises=TypeError, strict=True, reason=FORWARD_MODE)
    def test_gradient(self):
        super().test_gradient()
