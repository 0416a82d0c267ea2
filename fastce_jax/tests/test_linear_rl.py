"""fastce_jax.linear_cross_entropy's RL keywords (issue 37): temperature, token_weights, logits_dtype, the
differentiable entropy output, and linear_log_probs, against a float64 NumPy reference.

The reference computes the temperature literally, z = softcap(scaling * x) / T (shared_tests/reference.py's
transform, then the division), and runs shared_tests' cross_entropy on z with the remaining options; the entropy's
gradient dH/dz_j = p_j (mz - z_j) (mz = sum_j p_j z_j) is added by hand, then chained through dz/dx and the
matmul. CPU: the chunked path with the Pallas kernels in interpret mode, tiny shapes, several chunks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fastce_jax import contract, linear_cross_entropy, linear_log_probs
from shared_tests import reference as ref64

from . import checks
from .checks import as_float64
from .test_linear_cross_entropy import LOSS_TOL, ROWS, assert_close, grad_tol, make_inputs


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


def expected(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    reduction="mean",
    n_items=None,
    temperature=1.0,
    token_weights=None,
    class_weight=None,
    g_loss=1.0,
    g_entropy=None,
    **opts,
):
    """float64 (loss, entropy output, d hidden, d weight, d bias) of g_loss * loss + g_entropy * entropy (both
    scalars for "mean" / "sum", per-token arrays for "none"; g_entropy None: the loss alone). Labels flat (N,)."""
    h = as_float64(hidden).reshape(-1, hidden.shape[-1])
    w = as_float64(weight)
    y = np.asarray(labels).reshape(-1).astype(np.int64)
    x = h @ w.T + (0.0 if bias is None else as_float64(bias))
    base = ref64.Options(**opts)
    z = ref64.transform(x, base) / temperature
    dz_dx = ref64.dz_dx(x, base) / temperature
    plain = ref64.Options(ignore_index=base.ignore_index, label_smoothing=base.label_smoothing, z_loss=base.z_loss)
    ignored = y == base.ignore_index
    tw = np.ones(y.shape) if token_weights is None else np.asarray(token_weights, np.float64).reshape(-1)
    tw = np.where(ignored, 0.0, tw)
    cw = None if class_weight is None else np.asarray(class_weight, np.float64)
    if reduction == "none":
        den = den_h = 1.0
        g_tok = np.broadcast_to(np.asarray(g_loss, np.float64), y.shape).reshape(-1)
        g_h = None if g_entropy is None else np.broadcast_to(np.asarray(g_entropy, np.float64), y.shape).reshape(-1)
    else:
        den = ref64.denominator(y, reduction, n_items, base.ignore_index, cw)
        den_h = ref64.denominator(y, reduction, n_items, base.ignore_index)
        g_tok = np.full(y.shape, g_loss / den)
        g_h = None if g_entropy is None else np.full(y.shape, g_entropy / den_h)
    r = ref64.cross_entropy(z, y, reduction="none", upstream=g_tok * tw, opts=plain, weight=cw)
    token = r.token_loss * tw
    loss = token.reshape(np.shape(labels)) if reduction == "none" else np.sum(token) / den
    ent = ref64.outputs(z, y, reduction="none", opts=plain).entropy
    entropy = ent.reshape(np.shape(labels)) if reduction == "none" else np.sum(ent) / den_h
    grad_z = r.grad
    if g_h is not None:
        p = np.exp(z - r.lse[:, None])
        mz = np.sum(p * z, axis=-1, keepdims=True)
        grad_z = grad_z + np.where(ignored[:, None], 0.0, g_h[:, None] * p * (mz - z))
    g = grad_z * dz_dx
    dh = (g @ w).reshape(hidden.shape)
    return loss, entropy, dh, g.T @ h, None if bias is None else g.sum(axis=0)


def run(put, hidden, weight, labels, *, bias=None, reduction="mean", g_loss=1.0, g_entropy=None, **kw):
    """value and gradients (hidden, weight, bias) of g_loss * loss (+ g_entropy * entropy) through the kernels."""
    y = put(labels, jnp.int32)
    entropy_out = g_entropy is not None

    def f(h, w, b):
        out = linear_cross_entropy(
            h, w, y, bias=b, reduction=reduction, backend="kernel", chunk_rows=kw.pop("chunk_rows", ROWS),
            return_entropy=entropy_out, **kw,
        )  # fmt: skip
        loss = out.loss if entropy_out else out
        total = jnp.sum(loss * g_loss)
        if entropy_out:
            total = total + jnp.sum(out.entropy * g_entropy)
        return total, out

    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(hidden, weight, bias)
    return out, grads


def compare(out, grads, want, *, entropy=False, grad_rtol=2e-4, loss_tol=LOSS_TOL):
    loss = out.loss if entropy else out
    assert_close(loss, want[0], what="loss", **loss_tol)
    if entropy:
        assert_close(out.entropy, want[1], what="entropy", **loss_tol)
    for name, got, ref in zip(("dhidden", "dweight", "dbias"), grads, want[2:]):
        if ref is None:
            continue
        assert_close(got, ref, what=name, **grad_tol(ref, grad_rtol))


# ----------------------------------------------------------------------------
# temperature
# ----------------------------------------------------------------------------

OPTIONS = {
    "plain": {},
    "all": dict(label_smoothing=0.1, z_loss=1e-3, logit_softcapping=5.0, logit_scaling=1.3),
}


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
    options = contract.Options(logit_scaling=0.5, logit_softcapping=3.0)
    assert contract.fold_temperature(options, 1.0) is options
    folded = contract.fold_temperature(contract.Options(), 2.0)
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


def _dot_generals(fn, *args):
    """(operand dtypes, output dtype, output shape) of every dot_general in fn's jaxpr (nested ones included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(
                    (tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype),
                     tuple(eqn.outvars[0].aval.shape))
                )  # fmt: skip
            for param in eqn.params.values():
                for inner in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(inner, "jaxpr") and hasattr(inner.jaxpr, "eqns"):
                        walk(inner.jaxpr)
                    elif hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


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
    dots = _dot_generals(
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
        return {shape[0] for *_, shape in _dot_generals(fn, hidden, weight)}

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
    "plain": {},
    "z_loss+smoothing": dict(z_loss=1e-2, label_smoothing=0.1),
    "n_items": dict(n_items=7),
    "class_weight": dict(class_weight=np.linspace(0.2, 2.0, 50)),
    "skip_ignored": dict(skip_ignored_rows=True),
}


