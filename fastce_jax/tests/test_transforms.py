"""fastce_jax where real training code puts it: float64 logits (computed in float64), what autodiff supports
(reverse mode through the kernels, higher order through the reference's jvp rules, JAX's TypeError for forward mode
on the loss), where backend="auto" runs under jit, and batch invariance (vmap and batch size never change a row's
bits).

On CPU the kernels run in interpret mode; with --gpu the same tests run the compiled kernels, plus the `gpu` ones.
"""

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest

from fastce_jax import cross_entropy
from fastce_jax.core import options as core_options
from fastce_jax.losses.cross_entropy import autograd, launch
from shared_tests import reference as float64_reference
from shared_tests import tolerances

from .checks import as_float64, assert_grad, assert_loss, expected

FORWARD_MODE = "forward-mode"  # JAX's own message for jvp of a custom_vjp function


def random_inputs(n, v, seed, *, n_ignored=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, v)) * 2.0
    y = rng.integers(0, v, n)
    y[rng.permutation(n)[:n_ignored]] = -100
    w = rng.uniform(0.5, 2.0, n)  # a per-token cotangent, never all ones
    return x, y, w


def vjp_step(**kwargs):
    """A jitted training step: per-token losses and the gradient of sum(w * losses)."""

    def run(logits, labels, w):
        loss, vjp = jax.vjp(lambda a: cross_entropy(a, labels, reduction="none", **kwargs), logits)
        return loss, vjp(w)[0]

    return jax.jit(run)


def vjp_none(x, labels, w, **kwargs):
    return vjp_step(**kwargs)(x, labels, w)


# ----------------------------------------------------------------------------------------------------------------
# float64 logits: computed in float64 by the reference whatever the backend (loss and gradient float64).
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "kernel", "reference"])
def test_float64_logits_are_computed_in_float64(put, backend):
    x, y, w = random_inputs(6, 300, seed=1)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcapping=4.0)
    with jax.enable_x64(True):
        x64, labels, w64 = put(x, jnp.float64), put(y, jnp.int32), put(w, jnp.float64)
        loss, grad = vjp_none(x64, labels, w64, backend=backend, **opts)
        assert loss.dtype == jnp.float64 and grad.dtype == jnp.float64 and grad.shape == x64.shape
        loss, grad = np.asarray(loss), np.asarray(grad)
        # The mean, the way optax users call their loss.
        mean = cross_entropy(x64, labels, backend=backend, **opts)
        assert mean.dtype == jnp.float64
        mean = np.asarray(mean)
    ref = float64_reference.cross_entropy(x, y, reduction="none", upstream=w, opts=float64_reference.Options(**opts))
    rtol = tolerances.RTOL64
    tolerances.check(loss, ref.loss, tolerances.loss_bound(ref, rtol), "loss")
    tolerances.check(grad, ref.grad, tolerances.grad_bound(ref, grad, "float64", rtol=rtol), "grad")
    ref_mean = float64_reference.cross_entropy(x, y, opts=float64_reference.Options(**opts))
    tolerances.check(mean, ref_mean.loss, tolerances.loss_bound(ref_mean, rtol), "mean")


