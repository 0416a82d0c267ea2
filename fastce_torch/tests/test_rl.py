"""cross_entropy's RL keywords (temperature, token_weights, a differentiable entropy), CrossEntropyLoss's and
log_probs, against the repository's float64 reference (shared_tests/reference.py: reference.differentiated) with
its tolerance model: what the shared suite (test_token_weights.py, test_entropy_grad.py, test_rl.py) does not run
here: the torch reference backend, the in-place (non-leaf) backward with the entropy's gradient, bf16 and float64
logits, class weights on poisoned buffers; torch.compile(fullgraph=True), second order and torch.func through the
entropy; the bad-input errors. Issue 37, CONTRACT.md."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import fastce_torch
from fastce_torch import CrossEntropyLoss, CrossEntropyOutput, LogProbOutput, cross_entropy, log_probs
from fastce_torch.core.options import Options, with_temperature
from fastce_torch.losses.cross_entropy import launch
from shared_tests import reference, tolerances

from .checks import as_float64, assert_grad

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning", "ignore::DeprecationWarning"
)

VOCAB = 300
ALL = dict(logit_softcapping=5.0, logit_scaling=0.9, label_smoothing=0.1, z_loss=1e-3)
OPTION_NAMES = ("ignore_index", "logit_softcapping", "logit_scaling", "label_smoothing", "z_loss", "temperature")


def problem(device, shape=(3, 7), vocab=VOCAB, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn((*shape, vocab), generator=generator, dtype=torch.float64) * 2.0).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=generator)
    labels.view(-1)[::5] = -100
    weights = torch.randn(shape, generator=generator)  # advantages: either sign
    return logits.to(device), labels.to(device), weights.to(device)


def objective(out, fields):
    """sum over the asked fields of coefficient * field.sum()."""
    return sum(coefficient * getattr(out, name).sum() for name, coefficient in fields.items())


def expected(logits, labels, fields, **keywords):
    """reference.differentiated for the call's keywords, the objective's coefficients as the cotangents."""
    opts = reference.Options(**{k: v for k, v in keywords.items() if k in OPTION_NAMES})
    rest = {k: v for k, v in keywords.items() if k in ("reduction", "n_items", "weight", "token_weights", "shift")}
    rest = {k: as_float64(v) if isinstance(v, torch.Tensor) else v for k, v in rest.items()}
    upstream = tuple(float(fields.get(name, 0.0)) for name in ("loss", "z_loss", "entropy"))
    return reference.differentiated(as_float64(logits), labels.cpu().numpy(), opts=opts, upstream=upstream, **rest)


def compare(logits, labels, fields, inplace=True, rtol=tolerances.RTOL, **keywords):
    """The package's fields and the gradient of `objective` against the float64 reference (float64 logits: rtol
    RTOL64)."""
    leaf = logits.detach().clone().requires_grad_()
    source = leaf * 1 if inplace else leaf  # a non-leaf: the in-place backward's case
    asked = {f"return_{name}": True for name in fields if name != "loss"}
    out = cross_entropy(source, labels, **asked, **keywords)
    if not asked:
        out = CrossEntropyOutput(out)
    objective(out, fields).backward()
    ref = expected(logits, labels, fields, **keywords)
    tolerances.check(as_float64(out.loss), ref.loss.loss, tolerances.loss_bound(ref.loss, rtol), "loss")
    if "z_loss" in fields:  # the z-loss term's error is within the loss's
        tolerances.check(as_float64(out.z_loss), ref.z_loss, tolerances.loss_bound(ref.loss, rtol), "z_loss")
    if "entropy" in fields:
        tolerances.check(as_float64(out.entropy), ref.entropy.loss, tolerances.loss_bound(ref.entropy, rtol), "entropy")
    if logits.dtype == torch.float64:
        got = as_float64(leaf.grad)
        bound = tolerances.grad_bound(ref.loss, got, "float64", rtol=rtol)
        tolerances.check(got, ref.loss.grad, bound, "grad")
    else:
        assert_grad(leaf.grad, ref.loss)
    return out, leaf.grad


REDUCTIONS = ["mean", "sum", "none"]
BACKENDS = ["kernel", "reference"]


def test_temperature_one_keeps_the_options():
    options = Options(logit_softcapping=30.0)
    assert with_temperature(options, 1.0) is options
    folded = with_temperature(options, 2.0)
    assert folded.logit_scaling == 0.5 and folded.logit_softcapping == 15.0


# The kernel path of these cases (both packages, inputs in place or not) is shared_tests/test_token_weights.py's and
# test_entropy_grad.py's; here the torch reference backend (plain torch ops) with the same keywords.
REFERENCE_BACKEND_CASES = {
    "temperature": dict(temperature=0.7),
    "all": dict(temperature=0.7, **ALL),
    "token-weights": dict(token_weights=True),
    "all-token-weights": dict(token_weights=True, temperature=0.7, **ALL),
    "n_items": dict(token_weights=True, n_items=11),
    "class_weights": dict(token_weights=True, weight=True, label_smoothing=0.1, z_loss=1e-3),
    "shift": dict(token_weights=True, shift=2, z_loss=1e-3),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", sorted(REFERENCE_BACKEND_CASES))
def test_reference_backend(case, reduction, device):
    logits, labels, weights = problem(device, seed=1)
    keywords = dict(REFERENCE_BACKEND_CASES[case])
    if keywords.pop("token_weights", False):
        keywords["token_weights"] = weights
    if keywords.pop("weight", False):
        keywords["weight"] = (torch.rand(VOCAB, generator=torch.Generator().manual_seed(2)) + 0.5).to(device)
    fields = dict(loss=1.0, entropy=0.5, z_loss=3.0) if keywords.get("z_loss") else dict(loss=1.0, entropy=0.5)
    compare(logits, labels, fields, reduction=reduction, backend="reference", **keywords)


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
    compare(logits, labels, dict(loss=1.0, entropy=0.1), token_weights=weights.bfloat16(), temperature=0.7,
            backend="kernel")  # fmt: skip


# In place (a non-leaf's buffer takes the gradient) with the entropy's gradient: the shared suite's entropy tests
# differentiate leaves.
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("fields", ["entropy", "loss+entropy+z_loss"])
def test_entropy_gradient_in_place(reduction, fields, device):
    logits, labels, weights = problem(device, seed=3)
    logits[1, 2, ::9] = -float("inf")  # p = 0 there: a zero gradient, no NaN
    coefficients = dict(loss=1.0, entropy=-0.01, z_loss=2.0)
    asked = {name: coefficients[name] for name in fields.split("+")}
    options = dict(ALL, token_weights=weights) if "z_loss" in asked else dict(logit_softcapping=5.0)
    _, grad = compare(logits, labels, asked, reduction=reduction, temperature=0.8, backend="kernel", **options)
    assert (grad[labels == -100] == 0).all()


def test_entropy_gradient_reference_backend_and_float64(device):
    logits, labels, _ = problem(device, seed=4)
    compare(logits, labels, dict(loss=1.0, entropy=0.3), temperature=1.3, backend="reference", **ALL)
    compare(
        logits.double(), labels, dict(loss=1.0, entropy=0.3), rtol=tolerances.RTOL64, temperature=1.3, backend="kernel"
    )


def test_entropy_gradient_with_class_weights(poisoned, device):
    logits, labels, weights = problem(device, seed=5)
    class_weights = (torch.rand(VOCAB, generator=torch.Generator().manual_seed(6)) + 0.5).to(device)
    compare(logits, labels, dict(loss=1.0, entropy=0.2), backend="kernel", weight=class_weights,
            label_smoothing=0.1, token_weights=weights)  # fmt: skip


def test_entropy_returned_but_not_differentiated_runs_nothing_extra(monkeypatch, device):
    calls = []
    backward = launch.backward

    def recording(*args, **kwargs):
        calls.append(kwargs.get("grad_entropy") is not None)
        return backward(*args, **kwargs)

    monkeypatch.setattr(launch, "backward", recording)
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
    """The output type, dtype and shape with shift; +0.0 where ignored, NaN for a label outside [0, V) (its entropy
    finite); the values against the float64 reference. Gradients through log_probs (non-leaf logits, a bad token's
    NaN row, a clipped-ratio objective): shared_tests/test_rl.py, both packages."""
    logits, labels, _ = problem(device, seed=9)
    labels[2, 3] = VOCAB + 4  # outside [0, V): NaN
    out = log_probs(logits * 1, labels, temperature=0.7, return_entropy=True, shift=1, backend="kernel",
                    logit_softcapping=5.0)  # fmt: skip
    assert isinstance(out, LogProbOutput) and out.logprobs.shape == out.entropy.shape == labels[..., 1:].shape
    assert out.logprobs.dtype == out.entropy.dtype == torch.float32
    ignored = labels[..., 1:] == -100
    assert (out.logprobs[ignored] == 0).all() and not torch.signbit(out.logprobs[ignored]).any()
    assert torch.isnan(out.logprobs[2, 2]) and torch.isfinite(out.entropy[2, 2])
    opts = reference.Options(temperature=0.7, logit_softcapping=5.0)
    ref = reference.log_probs(as_float64(logits), labels.cpu().numpy(), opts=opts, shift=1)
    rtol = tolerances.RTOL
    tolerances.check(as_float64(out.logprobs), ref.logprobs, rtol * ref.logprob_scale + tolerances.FLOOR, "logprobs")
    tolerances.check(as_float64(out.entropy), ref.entropy, 2 * rtol * ref.logprob_scale + tolerances.FLOOR, "entropy")


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
