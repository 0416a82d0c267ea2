"""fastce_torch.linear_cross_entropy's RL keywords (issue 37): temperature, token_weights, the differentiable entropy
output and logits_dtype=float32, and linear_log_probs; against the repository's float64 reference
(shared_tests/reference.py: head_logits, differentiated, chain_through_head). The kernels on the `device`
fixture's device (CPU: Triton's interpreter), small shapes."""

import sys

import pytest
import torch

import fastce_torch
from fastce_torch import linear_cross_entropy, linear_log_probs
from shared_tests import reference as ref64

from .checks import as_float64

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning",
    "ignore:invalid value:RuntimeWarning",
    "ignore:Conversion of an array:DeprecationWarning",
)

chunks_module = sys.modules["fastce_torch.linear.engine"]  # the LM-head engine
ce_launch = sys.modules["fastce_torch.losses.cross_entropy.launch"]
IGNORE = -100


def problem(device, n=18, width=20, vocab=70, dtype=torch.float32, seed=0, shape=None, bias=True):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*(shape or (n,)), width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen) / width**0.5 * 2
    b = torch.randn(vocab, generator=gen) * 0.3 if bias else None
    labels = torch.randint(0, vocab, hidden.shape[:-1], generator=gen)
    labels.view(-1)[2::5] = IGNORE
    weights = torch.randn(hidden.shape[:-1], generator=gen)  # advantages: either sign
    leaves = [None if t is None else t.to(device=device, dtype=dtype).requires_grad_() for t in (hidden, weight, b)]
    return (*leaves, labels.to(device), weights.to(device))


def expected(hidden, weight, bias, labels, upstreams, *, reduction="mean", n_items=None, token_weights=None,
             class_weight=None, shift=0, **options):  # fmt: skip
    """The float64 (loss, z_loss, entropy) outputs and the gradients (hidden, weight, bias) of
    sum_k <upstreams[k], output k> (numbers or per-token tensors; 0 leaves a term out) from the reference."""
    f64 = lambda t: None if t is None else as_float64(t)  # noqa: E731
    logits, _, h, w, b, lead = ref64.head_logits(f64(hidden), f64(weight), f64(bias))
    ref = ref64.differentiated(
        logits.reshape(*lead, -1), labels.cpu().numpy(), reduction=reduction, n_items=n_items,
        opts=ref64.Options(**options), weight=f64(class_weight), token_weights=f64(token_weights), shift=shift,
        upstream=tuple(f64(u) if isinstance(u, torch.Tensor) and u.dim() else float(u) for u in upstreams),
    )  # fmt: skip
    values = [torch.as_tensor(v) for v in (ref.loss.loss, ref.z_loss, ref.entropy.loss)]
    grads = [None if g is None else torch.as_tensor(g) for g in ref64.chain_through_head(ref.loss.grad, h, w, b, lead)]
    return values, [g for g in grads if g is not None]


def gradients(outputs, upstreams, inputs):
    total = sum((out * up.to(out.device)).sum() for out, up in zip(outputs, upstreams) if out is not None)
    return torch.autograd.grad(total, [t for t in inputs if t is not None])


