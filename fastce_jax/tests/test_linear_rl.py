"""fastce_jax.linear_cross_entropy's RL keywords (issue 37): temperature, logits_dtype and token_weights, against
a float64 NumPy reference (linear_rl_checks.py). CPU: the chunked path with the Pallas kernels in interpret mode,
tiny shapes, several chunks. The entropy's gradient, linear_log_probs and sharded heads: test_linear_rl_entropy.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import linear_cross_entropy
from fastce_jax.core.options import Options, fold_temperature
from shared_tests import reference as ref64

from .checks import as_float64
from .linear_rl_checks import compare, dot_generals, expected, run
from .test_linear_cross_entropy import LOSS_TOL, ROWS, assert_close, grad_tol, make_inputs


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """The chunk matmuls at float32 precision (a GPU may use TF32): the tolerances are for float32 products."""
    with jax.default_matmul_precision("float32"):
        yield


# ----------------------------------------------------------------------------
# temperature
# ----------------------------------------------------------------------------

OPTIONS = {"all": dict(label_smoothing=0.1, z_loss=1e-3, logit_softcapping=5.0, logit_scaling=1.3)}


# Temperature with the plain options: shared_tests' test_token_weights.py and test_entropy_grad.py linear cases
# (both packages); here with every option, each reduction, and the jnp reference backend.
@pytest.mark.parametrize("option_set", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_temperature(put, option_set, reduction):
    opts = OPTIONS[option_set]
    hidden, weight, bias, labels = make_inputs(put, 21, 16, 67, seed=1)
    g = np.random.default_rng(1).uniform(0.5, 2.0, labels.shape) if reduction == "none" else 1.7
    out, grads = run(put, hidden, weight, labels, bias=bias, reduction=reduction, g_loss=g, temperature=0.7, **opts)
    want = expected(hidden, weight, labels, bias=bias, reduction=reduction, temperature=0.7, g_loss=g, **opts)
    compare(out, grads, want)
    # The reference backend (plain jnp) folds it the same way.
    ref_loss = linear_cross_entropy(
        hidden, weight, put(labels, jnp.int32), bias=bias, reduction=reduction, backend="reference",
        temperature=0.7, **opts,
    )  # fmt: skip
    assert_close(ref_loss, want[0], what="reference backend", **LOSS_TOL)


def test_temperature_one_leaves_the_options():
    options = Options(logit_scaling=0.5, logit_softcapping=3.0)
    assert fold_temperature(options, 1.0) is options
    folded = fold_temperature(Options(), 2.0)
    assert folded.logit_scaling == 0.5 and folded.logit_softcapping == 0.0


@pytest.mark.parametrize(
    "value, error", [(True, TypeError), (0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                     (float("inf"), ValueError), ("1.0", TypeError)]
)  # fmt: skip
def test_bad_temperature(put, value, error):
    hidden, weight, _, labels = make_inputs(put, 4, 8, 10, seed=2)
    with pytest.raises(error, match="temperature"):
        linear_cross_entropy(hidden, weight, put(labels, jnp.int32), temperature=value, backend="kernel")


# ----------------------------------------------------------------------------
# logits_dtype
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_logits_dtype_float32(put, reduction):
    """bf16 operands, float32 logits: the loss is the float64 one of the bf16 inputs to float32 accuracy (the
    default bf16 logits are off by bf16's rounding), the GEMM takes bf16 operands with a float32 result, and the
    gradients keep the inputs' dtypes."""
    hidden, weight, bias, labels = make_inputs(put, 24, 32, 70, seed=3, dtype=jnp.bfloat16)
    g = np.random.default_rng(3).uniform(0.5, 2.0, labels.shape) if reduction == "none" else 1.0
    want = expected(hidden, weight, labels, bias=bias, reduction=reduction, temperature=0.7, g_loss=g)
    out, grads = run(
        put, hidden, weight, labels, bias=bias, reduction=reduction, g_loss=g, temperature=0.7, logits_dtype="float32"
    )
    assert_close(out, want[0], what="loss", rtol=2e-5, atol=2e-5)
    bf16_out, _ = run(put, hidden, weight, labels, bias=bias, reduction=reduction, g_loss=g, temperature=0.7)
    err32 = np.max(np.abs(np.asarray(out, np.float64) - want[0]))
    err16 = np.max(np.abs(np.asarray(bf16_out, np.float64) - want[0]))
    assert err32 < err16 / 10, (err32, err16)
    for got, ref, like in zip(grads, want[2:], (hidden, weight, bias)):
        assert got.dtype == like.dtype
        assert_close(got, ref, what="grad", **grad_tol(ref, 5e-2))
    y = put(labels, jnp.int32)
    dots = dot_generals(
        lambda h, w: linear_cross_entropy(h, w, y, backend="kernel", chunk_rows=ROWS, logits_dtype=jnp.float32), hidden,
        weight,
    )  # fmt: skip
    assert dots and all(d == (("bfloat16", "bfloat16"), "float32", (ROWS, 70)) for d in dots), dots


def test_logits_dtype_workspace_counts_four_bytes(put):
    """The workspace budget counts 4 bytes per logit with float32 logits: half the rows of bf16 logits."""
    hidden, weight, _, labels = make_inputs(put, 64, 8, 16, seed=4, dtype=jnp.bfloat16)
    y = put(labels, jnp.int32)
    budget = 16 * 2 * 32  # 32 rows of bf16 logits, 16 of float32

    def rows(**kw):
        fn = lambda h, w: linear_cross_entropy(h, w, y, backend="kernel", workspace_bytes=budget, **kw)  # noqa: E731
        return {shape[0] for *_, shape in dot_generals(fn, hidden, weight)}

    assert rows() == {32} and rows(logits_dtype="float32") == {16}


@pytest.mark.parametrize("value", ["float16", "bfloat16", "bf16", jnp.bfloat16, jnp.float64, "float64", 4, True])
def test_bad_logits_dtype(put, value):
    hidden, weight, _, labels = make_inputs(put, 4, 8, 10, seed=5, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="logits_dtype"):
        linear_cross_entropy(hidden, weight, put(labels, jnp.int32), logits_dtype=value, backend="kernel")


def test_logits_dtype_is_a_no_op_for_float32_inputs(put):
    hidden, weight, _, labels = make_inputs(put, 16, 8, 30, seed=6)
    y = put(labels, jnp.int32)
    a = linear_cross_entropy(hidden, weight, y, backend="kernel", chunk_rows=ROWS, logits_dtype=np.dtype("float32"))
    b = linear_cross_entropy(hidden, weight, y, backend="kernel", chunk_rows=ROWS)
    assert np.array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------
# token_weights
# ----------------------------------------------------------------------------

WEIGHTED = {
    "class_weight": dict(class_weight=np.linspace(0.2, 2.0, 50)),
    "skip_ignored": dict(skip_ignored_rows=True),
}


# Plain, n_items, z-loss and smoothing with token weights: shared_tests/test_token_weights.py's linear cases (both
# packages); here class weights and skip_ignored_rows with them (and an ignored token's NaN weight).
@pytest.mark.parametrize(
    "case, reduction",
    [(case, reduction) for case in WEIGHTED for reduction in ("mean", "none")],
)
def test_token_weights(put, case, reduction):
    kw = dict(WEIGHTED[case])
    hidden, weight, bias, labels = make_inputs(put, 21, 16, 50, seed=7)
    rng = np.random.default_rng(7)
    tw = rng.uniform(-1.0, 2.0, labels.shape)  # negative: advantages
    tw[labels == -100] = np.nan  # an ignored token's weight takes no part
    g = rng.uniform(0.5, 2.0, labels.shape) if reduction == "none" else 1.7
    ref_kw = {k: v for k, v in kw.items() if k != "skip_ignored_rows"}
    if "class_weight" in kw:
        kw["class_weight"] = put(kw["class_weight"], jnp.float32)
    out, grads = run(
        put, hidden, weight, labels, bias=bias, reduction=reduction, g_loss=g,
        token_weights=put(tw, jnp.float32), temperature=0.8, **kw,
    )  # fmt: skip
    want = expected(
        hidden, weight, labels, bias=bias, reduction=reduction, token_weights=tw, temperature=0.8, g_loss=g, **ref_kw
    )
    compare(out, grads, want)


def test_token_weights_shift_and_z_loss_output(put):
    """shift=1 aligns the weights with labels (w[..., t] with label[..., t]); the z_loss output is weighted like
    the loss's term, lse and entropy are not."""
    hidden, weight, _, labels = make_inputs(put, 24, 16, 40, seed=8, lead=(2, 12))
    tw = np.random.default_rng(8).uniform(0.0, 2.0, labels.shape)
    y = put(labels, jnp.int32)
    out = linear_cross_entropy(
        hidden, weight, y, backend="kernel", chunk_rows=ROWS, shift=1, token_weights=put(tw, jnp.float32), z_loss=1e-2,
        return_z_loss=True, return_entropy=True, return_lse=True,
    )  # fmt: skip
    sliced = dict(hidden=hidden[:, :-1].reshape(-1, 16), labels=labels[:, 1:].reshape(-1), tw=tw[:, 1:].reshape(-1))
    want = expected(sliced["hidden"], weight, sliced["labels"], token_weights=sliced["tw"], z_loss=1e-2)
    assert_close(out.loss, want[0], what="loss", **LOSS_TOL)
    assert_close(out.entropy, want[1], what="entropy (unweighted)", **LOSS_TOL)
    x = as_float64(sliced["hidden"]) @ as_float64(weight).T
    plain = ref64.outputs(x, sliced["labels"], reduction="none", opts=ref64.Options(z_loss=1e-2))
    kept = max(1, int(np.sum(sliced["labels"] != -100)))
    assert_close(out.z_loss, np.sum(plain.z_loss * sliced["tw"]) / kept, what="z_loss", **LOSS_TOL)
    assert_close(out.lse, plain.lse.reshape(2, 11), what="lse", **LOSS_TOL)


def test_token_weights_keep_the_gradient_in_forward_path(put):
    """ "mean" with token weights runs the same matmuls as without (three per chunk, no recompute in the
    backward): the per-row factor replaces the scalar."""
    hidden, weight, _, labels = make_inputs(put, 24, 8, 30, seed=9)
    y = put(labels, jnp.int32)
    tw = put(np.random.default_rng(9).uniform(0.5, 2.0, labels.shape), jnp.float32)

    def grad_fn(weights):
        return jax.grad(
            lambda h, w: linear_cross_entropy(h, w, y, backend="kernel", chunk_rows=ROWS, token_weights=weights),
            argnums=(0, 1),
        )

    plain = dot_generals(grad_fn(None), hidden, weight)
    weighted = dot_generals(grad_fn(tw), hidden, weight)
    assert len(weighted) == len(plain) == 6, (plain, weighted)  # chunk 0 and the loop body, 3 products each


def test_token_weights_have_no_gradient(put):
    hidden, weight, _, labels = make_inputs(put, 8, 8, 20, seed=10)
    y = put(labels, jnp.int32)
    tw = put(np.ones(labels.shape), jnp.float32)
    for reduction in ("mean", "none"):
        with pytest.raises(ValueError, match="token_weights"):
            jax.grad(
                lambda t: jnp.sum(
                    linear_cross_entropy(hidden, weight, y, reduction=reduction, token_weights=t, backend="kernel")
                )
            )(tw)


def test_bad_token_weights(put):
    hidden, weight, _, labels = make_inputs(put, 8, 8, 20, seed=11)
    y = put(labels, jnp.int32)
    with pytest.raises(ValueError, match="token_weights"):
        linear_cross_entropy(hidden, weight, y, token_weights=jnp.ones((9,)), backend="kernel")
    with pytest.raises(TypeError, match="token_weights"):
        linear_cross_entropy(hidden, weight, y, token_weights=jnp.ones((8,), jnp.int32), backend="kernel")


def test_nan_token_weight_is_visible(put):
    hidden, weight, _, labels = make_inputs(put, 8, 8, 20, seed=12, n_ignored=0)
    tw = np.ones(labels.shape)
    tw[3] = np.nan
    y = put(labels, jnp.int32)
    per_token = linear_cross_entropy(hidden, weight, y, reduction="none", token_weights=put(tw, jnp.float32),
                                     backend="kernel", chunk_rows=ROWS)  # fmt: skip
    assert np.isnan(np.asarray(per_token)).tolist() == [i == 3 for i in range(8)]
    mean = linear_cross_entropy(hidden, weight, y, token_weights=put(tw, jnp.float32), backend="kernel")
    assert np.isnan(float(mean))