@pytest.mark.parametrize("backend", ["auto", "kernel", "reference"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_float64_gradients_pass_check_grads(put, backend, reduction):
    """jax.test_util.check_grads (finite differences in float64, x64 on in this test only), every option on."""
    x, y, _ = random_inputs(4, 9, seed=5)
    opts = dict(logit_softcapping=3.0, logit_scaling=0.7, label_smoothing=0.1, z_loss=1e-3)
    with jax.enable_x64(True):
        x64, labels = put(x, jnp.float64), put(y, jnp.int32)
        f = lambda a: cross_entropy(a, labels, reduction=reduction, backend=backend, **opts)  # noqa: E731
        jax.test_util.check_grads(f, (x64,), order=1, modes=["rev"])
        jax.test_util.check_grads(jax.jit(f), (x64,), order=1, modes=["rev"])
    assert not jax.config.jax_enable_x64  # the scope ended


def test_float64_matches_optax_in_float64(put):
    optax = pytest.importorskip("optax")
    x, y, _ = random_inputs(5, 200, seed=2, n_ignored=0)
    with jax.enable_x64(True):
        x64, labels = put(x, jnp.float64), put(y, jnp.int32)
        ours = np.asarray(cross_entropy(x64, labels, reduction="none", backend="kernel"))
        theirs = np.asarray(optax.softmax_cross_entropy_with_integer_labels(x64, labels))
    assert ours.dtype == theirs.dtype == np.float64
    ref = float64_reference.cross_entropy(x, y, reduction="none")
    bound = tolerances.loss_bound(ref, tolerances.RTOL64)
    tolerances.check(ours, ref.loss, bound, "our loss")
    tolerances.check(theirs, ref.loss, bound, "optax loss")


def test_numpy_float64_without_x64_is_accepted():
    x, y, _ = random_inputs(4, 100, seed=3)
    assert x.dtype == np.float64 and not jax.config.jax_enable_x64
    loss = cross_entropy(x, y, backend="kernel", reduction="none")
    expected = cross_entropy(x.astype(np.float32), y, backend="kernel", reduction="none")
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(expected))


# ----------------------------------------------------------------------------------------------------------------
# Autodiff: reverse mode through the kernels, higher order exact; forward mode on the loss raises JAX's TypeError.
# ----------------------------------------------------------------------------------------------------------------


def _small(put):
    x, y, _ = random_inputs(3, 40, seed=4, n_ignored=0)
    return put(x, jnp.float32), put(y, jnp.int32)


def _higher_order(f, x):
    v = jnp.ones_like(x) * 0.5
    return {
        "grad_of_grad": lambda: jax.grad(lambda a: jnp.sum(jax.grad(f)(a) ** 2))(x),
        "hessian": lambda: jax.hessian(f)(x),
        "hvp_jvp_of_grad": lambda: jax.jvp(jax.grad(f), (x,), (v,)),
        "jitted_grad_of_grad": lambda: jax.jit(jax.grad(lambda a: jnp.sum(jax.grad(f)(a) ** 2)))(x),
    }


def _forward_mode(f, x):
    v = jnp.ones_like(x) * 0.5
    return {
        "jvp": lambda: jax.jvp(f, (x,), (v,)),
        "jitted_jvp": lambda: jax.jit(lambda a: jax.jvp(f, (a,), (v,)))(x),
        "linearize": lambda: jax.linearize(f, x)[1](v),
        "jacfwd": lambda: jax.jacfwd(f)(x),
    }


# grad of grad and jvp of grad against float64, every option set and reduction: shared_tests/test_second_order.py.
@pytest.mark.parametrize("transform", ["hessian", "jitted_grad_of_grad"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_higher_order_through_the_kernels_equals_the_reference(put, transform, reduction):
    """Reverse mode runs the kernels; differentiating that again goes through the launchers' jvp rules (the
    reference's), so the full Hessian and a jitted grad of grad equal the reference backend's."""
    x, labels = _small(put)
    options = dict(z_loss=1e-3, logit_softcapping=5.0, label_smoothing=0.1)

    def loss(backend):
        def f(a):
            out = cross_entropy(a, labels, backend=backend, reduction=reduction, **options)
            return jnp.sum(out * jnp.linspace(0.5, 2.0, out.size).reshape(out.shape))

        return f

    got = _higher_order(loss("kernel"), x)[transform]()
    want = _higher_order(loss("reference"), x)[transform]()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(w)))
        assert scale > 1e-4  # a second derivative that is not trivially zero
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("transform", ["jvp", "jitted_jvp", "linearize", "jacfwd"])
def test_forward_mode_through_the_kernels_raises_jax_type_error(put, transform):
    x, labels = _small(put)
    with pytest.raises(TypeError, match=FORWARD_MODE):
        _forward_mode(lambda a: cross_entropy(a, labels, backend="kernel"), x)[transform]()


def test_reference_backend_supports_forward_mode_and_second_order(put):
    x, labels = _small(put)
    v = put(np.random.default_rng(5).standard_normal(x.shape), jnp.float32)

    def f(a):
        return cross_entropy(a, labels, backend="reference", reduction="sum")

    # d(sum loss) = sum(grad * v); the Hessian of lse - z_y is diag(p) - p p^T per row. Directional and second
    # derivatives are outside tolerances.py's model (loss and gradient): plain rtol / atol here.
    ref = expected(x, labels, reduction="sum")
    p = np.exp(as_float64(x) - ref.lse[:, None])
    vv = np.asarray(v, np.float64)
    _, tangent = jax.jvp(f, (x,), (v,))
    np.testing.assert_allclose(np.asarray(tangent), np.sum(ref.grad * vv), rtol=1e-5, atol=1e-5, err_msg="jvp")
    _, hvp = jax.jvp(jax.grad(f), (x,), (v,))
    hvp_exact = p * vv - p * np.sum(p * vv, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(hvp, np.float64), hvp_exact, rtol=1e-4, atol=1e-6, err_msg="hvp")


# ----------------------------------------------------------------------------------------------------------------
# backend="auto" under jit: decided where the computation runs (at lowering), never interpret mode on the CPU.
# ----------------------------------------------------------------------------------------------------------------


def _cpu_inputs():
    x, y, w = random_inputs(4, 300, seed=6)
    cpu = jax.devices("cpu")[0]
    return (jax.device_put(jnp.asarray(x, jnp.float32), cpu), jax.device_put(jnp.asarray(y, jnp.int32), cpu), w)


def _value_and_grad(backend):
    return jax.jit(jax.value_and_grad(lambda a, b: cross_entropy(a, b, backend=backend, z_loss=1e-4)))


def test_auto_under_jit_on_cpu_arrays_is_the_reference():
    x, labels, _ = _cpu_inputs()
    step = _value_and_grad("auto")
    text = step.lower(x, labels).as_text()
    assert "triton" not in text and "while" not in text  # neither compiled nor interpreted kernels
    loss, grad = step(x, labels)
    ref_loss, ref_grad = _value_and_grad("reference")(x, labels)
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(ref_loss))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(ref_grad))


