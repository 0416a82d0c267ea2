"""fastce_jax with sharded logits under jit (distributed/partitioning.py) and the kernels' vocab-parallel mode.

Everything is compared with the float64 reference in shared_tests/reference.py.  The sharded tests need several
devices: on CPU, ``test_sharded_suite_on_4_cpu_devices`` re-runs this module (and the sharded tests of the other
modules, SHARDED_ELSEWHERE) in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (the flag must be set before jax is imported); run directly in a
process that already has several devices (or with --gpu on two GPUs) the tests run here.  On CPU backend="kernel"
runs the Pallas kernels in interpret mode, backend="auto" the jnp reference, so both are tested.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fastce_jax import cross_entropy
from fastce_jax.core.options import Options
from fastce_jax.losses.cross_entropy import launch
from shared_tests import reference, tolerances

from . import checks

EPS32 = tolerances.EPS32
N_ROWS, VOCAB = 8, 64  # tiny: the interpreter is slow; divisible by 4 devices either way
ALL = dict(label_smoothing=0.2, z_loss=1e-3, logit_softcapping=7.0, logit_scaling=1.3)
OPTION_SETS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "smoothing1": dict(label_smoothing=1.0),
    "z_loss": dict(z_loss=1e-2),
    "softcap": dict(logit_softcapping=4.0),
    "scaling": dict(logit_scaling=0.5),
    "ignore5": dict(ignore_index=5),
    "all": ALL,
}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


# ----------------------------------------------------------------------------
# Running the sharded tests somewhere with several devices.
# ----------------------------------------------------------------------------


def _platform(use_gpu):
    return "gpu" if use_gpu else "cpu"


# Every test of the suite that needs several devices, in one 4-device child: this module, and the sharded tests of
# test_outputs.py, test_linear_cross_entropy.py, test_rl_sharding.py, test_jsd.py and test_weight_layout.py, which
# must run there, not skip.
SHARDED_ELSEWHERE = (
    "fastce_jax/tests/test_outputs.py::test_sharded_layout",
    "fastce_jax/tests/test_linear_cross_entropy.py::test_skip_ignored_rows_sharded",
    "fastce_jax/tests/test_linear_cross_entropy.py::test_class_weight_rows_sharded",
    "fastce_jax/tests/test_rl_sharding.py",
    "fastce_jax/tests/test_jsd.py::test_jsd_rows_sharded",
    "fastce_jax/tests/test_weight_layout.py::test_hv_sharded_vocabulary",
    "fastce_jax/tests/test_linear_rl_entropy.py::test_sharded_head_temperature_token_weights_entropy",
    "fastce_jax/tests/test_linear_rl_entropy.py::test_sharded_head_float32_logits",
)


@pytest.mark.slow
def test_sharded_suite_on_4_cpu_devices(use_gpu):
    # The one-device tests of this module (the kernels' vocab-parallel mode) ran in this process already.
    targets = ["fastce_jax/tests/test_sharding.py", *SHARDED_ELSEWHERE, "-k", "not test_vocab_parallel_kernel_mode"]
    out = checks.run_on_4_cpu_devices(use_gpu, targets)
    print(out[-3000:])
    modules_elsewhere = {node.split("::")[0] for node in SHARDED_ELSEWHERE}
    skipped_elsewhere = [
        line for line in out.splitlines() if line.startswith("SKIPPED") and any(m in line for m in modules_elsewhere)
    ]
    assert not skipped_elsewhere, skipped_elsewhere  # (a node id that names nothing fails the child)


@pytest.fixture(scope="module")
def devices(use_gpu):
    devs = jax.devices(_platform(use_gpu))
    if len(devs) < 2:
        pytest.skip("needs several devices (run through test_sharded_suite_on_4_cpu_devices)")
    return devs


def mesh_for(devices, layout):
    """(mesh, logits spec, logits shape) of a named layout."""
    n = len(devices)
    one = Mesh(np.array(devices), ("d",))
    if layout in ("rows", "vocab", "seq"):
        return one, {"rows": P("d", None), "vocab": P(None, "d"), "seq": P(None, "d", None)}[layout]
    if n < 4:
        pytest.skip("a 2-D mesh needs 4 devices")
    two = Mesh(np.array(devices[:4]).reshape(2, 2), ("r", "v"))
    return two, {
        "2d": P("r", "v"),
        "rows2": P(("r", "v"), None),
        "vocab2": P(None, ("v", "r")),
        "3d": P("r", None, "v"),
    }[layout]


def make_inputs(shape, seed, *, ignore_index=-100, dtype=np.float32, bad_labels=False):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2.0).astype(np.float32)
    y = rng.integers(0, shape[-1], shape[:-1]).astype(np.int32)
    flat = y.reshape(-1)
    flat[rng.permutation(flat.size)[:2]] = ignore_index
    if bad_labels:
        flat[rng.permutation(flat.size)[:2]] = [shape[-1] + 3, -7]
    return jnp.asarray(x, dtype), y


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def expected(x, y, opts, reduction="mean", n_items=None, upstream=None):
    return checks.expected(x, y, reduction=reduction, n_items=n_items, upstream=upstream, **opts)


def check_against_reference(loss, grad, x, y, opts, reduction="mean", n_items=None, upstream=None):
    ref = expected(x, y, opts, reduction, n_items, upstream)
    checks.assert_loss(loss, ref)
    checks.assert_grad(grad, ref)


def collectives(compiled_text):
    """[(op, element count of its result)] of every collective in compiled HLO text."""
    found = []
    for line in compiled_text.splitlines():
        m = re.search(r"=\s*(\(?[^=]*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
        if not m:
            continue
        sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\[([\d,]*)\]", m[1])]
        found.append((m[2], max(sizes, default=1)))
    return found


def value_and_grad_fn(backend, reduction="mean", n_items=None, **opts):
    def f(a, b):
        return cross_entropy(a, b, backend=backend, reduction=reduction, n_items=n_items, **opts)

    return jax.jit(jax.value_and_grad(f))


# ----------------------------------------------------------------------------
# Every layout, both backends.
# ----------------------------------------------------------------------------


LAYOUTS = ["rows", "vocab", "seq", "2d", "rows2", "vocab2", "3d"]


@pytest.mark.parametrize("backend", ["kernel", "auto"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_reference(devices, layout, backend):
    mesh, spec = mesh_for(devices, layout)
    shape = (2, N_ROWS // 2 * 2, VOCAB) if len(spec) == 3 else (N_ROWS, VOCAB)
    x, y = make_inputs(shape, seed=len(layout))
    xs, ys = put(x, mesh, spec), put(y, mesh, P(*spec[:-1]))
    f = value_and_grad_fn(backend, **ALL)
    loss, grad = f(xs, ys)
    check_against_reference(loss, grad, x, y, ALL)
    # The gradient keeps the logits' sharding.
    assert grad.sharding.is_equivalent_to(xs.sharding, xs.ndim), (grad.sharding, xs.sharding)
    if backend == "kernel":
        # O(N) communication: no collective anywhere near the logits' size.
        found = collectives(f.lower(xs, ys).compile().as_text())
        assert all(size <= 3 * y.size for _, size in found), found
        if spec[-1] is None:  # rows only: a "mean" needs scalar all-reduces and nothing else
            assert all(size == 1 for _, size in found), found
        else:  # vocabulary sharded: the combine's all-reduces of N-vectors are there
            assert any(op == "all-reduce" and size > 1 for op, size in found), found


@pytest.mark.parametrize("name", list(OPTION_SETS))
@pytest.mark.parametrize("layout", ["vocab", "2d"])
def test_every_option_vocab_parallel(devices, layout, name):
    opts = OPTION_SETS[name]
    mesh, spec = mesh_for(devices, layout)
    x, y = make_inputs((N_ROWS, VOCAB), seed=3, ignore_index=opts.get("ignore_index", -100))
    xs, ys = put(x, mesh, spec), put(y, mesh, P(spec[0]))
    loss, grad = value_and_grad_fn("kernel", **opts)(xs, ys)
    check_against_reference(loss, grad, x, y, opts)


@pytest.mark.parametrize("reduction", ["sum", "none", "n_items", "n_items_traced"])
@pytest.mark.parametrize("layout", ["rows", "vocab", "2d"])
def test_reductions_and_n_items(devices, layout, reduction):
    mesh, spec = mesh_for(devices, layout)
    x, y = make_inputs((N_ROWS, VOCAB), seed=4)
    xs, ys = put(x, mesh, spec), put(y, mesh, P(spec[0]))
    if reduction == "none":
        w = np.random.default_rng(5).uniform(0.5, 2.0, y.shape).astype(np.float32)

        def f(a, b):
            return cross_entropy(a, b, backend="kernel", reduction="none", **ALL)

        loss, vjp = jax.vjp(lambda a: f(a, ys), xs)
        (grad,) = vjp(jnp.asarray(w))
        check_against_reference(loss, grad, x, y, ALL, reduction="none", upstream=w)
        assert loss.sharding.is_equivalent_to(NamedSharding(mesh, P(spec[0])), 1)
    elif reduction == "sum":
        loss, grad = value_and_grad_fn("kernel", "sum", **ALL)(xs, ys)
        check_against_reference(loss, grad, x, y, ALL, reduction="sum")
    elif reduction == "n_items":
        loss, grad = value_and_grad_fn("kernel", "mean", n_items=13, **ALL)(xs, ys)
        check_against_reference(loss, grad, x, y, ALL, reduction="mean", n_items=13)
    else:  # a traced n_items (transformers' num_items_in_batch is an array)

        @jax.jit
        def f(a, b, n):
            return jax.value_and_grad(lambda t: cross_entropy(t, b, backend="kernel", n_items=n, **ALL))(a)

        loss, grad = f(xs, ys, jnp.int32(11))
        check_against_reference(loss, grad, x, y, ALL, reduction="mean", n_items=11)
    assert grad.sharding.is_equivalent_to(xs.sharding, 2)


@pytest.mark.parametrize("layout", ["vocab", "2d"])
def test_bad_labels_give_nan_rows_only(devices, layout):
    """Labels outside [0, V): NaN loss and NaN gradient row on every shard, other rows exact."""
    mesh, spec = mesh_for(devices, layout)
    x, y = make_inputs((N_ROWS, VOCAB), seed=6, bad_labels=True)
    xs, ys = put(x, mesh, spec), put(y, mesh, P(spec[0]))
    w = np.ones(y.shape, np.float32)
    loss, vjp = jax.vjp(lambda a: cross_entropy(a, ys, backend="kernel", reduction="none", **ALL), xs)
    (grad,) = vjp(jnp.asarray(w))
    assert np.isnan(np.asarray(loss)).sum() == 2
    check_against_reference(loss, grad, x, y, ALL, reduction="none", upstream=w)


@pytest.mark.parametrize("layout", ["rows", "vocab", "2d"])
def test_second_order_under_sharding(devices, layout):
    """Grad of grad and jvp of grad through the sharded kernels (the launchers' jvp rules, the reference's, applied
    to the sharded arrays) equal the unsharded reference backend's."""
    mesh, spec = mesh_for(devices, layout)
    x, y = make_inputs((N_ROWS, VOCAB), seed=9)
    v = jnp.asarray(np.random.default_rng(10).standard_normal(x.shape), jnp.float32)

    def second_order(backend):
        def loss(a, b):
            return cross_entropy(a, b, backend=backend, **ALL)

        def run(a, b, t):
            penalty = jax.grad(lambda a: jnp.sum(jax.grad(loss)(a, b) ** 2))(a)
            return penalty, jax.jvp(lambda a: jax.grad(loss)(a, b), (a,), (t,))[1]

        return jax.jit(run)

    got = second_order("kernel")(put(x, mesh, spec), put(y, mesh, P(spec[0])), put(v, mesh, spec))
    want = second_order("reference")(x, y, v)
    for name, g, w in zip(("grad of grad", "jvp of grad"), got, want):
        scale = float(jnp.max(jnp.abs(w)))
        assert scale > 1e-4, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def test_bfloat16_vocab_parallel(devices):
    mesh, spec = mesh_for(devices, "vocab")
    x, y = make_inputs((N_ROWS, VOCAB), seed=7, dtype=jnp.bfloat16)
    xs, ys = put(x, mesh, spec), put(y, mesh, P(None))
    loss, grad = value_and_grad_fn("kernel", **ALL)(xs, ys)
    assert grad.dtype == jnp.bfloat16
    check_against_reference(loss, grad, x, y, ALL)