@pytest.mark.parametrize(
    "case, reduction",
    [(case, reduction) for case in WEIGHTED for reduction in ("mean", "none")] + [("plain", "sum"), ("n_items", "sum")],
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

    plain = _dot_generals(grad_fn(None), hidden, weight)
    weighted = _dot_generals(grad_fn(tw), hidden, weight)
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


# ----------------------------------------------------------------------------
# The differentiable entropy output
# ----------------------------------------------------------------------------

ENTROPY_CASES = {
    "alone": dict(g_loss=0.0),
    "with-loss": dict(),
    "all-options": dict(temperature=0.7, label_smoothing=0.1, z_loss=1e-3, logit_softcapping=5.0, logit_scaling=1.3),
    "weights": dict(temperature=0.8, token_weights=True, class_weight=True),
}


@pytest.mark.parametrize(
    "case, reduction",
    [(case, reduction) for case in ENTROPY_CASES for reduction in ("mean", "none")] + [("alone", "sum")],
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

    base = len(_dot_generals(objective(False), hidden, weight))
    with_entropy = len(_dot_generals(objective(True), hidden, weight))
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
    assert len(_dot_generals(plain, hidden, weight)) == 2  # chunk 0 and the loop body
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
# Sharded heads (linear/sharded.py): 4 host devices, in one child process
# ----------------------------------------------------------------------------

SHARDED_LAYOUTS = {  # (mesh shape and axes, hidden spec, weight spec)
    "rows": ((4,), ("d",), P("d", None), P(None, None)),
    "vocab": ((4,), ("d",), P(None, None), P("d", None)),
    "2d": ((2, 2), ("r", "v"), P("r", None), P("v", None)),
}


def test_sharded_rl_on_4_cpu_devices(use_gpu):
    """Runs this file's sharded_head tests in a child process with 4 CPU devices."""
    out = checks.run_on_4_cpu_devices(use_gpu, ["fastce_jax/tests/test_linear_rl.py", "-k", "sharded_head"])
    assert "skipped" not in out.splitlines()[-1], out[-2000:]


@pytest.mark.parametrize("layout", list(SHARDED_LAYOUTS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_sharded_head_temperature_token_weights_entropy(layout, reduction):
    """Under jit, rows and / or vocabulary sharded: temperature, token weights and the entropy's gradient (with a
    differentiated z_loss output) equal the float64 reference, and the gradients keep the inputs' shardings."""
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices (run through test_sharded_rl_on_4_cpu_devices)")
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