@pytest.fixture
def pretend_gpu_machine(monkeypatch):
    """A process with a GPU backend: traced logits take the platform-dependent route (as on the H200), and this
    CPU-only test then lowers it for the CPU, like committed CPU arrays under jit on a GPU machine."""
    monkeypatch.setattr(core_options, "gpu_available", lambda: True)


def test_auto_under_jit_decides_at_lowering(pretend_gpu_machine):
    x, labels, _ = _cpu_inputs()
    step = _value_and_grad("auto")
    assert "platform_index" in str(jax.make_jaxpr(step)(x, labels))  # the choice is staged out
    cpu_text = step.lower(x, labels).as_text()
    assert "triton" not in cpu_text and "while" not in cpu_text  # the CPU gets the reference, not interpret mode
    loss, grad = step(x, labels)
    ref_loss, ref_grad = _value_and_grad("reference")(x, labels)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=1e-6, atol=1e-9)
    # The same function lowered for a GPU keeps the three compiled kernels.
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, labels)]
    cuda_text = step.trace(*abstract).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda_text.count("__gpu$xla.gpu.triton") == 3


def test_eager_committed_cpu_arrays_take_the_reference(pretend_gpu_machine, monkeypatch):
    x, labels, _ = _cpu_inputs()
    ref_loss, ref_grad = _value_and_grad("reference")(x, labels)
    # Under jax.grad without jit the choice is staged out too; the kernel path is jitted inside the call, so it is
    # made when that jit lowers for the CPU arrays, even in a process whose default backend is a GPU (applied op by
    # op it used to pick the compiled branch there and fail to lower it).
    loss, grad = jax.value_and_grad(lambda a: cross_entropy(a, labels, z_loss=1e-4))(x)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=1e-6, atol=1e-9)

    def no_kernels(*args, **kwargs):
        raise AssertionError("auto picked the kernels for concrete CPU arrays")

    # Concrete arrays say where they are: the reference, without tracing (or reusing a trace of) any kernel.
    monkeypatch.setattr(launch, "forward", no_kernels)
    monkeypatch.setattr(autograd, "kernel_loss", no_kernels)
    np.testing.assert_allclose(float(cross_entropy(x, labels, z_loss=1e-4)), float(ref_loss), rtol=1e-6)