@pytest.mark.parametrize("layout", ["rows", "vocab", "2d"])
def test_batch_invariance(devices, layout):
    """A row's loss and gradient do not depend on the other rows (bitwise), sharded or not."""
    mesh, spec = mesh_for(devices, layout)
    x, y = make_inputs((N_ROWS, VOCAB), seed=8)
    x2, _ = make_inputs((N_ROWS, VOCAB), seed=9)
    x2 = x2.at[: N_ROWS // 2].set(x[: N_ROWS // 2])
    g = jax.jit(
        lambda a, b: jax.value_and_grad(lambda t: cross_entropy(t, b, reduction="sum", backend="kernel", **ALL))(a)
    )
    ys = put(y, mesh, P(spec[0]))
    _, g1 = g(put(x, mesh, spec), ys)
    _, g2 = g(put(x2, mesh, spec), ys)
    half = N_ROWS // 2
    assert np.array_equal(np.asarray(g1)[:half], np.asarray(g2)[:half])
    per_token = jax.jit(lambda a, b: cross_entropy(a, b, reduction="none", backend="kernel", **ALL))
    l1, l2 = per_token(put(x, mesh, spec), ys), per_token(put(x2, mesh, spec), ys)
    assert np.array_equal(np.asarray(l1)[:half], np.asarray(l2)[:half])
    if spec[-1] is None:  # rows sharded: the very same kernels as one device, bit for bit
        one = per_token(jnp.asarray(x), jnp.asarray(y))
        assert np.array_equal(np.asarray(l1), np.asarray(one))


def test_vmap_and_eager_under_sharding(devices):
    mesh, spec = mesh_for(devices, "seq")  # (B, T, V) with T sharded
    x, y = make_inputs((2, N_ROWS, VOCAB), seed=10)
    xs, ys = put(x, mesh, P(None, None, "d")), put(y, mesh, P(None, None))
    f = jax.value_and_grad(lambda a, b: cross_entropy(a, b, backend="kernel", **ALL))
    loss, grad = jax.jit(jax.vmap(f))(xs, ys)
    for i in range(2):
        check_against_reference(loss[i], grad[i], x[i], y[i], ALL)
    loss, grad = f(xs, ys)  # eager: each op runs as its own jit
    check_against_reference(loss, grad, x, y, ALL)
    assert grad.sharding.is_equivalent_to(xs.sharding, 3)


# ----------------------------------------------------------------------------
# Inside a user's shard_map.
# ----------------------------------------------------------------------------


def _local_value_and_grad(backend, check_vma, mesh, spec):
    """shard_map over the rows: each device's summed loss (a (1,) block) and its gradient block."""

    def body(a, b):
        loss, grad = jax.value_and_grad(lambda t: cross_entropy(t, b, backend=backend, reduction="sum", **ALL))(a)
        return loss[None], grad

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(spec, P(*spec[:-1])), out_specs=(P(spec[0]), spec), check_vma=check_vma
        )
    )


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("backend", ["kernel", "auto"])
def test_inside_shard_map(devices, use_gpu, backend, check_vma):
    mesh, spec = mesh_for(devices, "rows")
    x, y = make_inputs((N_ROWS, VOCAB), seed=12)
    f = _local_value_and_grad(backend, check_vma, mesh, spec)
    if backend == "kernel" and check_vma and not use_gpu:
        with pytest.raises(NotImplementedError, match="check_vma"):
            f(x, y)
        return
    losses, grad = f(put(x, mesh, spec), put(y, mesh, P("d")))
    ref = expected(x, y, ALL, "sum")
    check_against_reference(jnp.sum(losses), grad, x, y, ALL, reduction="sum")
    # Each device's block is the sum of its own rows.
    blocks = ref.token_loss.reshape(len(devices), -1).sum(axis=1)
    tolerances.check(
        losses, blocks, 32 * EPS32 * ref.loss_scale.reshape(len(devices), -1).sum(axis=1), "per-device sums"
    )


