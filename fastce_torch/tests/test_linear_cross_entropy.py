"""fastce_torch.linear_cross_entropy: what the shared float64 suite (shared_tests/test_linear_cross_entropy.py) does
not cover: torch-only behaviour (autograd plumbing, backends, torch.compile, poisoned buffers, arguments), the weight
gradient's accumulation error, and on the GPU the memory bound. CPU: the kernels in Triton's interpreter."""

import sys

import pytest
import torch
import torch.nn.functional as F

import fastce_torch
from fastce_torch import linear_cross_entropy

from . import checks

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning",
    "ignore:invalid value:RuntimeWarning",
    "ignore:Conversion of an array:DeprecationWarning",
)

module = sys.modules["fastce_torch.linear.engine"]


def problem(device, n=18, width=20, vocab=70, bias=True, dtype=torch.float32, seed=0, shape=None):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*(shape or (n,)), width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen) / width**0.5 * 2
    b = torch.randn(vocab, generator=gen) * 0.3 if bias else None
    labels = torch.randint(0, vocab, hidden.shape[:-1], generator=gen)
    labels.view(-1)[2::5] = -100
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() if t is not None else None for t in (hidden, weight, b)]
    return (*leaves, labels.to(device))


def unfused(hidden, weight, labels, bias=None, **options):
    """The loss the fused function must equal: fastce's torch reference on the materialised logits."""
    return fastce_torch.cross_entropy(F.linear(hidden, weight, bias), labels, backend="reference", **options)


def grads_of(loss, inputs, upstream=None):
    inputs = [t for t in inputs if t is not None]
    return torch.autograd.grad(loss if upstream is None else (loss * upstream).sum(), inputs)


def assert_same(fused, expected, rtol=2e-5, atol=2e-6):
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


OPTION_SETS = [
    dict(),
    dict(reduction="sum"),
    dict(reduction="none"),
    dict(reduction="sum", n_items=5),
    dict(logit_softcapping=2.5, logit_scaling=1.3, label_smoothing=0.1, z_loss=1e-3),
    dict(reduction="none", logit_softcapping=4.0, z_loss=1e-2),
]


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "mean")
def test_kernel_matches_unfused_loss_under_poisoned_buffers(options, device, poisoned):
    """Every buffer the function allocates starts as NaN: each must be fully written (chunks of 4 rows + a tail)."""
    hidden, weight, bias, labels = problem(device)
    upstream = torch.randn(labels.shape, device=device) if options.get("reduction") == "none" else None
    fused = linear_cross_entropy(hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=4, **options)
    expected = unfused(hidden, weight, labels, bias, **options)
    torch.testing.assert_close(fused, expected, rtol=2e-6, atol=2e-6)
    assert_same(grads_of(fused, (hidden, weight, bias), upstream), grads_of(expected, (hidden, weight, bias), upstream))


def test_backends(device):
    hidden, weight, bias, labels = problem(device)
    expected = unfused(hidden, weight, labels, bias)
    for backend in ("auto", "kernel", "reference"):
        got = linear_cross_entropy(hidden, weight, labels, bias=bias, backend=backend)
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
    # "auto" on CPU tensors is plain torch: autograd nodes of torch's own ops, not the fused Function.
    auto = linear_cross_entropy(hidden, weight, labels, bias=bias)
    assert ("ReducedFunction" in type(auto.grad_fn).__name__) == hidden.is_cuda


@pytest.mark.parametrize("factor", [1.0, 2.5, 0.0, float("nan")])
def test_upstream_scalar_scales_the_precomputed_gradients(factor, device):
    """factor 1 is skipped on the device; anything else (0 and NaN included) multiplies."""
    hidden, weight, bias, labels = problem(device)
    fused = linear_cross_entropy(hidden, weight, labels, bias=bias, backend="kernel")
    expected = unfused(hidden, weight, labels, bias)
    upstream = torch.tensor(factor, device=device)
    got = grads_of(fused, (hidden, weight, bias), upstream)
    want = grads_of(expected, (hidden, weight, bias), upstream)
    for g, w in zip(got, want):
        # With NaN: the ignored rows of d hidden stay 0, as the unfused loss gives them; everything else is NaN.
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6, equal_nan=True)
        assert g.isfinite().all() or factor != factor