def upstreams_for(reduction, shape, seed=5):
    """Random cotangents of the three outputs: per token for "none", numbers otherwise."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape if reduction == "none" else (), generator=gen) for _ in range(3)]


def check(got, want, rtol=2e-5, atol=2e-6):
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.to(a.device).double(), rtol=rtol, atol=atol)


CASES = [
    dict(temperature=0.7),
    dict(reduction="sum", temperature=1.6, n_items=7),
    dict(reduction="none", temperature=0.5),
    dict(logit_softcapping=2.5, logit_scaling=1.3, temperature=0.7, label_smoothing=0.1, z_loss=1e-3),
    dict(reduction="none", logit_softcapping=4.0, temperature=2.0, z_loss=1e-2),
]


def _ids(case):
    return ",".join(f"{k}={v}" for k, v in case.items())


@pytest.mark.parametrize("with_weights", [False, True], ids=["unweighted", "token_weights"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_temperature_and_token_weights_match_float64(case, with_weights, device, poisoned):
    """Loss, z_loss and entropy outputs and every gradient (the entropy's included) over chunks of 4 rows + a tail,
    every buffer poisoned with NaN, against the float64 formulas."""
    hidden, weight, bias, labels, weights = problem(device)
    token_weights = weights if with_weights else None
    out = linear_cross_entropy(
        hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=4, token_weights=token_weights,
        return_z_loss=True, return_entropy=True, **case,
    )  # fmt: skip
    upstreams = upstreams_for(case.get("reduction", "mean"), labels.shape)
    want, want_grads = expected(hidden, weight, bias, labels, upstreams, token_weights=token_weights, **case)
    got = (out.loss, out.z_loss, out.entropy)
    check(got, want)
    check(gradients(got, upstreams, (hidden, weight, bias)), want_grads, 1e-4, 1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_token_weights_with_class_weight_shift_and_skipped_rows(reduction, device, poisoned):
    """Token weights with class weights (multiplied), shift (aligned with the labels), smoothing, z-loss and
    skip_ignored_rows; the z_loss output weighted like the loss's term, the entropy output not weighted; every output
    differentiated."""
    hidden, weight, bias, labels, weights = problem(device, shape=(3, 7), seed=3)
    class_weight = torch.rand(weight.shape[0], generator=torch.Generator().manual_seed(4)).to(device) + 0.5
    case = dict(reduction=reduction, class_weight=class_weight, shift=1, label_smoothing=0.1, temperature=0.8,
                z_loss=1e-2)  # fmt: skip
    out = linear_cross_entropy(
        hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=5, token_weights=weights,
        skip_ignored_rows=True, return_z_loss=True, return_entropy=True, **case,
    )  # fmt: skip
    upstreams = upstreams_for(reduction, labels[:, 1:].shape)
    want, want_grads = expected(hidden, weight, bias, labels, upstreams, token_weights=weights, **case)
    got = (out.loss, out.z_loss, out.entropy)
    check(got, want)
    check(gradients(got, upstreams, (hidden, weight, bias)), want_grads, 1e-4, 1e-5)


def test_token_weights_nan_negative_and_ignored(device):
    """A NaN weight makes its token's loss NaN ("none") and so the reduced loss; on an ignored token it does nothing.
    Negative weights flip the gradient's sign exactly."""
    hidden, weight, bias, labels, weights = problem(device)
    weights = weights.clone()
    weights[2] = float("nan")  # labels[2] is ignored
    per_token = linear_cross_entropy(hidden, weight, labels, backend="kernel", reduction="none", token_weights=weights)
    assert per_token[2] == 0 and not per_token.isnan().any()
    weights[3] = float("nan")
    per_token = linear_cross_entropy(hidden, weight, labels, backend="kernel", reduction="none", token_weights=weights)
    assert per_token[3].isnan() and per_token.isnan().sum() == 1
    assert linear_cross_entropy(hidden, weight, labels, backend="kernel", token_weights=weights).isnan()
    ones = torch.ones_like(weights)
    plus = linear_cross_entropy(hidden, weight, labels, backend="kernel", token_weights=ones, reduction="sum")
    minus = linear_cross_entropy(hidden, weight, labels, backend="kernel", token_weights=-ones, reduction="sum")
    grad_plus, grad_minus = (torch.autograd.grad(loss, (hidden, weight)) for loss in (plus, minus))
    assert torch.equal(minus, -plus)
    for a, b in zip(grad_plus, grad_minus):
        assert torch.equal(a, -b)


@pytest.fixture
def logits_matmuls(monkeypatch):
    """The workspace dtype of every logits matmul the chunk loop runs, in call order."""
    calls = []
    original = chunks_module.chunk_logits

    def spy(workspace, hidden_chunk, weight, bias):
        calls.append(workspace.dtype)
        return original(workspace, hidden_chunk, weight, bias)

    monkeypatch.setattr(chunks_module, "chunk_logits", spy)
    return calls


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_token_weights_keep_the_gradients_in_the_forward(reduction, device, logits_matmuls):
    """ "mean"/"sum" with token weights: the logits are computed once per chunk in the forward, never in the backward
    (no recompute), and a differentiated entropy output recomputes each chunk only then."""
    hidden, weight, bias, labels, weights = problem(device)
    loss = linear_cross_entropy(
        hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=6, reduction=reduction, token_weights=weights
    )
    assert len(logits_matmuls) == 3
    loss.backward()
    assert len(logits_matmuls) == 3
    out = linear_cross_entropy(
        hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=6, reduction=reduction, token_weights=weights,
        return_entropy=True,
    )  # fmt: skip
    assert len(logits_matmuls) == 6
    out.loss.backward()  # the entropy not differentiated: no recompute
    assert len(logits_matmuls) == 6
    out = linear_cross_entropy(
        hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=6, reduction=reduction, return_entropy=True
    )
    (out.loss - 0.01 * out.entropy).backward()
    assert len(logits_matmuls) == 12


def test_per_token_entropy_gradient_adds_no_matmul(device, logits_matmuls):
    """reduction="none": the entropy's gradient comes in the backward that recomputes the logits anyway."""
    hidden, weight, bias, labels, _ = problem(device)
    out = linear_cross_entropy(
        hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=6, reduction="none", return_entropy=True
    )
    (out.loss.sum() - 0.01 * out.entropy.sum()).backward()
    assert len(logits_matmuls) == 6


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_entropy_gradient_alone(reduction, device):
    hidden, weight, bias, labels, _ = problem(device)
    case = dict(reduction=reduction, temperature=0.6, logit_softcapping=3.0)
    out = linear_cross_entropy(hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=7, return_entropy=True,
                               **case)  # fmt: skip
    upstreams = upstreams_for(reduction, labels.shape)
    upstreams[:2] = 0.0, 0.0  # the entropy alone
    want, want_grads = expected(hidden, weight, bias, labels, upstreams, **case)
    check([out.entropy], want[2:])
    check(gradients([out.entropy], upstreams[2:], (hidden, weight, bias)), want_grads, 1e-4, 1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_reference_backend_and_float64_entropy_gradients(reduction, device):
    """backend="reference" (plain torch) and float64 inputs (computed in float64 by it) give the same differentiable
    outputs, float64 within 1e-12."""
    hidden, weight, bias, labels, weights = problem(device)
    case = dict(reduction=reduction, temperature=0.9, z_loss=1e-3)
    for backend, dtype, tolerance in (
        ("reference", torch.float32, (2e-5, 2e-6)),
        ("kernel", torch.float64, (1e-12, 1e-12)),
    ):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias)]
        out = linear_cross_entropy(*inputs[:2], labels, bias=inputs[2], backend=backend, token_weights=weights,
                                   return_entropy=True, return_z_loss=True, **case)  # fmt: skip
        upstreams = upstreams_for(reduction, labels.shape)
        want, want_grads = expected(*inputs[:2], inputs[2], labels, upstreams, token_weights=weights, **case)
        got = (out.loss, out.z_loss, out.entropy)
        check(got, want, *tolerance)
        check(gradients(got, upstreams, inputs), want_grads, *tolerance)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_entropy_second_order(reduction, device):
    """create_graph=True through the entropy output: the gradient is plain torch, differentiated again exactly."""
    hidden, weight, bias, labels, _ = problem(device, n=6, vocab=9)
    inputs = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]

    def objective(h, w, b, backend):
        out = linear_cross_entropy(h, w, labels, bias=b, backend=backend, reduction=reduction, return_entropy=True,
                                   temperature=0.7)  # fmt: skip
        return (out.loss - 0.3 * out.entropy).sum()

    kernel_inputs = [t.detach().float().requires_grad_() for t in inputs]
    got = torch.autograd.grad(objective(*kernel_inputs, "kernel"), kernel_inputs[0], create_graph=True)[0]
    want = torch.autograd.grad(objective(*inputs, "reference"), inputs[0], create_graph=True)[0]
    (got_second,) = torch.autograd.grad(got.square().sum(), kernel_inputs[1])
    (want_second,) = torch.autograd.grad(want.square().sum(), inputs[1])
    check([got, got_second], [want, want_second], 1e-4, 1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("logits_dtype", ["float32", torch.float32])
def test_float32_logits_with_bf16_inputs(reduction, logits_dtype, device, logits_matmuls, poisoned):
    """bf16 inputs with logits_dtype=float32: the chunks' logits are float32; the loss and entropy are those of the
    float32 product of the bf16 operands (float64 reference from the same bf16 values), closer than bf16 logits."""
    hidden, weight, bias, labels, weights = problem(device, dtype=torch.bfloat16)
    case = dict(reduction=reduction, temperature=0.7, token_weights=weights, return_entropy=True)
    out = linear_cross_entropy(hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=4,
                               logits_dtype=logits_dtype, **case)  # fmt: skip
    assert set(logits_matmuls) == {torch.float32}
    bf16 = linear_cross_entropy(hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=4, **case)
    upstreams = upstreams_for(reduction, labels.shape)
    upstreams[1] = 0.0  # the z_loss output is not asked
    keywords = {k: v for k, v in case.items() if k != "return_entropy"}
    want, want_grads = expected(hidden, weight, bias, labels, upstreams, **keywords)
    want = [want[0], want[2]]
    check([out.loss, out.entropy], want, 1e-5, 1e-5)
    check([bf16.loss, bf16.entropy], want, 2e-2, 2e-2)  # bf16 logits: bf16's rounding
    error = (out.loss.cpu().double() - want[0]).abs().max()
    assert error < (bf16.loss.cpu().double() - want[0]).abs().max()
    got_grads = gradients([out.loss, out.entropy], [upstreams[0], upstreams[2]], (hidden, weight, bias))
    assert all(g.dtype == torch.bfloat16 for g in got_grads)
    check(got_grads, want_grads, 2e-2, 2e-2)


def test_float32_logits_workspace_counts_4_bytes(device):
    """The rows per chunk come from 4 bytes per logit (forward-only) or 4 + the inputs' itemsize (with gradients)."""
    hidden, weight, _, labels, _ = problem(device, n=64, dtype=torch.bfloat16)
    chunking = chunks_module.Chunking(workspace_bytes=70 * 16 * 4, float32_logits=True)
    assert chunks_module.logit_bytes(hidden, chunking, False) == 4
    assert chunks_module.logit_bytes(hidden, chunking, True) == 6
    assert chunks_module.logit_bytes(hidden.float(), chunking._replace(float32_logits=False), True) == 4


@pytest.mark.parametrize(
    "value", ["float16", "bf16", torch.bfloat16, torch.float64, torch.float16, 32, "float64"], ids=str
)
def test_bad_logits_dtype_is_named(value, device):
    hidden, weight, _, labels, _ = problem(device)
    with pytest.raises(ValueError, match="logits_dtype"):
        linear_cross_entropy(hidden, weight, labels, logits_dtype=value)


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(temperature=0.0), ValueError),
        (dict(temperature=-1.0), ValueError),
        (dict(temperature=float("nan")), ValueError),
        (dict(temperature=float("inf")), ValueError),
        (dict(temperature=True), TypeError),
        (dict(temperature="1"), TypeError),
        (dict(token_weights="shape"), ValueError),
        (dict(token_weights="int"), TypeError),
        (dict(token_weights="grad"), ValueError),
    ],
    ids=lambda c: str(c),
)
def test_bad_rl_arguments_are_named(change, error, device):
    hidden, weight, _, labels, weights = problem(device)
    name = next(iter(change))
    special = {
        "shape": weights[:-1],
        "int": weights.long(),
        "grad": weights.clone().requires_grad_(),
    }
    value = change[name]
    value = special.get(value, value) if isinstance(value, str) and name == "token_weights" else value
    with pytest.raises(error, match=name):
        linear_cross_entropy(hidden, weight, labels, backend="kernel", **{name: value})


