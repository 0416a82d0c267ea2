"""linear_cross_entropy in both packages against the float64 reference (reference.linear_cross_entropy): loss and
the gradients of hidden, weight and bias, every option and reduction, with the rows split into several chunks.

Each package is called the way users call it: torch's `(loss * upstream).sum().backward()` (a scalar upstream for
"mean"/"sum", so the backward's scaling is checked too) and JAX's `jax.value_and_grad` of the same objective, with
float32 matmuls at full precision (no TF32). Inputs are made once in torch (the values each package sees, already
rounded to the case's dtype) and handed to JAX through DLPack. A package without linear_cross_entropy is skipped.
The rows are split into chunks of CHUNK_ROWS_SMALL (the packages' chunk_rows keyword), so several chunks run, the
last one partial (torch) or clamped onto the one before (JAX).

Tolerances follow from the arithmetic, as in harness.py, with u the unit roundoff of the computation that dominates
and K a small count of roundings (K_FACTOR): float32 inputs: u = 2**-23, K = 16 (the kernels' float32, GPU exp/log
approximations included); bfloat16: u = 2**-8, K = 4 (the logits chunk and its gradient are held in bf16, as the
unfused lm_head output and its gradient are).
  loss:        K u sum_t |g_t| (M_t + 2 E_t)      M_t from reference.error_scales; E_t = max_j (|h| |W|^T + |b|)_tj,
                                                    the size of the logits' own product error
  d logits G:  error scale S = grad_scale + grad_terms 2 E_t
  d hidden:    K u (S + |G|) |W|
  d weight:    K u (1 + chunks) (S + |G|)^T |h|          (one rounding to the weight's dtype per chunk of rows)
  d bias:      K u (1 + chunks) sum_t (S + |G|)_t
NaN must appear exactly where the reference has it (a bad label makes its row of d hidden NaN, and all of d weight).
"""

import dataclasses
import importlib
import inspect
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from . import reference, tolerances

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
UNIT_ROUNDOFF = {"float32": 2.0**-23, "bfloat16": 2.0**-8}
# float32: harness.RTOL_REFERENCE's 16 (GPU exp/log approximations, long float32 sums); bfloat16: each quantity is
# rounded to bf16 at most twice on its way (logits, their gradient, the product), so 4 unit roundoffs.
K_FACTOR = {"float32": 16, "bfloat16": 4}
FLOOR = 2.0**-125
CHUNK_ROWS_SMALL = 5  # rows per chunk forced in both packages: several chunks, a partial (or clamped) last one


@dataclass(frozen=True)
class LinearCase:
    name: str
    shape: tuple = (12,)  # leading shape of hidden and labels
    width: int = 24  # H
    vocab: int = 130  # V
    dtype: str = "float32"
    reduction: str = "mean"
    n_items: object = None  # None, a number, or ("tensor", value)
    bias: bool = False
    opts: reference.Options = field(default_factory=reference.Options)
    ignore: str = "some"  # "none", "some", "all", or one of IGNORED_PATTERNS
    bad_label: bool = False  # row 0 gets label V: NaN by contract
    strided: bool = False  # hidden is a column slice of a wider buffer
    label_dtype: str = "int64"
    scalar_upstream: float = 1.0  # d objective / d loss for "mean"/"sum" (1 takes the backward's skip-the-scaling path)
    shift: int = 0  # passed on as the packages' shift keyword when not 0 (test_shift.py)
    chunk_rows: int | None = None  # passed on as the packages' chunk_rows keyword when set
    skip_ignored_rows: bool = False  # passed on as the packages' skip_ignored_rows keyword when True
    seed: int = 0

    @property
    def id(self):
        return f"{self.name}-{self.dtype}"