def test_frozen_weight_and_only_some_gradients(device):
    """LoRA-style: the weight needs no gradient (none is computed or returned); bias without grad; hidden only."""
    hidden, weight, bias, labels = problem(device)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    for reduction in ("mean", "none"):
        fused = linear_cross_entropy(hidden, weight, labels, bias=bias, reduction=reduction, backend="kernel")
        fused.sum().backward()
        expected = unfused(hidden, weight, labels, bias, reduction=reduction)
        (want,) = torch.autograd.grad(expected.sum(), hidden)
        torch.testing.assert_close(hidden.grad, want, rtol=2e-5, atol=2e-6)
        assert weight.grad is None and bias.grad is None
        hidden.grad = None


def test_no_grad_gives_the_same_loss(device):
    hidden, weight, bias, labels = problem(device)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, bias=bias, backend="kernel")
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, unfused(hidden, weight, labels, bias).detach(), rtol=2e-6, atol=2e-6)


def test_gradient_accumulation_over_micro_batches(device):
    """Two losses, two backward calls: .grad sums them (the precomputed gradients are handed over, not aliased)."""
    hidden, weight, bias, labels = problem(device)
    for half in (slice(0, 9), slice(9, 18)):
        linear_cross_entropy(hidden[half], weight, labels[half], bias=bias, backend="kernel", chunk_rows=5).backward()
    got = (hidden.grad, weight.grad, bias.grad)
    expected = sum(unfused(hidden[h], weight, labels[h], bias) for h in (slice(0, 9), slice(9, 18)))
    assert_same(got, grads_of(expected, (hidden, weight, bias)))


def test_second_backward_raises(device):
    hidden, weight, bias, labels = problem(device)
    loss = linear_cross_entropy(hidden, weight, labels, bias=bias, backend="kernel")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_three_dims_and_strided_hidden(device):
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(3, 5, 40, generator=gen).to(device)
    hidden = base[:, :, 4:28].requires_grad_()  # strided rows: a non-contiguous (3, 5, 24) view
    _, weight, _, _ = problem(device, width=24, vocab=50)
    labels = torch.randint(0, 50, (3, 5), generator=gen).to(device)
    for reduction in ("mean", "none"):
        fused = linear_cross_entropy(hidden, weight, labels.int(), reduction=reduction, backend="kernel", chunk_rows=4)
        expected = unfused(hidden, weight, labels, reduction=reduction)
        assert fused.shape == expected.shape
        torch.testing.assert_close(fused, expected, rtol=2e-6, atol=2e-6)
        assert_same(grads_of(fused.sum(), (hidden, weight)), grads_of(expected.sum(), (hidden, weight)))


def test_all_ignored_and_empty(device):
    hidden, weight, bias, labels = problem(device)
    labels = torch.full_like(labels, -100)
    loss = linear_cross_entropy(hidden, weight, labels, bias=bias, backend="kernel")
    assert loss.item() == 0.0
    for grad in grads_of(loss, (hidden, weight, bias)):
        assert not grad.any()
    empty = linear_cross_entropy(hidden[:0], weight, labels[:0], bias=bias, backend="kernel")
    assert empty.item() == 0.0
    assert grads_of(empty, (weight,))[0].abs().sum() == 0


