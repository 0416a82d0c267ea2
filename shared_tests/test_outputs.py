"""The extra outputs (return_z_loss, return_lse, return_accuracy, return_entropy -> CrossEntropyOutput) of
cross_entropy and linear_cross_entropy in both packages, against the float64 reference (reference.outputs).

Tolerances, from the shared model (tolerances.py), per token t with M_t the loss's error scale
(reference.Result.loss_scale, which bounds 1 + |lse_t| + max_j |z_tj|):
  lse:      RTOL M_t                 (the loss's own logsumexp)
  z_loss:   RTOL (2 |z_loss| |lse_t| M_t + |z_loss| lse_t^2)
  entropy:  2 RTOL M_t               (lse_t - E_p[z]: each term's error is ~ eps32 M_t)
  accuracy: exact (argmax of float32 values; the cases are checked to hold no near-ties, where float32 rounding may
            pick another column than float64 does)
reduced like the outputs (the sum of per-token bounds over the denominator, plus the float32 summation).
Also: each keyword alone, exact ties, several vocabulary chunks, the z_loss output's gradient (alone and with the
loss's), no gradient on lse and accuracy (the entropy's gradient: test_entropy_grad.py), linear_cross_entropy over
several row chunks, torch.compile(fullgraph=True), vocab-parallel and DTensor over gloo ranks
(fastce_torch/tests/vocab_parallel_outputs_check.py) and, with --gpu, CUDA-graph capture. fastce_jax's cases are
skipped until fastce_jax.CrossEntropyOutput exists.
"""

import dataclasses
import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from . import exchange, reference
from .harness import Case, as_f64, make_inputs, optional_jax
from .tolerances import FLOOR, RTOL, check, grad_bound

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")

FIELDS = ("z_loss", "lse", "accuracy", "entropy")
ALL_RETURNS = {f"return_{name}": True for name in FIELDS}
ALL = reference.Options(logit_softcapping=5.0, logit_scaling=0.7, label_smoothing=0.1, z_loss=1e-3)
PACKAGES = ["torch", "jax"]


def jax_or_skip():
    fastce_jax = optional_jax()
    if fastce_jax is None or not hasattr(fastce_jax, "CrossEntropyOutput"):
        pytest.skip("fastce_jax has no CrossEntropyOutput yet")
    return fastce_jax


def case(name, **fields):
    fields.setdefault("shape", (9,))
    fields.setdefault("vocab", 37)
    return pytest.param(Case(name, **fields), id=f"{name}-{fields.get('dtype', 'float32')}")


Z = reference.Options(z_loss=1e-2)
CASES = [
    case("mean", seed=1),
    case("sum", reduction="sum", seed=2),
    case("none", reduction="none", seed=3),
    case("z-loss-mean", opts=Z, offset=5.0, seed=4),
    case("z-loss-none", opts=Z, reduction="none", seed=5),
    case("smoothing", opts=reference.Options(label_smoothing=0.2), reduction="sum", seed=6),
    case("softcap", opts=reference.Options(logit_softcapping=5.0), reduction="none", seed=7),
    case("scaling", opts=reference.Options(logit_scaling=-1.5), seed=8),
    case("all-options", opts=ALL, reduction="none", seed=9),
    case("all-options-mean", opts=ALL, seed=10),
    case("ignore-minus-one", opts=reference.Options(ignore_index=-1), reduction="none", seed=11),
    case("ignore-real-class", ignore="class", opts=reference.Options(ignore_index=3), seed=12),
    case("all-ignored", ignore="all", seed=13),
    case("all-ignored-none", ignore="all", reduction="none", seed=14),
    case("none-ignored", ignore="none", reduction="sum", seed=15),
    case("n-items", n_items=5, opts=Z, seed=16),
    case("n-items-tensor-sum", reduction="sum", n_items=("tensor", 3.5), seed=17),
    case("bad-labels", bad_labels=(37, -5), reduction="none", opts=Z, seed=18),
    case("bad-labels-mean", bad_labels=(40,), seed=19),
    case("neg-inf-tail", neg_inf="tail", reduction="none", seed=20),
    case("neg-inf-scatter", neg_inf="scatter", opts=reference.Options(label_smoothing=0.1), seed=21),
    case("nonfinite-rows", nonfinite_rows=True, reduction="none", seed=22),
    case("3d", shape=(2, 3, 4), reduction="none", seed=23),
    case("3d-mean", shape=(2, 3, 4), opts=ALL, seed=24),
    case("int32", label_dtype="int32", reduction="none", seed=25),
    case("not-inplace", inplace=False, opts=Z, seed=26),
    case("bf16", dtype="bfloat16", opts=ALL, reduction="none", seed=27),
    case("f16-mean", dtype="float16", seed=28),
    case("f64", dtype="float64", opts=ALL, reduction="none", bad_labels=(37,), seed=30),
    case("wide", vocab=300, reduction="none", seed=29),
]


