"""cross_entropy's RL keywords (temperature, token_weights, a differentiable entropy), CrossEntropyLoss's and
log_probs, against a literal float64 reference (rl_reference.literal) with the options they interact with, on the
kernels (on the `device` fixture's device; CPU: Triton's interpreter) and the reference backend, the reference on the
CPU; torch.compile(fullgraph=True), second order and
torch.func through the entropy; the bad-input errors. Issue 37, CONTRACT.md."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import fastce_torch
from fastce_torch import CrossEntropyLoss, LogProbOutput, contract, cross_entropy, kernels, log_probs

from .rl_reference import literal

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning", "ignore::DeprecationWarning"
)

VOCAB = 300
ALL = dict(logit_softcapping=5.0, logit_scaling=0.9, label_smoothing=0.1, z_loss=1e-3)


def problem(device, shape=(3, 7), vocab=VOCAB, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn((*shape, vocab), generator=generator, dtype=torch.float64) * 2.0).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=generator)
    labels.view(-1)[::5] = -100
    weights = torch.randn(shape, generator=generator)  # advantages: either sign
    return logits.to(device), labels.to(device), weights.to(device)


def on_cpu(keywords):
    """keywords with their tensors (class weights, token weights) moved to the CPU, for the float64 reference."""
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in keywords.items()}


def objective(out, fields):
    """sum over the asked fields of coefficient * field.sum(), the same for the package's output and the literal."""
    get = (lambda name: out[name]) if isinstance(out, dict) else (lambda name: getattr(out, name))
    return sum(coefficient * get(name).sum() for name, coefficient in fields.items())


def compare(logits, labels, fields, tol=2e-5, inplace=True, **keywords):
    """The package's fields and gradient of `objective` against the literal float64 reference's."""
    leaf = logits.detach().clone().requires_grad_()
    source = leaf * 1 if inplace else leaf  # a non-leaf: the in-place backward's case
    asked = {f"return_{name}": True for name in fields if name != "loss"}
    out = cross_entropy(source, labels, **asked, **keywords)
    if not asked:
        out = contract.CrossEntropyOutput(out)
    objective(out, fields).backward()
    exact = logits.detach().cpu().double().requires_grad_()
    reference_keywords = on_cpu({k: v for k, v in keywords.items() if k not in ("backend", "inplace_backward")})
    expected = literal(exact, labels.cpu(), **reference_keywords)
    objective(expected, fields).backward()
    for name in fields:
        assert_close(getattr(out, name), expected[name], tol, name)
    assert_close(leaf.grad, exact.grad, tol, "grad")
    return out, leaf.grad


def assert_close(got, expected, tol, what):
    expected = expected.detach()
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1e-30)
    torch.testing.assert_close(got.detach().cpu().double(), expected, rtol=tol, atol=tol * scale, msg=what)


