"""jsd and linear_jsd (issue 38) against a float64 NumPy formula of the loss and its closed-form student gradient:
every beta kind (0, a mixture, 1), temperature and both soft-cappings, the reductions and ignore patterns, a wider
teacher head, NaN rows, the teacher's zero gradient, jit / grad / vmap, the reference backend in float64 and the
argument checks. The kernels run where the inputs are: compiled on a GPU (pytest --gpu, larger shapes), in Pallas
interpret mode on the CPU (tiny shapes, tiles of 128 columns so a row spans several tiles, the last one partial).

Compile time is the cost on the CPU: every beta in (0, 1) shares one compiled kernel (beta is an operand), and the
tests reuse one shape per entry point."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fastce_jax
from fastce_jax import jsd, linear_jsd
from fastce_jax.kernels import jsd as jsd_kernels
from shared_tests import tolerances
from shared_tests.reference_distill import jsd as jsd_reference

from .checks import as_float64
from .test_sharding import collectives

EPS = tolerances.EPS32
TRANSFORMED = dict(temperature=0.7, student_softcapping=5.0, teacher_softcapping=8.0)
TRANSFORMED_LINEAR = dict(temperature=0.8, student_softcapping=6.0, teacher_softcapping=9.0)


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch, use_gpu):
    """On the CPU, 128-column tiles: V = 257 spans three, the last holding one column."""
    if not use_gpu:
        monkeypatch.setattr(jsd_kernels, "FORWARD_BLOCK", 128)
        monkeypatch.setattr(jsd_kernels, "BACKWARD_BLOCK", 128)


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """linear_jsd's chunk matmuls at float32 precision (a GPU may use TF32): the tolerances are for float32
    products."""
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture(scope="module")
def sizes(request):
    """(N, V, V_t): tiny on the CPU, a real vocabulary on the GPU."""
    return (48, 32771, 32800) if request.config.getoption("--gpu", default=False) else (12, 257, 263)


# ----------------------------------------------------------------------------------------------------------------
# The float64 formula (CONTRACT / issue 38), written from the definitions, NumPy only.
# ----------------------------------------------------------------------------------------------------------------


def host(array):
    """An array's values on the host in float64 (float64 arrays as they are)."""
    array = jnp.asarray(array)
    return np.asarray(array, np.float64) if array.dtype == jnp.float64 else as_float64(array)


