"""fastce_torch.liger: Liger-Kernel 0.8.5's loss entry points by name and signature, each Liger argument against the
float64 reference of Liger's meaning (shared_tests/reference.py: Liger's unweighted z-loss term is the difference
of two unweighted reference calls), every refusal's message, and the JSD entry points (against Liger's formula on
log-space inputs) when fastce_torch has jsd / linear_jsd, else through a stand-in of the spec's jsd."""

import inspect
import math
import sys

import numpy as np
import pytest
import torch

import fastce_torch
from fastce_torch import liger
from fastce_torch.integrations import liger as integrations_liger
from shared_tests import reference

from .checks import as_float64

REF_TOL = dict(rtol=1e-10, atol=1e-12)  # float64 inputs are computed in float64 (RTOL64 territory)


def inputs(n=13, v=37, h=8, ignore_index=-100, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, dtype=torch.float64, generator=generator) * 3).to(dtype)
    target = torch.randint(0, v, (n,), generator=generator)
    target[torch.randperm(n, generator=generator)[:4]] = ignore_index
    weight = torch.rand(v, dtype=torch.float64, generator=generator).to(dtype) + 0.25
    hidden = torch.randn(n, h, dtype=torch.float64, generator=generator).to(dtype)
    head = torch.randn(v, h, dtype=torch.float64, generator=generator).to(dtype) / 2
    bias = torch.randn(v, dtype=torch.float64, generator=generator).to(dtype)
    return logits, target, weight, hidden, head, bias


def liger_reference(logits, target, *, weight, ignore_index, scale, smoothing, softcap, reduction, upstream=None,
                    token_weights=None):  # fmt: skip
    """Liger's loss on logits, from the float64 reference: the (class-weighted) loss without z-loss plus Liger's
    unweighted z-loss term (unweighted call with it minus without it). Returns (loss, grad, z_loss, accuracy)."""
    x, y = as_float64(logits), target.numpy()
    g = None if upstream is None else as_float64(upstream)
    common = dict(ignore_index=ignore_index, logit_softcapping=softcap or 0.0)
    tw = None if token_weights is None else as_float64(token_weights)

    def call(w=None, **options):
        opts = reference.Options(**common, **options)
        return reference.cross_entropy(x, y, reduction=reduction, upstream=g, opts=opts, weight=w, token_weights=tw)

    base = call(None if weight is None else as_float64(weight), label_smoothing=smoothing)
    with_z, without_z = call(z_loss=scale), call()
    opts = reference.Options(**common, z_loss=scale)
    outputs = reference.outputs(x, y, reduction=reduction, opts=opts, token_weights=tw)
    loss = base.loss + (with_z.loss - without_z.loss)
    return loss, base.grad + (with_z.grad - without_z.grad), outputs.z_loss, outputs.accuracy


def close(actual, expected, what, **tol):
    np.testing.assert_allclose(as_float64(actual), np.asarray(expected, np.float64), err_msg=what, **(tol or REF_TOL))


def upstream_for(reduction, n, seed=3):
    return (
        torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        if reduction == "none"
        else None
    )


# (weighted, ignore_index, lse_square_scale, label_smoothing, softcap): the weighted z-loss rows take two fastce calls.
OPTIONS = [
    (False, -100, 0.0, 0.0, None),
    (False, 3, 1e-2, 0.1, 30.0),
    (True, -100, 0.0, 0.2, None),
    (True, 3, 1e-2, 0.0, None),
    (True, -100, 1e-2, 0.1, 5.0),
]