def test_temperature_one_leaves_the_options_alone(device, monkeypatch):
    """T == 1 passes exactly today's options to the kernels (the same compiled variant)."""
    seen = []
    original = ce_launch.forward

    def spy(logits, labels, options, *args, **kwargs):
        seen.append(options)
        return original(logits, labels, options, *args, **kwargs)

    monkeypatch.setattr(ce_launch, "forward", spy)
    hidden, weight, _, labels, _ = problem(device)
    linear_cross_entropy(hidden, weight, labels, backend="kernel", chunk_rows=32, temperature=1, logit_scaling=1.5)
    linear_cross_entropy(hidden, weight, labels, backend="kernel", chunk_rows=32, temperature=2.0, logit_scaling=1.5)
    assert seen[0] == fastce_torch.core.options.Options(logit_scaling=1.5) and seen[1].logit_scaling == 0.75


# --- torch.compile --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fullgraph_compile_entropy_and_token_weights(reduction, device):
    from fastce_torch.tests.test_compile import ops_in, recording_backend

    hidden, weight, bias, labels, weights = problem(device)

    def step(h, w, b):
        out = linear_cross_entropy(h, w, labels, bias=b, backend="kernel", chunk_rows=5, reduction=reduction,
                                   token_weights=weights, temperature=0.7, return_entropy=True)  # fmt: skip
        return (out.loss - 0.01 * out.entropy).sum()

    def run(fn):
        inputs = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        value = fn(*inputs)
        return [value.detach(), *torch.autograd.grad(value, inputs)]

    expected = run(step)
    torch._dynamo.reset()
    backend, graphs = recording_backend()
    got = run(torch.compile(step, fullgraph=True, backend=backend))
    torch._dynamo.reset()
    assert "fastce.linear_cross_entropy_forward_outputs.default" in ops_in(graphs["forward"])
    assert "fastce.linear_cross_entropy_backward.default" in ops_in(graphs["backward"])
    check(got, expected, 1e-5, 1e-6)