# --- the expected values and their tolerances ---------------------------------------------------------------------


def as_numpy(logits, labels):
    return logits.detach().to("cpu", torch.float64).numpy(), labels.cpu().numpy()


def n_items_value(n_items):
    return n_items.item() if isinstance(n_items, torch.Tensor) else n_items


def no_near_ties(x, y, opts):
    """The reference's argmax is unambiguous in float32 on every scored row (else the case is a bad test): the two
    largest z are equal or clearly apart."""
    z = reference.transform(np.where((y == opts.ignore_index)[..., None], 0.0, x), opts).reshape(-1, x.shape[-1])
    finite = np.where(np.isfinite(z), z, -np.inf)
    top = np.sort(finite, axis=-1)[:, -2:] if z.shape[-1] > 1 else None
    if top is None:
        return
    gap = top[:, 1] - top[:, 0]
    scored = (y.reshape(-1) != opts.ignore_index) & np.isfinite(top[:, 1])
    # Exact ties are fine (equal inputs stay equal through the transform: both take the first index).
    clear = (gap == 0) | (gap > 1e-5 * (1 + np.abs(top[:, 1])))
    assert np.all(clear[scored]), "a near-tie in the test data"


def bounds(x, y, reduction, n_items, opts):
    """Tolerances of (z_loss, lse, accuracy, entropy) in the shape reference.outputs gives them."""
    ce = reference.cross_entropy(x, y, reduction="none", opts=opts)
    lead = np.shape(y)
    flat_y = np.asarray(y).reshape(-1)
    ignored = flat_y == opts.ignore_index
    m = np.where(ignored, 0.0, ce.loss_scale)
    lse = np.where(np.isfinite(ce.lse), np.abs(ce.lse), 0.0)
    zl = abs(opts.z_loss)
    per_token = dict(
        z_loss=RTOL * (2 * zl * lse * m + zl * lse * lse) + FLOOR,
        lse=RTOL * ce.loss_scale + FLOOR,
        accuracy=np.zeros_like(m),
        entropy=2 * RTOL * m + FLOOR,
    )
    if reduction == "none":
        return {name: value.reshape(lead) for name, value in per_token.items()}
    den = reference.denominator(flat_y, reduction, n_items, opts.ignore_index)
    exact = reference.outputs(x, y, reduction="none", opts=opts)
    out = {}
    for name in ("z_loss", "entropy"):
        values = np.abs(np.nan_to_num(getattr(exact, name).reshape(-1)))
        out[name] = (np.sum(per_token[name]) + RTOL * np.sum(values)) / den + FLOOR
    out["lse"] = per_token["lse"].reshape(lead)
    out["accuracy"] = 1e-6
    return out


def check_outputs(output, x, y, reduction, n_items, opts, asked=FIELDS, what=""):
    no_near_ties(x, y, opts)
    expected = reference.outputs(x, y, reduction=reduction, n_items=n_items, opts=opts)
    tolerance = bounds(x, y, reduction, n_items, opts)
    for name in FIELDS:
        value = getattr(output, name)
        if name not in asked:
            assert value is None, f"{what}{name} was not asked but returned"
            continue
        assert value is not None, f"{what}{name} was asked but not returned"
        assert str(value.dtype).endswith(("float32", "float64")), f"{what}{name}: dtype {value.dtype}"
        check(as_f64(value), getattr(expected, name), tolerance[name], f"{what}{name}")


# --- runners: one call of each package, the outputs as torch tensors ------------------------------------------------


def torch_call(case, logits, labels, n_items, **returns):
    x = logits.detach().requires_grad_()
    out = fastce_torch.cross_entropy(
        x.clone() if case.inplace else x,
        labels,
        reduction=case.reduction,
        n_items=n_items,
        backend="kernel",
        inplace_backward=case.inplace,
        **case.opts.as_kwargs(),
        **returns,
    )
    return out, x