# Which rows of n are ignored (a boolean mask): half or 90% of them, spread out (every other row, 9 of every 10) or
# in blocks (a prompt, then the answer; in supervised fine-tuning 50-90% of the rows are prompt or padding).
IGNORED_PATTERNS = {
    "half-interleaved": lambda n: np.arange(n) % 2 == 1,
    "half-clustered": lambda n: np.arange(n) < n // 2,
    "ninety-interleaved": lambda n: np.arange(n) % 10 != 3,
    "ninety-clustered": lambda n: (np.arange(n) < n // 2) | (np.arange(n) >= n // 2 + max(1, n // 10)),
}

CASES = [
    LinearCase("mean"),
    LinearCase("mean-bias", bias=True, vocab=300, width=16),
    LinearCase("sum", reduction="sum", ignore="none"),
    LinearCase("sum-n_items", reduction="sum", n_items=7, scalar_upstream=1.3),
    LinearCase("mean-n_items-tensor", n_items=("tensor", 9.5), bias=True, scalar_upstream=0.7),
    LinearCase("none", reduction="none", bias=True),
    LinearCase("none-3d", reduction="none", shape=(3, 7)),
    LinearCase("softcap-scaling", opts=reference.Options(logit_softcapping=3.0, logit_scaling=1.7), bias=True),
    LinearCase("smoothing-zloss", opts=reference.Options(label_smoothing=0.1, z_loss=1e-3)),
    LinearCase("none-all-options", reduction="none", opts=reference.Options(-1, 5.0, 0.8, 0.2, 1e-4), bias=True),
    LinearCase("ignore-index-is-a-class", opts=reference.Options(ignore_index=3)),
    LinearCase(
        "ignore-7-sum-n_items", reduction="sum", n_items=4, opts=reference.Options(ignore_index=7), scalar_upstream=1.3
    ),
    LinearCase("all-ignored", ignore="all"),
    LinearCase("bad-label", bad_label=True, reduction="sum"),
    LinearCase("bad-label-none", bad_label=True, reduction="none"),
    LinearCase("strided-3d-int32", shape=(2, 3, 5), strided=True, label_dtype="int32", bias=True),
    LinearCase("bf16", dtype="bfloat16", bias=True, scalar_upstream=1.7),
    LinearCase("bf16-none-softcap", dtype="bfloat16", reduction="none", opts=reference.Options(logit_softcapping=4.0)),
]


def make_inputs(case, device):
    gen = torch.Generator().manual_seed(case.seed)
    dtype = TORCH_DTYPES[case.dtype]
    n = int(np.prod(case.shape))
    hidden = torch.randn((*case.shape, case.width + (8 if case.strided else 0)), generator=gen)
    if case.strided:
        hidden = hidden[..., 3 : 3 + case.width]
    weight = torch.randn((case.vocab, case.width), generator=gen) * (2.0 / case.width**0.5)
    bias = torch.randn(case.vocab, generator=gen) * 0.5 if case.bias else None
    labels = torch.randint(0, case.vocab, (n,), generator=gen)
    ignore_index = case.opts.ignore_index
    if case.ignore == "some":
        labels[1::4] = ignore_index
    elif case.ignore == "all":
        labels[:] = ignore_index
    elif case.ignore in IGNORED_PATTERNS:
        labels[IGNORED_PATTERNS[case.ignore](n)] = ignore_index
    if case.bad_label:
        labels[0] = case.vocab
    labels = labels.reshape(case.shape).to(getattr(torch, case.label_dtype))
    upstream = (
        torch.randn(case.shape, generator=gen) if case.reduction == "none" else torch.tensor(case.scalar_upstream)
    )
    n_items = case.n_items
    if isinstance(n_items, tuple):
        n_items = torch.tensor(n_items[1], device=device)
    hidden = hidden.to(device=device, dtype=dtype)
    weight, bias = weight.to(device=device, dtype=dtype), None if bias is None else bias.to(device=device, dtype=dtype)
    return hidden, weight, bias, labels.to(device), upstream.to(device), n_items


def kwargs_of(case, n_items):
    shift = {"shift": case.shift} if case.shift else {}
    chunking = {} if case.chunk_rows is None else {"chunk_rows": case.chunk_rows}
    if case.skip_ignored_rows:
        chunking["skip_ignored_rows"] = True
    return dict(reduction=case.reduction, n_items=n_items, **case.opts.as_kwargs(), **shift, **chunking)


def run_torch(case, inputs, **extra):
    """extra: more keywords for the call (token_weights=...)."""
    hidden, weight, bias, labels, upstream, n_items = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    bias_leaf = None if bias is None else bias.detach().clone().requires_grad_()
    loss = fastce_torch.linear_cross_entropy(
        *leaves, labels, bias=bias_leaf, backend="kernel", **kwargs_of(case, n_items), **extra
    )
    (loss * upstream).sum().backward()
    grads = [leaves[0].grad, leaves[1].grad, None if bias is None else bias_leaf.grad]
    return loss.detach(), grads


def run_jax(case, inputs, **extra):
    """extra: more keywords for the call, torch tensors among them handed over through DLPack."""
    import jax
    import jax.numpy as jnp

    from . import exchange

    fastce_jax = sys.modules["fastce_jax"]
    hidden, weight, bias, labels, upstream, n_items = inputs
    as_jax = exchange.to_jax
    h, w = as_jax(hidden), as_jax(weight)
    b = None if bias is None else as_jax(bias)
    y = exchange.labels_to_jax(labels)
    kwargs = kwargs_of(case, as_jax(n_items) if torch.is_tensor(n_items) else n_items)
    kwargs.update({k: as_jax(v) if torch.is_tensor(v) else v for k, v in extra.items()})
    weighting = as_jax(upstream)

    def objective(h, w, b):
        loss = fastce_jax.linear_cross_entropy(h, w, y, bias=b, backend="kernel", **kwargs)
        return jnp.sum(loss * weighting), loss

    with jax.default_matmul_precision("float32"):
        (_, loss), grads = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(h, w, b)
    to_torch = exchange.to_torch
    return to_torch(loss), [None if grad is None else to_torch(grad) for grad in grads]


def package_runner(name):
    module = pytest.importorskip(name)
    if not hasattr(module, "linear_cross_entropy"):
        pytest.skip(f"{name} has no linear_cross_entropy")
    return {"fastce_torch": run_torch, "fastce_jax": run_jax}[name]


def assert_within(actual, expected, bound, what):
    actual = np.asarray(actual.detach().float().cpu().numpy() if torch.is_tensor(actual) else actual, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_expected = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan_expected), f"{what}: NaN pattern differs from the reference"
    diff = np.abs(np.where(nan_expected, 0.0, actual - expected))
    worst = np.max(diff / (bound + FLOOR)) if diff.size else 0.0
    assert worst <= 1.0, f"{what}: max |diff| / tolerance = {worst:.3g} (max |diff| {diff.max():.3g})"


def check(case, device, runner, chunks):
    inputs = make_inputs(case, device)
    check_result(case, inputs, runner(case, inputs), chunks)


def check_result(case, inputs, result, chunks, token_weights=None):
    """result = (loss, [grad_hidden, grad_weight, grad_bias]) of `inputs` against the float64 reference; with the
    call's token_weights (a tensor shaped like labels) when it had them."""
    hidden, weight, bias, labels, upstream, n_items = inputs
    as64 = lambda t: None if t is None else t.detach().double().cpu().numpy()  # noqa: E731
    exact = reference.linear_cross_entropy(
        as64(hidden),
        as64(weight),
        labels.cpu().numpy(),
        bias=as64(bias),
        reduction=case.reduction,
        n_items=float(n_items) if torch.is_tensor(n_items) else n_items,
        upstream=as64(upstream) if case.reduction == "none" else None,
        opts=case.opts,
        token_weights=as64(token_weights),
    )
    scalar = 1.0 if case.reduction == "none" else case.scalar_upstream  # the reference's gradients are of the loss
    loss, (grad_hidden, grad_weight, grad_bias) = result

    u = UNIT_ROUNDOFF[case.dtype] * K_FACTOR[case.dtype]
    r = exact.logits
    n_rows, vocab = r.lse.shape[0], weight.shape[0]
    logit_error = 2.0 * exact.logits_abs.max(axis=-1) if vocab else np.zeros(n_rows)  # E_t, times 2
    g = np.abs(np.nan_to_num(r.upstream))
    weight_abs = 1.0 if token_weights is None else np.abs(np.nan_to_num(as64(token_weights).reshape(-1)))
    loss_terms = np.nan_to_num(r.loss_scale) + logit_error * weight_abs  # loss_scale holds |w_t| already
    if case.reduction == "none":
        loss_bound = u * loss_terms.reshape(case.shape)
    else:
        loss_bound = np.asarray(u * np.sum(g * loss_terms))
    assert_within(loss, np.asarray(r.loss), loss_bound, "loss")

    G = np.abs(scalar * np.nan_to_num(r.grad.reshape(n_rows, vocab)))
    S = abs(scalar) * (
        np.nan_to_num(r.grad_scale.reshape(n_rows, vocab))
        + np.nan_to_num(r.grad_terms.reshape(n_rows, vocab)) * (logit_error[:, None])
    )
    h_abs = np.abs(as64(hidden).reshape(n_rows, hidden.shape[-1]))
    w_abs = np.abs(as64(weight))
    assert_within(grad_hidden, scalar * exact.grad_hidden, (u * ((S + G) @ w_abs)).reshape(hidden.shape), "grad_hidden")
    assert_within(grad_weight, scalar * exact.grad_weight, u * (1 + chunks) * ((S + G).T @ h_abs), "grad_weight")
    if bias is None:
        assert grad_bias is None
    else:
        assert_within(grad_bias, scalar * exact.grad_bias, u * (1 + chunks) * (S + G).sum(axis=0), "grad_bias")


def small_chunks(case):
    """The case with chunk_rows=CHUNK_ROWS_SMALL, and how many chunks it then runs, which bounds the weight
    gradient's roundings."""
    return dataclasses.replace(case, chunk_rows=CHUNK_ROWS_SMALL), -(-int(np.prod(case.shape)) // CHUNK_ROWS_SMALL)


@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_against_float64_reference(case, package, device):
    runner = package_runner(package)
    case, chunks = small_chunks(case)
    check(case, device, runner, chunks)


# skip_ignored_rows=True: the chunks cover the kept rows only; the same loss and gradients as the reference, with
# 0%, 50%, 90% and 100% of the rows ignored, spread out and in blocks (20 rows: 2 kept at 90%).
SKIP_CASES = [
    LinearCase(f"skip-{ignore}-{reduction}", shape=(20,), reduction=reduction, ignore=ignore, skip_ignored_rows=True)
    for ignore in ("none", *IGNORED_PATTERNS, "all")
    for reduction in ("mean", "none")
] + [
    LinearCase(
        "skip-sum-options-bias",
        shape=(4, 5),
        reduction="sum",
        n_items=6,
        bias=True,
        ignore="ninety-clustered",
        opts=reference.Options(logit_softcapping=3.0, label_smoothing=0.1, z_loss=1e-3),
        scalar_upstream=1.3,
        skip_ignored_rows=True,
    ),
    LinearCase(
        "skip-bad-label", shape=(20,), reduction="none", ignore="half-clustered", bad_label=True, skip_ignored_rows=True
    ),
    LinearCase(
        "skip-ignore-7",
        shape=(20,),
        ignore="half-interleaved",
        opts=reference.Options(ignore_index=7),
        skip_ignored_rows=True,
    ),
    LinearCase(
        "skip-bf16", shape=(20,), dtype="bfloat16", bias=True, ignore="ninety-interleaved", skip_ignored_rows=True
    ),
]


@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
@pytest.mark.parametrize("case", SKIP_CASES, ids=lambda c: c.id)
def test_skip_ignored_rows_against_float64_reference(case, package, device):
    runner = package_runner(package)
    case, chunks = small_chunks(case)
    check(case, device, runner, chunks)


def linear_module(package):
    """The package's LM-head engine (linear/engine.py): the chunking defaults and rows_per_chunk."""
    return importlib.import_module(f"{package}.linear.engine")


@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
def test_chunk_rows_from_the_budget(package):
    """The same defaults and chunking rule in both packages."""
    package_runner(package)
    module = linear_module(package)
    assert module.DEFAULT_WORKSPACE_BYTES == 256 << 20 and module.ROWS_MULTIPLE == 128
    for name in ("WORKSPACE_BYTES", "CHUNK_ROWS", "ACCUMULATE_WEIGHT_GRAD_IN_FLOAT32"):
        assert not hasattr(module, name), f"{name} is a keyword of linear_cross_entropy, not a module setting"
    keywords = inspect.signature(sys.modules[package].linear_cross_entropy).parameters
    assert [keywords[name].default for name in ("workspace_bytes", "chunk_rows", "accumulate_in_float32")] == [
        None,
        None,
        False,
    ]
    rows = module.rows_per_chunk
    assert rows(8192, 128256, 2) == 1024  # 1046 rows fit: 8 even chunks of a multiple of 128
    assert rows(8192, 256000, 2) == 512
    assert rows(100, 128256, 2) == 100  # fits: one chunk, never more than the rows there are
    assert rows(8192, 2**31, 4) == 1  # at least one row, whatever the budget
    # 4096 rows fit at V=32000; 8292 rows take 3 chunks, split evenly (2816, 2816, 2660), not 4096, 4096, 100.
    assert rows(8292, 32000, 2) == 2816
    assert rows(8192, 32000, 2, workspace_bytes=1 << 30) == 8192
    assert rows(8192, 32000, 2, chunk_rows=5) == 5 and rows(3, 32000, 2, chunk_rows=5) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
@pytest.mark.parametrize(
    "case",
    [
        LinearCase("gpu-mid", shape=(2048,), width=512, vocab=32768, dtype="bfloat16", bias=True),
        LinearCase("gpu-mid-none", shape=(1024,), width=256, vocab=50000, dtype="bfloat16", reduction="none"),
        LinearCase(
            "gpu-mid-f32-softcap", shape=(1024,), width=256, vocab=20000, opts=reference.Options(logit_softcapping=30.0)
        ),
    ],
    ids=lambda c: c.id,
)
def test_mid_shapes_on_gpu(case, package, device):
    """The packages' own chunking (default workspace) at shapes where the matmuls use tensor cores."""
    runner = package_runner(package)
    n_rows = int(np.prod(case.shape))
    itemsize = TORCH_DTYPES[case.dtype].itemsize
    chunks = -(-n_rows // linear_module(package).rows_per_chunk(n_rows, case.vocab, itemsize))
    check(case, device, runner, chunks)


@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
def test_mixed_dtypes_compute_promoted_and_keep_each_gradient_dtype(package, device):
    """bf16 hidden states with a float32 LM head and bias (mixed-precision training): both packages compute in the
    promoted dtype (float32) and hand each gradient back in its own tensor's dtype."""
    runner = package_runner(package)
    case, chunks = small_chunks(LinearCase("mixed", bias=True, reduction="sum", scalar_upstream=1.0))
    hidden, weight, bias, labels, upstream, n_items = make_inputs(case, device)
    hidden = hidden.bfloat16()
    loss, grads = runner(case, (hidden, weight, bias, labels, upstream, n_items))
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float32]
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    exact = reference.linear_cross_entropy(
        as64(hidden), as64(weight), labels.cpu().numpy(), bias=as64(bias), reduction="sum", opts=case.opts
    )
    u = UNIT_ROUNDOFF["float32"] * K_FACTOR["float32"] * (1 + chunks)
    assert_within(loss, exact.logits.loss, u * np.sum(np.abs(exact.logits.token_loss) + 1) * case.width, "loss")
    for got, want, unit in zip(grads, (exact.grad_hidden, exact.grad_weight, exact.grad_bias), (2.0**-8, u, u)):
        assert_within(got, want, unit * (np.abs(want).max() + np.abs(want)), "gradient")


@pytest.mark.parametrize("backend", ["auto", "kernel", "reference"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
def test_float64_is_computed_in_float64(package, reduction, backend, device):
    """A float64 promoted dtype (here a float64 LM head over float32 hidden states) is computed in float64 by the
    plain-framework path whatever the backend: a float64 loss within RTOL64 of the float64 reference, and each
    gradient in its own tensor's dtype (the float64 ones within RTOL64 too)."""
    pytest.importorskip(package)
    opts = reference.Options(logit_softcapping=4.0, label_smoothing=0.1, z_loss=1e-3)
    gen = torch.Generator().manual_seed(41)
    hidden = torch.randn(6, 8, generator=gen, dtype=torch.float64).float()
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    bias = torch.randn(11, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (6,), generator=gen)
    labels[2] = -100
    upstream = torch.rand(6, generator=gen, dtype=torch.float64) + 0.5
    kwargs = dict(reduction=reduction, backend=backend, **opts.as_kwargs())
    cotangent = upstream if reduction == "none" else torch.ones((), dtype=torch.float64)
    if package == "fastce_torch":
        leaves = [t.detach().clone().to(device).requires_grad_() for t in (hidden, weight, bias)]
        loss = fastce_torch.linear_cross_entropy(leaves[0], leaves[1], labels.to(device), bias=leaves[2], **kwargs)
        loss.backward(cotangent.to(device))
        loss, grads = loss.detach().cpu().numpy(), [leaf.grad.cpu().numpy() for leaf in leaves]
    else:
        import jax
        import jax.numpy as jnp

        from . import exchange

        fastce_jax = sys.modules["fastce_jax"]
        with jax.enable_x64(True):
            h, w, b, g = (exchange.to_jax(t.to(device)) for t in (hidden, weight, bias, cotangent))
            y = exchange.labels_to_jax(labels.to(device))
            assert w.dtype == jnp.float64

            def run(h, w, b):
                return fastce_jax.linear_cross_entropy(h, w, y, bias=b, **kwargs)

            loss, vjp = jax.vjp(run, h, w, b)
            grads = [np.asarray(grad) for grad in vjp(g)]
            loss = np.asarray(loss)
    assert loss.dtype == np.float64
    assert [grad.dtype for grad in grads] == [np.float32, np.float64, np.float64]
    exact = reference.linear_cross_entropy(
        hidden.numpy(),
        weight.numpy(),
        labels.numpy(),
        bias=bias.numpy(),
        reduction=reduction,
        upstream=upstream.numpy() if reduction == "none" else None,
        opts=opts,
    )
    rtol = tolerances.RTOL64
    tolerances.check(loss, exact.logits.loss, tolerances.loss_bound(exact.logits, rtol), "loss")
    want_hidden = exact.grad_hidden
    # float32 hidden's gradient is the float64 one rounded once to float32.
    assert_within(grads[0], want_hidden, 2.0**-24 * np.abs(want_hidden) + 1e-300, "hidden gradient")
    for got, want, what in ((grads[1], exact.grad_weight, "weight"), (grads[2], exact.grad_bias, "bias")):
        assert_within(got, want, rtol * (np.abs(want).max() + np.abs(want)), f"{what} gradient")