def test_fullgraph_compile_token_weights_reduced(device):
    from fastce_torch.tests.test_compile import ops_in, recording_backend

    hidden, weight, bias, labels, weights = problem(device)

    def step(h, w, b):
        return linear_cross_entropy(h, w, labels, bias=b, backend="kernel", chunk_rows=5, token_weights=weights)

    def run(fn):
        inputs = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        value = fn(*inputs)
        return [value.detach(), *torch.autograd.grad(value * 1.5, inputs)]

    expected = run(step)
    torch._dynamo.reset()
    backend, graphs = recording_backend()
    got = run(torch.compile(step, fullgraph=True, backend=backend))
    torch._dynamo.reset()
    assert "fastce.linear_cross_entropy_reduced.default" in ops_in(graphs["forward"])
    check(got, expected, 1e-5, 1e-6)


# --- linear_log_probs -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("return_entropy", [False, True])
def test_linear_log_probs_match_float64(return_entropy, device):
    """The output type, shape and dtype with shift; +0.0 where ignored; values and a linear objective's gradients."""
    hidden, weight, bias, labels, _ = problem(device, shape=(2, 9), seed=7)
    labels[0, 4] = IGNORE
    case = dict(temperature=0.7, shift=1)
    out = linear_log_probs(hidden, weight, labels, bias=bias, backend="kernel", chunk_rows=5,
                           return_entropy=return_entropy, **case)  # fmt: skip
    logprobs = out.logprobs if return_entropy else out
    assert isinstance(out, fastce_torch.LogProbOutput) == return_entropy
    assert logprobs.shape == labels[:, 1:].shape and logprobs.dtype == torch.float32
    ignored = labels[:, 1:] == IGNORE
    assert ignored.any() and (logprobs[ignored] == 0).all() and not torch.signbit(logprobs[ignored]).any()
    # A linear objective g . logprobs + h . entropy (logprob = -loss: the loss's cotangent is -g); the nonlinear RL
    # objective through linear_log_probs is shared_tests/test_rl_linear.py's, both packages.
    g, _, h = upstreams_for("none", logprobs.shape)
    h = h if return_entropy else 0.0
    want, want_grads = expected(hidden, weight, bias, labels, (-g, 0.0, h), reduction="none", **case)
    got = [logprobs] + ([out.entropy] if return_entropy else [])
    check(got, [-want[0]] + want[2:3] * return_entropy)
    total = (logprobs * g.to(device)).sum() + ((out.entropy * h.to(device)).sum() if return_entropy else 0.0)
    check(torch.autograd.grad(total, (hidden, weight, bias)), want_grads, 1e-4, 1e-5)