def jax_call(case, logits, labels, n_items, **returns):
    fastce_jax = jax_or_skip()
    n_items = jax_n_items(n_items)
    out = fastce_jax.cross_entropy(
        exchange.to_jax(logits.contiguous()),
        exchange.labels_to_jax(labels),
        reduction=case.reduction,
        n_items=n_items,
        backend="kernel",
        **case.opts.as_kwargs(),
        **returns,
    )
    if not isinstance(out, tuple):  # no return_* keyword: the plain loss
        return exchange.to_torch(out), None
    return type(out)(*(None if v is None else exchange.to_torch(v) for v in out)), None


RUNNERS = {"torch": torch_call, "jax": jax_call}


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("case", CASES)
def test_outputs_match_the_reference(case, package, device):
    inputs = make_inputs(case, device)
    out, _ = RUNNERS[package](case, inputs.logits, inputs.labels, inputs.n_items, **ALL_RETURNS)
    assert type(out).__name__ == "CrossEntropyOutput"
    x, y = as_numpy(inputs.logits, inputs.labels)
    n_items = n_items_value(inputs.n_items)
    check_outputs(out, x, y, case.reduction, n_items, case.opts, what=f"{package} ")
    # The loss is the call's loss without the keywords: to the bit in torch (the same kernel arithmetic). In JAX the
    # reduction of the per-row losses is XLA's, in two different programs: on a GPU their fusions may sum in another
    # order, so a few float32 ulps there.
    plain, _ = RUNNERS[package](case, inputs.logits, inputs.labels, inputs.n_items)
    if package == "jax" and device != "cpu":
        np.testing.assert_allclose(as_f64(out.loss), as_f64(plain), rtol=4 * 2.0**-23, atol=0)
    else:
        np.testing.assert_array_equal(as_f64(out.loss), as_f64(plain))


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("name", FIELDS)
def test_each_keyword_alone(name, package, device):
    inputs = make_inputs(Case("alone", shape=(6,), vocab=37, reduction="none", opts=Z, seed=40), device)
    c = Case("alone", reduction="none", opts=Z)
    out, _ = RUNNERS[package](c, inputs.logits, inputs.labels, None, **{f"return_{name}": True})
    x, y = as_numpy(inputs.logits, inputs.labels)
    check_outputs(out, x, y, "none", None, Z, asked=(name,), what=f"{package} ")


@pytest.mark.parametrize("package", PACKAGES)
def test_all_false_returns_the_loss_alone(package, device):
    inputs = make_inputs(Case("plain", shape=(4,), vocab=11), device)
    out, _ = RUNNERS[package](Case("plain"), inputs.logits, inputs.labels, None, **{k: False for k in ALL_RETURNS})
    assert isinstance(out, torch.Tensor) and out.dim() == 0


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_ties_go_to_the_first_index(reduction, package, device):
    # Exact ties (small integers are exact in every dtype): the first column holding the max is the prediction.
    logits = torch.tensor([[1.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, 5.0, -1.0], [4.0, 1.0, 4.0, 4.0]])
    labels = torch.tensor([1, 3, 1, 2])  # hit, miss (first is 0), hit, miss (first is 0)
    c = Case("ties", reduction=reduction)
    out, _ = RUNNERS[package](c, logits.to(device), labels.to(device), None, return_accuracy=True)
    expected = reference.outputs(logits.numpy(), labels.numpy(), reduction=reduction).accuracy
    np.testing.assert_array_equal(as_f64(out.accuracy), expected)
    np.testing.assert_array_equal(expected, [1.0, 0.0, 1.0, 0.0] if reduction == "none" else 0.5)