def call_cross_entropy(entry, x, target, weight, ignore_index, scale, smoothing, reduction, softcap):
    """One of the three cross-entropy entry points, every return_* on: Liger's (loss, z_loss, accuracy, predicted)."""
    if entry == "module":
        module = liger.LigerCrossEntropyLoss(
            weight, ignore_index, scale, smoothing, reduction, softcap, True, True, True
        )
        out = module(x, target)
    elif entry == "functional":
        out = liger.liger_cross_entropy(
            x, target, weight, None, ignore_index, None, reduction, smoothing, scale, softcap, True, True, True
        )
    else:
        args = (weight, ignore_index, scale, smoothing, reduction, softcap, True, True, True)
        return liger.LigerCrossEntropyFunction.apply(x, target, *args)
    assert isinstance(out, liger.CrossEntropyOutput)
    return out.loss, out.z_loss, out.token_accuracy, out.predicted_tokens


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted, ignore_index, scale, smoothing, softcap", OPTIONS)
def test_cross_entropy_against_reference(weighted, ignore_index, scale, smoothing, softcap, reduction):
    logits, target, weight, *_ = inputs(ignore_index=ignore_index)
    weight = weight if weighted else None
    want_loss, want_grad, want_z, want_accuracy = liger_reference(
        logits, target, weight=weight, ignore_index=ignore_index, scale=scale, smoothing=smoothing, softcap=softcap,
        reduction=reduction, upstream=upstream_for(reduction, 13),
    )  # fmt: skip
    for entry in ("module", "functional", "apply"):
        x = logits.clone().requires_grad_(True)
        loss, z_loss, accuracy, predicted = call_cross_entropy(
            entry, x * 1.0, target, weight, ignore_index, scale, smoothing, reduction, softcap
        )  # x * 1.0: an intermediate, as logits are (the gradient may go into its buffer)
        close(loss, want_loss, f"{entry} loss")
        close(z_loss, want_z, f"{entry} z_loss")
        close(accuracy, want_accuracy, f"{entry} accuracy", rtol=0, atol=1e-6)
        assert accuracy.dtype == torch.float32 and loss.dtype == z_loss.dtype == torch.float64
        assert predicted.dtype == torch.int64
        assert torch.equal(predicted, torch.where(target == ignore_index, -1, logits.argmax(-1)))
        loss.backward(upstream_for(reduction, 13) if reduction == "none" else None)
        close(x.grad, want_grad, f"{entry} grad")


def test_cross_entropy_loss_only_and_liger_dtypes():
    """No return_*: the bare loss; Liger's dtypes (loss and z_loss in the logits' dtype, accuracy float32)."""
    logits, target, *_ = inputs(dtype=torch.bfloat16)
    loss = liger.LigerCrossEntropyLoss()(logits, target)
    assert isinstance(loss, torch.Tensor) and loss.dtype == torch.bfloat16
    want = liger_reference(logits, target, weight=None, ignore_index=-100, scale=0.0, smoothing=0.0, softcap=None,
                           reduction="mean")  # fmt: skip
    close(loss, want[0], "bf16 loss", rtol=8e-3, atol=0)
    out = liger.liger_cross_entropy(logits, target, lse_square_scale=1e-3, return_z_loss=True)
    assert out.z_loss.dtype == torch.bfloat16 and out.token_accuracy is None and out.predicted_tokens is None


def test_two_call_path_keeps_logits_intact_on_the_kernels(device):
    """Class weights + z-loss on non-leaf float32 logits through the kernels (on the CPU Triton's interpreter): two
    fastce losses of one buffer, so neither backward writes into it (whichever autograd runs first, the other reads
    the logits); against the float64 reference."""
    logits, target, weight, *_ = inputs(n=6, v=40, ignore_index=3)
    x = logits.float().to(device).requires_grad_(True)
    loss_fn = liger.LigerCrossEntropyLoss(weight.float().to(device), 3, 1e-2, 0.1, "mean", 20.0, backend="kernel")
    intermediate = x * 1.0
    loss = loss_fn(intermediate, target.to(device))
    loss.backward()
    assert torch.equal(intermediate, x.detach()), "a backward wrote into the shared logits"
    want_loss, want_grad, *_ = liger_reference(
        x.detach().cpu(), target, weight=weight.float(), ignore_index=3, scale=1e-2, smoothing=0.1, softcap=20.0,
        reduction="mean",
    )  # fmt: skip
    close(loss, want_loss, "loss", rtol=1e-5, atol=1e-6)
    close(x.grad, want_grad, "grad", rtol=1e-4, atol=1e-6)


LINEAR_CASES = [  # (weighted, scale, smoothing, softcap, bias, use_token_scaling, reduction)
    (False, 1e-2, 0.1, 20.0, True, False, "mean"),
    (True, 0.0, 0.0, None, False, False, "sum"),
    (True, 1e-2, 0.1, None, True, False, "none"),
    (False, 0.0, 0.0, None, True, True, "none"),
    (True, 1e-2, 0.1, 5.0, True, True, "mean"),
]