def test_higher_order_under_the_platform_route(pretend_gpu_machine):
    x, labels, _ = _cpu_inputs()
    x = x[:2, :40]
    labels = jnp.minimum(labels[:2], 39)

    def f(backend):
        return lambda a: cross_entropy(a, labels, backend=backend)

    got = jax.jit(jax.hessian(f("auto")))(x)
    want = jax.hessian(f("reference"))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_cpu_arrays_under_jit_on_a_gpu_machine(device):
    cpu = jax.devices("cpu")[0]
    x, y, _ = random_inputs(8, 1000, seed=7)
    x = x.astype(np.float32)
    ref = expected(x, y, reduction="mean")
    for backend in ("auto",):  # backend="kernel" under jit in a GPU process means the compiled kernels
        step = jax.jit(jax.value_and_grad(lambda a, b: cross_entropy(a, b, backend=backend)))
        # Committed CPU arrays: jit runs on the CPU, so the kernels must not be lowered for it.
        xc, yc = jax.device_put(x, cpu), jax.device_put(y.astype(np.int32), cpu)
        assert "triton" not in step.lower(xc, yc).as_text()
        loss, grad = step(xc, yc)
        assert grad.devices() == {cpu}
        assert_loss(loss, ref, what=f"{backend} loss, committed CPU arrays")
        assert_grad(grad, ref, what=f"{backend} grad, committed CPU arrays")
        # The default device set to the CPU, NumPy inputs.
        with jax.default_device(cpu):
            loss, _ = step(x, y.astype(np.int32))
        assert_loss(loss, ref, what=f"{backend} loss, default device CPU")
    # GPU arrays under jit: the compiled kernels.
    step = jax.jit(jax.value_and_grad(lambda a, b: cross_entropy(a, b)))
    xg, yg = jax.device_put(x, device), jax.device_put(y.astype(np.int32), device)
    assert step.lower(xg, yg).as_text().count("__gpu$xla.gpu.triton") == 3
    loss, grad = step(xg, yg)
    assert_loss(loss, ref, what="auto loss, GPU arrays")
    assert_grad(grad, ref, what="auto grad, GPU arrays")


# ----------------------------------------------------------------------------------------------------------------
# Batch invariance: a row's loss and gradient depend on V (and dtype) only, never on N, the other rows or vmap.
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def several_chunks(monkeypatch):
    """Five forward chunks at V=5000 (so the chunk combine is exercised) and three backward tiles."""
    monkeypatch.setattr(launch, "CHUNK", 1024)
    monkeypatch.setattr(launch, "FORWARD_BLOCK", 256)
    monkeypatch.setattr(launch, "BACKWARD_BLOCK", 2048)
    config = launch.forward_config(5000)
    assert (config.block, config.chunk, config.n_chunks) == (256, 1024, 5)
    return 5000