class Expected:
    """Per-row loss and d loss_row / d student logits (float64), and the magnitudes their float32 rounding scales
    with (shared_tests/tolerances.py's model: |error| <= RTOL * scale + ulps + FLOOR)."""

    def __init__(self, student, teacher, labels, beta, temperature=1.0, student_softcapping=0.0,
                 teacher_softcapping=0.0, ignore_index=-100):  # fmt: skip
        xs = host(student)
        xt = host(teacher)[:, : xs.shape[1]]

        def u(x, cap):
            return (cap * np.tanh(x / cap) if cap else x) / temperature

        def log_softmax(v):
            m = np.max(v, axis=1, keepdims=True)
            lse = m + np.log(np.sum(np.exp(v - m), axis=1, keepdims=True))
            return v - lse, lse[:, 0]

        with np.errstate(all="ignore"):
            us, ut = u(xs, student_softcapping), u(xt, teacher_softcapping)
            (ls, lse_s), (lt, lse_t) = log_softmax(us), log_softmax(ut)
            ps, pt = np.exp(ls), np.exp(lt)
            if beta == 0.0:
                loss = kl = np.sum(np.where(pt == 0, 0.0, pt * (lt - ls)), axis=1)
                d_u = ps - pt
            elif beta == 1.0:
                loss = kl = np.sum(np.where(ps == 0, 0.0, ps * (ls - lt)), axis=1)
                d_u = np.where(ps == 0, 0.0, ps * (ls - lt - kl[:, None]))
            else:
                lm = np.logaddexp(np.log1p(-beta) + ls, np.log(beta) + lt)
                kl_t = np.sum(np.where(pt == 0, 0.0, pt * (lt - lm)), axis=1)
                kl = np.sum(np.where(ps == 0, 0.0, ps * (ls - lm)), axis=1)
                loss = beta * kl_t + (1 - beta) * kl
                d_u = (1 - beta) * np.where(ps == 0, 0.0, ps * (ls - lm - kl[:, None]))
            du_dx = np.full_like(xs, 1.0 / temperature)
            if student_softcapping:
                du_dx = du_dx * (1.0 - np.tanh(xs / student_softcapping) ** 2)
            magnitude = np.nan_to_num(np.abs(us) + np.abs(ut), posinf=0.0)
            stats = np.abs(lse_s) + np.abs(lse_t) + np.abs(kl)
            self.loss_scale = np.sum((ps + pt) * magnitude, axis=1) + stats
            self.grad_scale = du_dx * (ps + pt) * (1.0 + magnitude + stats[:, None])
        self.loss, self.grad = loss, d_u * du_dx
        self.counted = np.ones(len(loss), bool) if labels is None else np.asarray(labels) != ignore_index
        self.loss = np.where(self.counted, self.loss, 0.0)
        self.grad = np.where(self.counted[:, None], self.grad, 0.0)

    def weights(self, reduction, upstream=None):
        """d loss / d loss_row of the reduction (upstream for "none")."""
        if reduction == "none":
            return np.asarray(upstream, np.float64)
        if reduction == "sum":
            return np.ones(len(self.loss))
        return np.full(len(self.loss), 1.0 / max(self.counted.sum(), 1))

    def check_loss(self, loss, reduction="none", rtol=tolerances.RTOL):
        """The loss, per row ("none") or reduced, within rtol * its rounding scale."""
        bound = rtol * np.where(self.counted, self.loss_scale, 0.0) + tolerances.FLOOR
        expected = self.loss
        if reduction != "none":
            weights = self.weights(reduction)
            expected = np.sum(self.loss * weights)
            bound = np.sum(np.nan_to_num(bound) * weights) + rtol * np.sum(np.abs(self.loss * weights))
        tolerances.check(host(loss), expected, bound, "loss")

    def check_grad(self, grad, reduction="none", upstream=None, dtype=jnp.float32, rtol=tolerances.RTOL):
        """The student gradient of the reduced loss (of upstream . per-row losses for "none"), rounded to dtype."""
        weights = self.weights(reduction, upstream)[:, None]
        expected = self.grad * weights
        actual = host(grad)
        magnitude = np.maximum(np.abs(np.nan_to_num(actual)), np.abs(np.nan_to_num(expected)))
        bound = rtol * np.abs(weights) * np.nan_to_num(self.grad_scale) + tolerances.FLOOR
        bound = bound + tolerances.ULPS * tolerances.ulp(magnitude, dtype)
        tolerances.check(actual, expected, bound, "grad")

    def check(self, loss, grad, reduction="none", upstream=None, dtype=jnp.float32, rtol=tolerances.RTOL):
        self.check_loss(loss, reduction, rtol)
        self.check_grad(grad, reduction, upstream, dtype, rtol)


def logits_inputs(sizes, beta, dtype=jnp.float32, seed=0):
    """(student, teacher, labels): random logits, row 1 ignored (and NaN there), row 2 with -inf columns on both
    sides (padding: no term, no gradient), row 3 with -inf columns on the side whose KL stays finite, row 4 NaN in
    the student and row 6 NaN in the teacher (those rows NaN, no other), the teacher's extra columns -inf (row 5:
    NaN, never read)."""
    n, v, v_t = sizes
    rng = np.random.default_rng(seed)
    student = rng.standard_normal((n, v)) * 2.0
    teacher = rng.standard_normal((n, v_t)) * 2.0
    teacher[:, v:] = -np.inf
    teacher[5, v:] = np.nan
    student[1, 3] = teacher[1, 4] = np.nan
    student[2, :5] = teacher[2, :5] = -np.inf
    # Row 3: a column no probability reaches on the side that keeps every divergence finite.
    (teacher if beta < 1.0 else student)[3, 5:9] = -np.inf
    student[4, 7] = np.nan
    teacher[6, 2] = np.nan
    labels = rng.integers(0, v, n).astype(np.int32)
    labels[1] = -100
    return jnp.asarray(student, dtype), jnp.asarray(teacher, jnp.float32), labels


def rows_and_grad(student, teacher, labels, upstream, **kw):
    """Per-row losses and the gradient of upstream . losses (eager vjp: the jitted kernel path is reused)."""
    losses, vjp = jax.vjp(lambda x: jsd(x, teacher, labels, reduction="none", backend="kernel", **kw), student)
    return losses, vjp(jnp.asarray(upstream, jnp.float32))[0]