def small_vocab_chunks(package, monkeypatch):
    """Tiles of 16 and chunks of 32 columns: a row of V = 300 is 10 chunks, the last one partial. Patched in each
    package's losses/cross_entropy/launch.py, where the launchers look them up: fastce_torch's launch.forward_config (it
    caches per argument set), fastce_jax's tile constants (read at each call, part of its jit key). Returns that launch
    module, whose forward_config gives the patched tiles."""
    if package == "torch":
        from fastce_torch.losses.cross_entropy import launch

        monkeypatch.setattr(launch, "forward_config", functools.partial(launch.forward_config, block=16, chunk=32))
    else:
        jax_or_skip()
        from fastce_jax.losses.cross_entropy import launch

        monkeypatch.setattr(launch, "FORWARD_BLOCK", 16)
        monkeypatch.setattr(launch, "CHUNK", 32)
    assert launch.forward_config(300)[2] == 10, launch.forward_config(300)
    return launch


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize(
    "case",
    [
        case("chunks-none", vocab=300, reduction="none", opts=ALL, neg_inf="scatter", seed=50),
        case("chunks-mean", vocab=300, opts=Z, neg_inf="tail", seed=51),
        case("chunks-ties", vocab=300, reduction="none", std=0.0, offset=1.0, ignore="none", seed=52),
    ],
)
def test_several_vocab_chunks(case, package, device, monkeypatch):
    kernels = small_vocab_chunks(package, monkeypatch)
    assert kernels.forward_config(case.vocab)[2] > 1
    inputs = make_inputs(case, device)
    if case.std == 0.0:
        # Every logit equal, then the max placed in two later chunks: the first of them must win.
        inputs.logits[:, 200] = 2.0
        inputs.logits[:, 100] = 2.0
        inputs.labels[::2] = 100
    out, _ = RUNNERS[package](case, inputs.logits, inputs.labels, inputs.n_items, **ALL_RETURNS)
    x, y = as_numpy(inputs.logits, inputs.labels)
    if case.std == 0.0:
        expected = reference.outputs(x, y, reduction="none", opts=case.opts)
        np.testing.assert_array_equal(as_f64(out.accuracy), expected.accuracy)
        assert expected.accuracy[::2].all() and not expected.accuracy[1::2].any()
        return
    check_outputs(out, x, y, case.reduction, n_items_value(inputs.n_items), case.opts)


# --- gradients ----------------------------------------------------------------------------------------------------


def z_loss_gradient_reference(x, y, reduction, n_items, opts, upstream):
    """d (upstream . z_loss output) / d logits in float64: the z-loss part of the loss's gradient, i.e. the
    reference gradient with z_loss minus the one without (everything else the same)."""
    with_z = reference.cross_entropy(x, y, reduction=reduction, n_items=n_items, upstream=upstream, opts=opts)
    without = reference.cross_entropy(
        x, y, reduction=reduction, n_items=n_items, upstream=upstream, opts=dataclasses.replace(opts, z_loss=0.0)
    )
    return with_z, with_z.grad - without.grad


def objective_of(name, reduction, upstream):
    """upstream . z_loss (+ upstream . loss), in whichever framework `upstream` is."""

    def weighted(value):
        return (value * upstream).sum() if reduction == "none" else value

    def objective(out):
        total = weighted(out.z_loss)
        return total + weighted(out.loss) if name == "loss+z_loss" else total

    return objective


def torch_grads(case, inputs, objective):
    out, leaf = torch_call(case, inputs.logits, inputs.labels, inputs.n_items, **ALL_RETURNS)
    objective_of(objective, case.reduction, inputs.upstream)(out).backward()
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def jax_n_items(n_items):
    if isinstance(n_items, torch.Tensor):
        return exchange.to_jax(n_items) if n_items.is_floating_point() else exchange.labels_to_jax(n_items)
    return n_items


def jax_grads(case, inputs, objective):
    fastce_jax = jax_or_skip()
    import jax

    y = exchange.labels_to_jax(inputs.labels)
    fn = objective_of(objective, case.reduction, exchange.to_jax(inputs.upstream.contiguous()))

    def f(a):
        out = fastce_jax.cross_entropy(
            a, y, reduction=case.reduction, n_items=jax_n_items(inputs.n_items), backend="kernel",
            **case.opts.as_kwargs(), **ALL_RETURNS,
        )  # fmt: skip
        return fn(out)

    return exchange.to_torch(jax.grad(f)(exchange.to_jax(inputs.logits.contiguous())))