def assert_rows_equal(loss, grad, full_loss, full_grad, rows):
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(full_loss[rows]))
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(full_grad[rows], np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_alone_equals_row_in_larger_batches(put, several_chunks, dtype):
    v = several_chunks
    x, y, w = random_inputs(12, v, seed=8, n_ignored=2)
    # Shifted so that lse is near 0, where its float32 ulp is small enough to show a different chunk combine.
    x, labels, w = put(x - 10.0, dtype), put(y, jnp.int32), put(w, jnp.float32)
    step = vjp_step(backend="kernel", label_smoothing=0.1, z_loss=1e-3)
    full_loss, full_grad = step(x, labels, w)
    for row in range(12):
        assert_rows_equal(
            *step(x[row : row + 1], labels[row : row + 1], w[row : row + 1]), full_loss, full_grad, slice(row, row + 1)
        )
    assert_rows_equal(*step(x[3:8], labels[3:8], w[3:8]), full_loss, full_grad, slice(3, 8))
    assert_loss(full_loss, expected(x, y, label_smoothing=0.1, z_loss=1e-3))


def test_vmap_equals_the_flattened_call(put, several_chunks):
    v = several_chunks
    x, y, w = random_inputs(12, v, seed=9, n_ignored=2)
    x, labels, w = put(x, jnp.float32), put(y, jnp.int32), put(w, jnp.float32)
    flat_loss, flat_grad = vjp_none(x, labels, w, backend="kernel", logit_softcapping=20.0)

    def per_sequence(xs, ys, ws):
        loss, vjp = jax.vjp(
            lambda a: cross_entropy(a, ys, reduction="none", backend="kernel", logit_softcapping=20.0), xs
        )
        return loss, vjp(ws)[0]

    loss, grad = jax.jit(jax.vmap(per_sequence))(x.reshape(3, 4, v), labels.reshape(3, 4), w.reshape(3, 4))
    np.testing.assert_array_equal(np.asarray(loss).reshape(-1), np.asarray(flat_loss))
    np.testing.assert_array_equal(np.asarray(grad).reshape(-1, v), np.asarray(flat_grad))
    # vmap of a per-sequence summed loss: its gradient rows are the flattened call's with unit cotangents.
    grad_sum = jax.jit(jax.vmap(jax.grad(lambda a, b: cross_entropy(a, b, reduction="sum", backend="kernel"))))(
        x.reshape(3, 4, v), labels.reshape(3, 4)
    )
    _, flat_unit = vjp_none(x, labels, jnp.ones_like(w), backend="kernel")
    np.testing.assert_array_equal(np.asarray(grad_sum).reshape(-1, v), np.asarray(flat_unit))


@pytest.mark.gpu
def test_batch_invariance_at_llama3_vocabulary(device):
    v, n_max = 128256, 512
    key_x, key_y = jax.random.split(jax.random.key(10))
    x = jax.device_put(jax.random.normal(key_x, (n_max, v), jnp.bfloat16) * 2 - 8, device)
    labels = jax.device_put(jax.random.randint(key_y, (n_max,), 0, v, jnp.int32).at[3].set(-100), device)
    w = jax.device_put(jnp.linspace(0.5, 2.0, n_max, dtype=jnp.float32), device)
    step = vjp_step(z_loss=1e-4)  # backend="auto": the compiled kernels on GPU arrays
    full_loss, full_grad = step(x, labels, w)
    assert np.isfinite(np.asarray(full_loss)).all()
    for row in (0, 1, 2, 3, 100, 257, 510, 511):
        assert_rows_equal(
            *step(x[row : row + 1], labels[row : row + 1], w[row : row + 1]), full_loss, full_grad, slice(row, row + 1)
        )
    for start in (0, 300):
        rows = slice(start, start + 7)
        assert_rows_equal(*step(x[rows], labels[rows], w[rows]), full_loss, full_grad, rows)

    def per_sequence(xs, ys, ws):
        loss, vjp = jax.vjp(lambda a: cross_entropy(a, ys, reduction="none", z_loss=1e-4), xs)
        return loss, vjp(ws)[0]

    loss, grad = jax.jit(jax.vmap(per_sequence))(x.reshape(4, 128, v), labels.reshape(4, 128), w.reshape(4, 128))
    assert_rows_equal(loss.reshape(-1), grad.reshape(-1, v), full_loss, full_grad, slice(None))