def test_bad_label_gives_nan_and_validate_labels_raises(device):
    hidden, weight, bias, labels = problem(device)
    labels[4] = weight.shape[0]
    per_token = linear_cross_entropy(hidden, weight, labels, reduction="none", backend="kernel")
    assert per_token[4].isnan() and per_token[torch.arange(18) != 4].isfinite().all()
    (grad_hidden,) = torch.autograd.grad(per_token[torch.arange(18) != 4].sum() + 0 * per_token[4], hidden)
    assert grad_hidden[4].isnan().all() and grad_hidden[torch.arange(18) != 4].isfinite().all()
    assert linear_cross_entropy(hidden, weight, labels, backend="kernel").isnan()
    with pytest.raises(ValueError, match=r"labels\[4\] = 70"):
        linear_cross_entropy(hidden, weight, labels, backend="kernel", validate_labels=True)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(weight="transposed"), ValueError, "weight must be"),
        (dict(weight="int"), TypeError, "weight"),
        (dict(bias="short"), ValueError, "bias"),
        (dict(labels="short"), ValueError, "labels"),
        (dict(labels="float"), TypeError, "labels"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(logit_softcapping=-1.0), ValueError, "logit_softcapping"),
        (dict(n_items=0), ValueError, "n_items"),
        (dict(hidden="int"), TypeError, "hidden"),
    ],
)
def test_bad_arguments_are_named(change, error, match, device):
    hidden, weight, bias, labels = problem(device)
    kwargs = dict(bias=bias)
    for key, value in change.items():
        if key == "weight":
            weight = weight.t() if value == "transposed" else weight.int()
        elif key == "bias":
            kwargs["bias"] = bias[:-1]
        elif key == "labels":
            labels = labels[:-1] if value == "short" else labels.float()
        elif key == "hidden":
            hidden = hidden.int()
        else:
            kwargs[key] = value
    with pytest.raises(error, match=match):
        linear_cross_entropy(hidden, weight, labels, **kwargs)