# ----------------------------------------------------------------------------------------------------------------
# jsd
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("options", ["plain", "transformed"])
def test_jsd_matches_float64(sizes, beta, options):
    """Per-row losses and the student gradient (random upstream). plain: float32, labels with an ignored row;
    transformed: T = 0.7, both soft-cappings, bfloat16 student logits (a bfloat16 gradient), labels=None."""
    kw = TRANSFORMED if options == "transformed" else {}
    dtype = jnp.bfloat16 if options == "transformed" else jnp.float32
    student, teacher, labels = logits_inputs(sizes, beta, dtype, seed=int(beta * 10))
    labels = None if options == "transformed" else labels
    upstream = np.random.default_rng(1).uniform(-1.5, 1.5, sizes[0])
    losses, grad = rows_and_grad(student, teacher, labels, upstream, beta=beta, **kw)
    assert losses.dtype == jnp.float32 and losses.shape == (sizes[0],)
    assert grad.dtype == dtype and grad.shape == student.shape
    expected = Expected(student, teacher, labels, beta, **kw)
    assert np.isnan(expected.loss).sum() == 2 + (labels is None)  # rows 4 and 6 (and the unmasked row 1)
    expected.check(losses, grad, upstream=upstream, dtype=dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("pattern", ["some", "all", "none"])
def test_jsd_reductions_and_ignore_patterns(sizes, reduction, pattern):
    """ "mean" divides by the counted rows (all ignored: 0 and a zero gradient), "sum" sums; the rows ignored
    (their logits NaN here) count for nothing."""
    n, v, v_t = sizes
    rng = np.random.default_rng(2)
    student = jnp.asarray(rng.standard_normal((n, v)) * 2.0, jnp.float32)
    teacher = rng.standard_normal((n, v_t)) * 2.0
    labels = rng.integers(0, v, n).astype(np.int32)
    ignored = {"some": np.arange(n) % 3 == 0, "all": np.ones(n, bool), "none": np.zeros(n, bool)}[pattern]
    labels[ignored] = -100
    teacher[ignored, :] = np.nan
    teacher = jnp.asarray(teacher, jnp.float32)
    loss, grad = jax.value_and_grad(lambda x: jsd(x, teacher, labels, beta=0.5, reduction=reduction, backend="kernel"))(
        student
    )
    assert loss.shape == () and loss.dtype == jnp.float32
    Expected(student, teacher, labels, 0.5).check(loss, grad, reduction)
    if pattern == "all":
        assert float(loss) == 0.0 and not np.any(np.asarray(grad))


def test_jsd_under_jit_grad_vmap_teacher_gets_zero(sizes):
    """jit(vmap(grad)) over a batch of two problems (the labels shared): each student gradient is the float64
    one; the teacher, differentiated too, gets exactly zero (it is a constant)."""
    n, v, v_t = sizes
    rng = np.random.default_rng(3)
    students = jnp.asarray(rng.standard_normal((2, n, v)), jnp.float32)
    teachers = jnp.asarray(rng.standard_normal((2, n, v_t)), jnp.float32)
    labels = jnp.asarray(np.where(np.arange(n) % 4 == 1, -100, 0), jnp.int32)

    def loss(x, t, y):
        return jsd(x, t, y, beta=0.3, reduction="sum", backend="kernel", **TRANSFORMED)

    vmapped = jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(0, 0, None))
    values, (d_students, d_teachers) = jax.jit(vmapped)(students, teachers, labels)
    assert not np.any(np.asarray(d_teachers)) and d_teachers.shape == teachers.shape
    for b in range(2):
        Expected(students[b], teachers[b], labels, 0.3, **TRANSFORMED).check(values[b], d_students[b], "sum")