@pytest.mark.parametrize("weighted, scale, smoothing, softcap, with_bias, token_scaling, reduction", LINEAR_CASES)
def test_fused_linear_against_reference(weighted, scale, smoothing, softcap, with_bias, token_scaling, reduction):
    logits, target, weight, hidden, head, bias = inputs()
    weight, bias = (weight if weighted else None), (bias if with_bias else None)
    upstream = upstream_for(reduction, 13)
    x, y = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    w1 = head.clone().requires_grad_(True)
    w2 = head.clone().requires_grad_(True)
    module = liger.LigerFusedLinearCrossEntropyLoss(
        weight, -100, scale, smoothing, reduction, softcap, True, None, token_scaling, True
    )
    out = module(w1, x, target, bias)
    loss, z_loss, accuracy, predicted = liger.LigerFusedLinearCrossEntropyFunction.apply(
        y, w2, target, bias, weight, -100, scale, smoothing, reduction, softcap, True, None, token_scaling, True
    )
    assert predicted is None and isinstance(out, liger.CrossEntropyOutput) and out.predicted_tokens is None
    z = torch.nn.functional.linear(hidden, head, bias).detach()
    probs = None
    if token_scaling:  # Liger's factor: softmax(softcap(logits))[label], detached, 0 where ignored
        capped = softcap * torch.tanh(z / softcap) if softcap else z
        kept = target != -100
        probs = torch.where(kept, capped.softmax(-1).gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
    want_loss, want_grad, want_z, want_accuracy = liger_reference(
        z, target, weight=weight, ignore_index=-100, scale=scale, smoothing=smoothing, softcap=softcap,
        reduction=reduction, upstream=upstream, token_weights=probs,
    )  # fmt: skip
    for got_loss, got_z, got_accuracy in ((out.loss, out.z_loss, out.token_accuracy), (loss, z_loss, accuracy)):
        close(got_loss, want_loss, "loss")
        close(got_z, want_z, "z_loss")
        close(got_accuracy, want_accuracy, "accuracy", rtol=0, atol=1e-6)
    out.loss.backward(upstream)
    loss.backward(upstream)
    g = torch.from_numpy(want_grad)
    for h, w in ((x, w1), (y, w2)):
        close(h.grad, (g @ head).numpy(), "d hidden")
        close(w.grad, (g.T @ hidden).numpy(), "d weight")


def test_fused_linear_kernels_token_scaling_and_dtypes(device):
    """The kernels (on the CPU Triton's interpreter) behind use_token_scaling and ce_weight: float32 hidden, Liger's
    dtypes (loss float32, z_loss in the input's dtype); against the float64 path of the same entry point."""
    logits, target, weight, hidden, head, bias = inputs(n=8, v=40, h=16)
    args = (target, bias, weight, -100, 1e-2, 0.1, "mean", 10.0, True, None, True, True)
    h32, w32 = (t.float().to(device).requires_grad_(True) for t in (hidden, head))
    on_device = (target.to(device), bias.float().to(device), weight.float().to(device))
    got = liger.liger_fused_linear_cross_entropy(h32, w32, *on_device, *args[3:], backend="kernel")
    h64, w64 = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
    want = liger.liger_fused_linear_cross_entropy(h64, w64, *args)
    assert got.loss.dtype == torch.float32 and got.z_loss.dtype == torch.float32
    for name in ("loss", "z_loss", "token_accuracy"):
        close(getattr(got, name), as_float64(getattr(want, name)), name, rtol=2e-5, atol=1e-6)
    got.loss.backward()
    want.loss.backward()
    close(h32.grad, as_float64(h64.grad), "d hidden", rtol=2e-4, atol=1e-6)
    close(w32.grad, as_float64(w64.grad), "d weight", rtol=2e-4, atol=1e-6)


def test_fused_linear_arguments_reach_fastce(monkeypatch):
    """accum_dtype=torch.float32 -> accumulate_in_float32; chunk_mem_const changes nothing; keyword-only extras go to
    linear_cross_entropy; the bf16 z_loss comes back in the input's dtype."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return fastce_torch.linear_cross_entropy(*args, **kwargs)

    monkeypatch.setattr(integrations_liger, "linear_cross_entropy", spy)  # where the drop-in looks it up
    _, target, _, hidden, head, _ = inputs()
    for accum_dtype, chunk_mem_const in ((torch.float32, 1), (None, 8), (torch.float64, 4)):
        liger.liger_fused_linear_cross_entropy(
            hidden, head, target, accum_dtype=accum_dtype, chunk_mem_const=chunk_mem_const, workspace_bytes=2**20
        )
        assert seen[-1]["accumulate_in_float32"] is (accum_dtype == torch.float32)
        assert seen[-1]["workspace_bytes"] == 2**20 and "chunk_mem_const" not in seen[-1]
    out = liger.liger_fused_linear_cross_entropy(hidden.bfloat16(), head.bfloat16(), target, return_z_loss=True)
    assert out.loss.dtype == torch.float32 and out.z_loss.dtype == torch.bfloat16


def refusal_cases():
    """(error, message pattern, call): each refusal and Liger check, with the argument it names."""
    x, t, _, h, w, _ = inputs()
    ce, lin, apply = (
        liger.liger_cross_entropy,
        liger.liger_fused_linear_cross_entropy,
        liger.LigerFusedLinearCrossEntropyFunction.apply,
    )
    CE, FL = liger.LigerCrossEntropyLoss, liger.LigerFusedLinearCrossEntropyLoss
    NI, VE, TE = NotImplementedError, ValueError, TypeError
    return [
        (NI, "return_predicted_tokens", lambda: lin(h, w, t, return_predicted_tokens=True)),
        (NI, "return_predicted_tokens", lambda: FL(return_predicted_tokens=True)),
        (NI, "accum_dtype=torch.bfloat16", lambda: lin(h, w, t, accum_dtype=torch.bfloat16)),
        (TE, "accum_dtype must be", lambda: FL(accum_dtype="float32")),
        (NI, "ce_impl='nvidia-cutile'", lambda: apply(h, w, t, ce_impl="nvidia-cutile")),
        (NI, "ce_mode='x'", lambda: apply(h, w, t, ce_mode="x")),
        (VE, "chunk_mem_const", lambda: lin(h, w, t, chunk_mem_const=0)),
        (VE, "size_average", lambda: ce(x, t, size_average=True)),
        (VE, "reduce=False", lambda: ce(x, t, reduce=False)),
        (VE, "softcap must be None", lambda: CE(softcap=0.0)),
        (VE, "softcap must be None", lambda: lin(h, w, t, softcap=-1.0)),
        (VE, "label_smoothing must be between", lambda: CE(label_smoothing=1.5)),
        (TE, "label_smoothing must be a number", lambda: ce(x, t, label_smoothing="0.1")),
        (VE, "reduction must be", lambda: FL(reduction="batchmean")),
        (TE, "return_z_loss must be True or False", lambda: CE(return_z_loss=1)),
        (TE, "use_token_scaling must be True or False", lambda: lin(h, w, t, use_token_scaling=None)),
        (TE, "unexpected keyword.*return_entropy", lambda: CE(return_entropy=True)),
        (TE, "unexpected keyword.*inplace_backward", lambda: lin(h, w, t, inplace_backward=False)),
        (VE, "weight must have shape", lambda: ce(x, t, torch.ones(5, dtype=x.dtype))),
    ]


@pytest.mark.parametrize("case", range(len(refusal_cases())))
def test_refusals_name_the_argument(case):
    error, message, call = refusal_cases()[case]
    with pytest.raises(error, match=message):
        call()


def test_out_of_range_label_is_nan_without_synchronising():
    """Liger asserts (a host sync); fastce: NaN for that token, or ValueError with validate_labels=True."""
    logits, target, *_ = inputs()
    target[1] = 37
    per_token = liger.liger_cross_entropy(logits, target, reduction="none")
    assert torch.isnan(per_token[1]) and torch.isfinite(per_token[target != 37]).all()
    with pytest.raises(ValueError, match="outside"):
        liger.LigerCrossEntropyLoss(validate_labels=True)(logits, target)


# Liger-Kernel 0.8.5's parameter names, in order (its wheel's liger_kernel.transformers and .functional).
LIGER_085 = {
    "LigerCrossEntropyLoss.__init__": "weight ignore_index lse_square_scale label_smoothing reduction softcap "
    "return_z_loss return_token_accuracy return_predicted_tokens",
    "LigerCrossEntropyLoss.forward": "_input target",
    "LigerFusedLinearCrossEntropyLoss.__init__": "ce_weight ignore_index lse_square_scale label_smoothing reduction "
    "softcap return_z_loss accum_dtype use_token_scaling return_token_accuracy return_predicted_tokens",
    "LigerFusedLinearCrossEntropyLoss.forward": "lin_weight _input target bias",
    "liger_cross_entropy": "input target weight size_average ignore_index reduce reduction label_smoothing "
    "lse_square_scale softcap return_z_loss return_token_accuracy return_predicted_tokens",
    "liger_fused_linear_cross_entropy": "input weight target bias ce_weight ignore_index lse_square_scale "
    "label_smoothing reduction softcap return_z_loss accum_dtype use_token_scaling return_token_accuracy "
    "return_predicted_tokens chunk_mem_const",
    "LigerCrossEntropyFunction.apply": "_input target weight ignore_index lse_square_scale label_smoothing reduction "
    "softcap return_z_loss return_token_accuracy return_predicted_tokens",
    "LigerFusedLinearCrossEntropyFunction.apply": "_input weight target bias ce_weight ignore_index lse_square_scale "
    "label_smoothing reduction softcap return_z_loss accum_dtype use_token_scaling return_token_accuracy "
    "return_predicted_tokens ce_impl ce_mode chunk_mem_const",
    "LigerJSD.__init__": "beta ignore_index",
    "LigerJSD.forward": "log_q log_p shift_labels",
    "LigerFusedLinearJSD.__init__": "jsd_beta ignore_index temperature accum_dtype",
    "LigerFusedLinearJSD.forward": "student_input student_weight teacher_input teacher_weight shift_labels",
    "liger_jsd": "input target shift_labels beta ignore_index",
    "liger_fused_linear_jsd": "student_input student_weight teacher_input teacher_weight shift_labels jsd_beta "
    "ignore_index temperature accum_dtype",
}


def positional_names(function):
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return " ".join(
        p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds and p.name != "self"
    )


def test_signatures_are_liger_085s(jsd_entry_points):
    for dotted, names in LIGER_085.items():
        owner, _, attribute = dotted.partition(".")
        function = getattr(jsd_entry_points if "jsd" in owner.lower() else liger, owner)
        function = getattr(function, attribute) if attribute else function
        assert positional_names(function) == names, dotted
    assert not {"LigerCrossEntropyLoss", "liger_cross_entropy", "LigerJSD"} & set(fastce_torch.__all__)


# --- JSD: fastce_torch.jsd / linear_jsd if present, else a stand-in following the spec (its float64 formula).


def spec_jsd(student_logits, teacher_logits, labels=None, *, beta=0.5, temperature=1.0, ignore_index=-100,
             reduction="mean", student_softcapping=0.0, teacher_softcapping=0.0, backend="auto"):  # fmt: skip
    """The spec's generalized JSD of logits (teacher constant), float64 torch; only what the adapters use."""
    ls = torch.log_softmax(student_logits.double() / temperature, -1)
    lt = torch.log_softmax(teacher_logits.detach().double()[..., : ls.shape[-1]] / temperature, -1)
    if beta == 0:
        rows = (lt.exp() * (lt - ls)).sum(-1)
    elif beta == 1:
        rows = (ls.exp() * (ls - lt)).sum(-1)
    else:
        lm = torch.logaddexp(math.log(1 - beta) + ls, math.log(beta) + lt)
        rows = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    kept = torch.ones_like(rows, dtype=torch.bool) if labels is None else labels != ignore_index
    rows = torch.where(kept, rows, 0.0)
    return rows.sum() / kept.sum().clamp(min=1)


def spec_linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, labels=None, *, student_bias=None,
                    teacher_bias=None, workspace_bytes=None, logits_dtype=None, accumulate_in_float32=False,
                    **options):  # fmt: skip
    student = torch.nn.functional.linear(student_hidden, student_weight, student_bias)
    teacher = torch.nn.functional.linear(teacher_hidden, teacher_weight, teacher_bias)
    return spec_jsd(student, teacher, labels, **options)