def test_linear_log_probs_without_gradients_save_nothing(device):
    """Gradients off (no_grad, inference_mode, inputs not requiring grad): no graph and nothing saved for a backward."""
    hidden, weight, bias, labels, _ = problem(device)
    packed = []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            out = linear_log_probs(hidden, weight, labels, bias=bias, backend="kernel", return_entropy=True)
        with torch.inference_mode():
            linear_log_probs(hidden, weight, labels, bias=bias, backend="kernel")
        frozen = [t.detach() for t in (hidden, weight, bias)]
        plain = linear_log_probs(frozen[0], frozen[1], labels, bias=frozen[2], backend="kernel", return_entropy=True)
    assert packed == []
    assert all(t.grad_fn is None and not t.requires_grad for t in (*out, *plain))
    torch.testing.assert_close(out.logprobs, plain.logprobs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_log_probs(hidden, weight, labels, bias=bias, backend="kernel")
    assert packed  # with gradients on, the backward's inputs are saved (no logits among them)
    assert all(shape[-1] != weight.shape[0] or len(shape) == 1 for shape in packed)


def test_linear_log_probs_under_fullgraph_compile(device):
    """A PPO-style objective on linear_log_probs under torch.compile(fullgraph=True): the custom ops, the eager
    values and gradients, +0.0 where ignored."""
    hidden, weight, bias, labels, weights = problem(device)

    def step(h, w, b):
        out = linear_log_probs(h, w, labels, bias=b, backend="kernel", chunk_rows=5, temperature=0.7,
                               return_entropy=True)  # fmt: skip
        ratio = torch.exp(out.logprobs - out.logprobs.detach())
        return out.logprobs, -(ratio * weights).sum() - 0.01 * out.entropy.sum()

    def run(fn):
        inputs = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        logprobs, value = fn(*inputs)
        return [logprobs.detach(), value.detach(), *torch.autograd.grad(value, inputs)]

    expected = run(step)
    torch._dynamo.reset()
    got = run(torch.compile(step, fullgraph=True))
    torch._dynamo.reset()
    ignored = labels == IGNORE
    assert (got[0][ignored] == 0).all() and not torch.signbit(got[0][ignored]).any()
    check(got, expected, 1e-5, 1e-6)