def test_jsd_rows_sharded(use_gpu):
    """Several devices (test_sharding.py's 4-device child on the CPU): logits and labels sharded by rows under jit
    run the kernels on each device's rows (custom_partitioning): the float64 values, the student's gradient
    sharded like the student, and no collective but the mean's scalar all-reduces."""
    devices = jax.devices("gpu" if use_gpu else "cpu")
    if len(devices) < 2:
        pytest.skip("needs several devices (run through test_sharding.py::test_sharded_suite_on_4_cpu_devices)")
    mesh = Mesh(np.array(devices), ("d",))
    student, teacher, labels = logits_inputs((4 * len(devices), 200, 210), 0.5, seed=7)
    rows, per_row = NamedSharding(mesh, P("d", None)), NamedSharding(mesh, P("d"))
    args = jax.device_put(student, rows), jax.device_put(teacher, rows), jax.device_put(labels, per_row)
    for beta in (0.0, 0.5):
        f = jax.jit(jax.value_and_grad(lambda a, b, c: jsd(a, b, c, beta=beta, backend="kernel", **TRANSFORMED)))
        loss, grad = f(*args)
        Expected(student, teacher, labels, beta, **TRANSFORMED).check(loss, grad, "mean")
        assert grad.sharding.is_equivalent_to(rows, grad.ndim)
        found = collectives(f.lower(*args).compile().as_text())
        assert found and all(op == "all-reduce" and size <= 2 for op, size in found), found


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_reference_backend_in_float64(beta):
    """backend="reference" is plain jnp: with x64, float64 logits give a float64 loss and gradient within 1e-12 of
    the float64 formula (every backend routes float64 there); an empty batch gives 0."""
    student, teacher, labels = logits_inputs((8, 40, 45), beta, seed=4)
    upstream = np.linspace(-1.0, 1.0, 8)
    with jax.enable_x64(True):
        x, t = jnp.asarray(np.asarray(student, np.float64)), jnp.asarray(np.asarray(teacher, np.float64))
        for backend in ("reference", "kernel"):
            losses, vjp = jax.vjp(
                lambda a: jsd(a, t, labels, beta=beta, reduction="none", backend=backend, **TRANSFORMED), x
            )
            grad = vjp(jnp.asarray(upstream))[0]
            assert losses.dtype == grad.dtype == jnp.float64
            expected = Expected(x, t, labels, beta, **TRANSFORMED)
            expected.check(losses, grad, upstream=upstream, dtype=jnp.float64, rtol=tolerances.RTOL64)
        assert float(jsd(x[:0], t[:0], labels[:0], beta=beta, backend="kernel")) == 0.0


@pytest.mark.parametrize("beta,segments", [(0.0, 3), (0.3, 3), (1.0, 3), (0.3, 1)])
def test_jsd_forward_segments(monkeypatch, beta, segments):
    """The forward's rows split into S column segments (forward_segments, forced here with 32-column tiles and a
    small program target): V = 300 in segments of 128, 128 and 44 columns (the last tile of 12), or S = 1. Against
    reference_distill in float64 with a random upstream: row 1 ignored (NaN, never read), row 2 NaN in the
    student's last segment, row 5 NaN in the teacher's first, row 3 a whole middle segment at -inf on the side
    whose divergences stay finite (that segment's partials are (-inf, 0)); for the mixture, row 6 a term whose
    mixture underflows (floored: a negligible term, not p * inf)."""
    n, v = 8, 300
    monkeypatch.setattr(jsd_kernels, "FORWARD_BLOCK", 32)
    monkeypatch.setattr(jsd_kernels, "FORWARD_PROGRAMS", n * segments)
    assert jsd_kernels.forward_segments(n, v, 32, n * segments) == ((3, 128) if segments == 3 else (1, 320))
    rng = np.random.default_rng(11)
    student, teacher = rng.standard_normal((n, v)) * 2.0, rng.standard_normal((n, v + 3)) * 2.0
    student[1, 5] = teacher[1, 200] = np.nan
    student[2, 290] = np.nan
    teacher[5, 7] = np.nan
    (teacher if beta < 1.0 else student)[3, 128:256] = -np.inf
    if 0.0 < beta < 1.0:  # row 6: p_t = 2^-125.8 where p_s = 0: beta p_t is subnormal, flushed to 0
        student[6, 10] = -np.inf
        teacher[6, 10] = np.log(np.sum(np.exp(teacher[6, :v]))) - 125.8 * np.log(2.0)
    labels = rng.integers(0, v, n).astype(np.int32)
    labels[1] = -100
    upstream = rng.uniform(-1.5, 1.5, n)
    student, teacher = np.float32(student), np.float32(teacher)
    losses, grad = rows_and_grad(jnp.asarray(student), jnp.asarray(teacher), labels, upstream, beta=beta)
    ref = jsd_reference(student, teacher, labels, beta=beta, reduction="none", upstream=upstream)
    assert np.isnan(ref.token_loss).sum() == 2
    tolerances.check(host(losses), ref.token_loss, tolerances.loss_bound(ref), "loss")
    tolerances.check(host(grad), ref.grad, tolerances.grad_bound(ref, host(grad), "float32"), "grad")