def test_inside_shard_map_2d_with_psum(devices, use_gpu):
    """A 2-D shard_map whose body psums the loss: the varying types line up (reference backend on CPU)."""
    mesh, _ = mesh_for(devices, "2d")
    x, y = make_inputs((2, N_ROWS, VOCAB), seed=13)
    backend = "kernel" if use_gpu else "auto"

    def body(a, b):
        return jax.lax.psum(cross_entropy(a, b, backend=backend, reduction="sum", **ALL), ("r", "v"))

    f = jax.jit(
        jax.shard_map(
            jax.value_and_grad(body),
            mesh=mesh,
            in_specs=(P("r", "v", None), P("r", "v")),
            out_specs=(P(), P("r", "v", None)),
        )
    )
    loss, grad = f(x, y)
    check_against_reference(loss, grad, x, y, ALL, reduction="sum")


# ----------------------------------------------------------------------------
# The kernels' vocab-parallel mode alone (one device; the same mode as fastce_torch's).
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["plain", "all", "smoothing1", "ignore5"])
@pytest.mark.parametrize("splits", [(64,), (16, 48), (20, 20, 24)], ids=["one", "two", "three"])
def test_vocab_parallel_kernel_mode(name, splits):
    opts = OPTION_SETS[name]
    options = Options(**{**Options()._asdict(), **opts})
    x, y = make_inputs((N_ROWS, VOCAB), seed=14, ignore_index=options.ignore_index, bad_labels=True)
    ref = expected(x, y, opts, "none")
    starts = np.cumsum((0,) + splits)[:-1]
    stats = [
        launch.forward(
            x[:, s : s + w], jnp.asarray(y), options, interpret=True, vocab_start=jnp.int32(s), vocab_total=VOCAB
        )
        for s, w in zip(starts, splits)
    ]
    lse_parts = np.stack([np.asarray(s[0], np.float64) for s in stats])
    with np.errstate(invalid="ignore", divide="ignore"):
        top = np.nanmax(lse_parts, axis=0)
        top = np.where(np.isfinite(top), top, 0.0)
        lse = top + np.log(np.exp(lse_parts - top).sum(axis=0))
    z_label = sum(np.asarray(s[1], np.float64) for s in stats)
    sum_z = sum(np.asarray(s[2], np.float64) for s in stats)
    keep = y != options.ignore_index
    bound = 32 * EPS32 * ref.loss_scale
    tolerances.check(lse[keep], ref.lse[keep], bound[keep], "combined lse")
    in_range = (y >= 0) & (y < VOCAB) & keep
    zref = reference.transform(np.asarray(x, np.float64), reference.Options(**opts))
    want_label = np.take_along_axis(zref, np.where(in_range, y, 0)[:, None], axis=-1)[:, 0]
    tolerances.check(z_label[in_range], want_label[in_range], bound[in_range], "label logit")
    if options.label_smoothing:
        sum_bound = 32 * EPS32 * (np.abs(zref).sum(axis=-1) + 1.0)
        tolerances.check(sum_z[keep], zref.sum(axis=-1)[keep], sum_bound[keep], "sum of z")
    else:
        assert (sum_z == 0).all()
    # Backward with the global lse: the shards' gradients side by side are the full gradient.
    g = np.random.default_rng(15).uniform(0.5, 2.0, N_ROWS).astype(np.float32)
    ref = expected(x, y, opts, "none", upstream=g)
    grads = [
        launch.backward(
            x[:, s : s + w],
            jnp.asarray(y),
            jnp.asarray(ref.lse, jnp.float32),
            jnp.asarray(g),
            options,
            inplace=False,
            interpret=True,
            vocab_start=jnp.int32(s),
            vocab_total=VOCAB,
        )
        for s, w in zip(starts, splits)
    ]
    grad = np.concatenate([np.asarray(d) for d in grads], axis=1)
    tolerances.check(grad, ref.grad, 32 * EPS32 * ref.grad_scale + 1e-30, "gradient")