@pytest.fixture
def jsd_entry_points(monkeypatch):
    """fastce_torch.liger's JSD names (integrations/liger_jsd.py's)."""
    return liger


def liger_jsd_formula(log_q, log_p, labels, beta, ignore_index=-100):
    """Liger's generalized JSD of log-probabilities (its docstring): P the teacher, Q the student,
    M = beta P + (1 - beta) Q, beta KL(P||M) + (1 - beta) KL(Q||M); KL(P||Q) at 0, KL(Q||P) at 1; the mean over
    the kept rows."""
    q, p = log_q.double(), log_p.double()
    if beta == 0:
        rows = (p.exp() * (p - q)).sum(-1)
    elif beta == 1:
        rows = (q.exp() * (q - p)).sum(-1)
    else:
        m = torch.log(beta * p.exp() + (1 - beta) * q.exp())
        rows = beta * (p.exp() * (p - m)).sum(-1) + (1 - beta) * (q.exp() * (q - m)).sum(-1)
    kept = torch.ones_like(rows, dtype=torch.bool) if labels is None else labels != ignore_index
    return torch.where(kept, rows, 0.0).sum() / kept.sum()


@pytest.mark.parametrize(
    "beta, with_labels, backend", [(0.0, True, "auto"), (1.0, False, "auto"), (0.3, True, "kernel")]
)
def test_jsd_against_liger_formula(jsd_entry_points, beta, with_labels, backend, device):
    """Loss equal to Liger's; the gradient on the logits before the caller's log_softmax equal too (w.r.t. the
    log-probabilities themselves it differs by a per-row multiple of exp(log_q), see liger_jsd.py). "kernel":
    float32 through fastce's kernels (Triton's interpreter), Liger's dtype for the loss."""
    student, target, _, *_ = inputs(n=9, v=30, seed=4)
    teacher = inputs(n=9, v=30, seed=5)[0]
    dtype, tol = (torch.float32, dict(rtol=2e-5, atol=1e-6)) if backend == "kernel" else (torch.float64, REF_TOL)
    where = device if backend == "kernel" else "cpu"
    student, teacher, target = student.to(where, dtype), teacher.to(where, dtype), target.to(where)
    labels = target if with_labels else None
    log_p = teacher.log_softmax(-1)
    want_z = student.detach().double().clone().requires_grad_(True)
    want = liger_jsd_formula(want_z.log_softmax(-1), log_p, labels, beta)
    want.backward()
    for entry in ("module", "functional"):
        z = student.clone().requires_grad_(True)
        if entry == "module":
            got = jsd_entry_points.LigerJSD(beta=beta, backend=backend)(z.log_softmax(-1), log_p, labels)
        else:
            got = jsd_entry_points.liger_jsd(z.log_softmax(-1), log_p, labels, beta, backend=backend)
        assert got.dtype == dtype and got.shape == ()
        close(got, as_float64(want), f"{entry} loss", **tol)
        got.backward()
        close(z.grad, as_float64(want_z.grad), f"{entry} d logits", **tol)