@pytest.mark.parametrize("backend", ["auto", "kernel", "reference"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_float64_passes_gradcheck(backend, reduction, device):
    """float64 hidden, weight and bias are computed in float64 whatever the backend: gradcheck's finite differences
    agree with the backward for all three."""
    hidden, weight, bias, labels = problem(device, n=5, width=4, vocab=6, dtype=torch.float64, seed=3)
    options = dict(logit_softcapping=3.0, label_smoothing=0.1, z_loss=1e-3)

    def loss(h, w, b):
        return linear_cross_entropy(h, w, labels, bias=b, reduction=reduction, backend=backend, **options)

    assert loss(hidden, weight, bias).dtype == torch.float64
    assert torch.autograd.gradcheck(loss, (hidden, weight, bias))


@pytest.mark.parametrize("float32_accumulator", [False, True])
def test_float32_weight_grad_accumulator(float32_accumulator, device):
    """Both accumulators give the weight's dtype and the right gradient for bf16 weights."""
    dtype = torch.bfloat16
    hidden, weight, bias, labels = problem(device, dtype=dtype)
    settings = dict(chunk_rows=4, accumulate_in_float32=float32_accumulator)
    loss = linear_cross_entropy(hidden, weight, labels, bias=bias, backend="kernel", **settings)
    (grad_weight,) = torch.autograd.grad(loss, weight)
    assert grad_weight.dtype == dtype
    weight64 = weight.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(unfused(hidden.double(), weight64, labels, bias.double()), weight64)
    torch.testing.assert_close(grad_weight.double(), expected, rtol=2e-2, atol=2e-3)


def test_weight_gradient_accumulation_error():
    """The measurement behind the module docstring's precision note (plain torch on the CPU, the same arithmetic as
    the chunk loop: bf16 d logits, float32-accumulated products, one bf16 rounding per chunk): rms error of the
    bf16 weight gradient against float64, relative to its rms. One rounding: ~2.2e-3; 8 chunks ~3.7e-3; 32 ~6.5e-3."""
    torch.manual_seed(0)
    n, width, vocab = 4096, 64, 512
    hidden = torch.randn(n, width).bfloat16()
    weight = (torch.randn(vocab, width) * 2 / width**0.5).bfloat16()
    labels = torch.randint(0, vocab, (n,))
    rows = torch.arange(n)
    exact_dlogits = torch.softmax(hidden.double() @ weight.double().T, -1)
    exact_dlogits[rows, labels] -= 1
    exact = (exact_dlogits / n).T @ hidden.double()
    dlogits = torch.softmax((hidden @ weight.T).float(), -1)
    dlogits[rows, labels] -= 1
    dlogits = (dlogits / n).bfloat16()

    def relative_rms_error(chunk):
        accumulator = torch.zeros(vocab, width, dtype=torch.bfloat16)
        for start in range(0, n, chunk):
            accumulator.addmm_(dlogits[start : start + chunk].T, hidden[start : start + chunk])
        return ((accumulator.double() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()

    once = ((dlogits.float().T @ hidden.float()).bfloat16().double() - exact).pow(2).mean().sqrt().item()
    once /= exact.pow(2).mean().sqrt().item()
    errors = {chunks: relative_rms_error(n // chunks) for chunks in (1, 8, 32)}
    assert 1.5e-3 < once < 3e-3 and abs(errors[1] - once) < 2e-4
    assert errors[1] < errors[8] < errors[32] < 3.5 * once  # grows like sqrt(chunks) once chunks dominate
    assert errors[8] < 2 * once


# --- torch.compile ----------------------------------------------------------------------------------------------


class Head(torch.nn.Module):
    def __init__(self, width, vocab, **options):
        super().__init__()
        self.proj = torch.nn.Linear(width, vocab)
        self.options = options

    def forward(self, hidden, labels, n_items=None):
        return linear_cross_entropy(
            hidden, self.proj.weight, labels, bias=self.proj.bias, n_items=n_items, **self.options
        )


@pytest.mark.parametrize(
    "options",
    [
        dict(backend="kernel"),
        dict(backend="kernel", reduction="none", logit_softcapping=3.0),
        dict(backend="kernel", reduction="sum", z_loss=1e-3),
    ],
    ids=["mean", "none-softcap", "sum-zloss"],
)
def test_fullgraph_compile_matches_eager(options, device):
    from fastce_torch.tests.test_compile import ops_in, recording_backend

    torch.manual_seed(0)
    head = Head(16, 60, chunk_rows=4, **options).to(device)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 7, 16, generator=gen).to(device).requires_grad_()
    labels = torch.randint(0, 60, (2, 7), generator=gen).to(device)
    labels[0, :3] = -100
    n_items = torch.tensor(9.0, device=device) if options.get("reduction") == "sum" else None

    def run(fn):
        head.zero_grad(set_to_none=True)
        hidden.grad = None
        loss = fn(hidden, labels, n_items)
        (loss * torch.linspace(0.5, 1.5, loss.numel(), device=device).view(loss.shape)).sum().backward()
        return [loss.detach(), hidden.grad, head.proj.weight.grad, head.proj.bias.grad]

    expected = run(head)
    torch._dynamo.reset()
    backend, graphs = recording_backend()
    got = run(torch.compile(head, fullgraph=True, backend=backend))
    torch._dynamo.reset()
    name = "linear_cross_entropy_forward" if options.get("reduction") == "none" else "linear_cross_entropy_reduced"
    assert f"fastce.{name}.default" in ops_in(graphs["forward"])
    if options.get("reduction") == "none":
        assert "fastce.linear_cross_entropy_backward.default" in ops_in(graphs["backward"])
    assert_same(got, expected, rtol=1e-5, atol=1e-6)


# --- GPU ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_peak_memory_is_gradients_plus_workspace(reduction, device):
    """No (N, V) tensor: the peak above the inputs is the gradients, the workspace and small buffers (8 MiB)."""
    n, width, vocab = 8192, 1024, 32000  # bf16 logits would be 500 MiB, the workspace is 250 MiB
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, width, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, width, device=device, generator=gen) / 32).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (n,), device=device, generator=gen)
    for _ in range(2):  # warm-up: kernels compiled, cuBLAS workspaces allocated
        loss = linear_cross_entropy(hidden, weight, labels, reduction=reduction)
        torch.autograd.grad(loss.sum(), (hidden, weight))
    del loss
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = linear_cross_entropy(hidden, weight, labels, reduction=reduction)
    grads = torch.autograd.grad(loss.sum(), (hidden, weight))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    gradients = hidden.numel() * 2 + weight.numel() * 2
    workspace = module.rows_per_chunk(n, vocab, 2) * vocab * 2
    assert peak <= gradients + workspace + (8 << 20), (peak, gradients, workspace)
    assert peak < gradients + n * vocab * 2
    del grads


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_second_order_gradients_equal_the_unfused_reference(reduction, device):
    """create_graph=True: a gradient penalty through hidden, differentiated with respect to hidden, weight and bias,
    and a Hessian-vector product equal the unfused plain-torch reference's."""
    hidden, weight, bias, labels = problem(device)
    options = dict(logit_softcapping=4.0, z_loss=1e-3, label_smoothing=0.1)
    gen = torch.Generator().manual_seed(9)
    directions = [torch.randn(t.shape, generator=gen).to(device) for t in (hidden, weight, bias)]

    def second_order(fn):
        loss = fn(hidden, weight, labels, bias=bias, reduction=reduction, **options).sum()
        grads = torch.autograd.grad(loss, (hidden, weight, bias), create_graph=True)
        penalty = torch.autograd.grad(grads[0].pow(2).sum(), (hidden, weight, bias), retain_graph=True)
        hvp = torch.autograd.grad(sum((g * d).sum() for g, d in zip(grads, directions)), (hidden, weight, bias))
        return (*penalty, *hvp)

    got = second_order(lambda *a, **k: linear_cross_entropy(*a, backend="kernel", **k))
    want = second_order(unfused)
    for g, w in zip(got, want):
        assert w.abs().max() > 1e-3
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# --- autocast -----------------------------------------------------------------------------------------------------


def _rel_rms(got, want):
    got, want = got.double(), want.double()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def _autocast_case(device, with_bias, reduction):
    """float32 hidden, weight and bias (master weights), as a Trainer with bf16=True on a float32 model has them."""
    hidden, weight, bias, labels = problem(device, n=24, width=32, vocab=90, bias=with_bias)
    upstream = torch.linspace(0.5, 1.5, labels.numel(), device=device).view(labels.shape)
    return [hidden, weight, bias], labels, (upstream if reduction == "none" else None)


def _check_autocast_result(loss, got, inputs, labels, upstream, reduction):
    """Equal to F.linear + cross_entropy under the same autocast within bf16 rounding, gradients in float32, and
    visibly not the float32 computation (the matmuls ran in bf16)."""
    hidden, weight, bias = inputs
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        ref = unfused(hidden, weight, labels, bias, reduction=reduction)
    want = grads_of(ref, inputs, upstream)
    fp32 = grads_of(unfused(hidden, weight, labels, bias, reduction=reduction), inputs, upstream)
    assert [g.dtype for g in got] == [t.dtype for t in inputs if t is not None] == [torch.float32] * len(got)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    # bf16 logits: the losses of two bf16 computations differ by the logits' roundings only.
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=5e-3, atol=5e-3)
    for g, w, f in zip(got, want, fp32):
        assert torch.isfinite(g).all()
        assert _rel_rms(g, w) < 2e-2, "not F.linear's autocast result"
        # float32 matmuls would agree with the float32 computation to ~1e-7.
        assert _rel_rms(g, f) > 1e-4, "the matmuls did not run in bf16"


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_autocast_matmuls_in_the_autocast_dtype(reduction, with_bias, device):
    """Under torch.autocast(bfloat16) with float32 master weights the matmuls run in bf16, as F.linear's do, and
    each gradient comes back in its own tensor's float32."""
    inputs, labels, upstream = _autocast_case(device, with_bias, reduction)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = linear_cross_entropy(
            *inputs[:2], labels, bias=inputs[2], reduction=reduction, backend="kernel", chunk_rows=8
        )
    got = grads_of(loss, inputs, upstream)
    _check_autocast_result(loss, got, inputs, labels, upstream, reduction)


def test_autocast_weight_gradient_accumulates_in_float32(device):
    """A float32 master weight's gradient is accumulated in float32 (not rounded to bf16 per chunk): with float32
    accumulation forced on or left off it is the same tensor."""
    inputs, labels, _ = _autocast_case(device, True, "mean")
    results = []
    for flag in (False, True):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = linear_cross_entropy(
                *inputs[:2], labels, bias=inputs[2], backend="kernel", chunk_rows=4, accumulate_in_float32=flag
            )
        results.append(torch.autograd.grad(loss, inputs[1]))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    # Not a bf16 value cast up: a float32 accumulator leaves low mantissa bits set.
    assert (results[0][0] != results[0][0].bfloat16().float()).any()


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")
def test_autocast_disabled_or_other_device_type_is_float32(device):
    """autocast disabled, or enabled for another device type than the tensors', changes nothing."""
    inputs, labels, _ = _autocast_case(device, True, "mean")
    expected = linear_cross_entropy(*inputs[:2], labels, bias=inputs[2], backend="kernel")
    other = "cuda" if device.type == "cpu" else "cpu"
    for context in (torch.autocast(device.type, dtype=torch.bfloat16, enabled=False), torch.autocast(other)):
        with context:
            loss = linear_cross_entropy(*inputs[:2], labels, bias=inputs[2], backend="kernel")
        torch.testing.assert_close(loss, expected, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_autocast_under_torch_compile(reduction, device):
    """The custom-op path follows autocast the same way (fullgraph, the fastce ops in the graph)."""
    from fastce_torch.tests.test_compile import ops_in, recording_backend

    inputs, labels, upstream = _autocast_case(device, True, reduction)

    def fn(hidden, weight, bias, labels):
        with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
            return linear_cross_entropy(
                hidden, weight, labels, bias=bias, reduction=reduction, backend="kernel", chunk_rows=8
            )

    torch._dynamo.reset()
    backend, graphs = recording_backend()
    try:
        loss = torch.compile(fn, fullgraph=True, backend=backend)(*inputs, labels)
        got = grads_of(loss, inputs, upstream)
    finally:
        torch._dynamo.reset()
    name = "linear_cross_entropy_forward" if reduction == "none" else "linear_cross_entropy_reduced"
    assert f"fastce.{name}.default" in ops_in(graphs["forward"])
    _check_autocast_result(loss, got, inputs, labels, upstream, reduction)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunking_keywords_reach_the_custom_ops(reduction, device, monkeypatch):
    """Under torch.compile the ops run the chunk loop with the caller's chunk_rows / workspace_bytes."""
    seen = []
    original = module.rows_per_chunk

    def spy(n_rows, vocab, itemsize, workspace_bytes=None, chunk_rows=None):
        seen.append((workspace_bytes, chunk_rows))
        return original(n_rows, vocab, itemsize, workspace_bytes, chunk_rows)

    monkeypatch.setattr(module, "rows_per_chunk", spy)
    hidden, weight, bias, labels = problem(device)
    settings = dict(workspace_bytes=12345, chunk_rows=3, accumulate_in_float32=True)

    def fn(hidden, weight, bias, labels):
        return linear_cross_entropy(
            hidden, weight, labels, bias=bias, reduction=reduction, backend="kernel", **settings
        )

    torch._dynamo.reset()
    try:
        loss = torch.compile(fn, fullgraph=True)(hidden, weight, bias, labels)
        grads_of(loss.sum(), (hidden, weight, bias))
    finally:
        torch._dynamo.reset()
    assert seen and set(seen) == {(12345, 3)}


@pytest.mark.parametrize(
    "keyword, value, error",
    [
        ("workspace_bytes", 0, ValueError),
        ("workspace_bytes", 1.5, ValueError),
        ("chunk_rows", -1, ValueError),
        ("chunk_rows", True, ValueError),
        ("accumulate_in_float32", 1, TypeError),
    ],
)
def test_bad_chunking_keywords_raise(keyword, value, error, device):
    hidden, weight, bias, labels = problem(device)
    with pytest.raises(error, match=keyword):
        linear_cross_entropy(hidden, weight, labels, bias=bias, backend="kernel", **{keyword: value})


# --- skip_ignored_rows ----------------------------------------------------------------------------------------


@pytest.fixture
def matmul_rows(monkeypatch):
    """The rows of every logits matmul the chunk loop runs (each chunk's first matmul; its two gradient matmuls
    have the same rows), in call order."""
    return checks.chunk_logits_rows(monkeypatch, module)


def ignored_problem(device, pattern, n=40, seed=30):
    hidden, weight, bias, labels = problem(device, n=n, seed=seed)
    labels = torch.randint(0, weight.shape[0], (n,), generator=torch.Generator().manual_seed(seed)).to(device)
    index = torch.arange(n, device=device)
    ignored = {
        "none": index < 0,
        "half-interleaved": index % 2 == 1,
        "ninety-clustered": (index < 20) | (index >= 24),
        "all": index >= 0,
    }[pattern]
    labels[ignored] = -100
    return hidden, weight, bias, labels


@pytest.mark.parametrize("pattern", ["none", "half-interleaved", "ninety-clustered", "all"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_skip_ignored_rows_runs_matmuls_on_kept_rows_only(pattern, reduction, device, matmul_rows, monkeypatch):
    """The chunks cover only the kept rows (forward; "none" also in the backward, which recomputes the logits),
    found once per call (one synchronisation); the loss and gradients are those of the default loop, d hidden
    exactly 0 on ignored rows."""
    searches = []
    find = module.kept_rows
    monkeypatch.setattr(module, "kept_rows", lambda *args: (searches.append(args[2].skip_ignored_rows), find(*args))[1])
    hidden, weight, bias, labels = ignored_problem(device, pattern)
    n_kept = int((labels != -100).sum())
    upstream = torch.rand(labels.shape, device=device) + 0.5 if reduction == "none" else None
    results = {}
    for skip in (False, True):
        matmul_rows.clear()
        loss = linear_cross_entropy(
            hidden, weight, labels, bias=bias, reduction=reduction, backend="kernel", chunk_rows=8,
            skip_ignored_rows=skip,
        )  # fmt: skip
        forward_rows = list(matmul_rows)
        grads = grads_of(loss, (hidden, weight, bias), upstream)
        results[skip] = loss.detach(), grads, forward_rows, matmul_rows[len(forward_rows) :]
    loss, grads, forward_rows, backward_rows = results[True]
    assert searches.count(True) == 1
    assert sum(results[False][2]) == 40 and sum(forward_rows) == n_kept
    assert all(r <= 8 for r in forward_rows) and len(forward_rows) == -(-n_kept // 8)
    assert backward_rows == (forward_rows if reduction == "none" else [])
    torch.testing.assert_close(loss, results[False][0], rtol=1e-6, atol=1e-7)
    assert_same(grads, results[False][1], rtol=1e-5, atol=1e-7)
    assert not grads[0][labels == -100].any()
    expected = unfused(hidden, weight, labels, bias, reduction=reduction)
    torch.testing.assert_close(loss, expected.detach(), rtol=2e-6, atol=2e-6)
    assert_same(grads, grads_of(expected, (hidden, weight, bias), upstream))


def test_skip_ignored_rows_with_outputs_shift_and_poisoned_buffers(device, poisoned, matmul_rows):
    """Extra outputs (per token in the original order), shift=1 and z_loss's gradient through the lse output; every
    buffer allocated with torch.empty starts as NaN, so rows the skipping leaves unwritten would show."""
    gen = torch.Generator().manual_seed(31)
    hidden = torch.randn(2, 12, 20, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(70, 20, generator=gen) / 20**0.5 * 2).to(device).requires_grad_()
    labels = torch.randint(0, 70, (2, 12), generator=gen).to(device)
    labels[0, :7] = -100  # a prompt
    labels[1, 2::2] = -100
    outputs = dict(return_z_loss=True, return_lse=True, return_accuracy=True, return_entropy=True)
    kw = dict(backend="kernel", chunk_rows=3, shift=1, z_loss=1e-2, label_smoothing=0.1, **outputs)
    for reduction in ("mean", "none"):
        got, want = (
            linear_cross_entropy(hidden, weight, labels, reduction=reduction, skip_ignored_rows=skip, **kw)
            for skip in (True, False)
        )
        for name in got._fields:
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-7, equal_nan=True)
        assert torch.equal(got.lse.isneginf(), labels[:, 1:] == -100)  # position t scores label t + 1
        objective = [(out.loss + out.z_loss).sum() for out in (got, want)]
        assert_same(grads_of(objective[0], (hidden, weight)), grads_of(objective[1], (hidden, weight)), 1e-5, 1e-7)


def test_skip_ignored_rows_under_fullgraph_compile(device, matmul_rows):
    """The keyword reaches the custom ops (it is a Chunking field): under torch.compile(fullgraph=True) the chunks
    still cover the kept rows only, no graph break."""
    from fastce_torch.tests.test_compile import ops_in, recording_backend

    hidden, weight, bias, labels = ignored_problem(device, "ninety-clustered")
    head = Head(20, 70, backend="kernel", chunk_rows=8, skip_ignored_rows=True).to(device)
    head.proj.weight.data.copy_(weight.detach())
    head.proj.bias.data.copy_(bias.detach())
    expected = head(hidden, labels)
    torch._dynamo.reset()
    backend, graphs = recording_backend()
    try:
        matmul_rows.clear()
        got = torch.compile(head, fullgraph=True, backend=backend)(hidden, labels)
    finally:
        torch._dynamo.reset()
    assert "fastce.linear_cross_entropy_reduced.default" in ops_in(graphs["forward"])
    assert sum(matmul_rows) == 4
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_skip_ignored_rows_must_be_a_bool(device):
    hidden, weight, bias, labels = problem(device)
    with pytest.raises(TypeError, match="skip_ignored_rows must be a bool"):
        linear_cross_entropy(hidden, weight, labels, backend="kernel", skip_ignored_rows=1)


@pytest.mark.gpu
def test_skip_ignored_rows_refuses_cuda_graph_capture(device):
    """It synchronises (the number of kept rows), which capture forbids: a clear error, not a capture failure."""
    hidden, weight, bias, labels = problem(device)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        linear_cross_entropy(hidden, weight, labels, bias=bias, skip_ignored_rows=True)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="skip_ignored_rows"):
            with torch.cuda.graph(graph, stream=stream):
                linear_cross_entropy(hidden.detach(), weight.detach(), labels, skip_ignored_rows=True)


def test_class_weight_with_a_sharded_head_is_refused():
    """The sharded-head paths have no class weights: a clear error, not an unweighted loss."""
    hidden, weight, _, labels = problem("cpu")
    class_weight = torch.rand(weight.shape[0]) + 0.5
    with pytest.raises(NotImplementedError, match="class_weight with a sharded head"):
        linear_cross_entropy(hidden, weight, labels, class_weight=class_weight, vocab_start=0)