GRADIENTS = {"torch": torch_grads, "jax": jax_grads}
GRAD_CASES = [
    case("z-grad-mean", opts=Z, offset=3.0, seed=60),
    case("z-grad-sum-n-items", opts=ALL, reduction="sum", n_items=4, seed=61),
    case("z-grad-none", opts=Z, reduction="none", seed=62),
    case("z-grad-not-inplace", opts=Z, inplace=False, seed=63),
    case("z-grad-bad-label", opts=Z, reduction="none", bad_labels=(37,), seed=64),
    case("z-grad-bf16", dtype="bfloat16", opts=ALL, seed=65),
    case("z-grad-wide", vocab=300, opts=Z, reduction="none", seed=66),
]


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("objective", ["z_loss", "loss+z_loss"])
def test_z_loss_output_gradient(case, objective, package, device):
    """The z_loss output is differentiable: its gradient is the z-loss part of the loss's gradient; with the loss
    also differentiated, the two add up."""
    inputs = make_inputs(case, device)
    grad = GRADIENTS[package](case, inputs, objective)
    x, y = as_numpy(inputs.logits, inputs.labels)
    up = inputs.upstream.cpu().numpy() if case.reduction == "none" else None
    with_z, z_part = z_loss_gradient_reference(x, y, case.reduction, n_items_value(inputs.n_items), case.opts, up)
    # The loss already holds the z-loss term: loss + z_loss counts its gradient twice.
    expected = z_part if objective == "z_loss" else with_z.grad + z_part
    check(as_f64(grad), expected, grad_bound(with_z, as_f64(grad), case.dtype) + FLOOR, f"{package} d {objective}")


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_torch_lse_and_accuracy_carry_no_gradient(reduction, device):
    c = Case("no-grad", shape=(6,), vocab=37, reduction=reduction, opts=Z, seed=70)
    inputs = make_inputs(c, device)
    out, leaf = torch_call(c, inputs.logits, inputs.labels, None, **ALL_RETURNS)
    for name in ("lse", "accuracy"):
        assert not getattr(out, name).requires_grad, name
    # issue 37: the entropy is differentiable too (its gradient: test_entropy_grad.py); returning the differentiable
    # outputs leaves the loss's own gradient unchanged.
    assert out.loss.requires_grad and out.z_loss.requires_grad and out.entropy.requires_grad
    (out.loss.sum() if reduction == "none" else out.loss).backward()
    plain, plain_leaf = torch_call(c, inputs.logits, inputs.labels, None)
    (plain.sum() if reduction == "none" else plain).backward()
    torch.testing.assert_close(leaf.grad, plain_leaf.grad, rtol=0, atol=0)


def test_torch_keyword_checks(device):
    logits, labels = torch.randn(3, 5, device=device), torch.tensor([0, 1, 2], device=device)
    for name in ALL_RETURNS:
        with pytest.raises(TypeError, match=name):
            fastce_torch.cross_entropy(logits, labels, **{name: 1})
        with pytest.raises(TypeError, match=name):
            fastce_torch.linear_cross_entropy(logits, torch.randn(4, 5, device=device), labels, **{name: "yes"})


# One launch per rank count, its argument sets separated by `--then` (run in turn in the same processes, one
# summary line each): the plain-torch backend and the kernels on equal widths, the kernels with several chunks per
# slice (tiles of 4, chunks of 8) on unequal ones; three ranks: the kernels on unequal widths.
VOCAB_PARALLEL_RUNS = {
    2: [
        ["--backend=reference", "--widths=15,15"],
        ["--backend=kernel", "--widths=20,20"],
        ["--backend=kernel", "--widths=20,17", "--small-chunks"],
    ],
    3: [["--backend=kernel", "--widths=10,15,12"]],
}