@pytest.mark.parametrize("beta, temperature, backend", [(0.5, 1.0, "auto"), (0.0, 2.0, "auto"), (1.0, 0.7, "kernel")])
def test_fused_linear_jsd_against_liger_formula(jsd_entry_points, beta, temperature, backend, device):
    _, labels, _, hidden_s, head_s, _ = inputs(n=9, v=30, h=8, seed=6)
    _, _, _, hidden_t, head_t, _ = inputs(n=9, v=30, h=12, seed=7)
    dtype, tol = (torch.float32, dict(rtol=1e-4, atol=1e-6)) if backend == "kernel" else (torch.float64, REF_TOL)
    where = device if backend == "kernel" else "cpu"
    hidden_s, head_s, hidden_t, head_t = (t.to(where, dtype) for t in (hidden_s, head_s, hidden_t, head_t))
    labels = labels.to(where)
    hs, ws = (t.detach().double().clone().requires_grad_(True) for t in (hidden_s, head_s))
    ls = (hs @ ws.T / temperature).log_softmax(-1)
    lt = (hidden_t.double() @ head_t.double().T / temperature).log_softmax(-1)
    want = liger_jsd_formula(ls, lt, labels, beta)
    want.backward()
    for entry in ("module", "functional"):
        h, w = hidden_s.clone().requires_grad_(True), head_s.clone().requires_grad_(True)
        if entry == "module":
            loss_fn = jsd_entry_points.LigerFusedLinearJSD(jsd_beta=beta, temperature=temperature, backend=backend)
            got = loss_fn(h, w, hidden_t, head_t, labels)
        else:
            got = jsd_entry_points.liger_fused_linear_jsd(
                h, w, hidden_t, head_t, labels, beta, -100, temperature, backend=backend
            )
        assert got.shape == ()
        close(got, as_float64(want), f"{entry} loss", **tol)
        got.backward()
        close(h.grad, as_float64(hs.grad), f"{entry} d hidden", **tol)
        close(w.grad, as_float64(ws.grad), f"{entry} d weight", **tol)