# ----------------------------------------------------------------------------------------------------------------
# linear_jsd
# ----------------------------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("beta,reduction", [(0.5, "mean"), (1.0, "none"), (0.0, "sum")])
def test_linear_jsd_matches_float64(sizes, beta, reduction):
    """Several chunks (a small workspace; the last chunk clamped), a padded teacher head, biases, temperature and
    soft-capping: the loss and the student's three gradients against the float64 chain rule; the teacher's
    hidden, weight and bias get exactly zero."""
    student, teacher, labels = linear_inputs(sizes)
    n, v, v_t = sizes
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


def test_linear_jsd_under_jit_vmap(sizes):
    """jit(vmap(value_and_grad)) of linear_jsd over two problems sharing the weights and labels (Pallas' own
    batching of the kernels inside the chunk loop), no biases, the teacher's hidden batched too."""
    student, teacher, labels = linear_inputs(sizes, seed=8)
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
# Signatures and argument checks (no kernel runs).
# ----------------------------------------------------------------------------------------------------------------

SHARED_KEYWORDS = dict(
    beta=0.5,
    temperature=1.0,
    ignore_index=-100,
    reduction="mean",
    student_softcapping=0.0,
    teacher_softcapping=0.0,
)


def test_signatures_are_the_spec():
    for fn, positional, extra in [
        (jsd, ["student_logits", "teacher_logits", "labels"], dict(backend="auto")),
        (
            linear_jsd,
            ["student_hidden", "student_weight", "teacher_hidden", "teacher_weight", "labels"],
            dict(
                student_bias=None,
                teacher_bias=None,
                workspace_bytes=None,
                accumulate_in_float32=False,
                logits_dtype=None,
                backend="auto",
            ),
        ),
    ]:
        params = inspect.signature(fn).parameters
        assert list(params)[: len(positional)] == positional and params["labels"].default is None
        keywords = {k: p.default for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert keywords == {**SHARED_KEYWORDS, **extra}
        assert getattr(fastce_jax, fn.__name__) is fn and fn.__name__ in fastce_jax.__all__


X, T = np.zeros((4, 10), np.float32) + 0.5, np.ones((4, 12), np.float32)
Y = np.array([1, -100, 2, 3], np.int32)

BAD_JSD = [
    (dict(beta=-0.1), ValueError, "beta"),
    (dict(beta=1.5), ValueError, "beta"),
    (dict(beta=float("nan")), ValueError, "beta"),
    (dict(beta=True), TypeError, "beta"),
    (dict(beta="0.5"), TypeError, "beta"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(student_softcapping=-1.0), ValueError, "student_softcapping"),
    (dict(teacher_softcapping=float("inf")), ValueError, "teacher_softcapping"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(backend="triton"), ValueError, "backend"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(student_logits=X.astype(np.int32)), TypeError, "student_logits"),
    (dict(teacher_logits=T.astype(np.int32)), TypeError, "teacher_logits"),
    (dict(teacher_logits=T[:3]), ValueError, "teacher_logits"),  # leading shapes differ
    (dict(teacher_logits=T[:, :9]), ValueError, "teacher_logits"),  # V_t < V_s
    (dict(labels=Y[:3]), ValueError, "labels"),
    (dict(labels=Y.astype(np.float32)), TypeError, "labels"),
]


@pytest.mark.parametrize("change,error,name", BAD_JSD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD_JSD)])
def test_jsd_bad_arguments_raise_naming_the_argument(change, error, name):
    kwargs = {**dict(student_logits=X, teacher_logits=T, labels=Y, backend="kernel"), **change}
    args = [kwargs.pop(k) for k in ("student_logits", "teacher_logits", "labels")]
    with pytest.raises(error, match=name):
        jsd(*args, **kwargs)


H_S, W_S, H_T, W_T = (
    np.ones((4, 8), np.float32),
    np.ones((10, 8), np.float32),
    np.ones((4, 6), np.float32),
    np.ones((12, 6), np.float32),
)
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
]


@pytest.mark.parametrize("change,error,name", BAD_LINEAR, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD_LINEAR)])
def test_linear_jsd_bad_arguments_raise_naming_the_argument(change, error, name):
    kwargs = dict(student_hidden=H_S, student_weight=W_S, teacher_hidden=H_T, teacher_weight=W_T, labels=Y)
    kwargs.update({"backend": "kernel", **change})
    args = [kwargs.pop(k) for k in ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight", "labels")]
    with pytest.raises(error, match=name):
        linear_jsd(*args, **kwargs)