# ----------------------------------------------------------------------------
# linear_cross_entropy with the weight sharded over the vocabulary and / or the rows over another axis
# (fastce_jax/linear/sharded.py): against shared_tests/test_linear_cross_entropy.py's float64
# reference and tolerances, and the compiled HLO holds no weight-sized all-gather and no logits-sized collective.
# ----------------------------------------------------------------------------

LINEAR_LAYOUTS = {  # (hidden spec, weight spec)
    "rows": (P("d", None), P(None, None)),
    "vocab": (P(None, None), P("d", None)),
    "2d": (P("r", None), P("v", None)),
    "2d-swapped": (P("v", None), P("r", None)),
    "vocab2": (P(None, None), P(("v", "r"), None)),
}
LINEAR_CASES = ["mean-bias", "none-all-options", "sum-n_items", "bad-label-none"]


def linear_mesh(devices, layout):
    if layout in ("rows", "vocab"):
        return Mesh(np.array(devices), ("d",))
    if len(devices) < 4:
        pytest.skip("a 2-D mesh needs 4 devices")
    return Mesh(np.array(devices[:4]).reshape(2, 2), ("r", "v"))


def linear_case(name):
    import dataclasses

    from shared_tests import test_linear_cross_entropy as lin

    case = next(c for c in lin.CASES if c.name == name)
    # Rows and vocabulary divisible by 4 devices; several chunks per device, the last one clamped.
    return lin, dataclasses.replace(case, shape=(32,), vocab=128, width=8, chunk_rows=5, seed=7)