def test_jsd_refusals(jsd_entry_points):
    _, labels, _, hidden, head, _ = inputs(n=4, v=10, h=4)
    apply = jsd_entry_points.LigerFusedLinearJSDFunction.apply
    with pytest.raises(NotImplementedError, match="jsd_impl='x'"):
        jsd_entry_points.LigerJSDFunction.apply(hidden, hidden, None, 0.5, -100, "x")
    with pytest.raises(NotImplementedError, match="jsd_mode='y'"):
        apply(hidden, head, hidden, head, None, 0.5, -100, 1.0, None, None, "y")
    with pytest.raises(ValueError, match="temperature must be"):
        jsd_entry_points.LigerFusedLinearJSD(temperature=0.0)
    with pytest.raises(TypeError, match="unexpected keyword.*reduction"):
        jsd_entry_points.LigerJSD(reduction="sum")
    with pytest.raises(TypeError, match="accum_dtype must be"):
        jsd_entry_points.LigerFusedLinearJSD(accum_dtype="float32")
    with pytest.raises(NotImplementedError, match="accum_dtype=torch.float64.*accum_dtype=None"):
        apply(hidden.bfloat16(), head.bfloat16(), hidden.bfloat16(), head.bfloat16(), None, 0.5, -100, 1.0,
              torch.float64)  # fmt: skip