REDUCTIONS = ["mean", "sum", "none"]
BACKENDS = ["kernel", "reference"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("options", [{}, ALL], ids=["plain", "all"])
def test_temperature(backend, reduction, options, device):
    logits, labels, _ = problem(device)
    fields = dict(loss=1.0, entropy=0.5, z_loss=3.0) if options else dict(loss=1.0)
    compare(logits, labels, fields, reduction=reduction, temperature=0.7, backend=backend, **options)


def test_temperature_one_keeps_the_options():
    options = contract.Options(logit_softcapping=30.0)
    assert contract.with_temperature(options, 1.0) is options
    folded = contract.with_temperature(options, 2.0)
    assert folded.logit_scaling == 0.5 and folded.logit_softcapping == 15.0


TOKEN_WEIGHT_CASES = {
    "plain": {},
    "all": ALL,
    "n_items": dict(n_items=11),
    "class_weights": dict(label_smoothing=0.1, z_loss=1e-3),
    "shift": dict(shift=2, z_loss=1e-3),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", sorted(TOKEN_WEIGHT_CASES))
def test_token_weights(backend, reduction, case, device):
    logits, labels, weights = problem(device, seed=1)
    keywords = dict(TOKEN_WEIGHT_CASES[case])
    if case == "class_weights":
        keywords["weight"] = (torch.rand(VOCAB, generator=torch.Generator().manual_seed(2)) + 0.5).to(device)
    fields = dict(loss=1.0, z_loss=2.0) if keywords.get("z_loss") else dict(loss=1.0)
    compare(logits, labels, fields, reduction=reduction, token_weights=weights, backend=backend, **keywords)


def test_token_weights_nan_and_ignored(device):
    """A NaN weight shows as that token's NaN loss; an ignored token's weight is never used."""
    logits, labels, weights = problem(device)
    weights[0, 1] = float("nan")
    weights[0, 0] = float("nan")  # labels[0, 0] is ignored
    losses = cross_entropy(logits, labels, reduction="none", token_weights=weights, backend="kernel")
    assert torch.isnan(losses[0, 1]) and losses[0, 0] == 0
    assert torch.isfinite(losses.view(-1)[2:]).all()
    assert torch.isnan(cross_entropy(logits, labels, token_weights=weights, backend="kernel"))


def test_token_weights_bf16(device):
    logits, labels, weights = problem(device, dtype=torch.bfloat16)
    # bf16 gradients: the interpreter truncates to bf16 (2 ulps: 2**-7 relative).
    compare(logits, labels, dict(loss=1.0, entropy=0.1), tol=1.6e-2, token_weights=weights.bfloat16(),
            temperature=0.7, backend="kernel")  # fmt: skip


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("fields", ["entropy", "loss+entropy", "loss+entropy+z_loss"])
def test_entropy_gradient(reduction, fields, inplace, device):
    logits, labels, _ = problem(device, seed=3)
    logits[1, 2, ::9] = -float("inf")  # p = 0 there: a zero gradient, no NaN
    coefficients = dict(loss=1.0, entropy=-0.01, z_loss=2.0)
    asked = {name: coefficients[name] for name in fields.split("+")}
    options = ALL if "z_loss" in asked else dict(logit_softcapping=5.0)
    _, grad = compare(
        logits, labels, asked, reduction=reduction, temperature=0.8, backend="kernel", inplace=inplace, **options
    )
    assert (grad[labels == -100] == 0).all()


def test_entropy_gradient_reference_backend_and_float64(device):
    logits, labels, _ = problem(device, seed=4)
    compare(logits, labels, dict(loss=1.0, entropy=0.3), temperature=1.3, backend="reference", **ALL)
    compare(logits.double(), labels, dict(loss=1.0, entropy=0.3), tol=1e-10, temperature=1.3, backend="kernel")


def test_entropy_gradient_with_class_weights(poisoned, device):
    logits, labels, weights = problem(device, seed=5)
    class_weights = (torch.rand(VOCAB, generator=torch.Generator().manual_seed(6)) + 0.5).to(device)
    compare(logits, labels, dict(loss=1.0, entropy=0.2), backend="kernel", weight=class_weights,
            label_smoothing=0.1, token_weights=weights)  # fmt: skip


def test_entropy_returned_but_not_differentiated_runs_nothing_extra(monkeypatch, device):
    calls = []
    backward = kernels.backward

    def recording(*args, **kwargs):
        calls.append(kwargs.get("grad_entropy") is not None)
        return backward(*args, **kwargs)

    monkeypatch.setattr(kernels, "backward", recording)
    logits, labels, _ = problem(device)
    leaf = logits.clone().requires_grad_()
    out = cross_entropy(leaf * 1, labels, return_entropy=True, backend="kernel")
    out.loss.backward()
    assert calls == [False]
    calls.clear()
    out = cross_entropy(leaf * 1, labels, return_entropy=True, backend="kernel")
    (out.loss + out.entropy).backward()
    assert calls == [True]  # one pass: the loss's and the entropy's gradient together


def test_entropy_second_order_and_torch_func(device):
    """create_graph through the entropy and torch.func.grad of it take the differentiable plain-torch gradient."""
    logits, labels, _ = problem(device, shape=(2, 4), seed=7)

    def entropy(x, backend):
        return cross_entropy(x, labels, return_entropy=True, temperature=0.9, backend=backend).entropy

    results = {}
    for backend in BACKENDS:
        x = logits.clone().requires_grad_()
        (grad,) = torch.autograd.grad(entropy(x, backend), x, create_graph=True)
        (grad * grad).sum().backward()
        results[backend] = (grad.detach(), x.grad, torch.func.grad(lambda v: entropy(v, backend))(logits))
    for got, expected in zip(results["kernel"], results["reference"]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    tangent = torch.randn_like(logits)
    primal, jvp = torch.func.jvp(lambda v: entropy(v, "kernel"), (logits,), (tangent,))
    torch.testing.assert_close(jvp, (results["reference"][0] * tangent).sum(), rtol=1e-4, atol=1e-6)


def recording_backend():
    graphs = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")), graphs


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph(reduction, device):
    """temperature, token_weights and the entropy's gradient under torch.compile(fullgraph=True): the custom ops,
    no graph break, eager's values and gradient."""
    logits, labels, weights = problem(device, seed=8)

    def step(x, labels, weights):
        out = cross_entropy(x * 1, labels, reduction=reduction, temperature=0.7, token_weights=weights,
                            return_entropy=True, return_z_loss=True, backend="kernel", **ALL)  # fmt: skip
        return out.loss.sum() + 0.01 * out.entropy.sum() + out.z_loss.sum()

    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        backend, graphs = recording_backend()
        run = torch.compile(step, fullgraph=True, backend=backend) if compiled else step
        x = logits.clone().requires_grad_()
        value = run(x, labels, weights)
        value.backward()
        results.append((value.detach(), x.grad))
    names = {str(node.target) for gm in graphs["backward"] for node in gm.graph.nodes}
    assert "fastce.cross_entropy_backward.default" in names
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_cross_entropy_loss_module(device):
    logits, labels, weights = problem(device)
    module = CrossEntropyLoss(temperature=0.5, reduction="sum", backend="kernel")
    assert "temperature=0.5" in repr(module)
    expected = cross_entropy(logits, labels, reduction="sum", temperature=0.5, token_weights=weights)
    torch.testing.assert_close(module(logits, labels, token_weights=weights), expected)


def test_log_probs(device):
    logits, labels, _ = problem(device, seed=9)
    labels[2, 3] = VOCAB + 4  # outside [0, V): NaN
    x = logits.clone().requires_grad_()
    out = log_probs(x * 1, labels, temperature=0.7, return_entropy=True, shift=1, backend="kernel", **dict(
        logit_softcapping=5.0))  # fmt: skip
    assert isinstance(out, LogProbOutput) and out.logprobs.shape == labels[..., 1:].shape
    assert out.logprobs.dtype == torch.float32
    ignored = labels[..., 1:] == -100
    assert (out.logprobs[ignored] == 0).all() and not torch.signbit(out.logprobs[ignored]).any()
    assert torch.isnan(out.logprobs[2, 2]) and torch.isfinite(out.entropy[2, 2])
    exact = logits.cpu().double().requires_grad_()
    expected = literal(exact, labels.cpu(), reduction="none", temperature=0.7, shift=1, logit_softcapping=5.0)
    good = ~torch.isnan(out.logprobs.detach().cpu())
    assert_close(out.logprobs.cpu()[good], -expected["loss"][good], 2e-5, "logprobs")
    assert_close(out.entropy, expected["entropy"], 2e-5, "entropy")
    # A PPO-style clipped objective with an entropy bonus (the bad token masked out), differentiated.
    old = out.logprobs.detach() + 0.1
    advantages = torch.randn(out.logprobs.shape, generator=torch.Generator().manual_seed(1))

    def ppo(logprobs, entropy):
        good_here, advantages_here = good.to(logprobs.device), advantages.to(logprobs.device)
        old_here = old.to(logprobs.device, logprobs.dtype)
        ratio = torch.exp(torch.where(good_here, logprobs, 0.0) - torch.where(good_here, old_here, 0.0))
        clipped = torch.minimum(ratio * advantages_here, ratio.clamp(0.8, 1.2) * advantages_here)
        return -(clipped.sum() + 0.01 * entropy.sum())

    ppo(out.logprobs, out.entropy).backward()
    ppo(-expected["loss"], expected["entropy"]).backward()
    # The bad token's row is NaN (the contract's out-of-range label, whatever its upstream); the rest as float64.
    assert torch.isnan(x.grad[2, 2]).all()
    x.grad[2, 2] = exact.grad[2, 2].float().to(device)
    assert_close(x.grad, exact.grad, 2e-5, "grad")


def test_log_probs_keeps_nothing_without_gradients(device):
    logits, labels, _ = problem(device)
    saved = []

    def pack(tensor):
        saved.append(tensor.shape)
        return tensor

    x = logits.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            plain = log_probs(x, labels, return_entropy=True, backend="kernel")
        log_probs(logits, labels, return_entropy=True, backend="kernel")  # inputs not requiring grad
        with torch.inference_mode():
            log_probs(x, labels, backend="kernel")
        assert saved == [] and not plain.logprobs.requires_grad
        log_probs(x, labels, return_entropy=True, backend="kernel")
    assert saved  # the differentiated call does save (the logits among them)


def test_bad_inputs():
    logits, labels, weights = problem("cpu")
    for value, error in ((True, TypeError), ("0.7", TypeError), (None, TypeError), (0.0, ValueError),
                         (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError)):  # fmt: skip
        with pytest.raises(error, match="temperature"):
            cross_entropy(logits, labels, temperature=value)
        with pytest.raises(error, match="temperature"):
            log_probs(logits, labels, temperature=value)
    with pytest.raises(ValueError, match="temperature"):
        cross_entropy(logits, labels, temperature=1e-300)
    for bad, error in ((weights.long(), TypeError), (weights[:, :-1], ValueError), (weights.reshape(-1), ValueError),
                       (weights.clone().requires_grad_(), ValueError), (weights.to("meta"), ValueError),
                       ([1.0] * 21, TypeError)):  # fmt: skip
        with pytest.raises(error, match="token_weights"):
            cross_entropy(logits, labels, token_weights=bad)
    with pytest.raises(TypeError, match="return_entropy"):
        log_probs(logits, labels, return_entropy=1)


def test_exports():
    assert {"log_probs", "LogProbOutput"} <= set(fastce_torch.__all__)