@pytest.mark.slow
@pytest.mark.parametrize("n_ranks", sorted(VOCAB_PARALLEL_RUNS))
def test_torch_vocab_parallel(n_ranks, device):
    """process_group=: every output and the z_loss output's gradient over gloo ranks on the CPU
    (fastce_torch/tests/vocab_parallel_outputs_check.py; with --gpu, NCCL needs as many GPUs)."""
    if device.type == "cuda" and torch.cuda.device_count() < n_ranks:
        pytest.skip(f"needs {n_ranks} GPUs")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = VOCAB_PARALLEL_RUNS[n_ranks]
    arguments = [
        arg for i, run in enumerate(runs) for arg in [*(["--then"] if i else []), f"--device={device.type}", *run]
    ]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n_ranks}",
        "-m", "fastce_torch.tests.vocab_parallel_outputs_check", *arguments,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    report = [line for line in done.stdout.splitlines() if "FAIL" in line or line.startswith("vocab-parallel")]
    assert done.returncode == 0, "\n".join(report + [done.stderr[-3000:]])
    assert sum(line.endswith(": ok") for line in report) == len(runs), done.stdout[-2000:]


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_torch_module_and_reference_backend(backend, device):
    c = Case("module", shape=(2, 5), vocab=37, opts=ALL, seed=80)
    inputs = make_inputs(c, device)
    module = fastce_torch.CrossEntropyLoss(backend=backend, **ALL.as_kwargs(), **ALL_RETURNS)
    assert "return_lse=True" in repr(module)
    out = module(inputs.logits, inputs.labels)
    assert isinstance(out, fastce_torch.CrossEntropyOutput)
    x, y = as_numpy(inputs.logits, inputs.labels)
    check_outputs(out, x, y, "mean", None, ALL)


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_torch_shift(reduction, device):
    c = Case("shift", shape=(2, 6), vocab=37, reduction=reduction, opts=Z, seed=81)
    inputs = make_inputs(c, device)
    out = fastce_torch.cross_entropy(
        inputs.logits, inputs.labels, reduction=reduction, backend="kernel", shift=2, z_loss=Z.z_loss, **ALL_RETURNS
    )
    x, y = as_numpy(inputs.logits[:, :4], inputs.labels[:, 2:])
    check_outputs(out, x, y, reduction, None, Z)


# --- linear_cross_entropy ----------------------------------------------------------------------------------------

LINEAR_CASES = [
    dict(reduction="mean", opts=Z),
    dict(reduction="sum", opts=ALL, bias=True, n_items=5),
    dict(reduction="none", opts=Z, bias=True),
    dict(reduction="none", opts=ALL, bad_label=True),
    dict(reduction="mean", opts=reference.Options(), all_ignored=True),
]


def linear_inputs(device, bias, bad_label, all_ignored, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(11, 8, generator=gen)
    weight = torch.randn(37, 8, generator=gen) * 0.5
    b = torch.randn(37, generator=gen) if bias else None
    labels = torch.randint(0, 37, (11,), generator=gen)
    labels[[1, 6]] = -100
    if bad_label:
        labels[0] = 37
    if all_ignored:
        labels[:] = -100
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(hidden), move(weight), move(b), move(labels)


def torch_linear(hidden, weight, bias, labels, reduction, n_items, opts, backend="kernel"):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    out = fastce_torch.linear_cross_entropy(
        leaves[0], leaves[1], labels, bias=leaves[2], reduction=reduction, n_items=n_items, backend=backend,
        chunk_rows=3, **opts.as_kwargs(), **ALL_RETURNS,
    )  # fmt: skip
    return out, leaves


def jax_linear(hidden, weight, bias, labels, reduction, n_items, opts):
    fastce_jax = jax_or_skip()
    to = exchange.to_jax
    import jax

    # The chunk matmuls follow JAX's default precision, TF32 for float32 on a GPU: ask for float32, as torch does.
    with jax.default_matmul_precision("float32"):
        out = fastce_jax.linear_cross_entropy(
            to(hidden), to(weight), exchange.labels_to_jax(labels), bias=None if bias is None else to(bias),
            reduction=reduction, n_items=n_items, backend="kernel", chunk_rows=3, **opts.as_kwargs(), **ALL_RETURNS,
        )  # fmt: skip
    return type(out)(*(None if v is None else exchange.to_torch(v) for v in out)), None


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("spec", LINEAR_CASES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items() if k != "opts"))
def test_linear_outputs_with_several_chunks(spec, package, device):
    spec = dict(spec)
    opts, reduction, n_items = spec.pop("opts"), spec.pop("reduction"), spec.pop("n_items", None)
    hidden, weight, bias, labels = linear_inputs(
        device, spec.get("bias", False), spec.get("bad_label", False), spec.get("all_ignored", False), seed=90
    )
    run = torch_linear if package == "torch" else jax_linear
    out, _ = run(hidden, weight, bias, labels, reduction, n_items, opts)
    logits = torch.nn.functional.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    x, y = as_numpy(logits, labels)
    check_outputs(out, x, y, reduction, n_items, opts, what=f"{package} linear ")
    expected = reference.cross_entropy(x, y, reduction=reduction, n_items=n_items, opts=opts)
    # The matmul rounds the logits to float32 first: the loss within the linear tests' own margin.
    check(as_f64(out.loss), expected.loss, 1e-4 * (1 + np.abs(np.nan_to_num(expected.loss))), "linear loss")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("objective", ["z_loss", "loss+z_loss"])
