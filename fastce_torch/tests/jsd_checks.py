"""The float64 expectation of fastce_torch's jsd / linear_jsd tests (test_jsd.py, test_linear_jsd.py): the loss from
the definition of TRL's generalized JSD and the student's gradient by float64 torch autograd of it (independent of
the kernels' closed-form gradient), the checks against it, and the inputs and argument-check parameters both
modules use."""

import pytest
import torch

from shared_tests import tolerances

EPS32 = 2.0**-23


def _masked(p, a, b):
    """p (a - b), 0 where p = 0 (a or b may be -inf there; masked first so autograd's gradient stays finite)."""
    zero = p == 0
    return p * (torch.where(zero, 0.0, a) - torch.where(zero, 0.0, b))


def expected(student, teacher, labels=None, *, beta, temperature=1.0, reduction="mean", student_softcapping=0.0,
             teacher_softcapping=0.0, upstream=None, ignore_index=-100):  # fmt: skip
    """(loss, d loss / d student, error scale per row) in float64 on the values the kernels read: the definition
    (KL(p_t || m) and KL(p_s || m) with m = (1 - beta) p_s + beta p_t, the KLs at the ends) and autograd."""
    x = student.detach().double().cpu().requires_grad_()
    t = teacher.detach().double().cpu()[..., : x.shape[-1]]
    counted = torch.ones(x.shape[:-1], dtype=torch.bool) if labels is None else labels.cpu() != ignore_index
    x_kept = torch.where(counted.unsqueeze(-1), x, 0.0)
    t = torch.where(counted.unsqueeze(-1), t, 0.0)

    def scaled(v, cap):
        return (cap * torch.tanh(v / cap) if cap else v) / temperature

    u_s, u_t = scaled(x_kept, student_softcapping), scaled(t, teacher_softcapping)
    ls, lt = torch.log_softmax(u_s, -1), torch.log_softmax(u_t, -1)
    p_s, p_t = ls.exp(), lt.exp()
    if beta == 0:
        rows = _masked(p_t, lt, ls).sum(-1)
    elif beta == 1:
        rows = _masked(p_s, ls, lt).sum(-1)
    else:
        lm = torch.log((1 - beta) * p_s + beta * p_t)
        rows = beta * _masked(p_t, lt, lm).sum(-1) + (1 - beta) * _masked(p_s, ls, lm).sum(-1)
    rows = torch.where(counted, rows, 0.0)
    loss = rows if reduction == "none" else rows.sum() / (counted.sum().clamp_min(1) if reduction == "mean" else 1)
    weights = torch.ones_like(loss) if upstream is None else upstream.detach().double().cpu()
    (grad,) = torch.autograd.grad((loss * weights).sum(), x)
    finite = torch.isfinite
    magnitude = (
        1 + u_s.detach().where(finite(u_s), 0).abs().amax(-1) + u_t.where(finite(u_t), 0).abs().amax(-1)
        + (student_softcapping + teacher_softcapping) / temperature
    )  # fmt: skip
    return loss.detach(), grad, magnitude


def check_loss(actual, loss, magnitude, reduction):
    """|actual - loss| <= 16 eps32 (magnitude + |loss|) per row (summed for "mean" / "sum"): float32 inside."""
    per_row = 16 * EPS32 * (magnitude + loss.abs() if reduction == "none" else magnitude)
    bound = per_row if reduction == "none" else per_row.sum() + 16 * EPS32 * loss.abs() * magnitude.numel()
    assert actual.dtype == torch.float32, actual.dtype
    tolerances.check(actual.detach().double().cpu().numpy(), loss.numpy(), bound.numpy(), "loss")


def check_grad(actual, grad, magnitude, what="grad"):
    """Per element: 16 eps32 magnitude (largest |grad| of the row) plus an ulp of the gradient's dtype (1 ulp: the
    interpreter truncates to bfloat16)."""
    assert actual.shape == grad.shape, (actual.shape, grad.shape)
    row_scale = grad.where(torch.isfinite(grad), 0).abs().amax(-1, keepdim=True)
    values = actual.detach().double().cpu()
    bound = 16 * EPS32 * magnitude.unsqueeze(-1) * row_scale + torch.from_numpy(
        tolerances.ulp(values.abs().numpy(), actual.dtype)
    )
    tolerances.check(values.numpy(), grad.numpy(), bound.numpy() + tolerances.FLOOR, what)


def generator(seed):
    return torch.Generator().manual_seed(seed)


def linear_inputs(device, bias, n=11, h_s=16, h_t=24, vocab=70, vocab_teacher=75, seed=5):
    """Student [hidden, weight, bias] and teacher [hidden, weight, bias] (biases None without `bias`; the teacher's
    head V_t >= V rows) and labels (n,) with rows 0 and n // 2 ignored."""
    gen = generator(seed)
    student = [torch.randn(n, h_s, generator=gen), 0.4 * torch.randn(vocab, h_s, generator=gen)]
    teacher = [torch.randn(n, h_t, generator=gen), 0.4 * torch.randn(vocab_teacher, h_t, generator=gen)]
    student.append(torch.randn(vocab, generator=gen) if bias else None)
    teacher.append(torch.randn(vocab_teacher, generator=gen) if bias else None)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[[0, n // 2]] = -100
    move = [None if t is None else t.to(device) for t in (*student, *teacher, labels)]
    return move[:3], move[3:6], move[6]


def bad(kwargs, error, name):
    """A parameter of the argument-check tests: keywords, the error, the argument its message names."""

    # Tensors get their shape and dtype in the id, not their random values: pytest-xdist workers must collect the
    # same ids.
    def describe(value):
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)}-{str(value.dtype).removeprefix('torch.')}"
        return repr(value)

    return pytest.param(kwargs, error, name, id=",".join(f"{k}={describe(v)}" for k, v in kwargs.items()))
