"""fastce_jax.linear_jsd (issue 38) against the float64 chain rule of jsd_checks.Expected on the float64 logits
h W^T + b: every beta kind, the reductions, temperature and soft-capping, biases and a padded teacher head, in
several chunks (the last one clamped), jit / vmap, the teacher's zero cotangents; skip_ignored_rows (the kept rows
first, chunks without one skipped under lax.cond: the logits matmuls that actually ran counted, the same loss and
gradients as the default loop and as float64, nothing to skip or nothing kept, vmap over sequences with their own
ignored rows); the argument checks. On the CPU the kernels run in Pallas interpret mode on tiny shapes, their tiles
of 128 columns; compile time is the cost there, so each test compiles its programs once and loops over inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import linear_jsd
from fastce_jax.linear import engine
from shared_tests import tolerances

from .checks import as_float64
from .jsd_checks import Expected

pytestmark = pytest.mark.usefixtures("jsd_small_tiles", "float32_matmuls")
EPS = tolerances.EPS32
TRANSFORMED_LINEAR = dict(temperature=0.8, student_softcapping=6.0, teacher_softcapping=9.0)


def linear_inputs(sizes, seed=5):
    """Student (h, W, b) and teacher (h, W, b), H = 16 and 24, the teacher head padded to V_t rows whose bias is
    -inf; labels with two ignored rows."""
    n, v, v_t = sizes
    rng = np.random.default_rng(seed)
    student = (rng.standard_normal((n, 16)), rng.standard_normal((v, 16)) * 0.5, rng.standard_normal(v) * 0.2)
    teacher_bias = rng.standard_normal(v_t) * 0.2
    teacher_bias[v:] = -np.inf
    teacher = (rng.standard_normal((n, 24)), rng.standard_normal((v_t, 24)) * 0.5, teacher_bias)
    labels = rng.integers(0, v, n).astype(np.int32)
    labels[[0, 5]] = -100
    return [jnp.asarray(a, jnp.float32) for a in student], [jnp.asarray(a, jnp.float32) for a in teacher], labels


def check_linear(loss, grads, student, teacher, labels, reduction, upstream=None, **kw):
    """linear_jsd's loss and student gradients (hidden, weight, bias when given) against the float64 chain rule
    of the float64 logits h W^T + b."""
    h, w, b = (as_float64(a) for a in (*student, np.zeros(student[1].shape[0]))[:3])
    ht, wt, bt = (as_float64(a) for a in teacher)
    n, v = h.shape[0], w.shape[0]
    expected = Expected(h @ w.T + b, ht @ wt.T + bt, labels, **kw)
    # The logits' float32 rounding (sums of H products) reaches the loss too: rtol counts H of them.
    expected.check_loss(loss, reduction, rtol=tolerances.RTOL * 24)
    weights = expected.weights(reduction, upstream)[:, None]
    g, g_scale = expected.grad * weights, np.abs(expected.grad_scale * weights)
    # Each gradient product (float32, K terms): |error| <= K eps |g| |x| (a rigorous bound), plus the gradient's own.
    for name, actual, exact, bound in [
        ("d hidden", grads[0], g @ w, g_scale @ np.abs(w) * tolerances.RTOL + v * EPS * np.abs(g) @ np.abs(w)),
        ("d weight", grads[1], g.T @ h, g_scale.T @ np.abs(h) * tolerances.RTOL + n * EPS * np.abs(g).T @ np.abs(h)),
        ("d bias", grads[2:], g.sum(0), g_scale.sum(0) * tolerances.RTOL + n * EPS * np.abs(g).sum(0)),
    ][: len(grads)]:
        actual = actual[0] if name == "d bias" else actual
        tolerances.check(as_float64(actual), exact, bound + tolerances.FLOOR, name)


# ----------------------------------------------------------------------------------------------------------------
# Against float64
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta,reduction", [(0.5, "mean"), (1.0, "none"), (0.0, "sum")])
def test_linear_jsd_matches_float64(jsd_sizes, beta, reduction):
    """Several chunks (a small workspace; the last chunk clamped), a padded teacher head, biases, temperature and
    soft-capping: the loss and the student's three gradients against the float64 chain rule; the teacher's
    hidden, weight and bias get exactly zero."""
    student, teacher, labels = linear_inputs(jsd_sizes)
    n, v, v_t = jsd_sizes
    kw = dict(beta=beta, reduction=reduction, **TRANSFORMED_LINEAR)
    workspace = 5 * (v + v_t) * 4  # five rows of both logits per chunk

    def loss_fn(hs, ws, bs, ht, wt, bt):
        return linear_jsd(
            hs, ws, ht, wt, labels, student_bias=bs, teacher_bias=bt, workspace_bytes=workspace, backend="kernel", **kw
        )

    loss, vjp = jax.vjp(loss_fn, *student, *teacher)
    upstream = np.random.default_rng(6).uniform(-1, 1, n) if reduction == "none" else np.ones(())
    grads = vjp(jnp.asarray(upstream, jnp.float32))
    assert not any(np.any(np.asarray(g)) for g in grads[3:])
    check_linear(loss, grads[:3], student, teacher, labels, reduction, upstream, beta=beta, **TRANSFORMED_LINEAR)


def test_linear_jsd_under_jit_vmap(jsd_sizes):
    """jit(vmap(value_and_grad)) of linear_jsd over two problems sharing the weights and labels (Pallas' own
    batching of the kernels inside the chunk loop), no biases, the teacher's hidden batched too."""
    student, teacher, labels = linear_inputs(jsd_sizes, seed=8)
    hs = jnp.stack([student[0], student[0][::-1]])
    ht = jnp.stack([teacher[0], teacher[0][::-1]])

    def loss_fn(h, w, h_t):
        return linear_jsd(h, w, h_t, teacher[1], labels, beta=1.0, workspace_bytes=5 * 1024, backend="kernel")

    batched = jax.jit(jax.vmap(jax.value_and_grad(loss_fn, argnums=(0, 1)), in_axes=(0, None, 0)))
    losses, (d_hidden, d_weight) = batched(hs, student[1], ht)
    for i in range(2):
        teacher_i = (ht[i], teacher[1], jnp.zeros(teacher[1].shape[0]))
        check_linear(losses[i], (d_hidden[i], d_weight[i]), (hs[i], student[1]), teacher_i, labels, "mean", beta=1.0)


