"""jsd (issue 38) against a float64 NumPy formula of the loss and its closed-form student gradient (jsd_checks.py):
every beta kind (0, a mixture, 1), temperature and both soft-cappings, the reductions and ignore patterns, a wider
teacher head, NaN rows, the teacher's zero gradient, jit / grad / vmap, the reference backend in float64, jsd's
argument checks and both functions' signatures (linear_jsd's own tests: test_linear_jsd.py). The kernels run where
the inputs are: compiled on a GPU (pytest --gpu, larger shapes), in Pallas interpret mode on the CPU (tiny shapes,
tiles of 128 columns so a row spans several tiles, the last one partial).

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
from fastce_jax.losses.jsd import launch as jsd_launch
from shared_tests import tolerances
from shared_tests.reference_distill import jsd as jsd_reference

from .jsd_checks import Expected, host
from .test_sharding import collectives

# On the CPU the jsd kernels in tiles of 128 columns (a row of V = 257 spans three); float32 matmuls.
pytestmark = pytest.mark.usefixtures("jsd_small_tiles", "float32_matmuls")
TRANSFORMED = dict(temperature=0.7, student_softcapping=5.0, teacher_softcapping=8.0)


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
def test_jsd_matches_float64(jsd_sizes, beta, options):
    """Per-row losses and the student gradient (random upstream). plain: float32, labels with an ignored row;
    transformed: T = 0.7, both soft-cappings, bfloat16 student logits (a bfloat16 gradient), labels=None."""
    kw = TRANSFORMED if options == "transformed" else {}
    dtype = jnp.bfloat16 if options == "transformed" else jnp.float32
    student, teacher, labels = logits_inputs(jsd_sizes, beta, dtype, seed=int(beta * 10))
    labels = None if options == "transformed" else labels
    upstream = np.random.default_rng(1).uniform(-1.5, 1.5, jsd_sizes[0])
    losses, grad = rows_and_grad(student, teacher, labels, upstream, beta=beta, **kw)
    assert losses.dtype == jnp.float32 and losses.shape == (jsd_sizes[0],)
    assert grad.dtype == dtype and grad.shape == student.shape
    expected = Expected(student, teacher, labels, beta, **kw)
    assert np.isnan(expected.loss).sum() == 2 + (labels is None)  # rows 4 and 6 (and the unmasked row 1)
    expected.check(losses, grad, upstream=upstream, dtype=dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("pattern", ["some", "all", "none"])
def test_jsd_reductions_and_ignore_patterns(jsd_sizes, reduction, pattern):
    """ "mean" divides by the counted rows (all ignored: 0 and a zero gradient), "sum" sums; the rows ignored
    (their logits NaN here) count for nothing."""
    n, v, v_t = jsd_sizes
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


def test_jsd_under_jit_grad_vmap_teacher_gets_zero(jsd_sizes):
    """jit(vmap(grad)) over a batch of two problems (the labels shared): each student gradient is the float64
    one; the teacher, differentiated too, gets exactly zero (it is a constant)."""
    n, v, v_t = jsd_sizes
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
    monkeypatch.setattr(jsd_launch, "FORWARD_BLOCK", 32)
    monkeypatch.setattr(jsd_launch, "FORWARD_PROGRAMS", n * segments)
    assert jsd_launch.forward_segments(n, v, 32, n * segments) == ((3, 128) if segments == 3 else (1, 320))
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
                skip_ignored_rows=False,
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