def test_torch_linear_z_loss_gradient(reduction, objective, device):
    """The z_loss output's gradients of hidden, weight and bias (chunk by chunk, logits recomputed) equal the
    plain-torch reference backend's."""
    hidden, weight, bias, labels = linear_inputs(device, True, False, False, seed=91)
    grads = {}
    for backend in ("kernel", "reference"):
        out, leaves = torch_linear(hidden, weight, bias, labels, reduction, None, ALL, backend=backend)
        total = out.z_loss + (out.loss if objective == "loss+z_loss" else 0.0)
        total.sum().backward()
        grads[backend] = [leaf.grad for leaf in leaves]
    for name, got, want in zip(("hidden", "weight", "bias"), grads["kernel"], grads["reference"]):
        assert got is not None and want is not None, name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


# --- torch.compile --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("function", ["cross_entropy", "linear_cross_entropy"])
def test_torch_compile_fullgraph(function, reduction, device):
    """torch.compile(fullgraph=True) carries the outputs (the custom ops), z_loss's gradient included."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(6, 8, generator=gen).to(device)
    weight = torch.randn(37, 8, generator=gen).to(device)
    labels = torch.randint(0, 37, (6,), generator=gen).to(device)
    labels[2] = -100

    def step(h, w):
        if function == "cross_entropy":
            out = fastce_torch.cross_entropy(
                h @ w.t(), labels, reduction=reduction, backend="kernel", z_loss=1e-2, **ALL_RETURNS
            )
        else:
            out = fastce_torch.linear_cross_entropy(
                h, w, labels, reduction=reduction, backend="kernel", z_loss=1e-2, chunk_rows=4, **ALL_RETURNS
            )
        return (out.loss.sum() + out.z_loss.sum(), out.lse, out.accuracy, out.entropy)

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        total, *rest = fn(h, w)
        total.backward()
        return [total.detach(), *rest, h.grad, w.grad]

    expected = run(step)
    torch._dynamo.reset()
    got = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    torch._dynamo.reset()
    for value, want in zip(got, expected):
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, equal_nan=True)


# --- CUDA graphs (GPU) --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("function", ["cross_entropy", "linear_cross_entropy"])
def test_torch_cuda_graph_capture(function, device):
    """Forward and backward with every output (z_loss differentiated) captured in a CUDA graph after the warm-up;
    replays with new data match the reference."""
    n_rows, width, vocab = 256, 64, 32000
    static_hidden = torch.zeros(n_rows, width, device=device, requires_grad=True)
    weight = (torch.randn(vocab, width, generator=torch.Generator().manual_seed(3)) * 0.3).to(device)
    static_labels = torch.zeros(n_rows, dtype=torch.long, device=device)

    def step():
        if function == "cross_entropy":
            out = fastce_torch.cross_entropy(static_hidden @ weight.t(), static_labels, z_loss=1e-3, **ALL_RETURNS)
        else:
            out = fastce_torch.linear_cross_entropy(static_hidden, weight, static_labels, z_loss=1e-3, **ALL_RETURNS)
        (grad,) = torch.autograd.grad(out.loss + out.z_loss, static_hidden)
        return out, grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_grad = step()
    opts = reference.Options(z_loss=1e-3)
    for seed in (10, 11):
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(n_rows, width, generator=gen).to(device)
        labels = torch.randint(0, vocab, (n_rows,), generator=gen).to(device)
        labels[::5] = -100
        with torch.no_grad():
            static_hidden.copy_(hidden)
        static_labels.copy_(labels)
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            logits = (hidden @ weight.t()).double()
        x, y = as_numpy(logits, labels)
        expected = reference.outputs(x, y, reduction="mean", opts=opts)
        for name in FIELDS:
            # The matmul's float32 logits differ from float64 ones (an argmax may flip on a near-tie): a loose check
            # that the replay computed this data's outputs.
            atol = 1e-2 if name == "accuracy" else 1e-4
            np.testing.assert_allclose(as_f64(getattr(static_out, name)), getattr(expected, name), rtol=1e-3, atol=atol)
        assert torch.isfinite(static_grad).all()