def linear_value_and_grad(case, lin, n_items, upstream, with_bias):
    from fastce_jax import linear_cross_entropy

    kwargs = lin.kwargs_of(case, n_items)

    def objective(h, w, b, y):
        loss = linear_cross_entropy(h, w, y, bias=b if with_bias else None, backend="kernel", **kwargs)
        return jnp.sum(loss * upstream), loss

    return jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True))


# Every case on the vocabulary-sharded weight (one axis and 2-D); the other layouts (rows, axes swapped, a vocabulary
# over both axes) with a reduced case and a per-token one.
LINEAR_LAYOUT_CASES = [(layout, name) for layout in ("vocab", "2d") for name in LINEAR_CASES] + [
    (layout, name) for layout in ("rows", "2d-swapped", "vocab2") for name in ("mean-bias", "none-all-options")
]


@pytest.mark.parametrize("layout, name", LINEAR_LAYOUT_CASES)
def test_linear_sharded_weight(devices, layout, name):
    lin, case = linear_case(name)
    mesh = linear_mesh(devices, layout)
    hidden_spec, weight_spec = LINEAR_LAYOUTS[layout]
    inputs = lin.make_inputs(case, "cpu")
    hidden, weight, bias, labels, upstream, n_items = inputs
    n_items = None if n_items is None else jnp.asarray(float(n_items)) if hasattr(n_items, "item") else n_items
    h = put(jnp.asarray(hidden.numpy()), mesh, hidden_spec)
    w = put(jnp.asarray(weight.numpy()), mesh, weight_spec)
    b = put(jnp.asarray((bias if bias is not None else weight[:, 0]).numpy()), mesh, P(weight_spec[0]))
    y = put(jnp.asarray(labels.numpy()), mesh, P(hidden_spec[0]))
    g = jnp.asarray(upstream.numpy())
    f = linear_value_and_grad(case, lin, n_items, g, bias is not None)
    with jax.default_matmul_precision("float32"):
        (_, loss), (dh, dw, db) = f(h, w, b, y)
        text = f.lower(h, w, b, y).compile().as_text()
    chunks = -(-case.shape[0] // case.chunk_rows)
    grads = [np.asarray(dh), np.asarray(dw), None if bias is None else np.asarray(db)]
    lin.check_result(case, inputs, (np.asarray(loss), grads), chunks)
    assert dw.sharding.is_equivalent_to(w.sharding, 2) and dh.sharding.is_equivalent_to(h.sharding, 2)
    # Communication: the combine's per-chunk all-reduces, d hidden's over the vocabulary axes (the device's rows
    # x H) and d weight's over the rows' axes (the device's weight block): nothing weight-sized gathered, nothing
    # the size of a device's logits block.
    n, (vocab, width) = case.shape[0], weight.shape
    n_local = n // math.prod(mesh.shape[a] for a in _spec_axes(hidden_spec[0]))
    v_local = vocab // math.prod(mesh.shape[a] for a in _spec_axes(weight_spec[0]))
    found = collectives(text)
    assert all(op != "all-gather" or size <= 3 * n for op, size in found), found
    bound = max(3 * case.chunk_rows, n_local * width, v_local * width, 1)
    assert all(size <= bound for _, size in found), (bound, found)
    if weight_spec[0] is not None:
        assert any(op == "all-reduce" and size == 3 * case.chunk_rows for op, size in found), found


def _spec_axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def test_linear_vmap_and_user_shard_map(devices):
    """With several devices the chunk loop is a custom_partitioning op: under vmap it runs the unpartitioned loop,
    inside a user's shard_map (check_vma=False: Pallas interpret mode) the device's block as on one device."""
    from fastce_jax import linear_cross_entropy

    lin, case = linear_case("mean-bias")
    hidden, weight, bias, labels, _, _ = lin.make_inputs(case, "cpu")
    h, w, b, y = (jnp.asarray(t.numpy()) for t in (hidden, weight, bias, labels))

    def loss(h, w, b, y):
        return linear_cross_entropy(h, w, y, bias=b, backend="kernel", chunk_rows=5, reduction="sum")

    def reference_loss(h, w, b, y):
        return linear_cross_entropy(h, w, y, bias=b, backend="reference", reduction="sum")

    with jax.default_matmul_precision("float32"):
        hb, yb = h.reshape(2, 16, -1), y.reshape(2, 16)
        got = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(0, None, None, 0)))(hb, w, b, yb)
        want = jax.vmap(jax.value_and_grad(reference_loss, argnums=(0, 1)), in_axes=(0, None, None, 0))(hb, w, b, yb)
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-5)
        mesh = Mesh(np.array(devices), ("d",))
        local = jax.jit(
            jax.shard_map(
                lambda h, w, b, y: jax.lax.psum(loss(h, w, b, y), "d"),
                mesh=mesh,
                in_specs=(P("d"), P(), P(), P("d")),
                out_specs=P(),
                check_vma=False,
            )  # fmt: skip
        )
        np.testing.assert_allclose(float(local(h, w, b, y)), float(reference_loss(h, w, b, y)), rtol=2e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("layout", ["vocab", "2d"])
def test_linear_sharded_weight_extra_outputs(devices, layout, reduction):
    """Every return_* output through the partitioned loop, the loss and the z_loss output both differentiated,
    against the jnp reference of the same call (replicated); still no weight- or logits-sized collective."""
    from fastce_jax import linear_cross_entropy

    lin, case = linear_case("mean-bias")
    mesh = linear_mesh(devices, layout)
    hidden_spec, weight_spec = LINEAR_LAYOUTS[layout]
    hidden, weight, bias, labels, _, _ = lin.make_inputs(case, "cpu")
    h, w, b, y = (jnp.asarray(t.numpy()) for t in (hidden, weight, bias, labels))
    rng = np.random.default_rng(3)
    up = jnp.asarray(rng.standard_normal(y.shape if reduction == "none" else ()), jnp.float32)
    up_z = jnp.asarray(rng.standard_normal(y.shape if reduction == "none" else ()), jnp.float32)
    opts = dict(label_smoothing=0.1, z_loss=1e-2, logit_softcapping=6.0, reduction=reduction, chunk_rows=5)
    flags = dict(return_z_loss=True, return_lse=True, return_accuracy=True, return_entropy=True)

    def objective(backend):
        def f(h, w, b, y):
            out = linear_cross_entropy(h, w, y, bias=b, backend=backend, **opts, **flags)
            return jnp.sum(out.loss * up) + jnp.sum(out.z_loss * up_z), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    args = (put(h, mesh, hidden_spec), put(w, mesh, weight_spec), put(b, mesh, P(weight_spec[0])))
    args = args + (put(y, mesh, P(hidden_spec[0])),)
    # One jitted kernel objective, called and then lowered (its trace and executable cached: a second objective would
    # trace and compile the same program again).
    kernel_objective = objective("kernel")
    with jax.default_matmul_precision("float32"):
        (_, got), got_grads = kernel_objective(*args)
        (_, want), want_grads = objective("reference")(h, w, b, y)
        text = kernel_objective.lower(*args).compile().as_text()
    for name in ("loss", "z_loss", "lse", "accuracy", "entropy"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=3e-5, atol=3e-6, err_msg=name)
    for a, e in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, e, rtol=3e-5, atol=3e-6)
    found = collectives(text)
    n, (vocab, width) = case.shape[0], weight.shape
    v_local = vocab // math.prod(mesh.shape[a] for a in _spec_axes(weight_spec[0]))
    assert all(op != "all-gather" or size <= 4 * n for op, size in found), found
    assert all(size <= max(4 * n, n * width, v_local * width) for _, size in found), found