def test_fused_linear_jsd_precision_keywords(jsd_entry_points, monkeypatch):
    """Liger 0.8.5 projects in float32: logits_dtype="float32" always; accum_dtype=torch.float32 ->
    accumulate_in_float32=True, None or the weight's dtype -> the default."""
    module = jsd_entry_points
    if not hasattr(module, "fastce_linear_jsd"):
        module = sys.modules[jsd_entry_points.LigerFusedLinearJSDFunction.__module__]
    seen = []
    monkeypatch.setattr(module, "fastce_linear_jsd", lambda *args, **keywords: seen.append(keywords))
    _, labels, _, hidden, head, _ = inputs(n=4, v=10, h=4)
    hidden, head = hidden.bfloat16(), head.bfloat16()
    for accum_dtype in (None, torch.float32, torch.bfloat16):
        jsd_entry_points.liger_fused_linear_jsd(hidden, head, hidden, head, labels, accum_dtype=accum_dtype)
        jsd_entry_points.LigerFusedLinearJSD(accum_dtype=accum_dtype)(hidden, head, hidden, head, labels)
    assert all(keywords["logits_dtype"] == "float32" for keywords in seen)
    accumulating = [keywords.get("accumulate_in_float32", False) for keywords in seen]
    assert accumulating == [False, False, True, True, False, False]


def test_jsd_names_follow_fastce():
    """fastce_torch.liger has the JSD names exactly when fastce_torch has jsd and linear_jsd."""
    has = callable(getattr(fastce_torch, "jsd", None)) and callable(getattr(fastce_torch, "linear_jsd", None))
    assert all(
        hasattr(liger, n) == has for n in ("LigerJSD", "LigerFusedLinearJSD", "liger_jsd", "liger_fused_linear_jsd")
    )