# ----------------------------------------------------------------------------------------------------------------
# skip_ignored_rows: the kept rows first, chunks without one skipped on the device.
# ----------------------------------------------------------------------------------------------------------------

CHUNK = 3  # rows per chunk of the workspace the skip tests pass
IGNORED = {
    "prompt-and-interleaved": lambda i: (i < 5) | (i % 3 == 1),  # 5 of 12 rows kept on the CPU, from row 5 on
    "none": lambda i: i < 0,
    "all": lambda i: i >= 0,
}


def with_ignored(labels, pattern):
    """labels with exactly the rows of `pattern` ignored (the others given a class)."""
    labels = np.where(labels == -100, 1, labels)
    labels[IGNORED[pattern](np.arange(len(labels)))] = -100
    return labels


def workspace(student, teacher):
    """workspace_bytes for CHUNK rows of both float32 chunks of logits."""
    return CHUNK * (student[1].shape[0] + teacher[1].shape[0]) * 4


def chunks_of(n_rows, student, teacher):
    """How many chunks cover n_rows rows in the chunks linear_jsd makes with that workspace (CHUNK rows at most;
    their number of rows is fixed by all the rows, kept or not)."""
    rows = engine.rows_per_chunk(len(student[0]), workspace(student, teacher) // CHUNK, 1, workspace(student, teacher))
    return -(-n_rows // rows)


def assert_same(got, want, what):
    """The skipping loop's results against the default loop's: the chunks hold other rows (the kept ones first), so
    d weight and d bias are summed in another order, float32 roundings apart (relative to each array's largest)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()), err_msg=what)


def skip_step(student, teacher, reduction, upstream, **keywords):
    """jit(value_and_grad) of linear_jsd (chunks of CHUNK rows) in the student's hidden, weight and bias, the labels
    an argument (every ignored-row pattern runs the same compiled program): labels -> (loss, grads)."""

    def loss_fn(hs, ws, bs, labels):
        loss = linear_jsd(
            hs, ws, teacher[0], teacher[1], labels, student_bias=bs, teacher_bias=teacher[2], reduction=reduction,
            workspace_bytes=workspace(student, teacher), backend="kernel", **keywords,
        )  # fmt: skip
        return (jnp.sum(loss * upstream) if reduction == "none" else loss), loss

    step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True))

    def run(labels):
        (_, loss), grads = step(*student, jnp.asarray(labels))
        return jax.block_until_ready((loss, grads))

    return run


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_skip_ignored_rows_runs_only_chunks_with_kept_rows(jsd_sizes, chunks_run, beta, reduction):
    """Biases, temperature, both soft-cappings, a padded teacher head: with the keyword only the chunks holding kept
    rows run their two logits matmuls (forward; "none" also in its backward, which recomputes them); the loss and
    gradients are the default loop's and float64's, the ignored rows' losses and d hidden exactly 0. Then no row
    ignored and every row ignored through the same programs: the same results, every chunk or none."""
    student, teacher, base_labels = linear_inputs(jsd_sizes, seed=20)
    n = jsd_sizes[0]
    upstream = jnp.asarray(np.random.default_rng(21).uniform(0.5, 2.0, n), jnp.float32)
    kw = dict(beta=beta, **TRANSFORMED_LINEAR)
    steps = {skip: skip_step(student, teacher, reduction, upstream, skip_ignored_rows=skip, **kw)
             for skip in (False, True)}  # fmt: skip
    passes = 2 if reduction == "none" else 1
    for pattern in IGNORED:
        labels = with_ignored(base_labels, pattern)
        n_kept = int((labels != -100).sum())
        results = {}
        for skip, step in steps.items():
            chunks_run.clear()
            results[skip] = step(labels)
            expected_chunks = chunks_of(n_kept if skip else n, student, teacher)
            assert len(chunks_run) == 2 * passes * expected_chunks, (pattern, skip, len(chunks_run))
        (loss, grads), (loss0, grads0) = results[True], results[False]
        assert_same((loss, grads), (loss0, grads0), pattern)
        ignored = labels == -100
        assert not np.asarray(grads[0])[ignored].any(), pattern
        if reduction == "none":
            assert not np.asarray(loss)[ignored].any(), pattern
        if pattern == "prompt-and-interleaved":
            up = np.asarray(upstream) if reduction == "none" else None
            check_linear(loss, grads, student, teacher, labels, reduction, up, **kw)


def test_skip_ignored_rows_without_labels_runs_every_chunk(jsd_sizes, chunks_run):
    """labels=None: nothing to skip, the plain loop (every chunk) and the same results bit for bit."""
    student, teacher, _ = linear_inputs(jsd_sizes, seed=22)
    n = jsd_sizes[0]

    def run(skip):
        def loss_fn(hs, ws):
            return linear_jsd(hs, ws, *teacher[:2], workspace_bytes=workspace(student, teacher), backend="kernel",
                              skip_ignored_rows=skip)  # fmt: skip

        chunks_run.clear()
        out = jax.block_until_ready(jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(*student[:2]))
        return out, len(chunks_run)

    (got, count), (want, count0) = run(True), run(False)
    assert count == count0 == 2 * chunks_of(n, student, teacher)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_skip_ignored_rows_vmap_over_sequences_with_their_own_ignored_rows(jsd_sizes):
    """jit(vmap(value_and_grad)) over two sequences whose labels differ (batched labels: each chunk's cond runs
    both branches, the result is the same): the default loop's losses and gradients and float64's."""
    student, teacher, labels = linear_inputs(jsd_sizes, seed=23)
    labels = np.stack([with_ignored(labels, "prompt-and-interleaved"), labels])
    hs = jnp.stack([student[0], student[0][::-1]])
    kw = dict(beta=0.5, **TRANSFORMED_LINEAR)

    def run(skip):
        def loss_fn(h, w, y):
            return linear_jsd(h, w, *teacher[:2], y, teacher_bias=teacher[2], reduction="sum",
                              workspace_bytes=workspace(student, teacher), backend="kernel", skip_ignored_rows=skip,
                              **kw)  # fmt: skip

        batched = jax.vmap(jax.value_and_grad(loss_fn, argnums=(0, 1)), in_axes=(0, None, 0))
        return jax.jit(batched)(hs, student[1], jnp.asarray(labels))

    (losses, (d_hidden, d_weight)), want = run(True), run(False)
    assert_same((losses, (d_hidden, d_weight)), want, "vmap")
    for i in range(2):
        assert not np.asarray(d_hidden[i])[labels[i] == -100].any()
        grads = (d_hidden[i], d_weight[i])
        check_linear(losses[i], grads, (hs[i], student[1]), teacher, labels[i], "sum", **kw)


# ----------------------------------------------------------------------------------------------------------------
# Argument checks (no kernel runs).
# ----------------------------------------------------------------------------------------------------------------

H_S, W_S, H_T, W_T = (
    np.ones((4, 8), np.float32),
    np.ones((10, 8), np.float32),
    np.ones((4, 6), np.float32),
    np.ones((12, 6), np.float32),
)
Y = np.array([1, -100, 2, 3], np.int32)
BAD_LINEAR = [
    (dict(student_weight=W_S[:, :7]), ValueError, "student_weight"),
    (dict(teacher_weight=W_T[:, :5]), ValueError, "teacher_weight"),
    (dict(teacher_weight=W_T[:9]), ValueError, "teacher_weight"),  # V_t < V_s
    (dict(teacher_hidden=H_T[:3]), ValueError, "teacher_hidden"),
    (dict(student_hidden=H_S.astype(np.int32)), TypeError, "student_hidden"),
    (dict(student_bias=np.ones(9, np.float32)), ValueError, "student_bias"),
    (dict(teacher_bias=np.ones(10, np.float32)), ValueError, "teacher_bias"),
    (dict(labels=Y[:2]), ValueError, "labels"),
    (dict(workspace_bytes=0), ValueError, "workspace_bytes"),
    (dict(beta=2.0), ValueError, "beta"),
    (dict(logits_dtype=jnp.bfloat16), ValueError, "logits_dtype"),
    (dict(logits_dtype="float64"), ValueError, "logits_dtype"),
    (dict(accumulate_in_float32=1), TypeError, "accumulate_in_float32"),
    (dict(skip_ignored_rows=1), TypeError, "skip_ignored_rows"),
    (dict(skip_ignored_rows="yes"), TypeError, "skip_ignored_rows"),
    (dict(skip_ignored_rows=None), TypeError, "skip_ignored_rows"),
]


@pytest.mark.parametrize("change,error,name", BAD_LINEAR, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD_LINEAR)])
def test_linear_jsd_bad_arguments_raise_naming_the_argument(change, error, name):
    kwargs = dict(student_hidden=H_S, student_weight=W_S, teacher_hidden=H_T, teacher_weight=W_T, labels=Y)
    kwargs.update({"backend": "kernel", **change})
    args = [kwargs.pop(k) for k in ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight", "labels")]
    with pytest.raises(error, match=name):
        linear_jsd(*args, **kwargs)
