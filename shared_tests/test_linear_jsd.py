"""linear_jsd (issue 38) in both packages on the same inputs (DLPack), against the float64 reference
(reference_distill.linear_jsd) and against each other: the loss and the student's hidden, weight and bias gradients,
every beta, temperature, soft-capping, the three reductions, labels=None, a padded teacher head (V_t > V_s, its rows
past V_s NaN: never read), the rows in several chunks (a small workspace_bytes), float32 and bfloat16, bfloat16
with logits_dtype="float32" and accumulate_in_float32=True, and skip_ignored_rows=True (the chunks over the kept rows
only: the same bounds, the ignored rows' d hidden exactly 0). The teacher's hidden states, weight and bias get no
gradient (torch: None although they require grad; JAX: zero cotangents).

Tolerances follow the arithmetic (as test_linear_cross_entropy.py, with the distillation reference's magnitudes).
The logits are products over H in the inputs' dtype with float32 accumulation: each is within d = u E of the exact
one, E = max_j (|h| |W|^T + |b|)_tj per row, u = 32 eps32 (float32; the K = 16 of test_linear_cross_entropy.py, times
2) or 2**-7 (bfloat16: 4 times the half-ulp of the one rounding to bf16; float32's with logits_dtype="float32", the
products' u_o staying bf16's). With G = d loss / d student logits:
  loss per row:  RTOL loss_scale + d_s |dL/dx_s|_1 + d_t |dL/dx_t|_1       (the reference's student and teacher
                 gradients of the row: how far the logits' errors move it), the reduction as tolerances.loss_bound
  G:             S = RTOL grad_scale + 2 (d_s + d_t) / T grad_terms        (p moves relatively by 2 d / T)
                 + u_g |G| (G rounded to the inputs' dtype: u_g = eps32, or 2**-8 for bf16)
  d hidden:      S @ |W_s| + u_o |G| @ |W_s|                               (u_o: the product's rounding, as u)
  d weight:      S^T @ |h_s| + (1 + chunks) u_o |G|^T @ |h_s|              (one rounding per chunk of rows; 2 u_o
                                                                           with accumulate_in_float32)
  d bias:        the column sums of the same
"""

import dataclasses
import math

import numpy as np
import pytest
import torch

from . import exchange
from .harness import optional_jax
from .reference_distill import jsd as jsd_reference
from .reference_distill import linear_jsd as linear_jsd_reference
from .test_linear_cross_entropy import assert_within
from .tolerances import RTOL

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOGIT_ROUNDOFF = {"float32": 32 * 2.0**-23, "bfloat16": 2.0**-7}
GRAD_ROUNDOFF = {"float32": 2.0**-23, "bfloat16": 2.0**-8}
ROWS_PER_CHUNK = 5  # the workspace_bytes the cases pass holds about this many rows of the two chunks of logits


@dataclasses.dataclass(frozen=True)
class LinearJsdCase:
    name: str
    beta: float = 0.5
    shape: tuple = (12,)  # leading shape of both hidden states and labels
    student_width: int = 24  # H_s
    teacher_width: int = 16  # H_t
    vocab: int = 130  # V_s
    teacher_vocab: int | None = None  # V_t (None: V_s); rows past V_s of the teacher's weight and bias are NaN
    dtype: str = "float32"
    bias: bool = False  # both heads have a bias
    temperature: float = 1.0
    student_softcapping: float = 0.0
    teacher_softcapping: float = 0.0
    reduction: str = "mean"
    labels: bool = True  # False: labels=None (every row counts)
    scalar_upstream: float = 1.0
    small_chunks: bool = True  # a workspace_bytes of about ROWS_PER_CHUNK rows; False: the default (256 MiB)
    logits_dtype: str | None = None  # "float32": both models' logits in float32 (bf16 inputs)
    accumulate: bool = False  # accumulate_in_float32
    skip: bool = False  # skip_ignored_rows
    prompt: int = 0  # the first rows (flattened) ignored too, as a prompt, beside every fourth row
    seed: int = 0

    @property
    def id(self):
        return f"{self.name}-{self.dtype}"

    def options(self):
        return dict(
            beta=self.beta,
            temperature=self.temperature,
            reduction=self.reduction,
            student_softcapping=self.student_softcapping,
            teacher_softcapping=self.teacher_softcapping,
        )

    def kwargs(self):
        # About ROWS_PER_CHUNK rows of both chunks of float32 logits: several chunks, the last one partial.
        workspace = ROWS_PER_CHUNK * (self.vocab * 2) * 4 if self.small_chunks else None
        precision = dict(logits_dtype=self.logits_dtype, accumulate_in_float32=self.accumulate)
        return dict(self.options(), workspace_bytes=workspace, skip_ignored_rows=self.skip, **precision)

    def max_chunks(self):
        """An upper bound on the chunks of rows (the weight gradient's roundings): at most one a row with the small
        workspace; with the default 256 MiB, the two chunks' logits counted at 4 bytes, plus one."""
        n = math.prod(self.shape)
        return n if self.small_chunks else -(-n * 2 * self.vocab * 4 // 2**28) + 1


CAPS = dict(student_softcapping=5.0, teacher_softcapping=4.0)
CASES = [
    LinearJsdCase("mixture-bias", bias=True, seed=1),
    LinearJsdCase("forward-kl-sum", beta=0.0, reduction="sum", temperature=0.7, scalar_upstream=1.3, **CAPS, seed=2),
    LinearJsdCase("reverse-kl-none-padded", beta=1.0, shape=(2, 5), reduction="none", teacher_vocab=140, seed=3),
    LinearJsdCase("mixture-0.3-labels-none", beta=0.3, labels=False, bias=True, teacher_vocab=136, seed=4),
    LinearJsdCase("bf16-mixture-bias", dtype="bfloat16", bias=True, temperature=1.3, **CAPS, seed=5),
    LinearJsdCase("bf16-forward-kl-none", beta=0.0, dtype="bfloat16", reduction="none", teacher_vocab=132, seed=6),
    LinearJsdCase(
        "bf16-float32-logits", beta=0.0, dtype="bfloat16", bias=True, logits_dtype="float32", accumulate=True, seed=7
    ),
    # skip_ignored_rows: the chunks over the kept rows only (a prompt and every fourth row ignored)
    LinearJsdCase("skip-mixture-bias", bias=True, temperature=1.2, teacher_vocab=136, skip=True, prompt=5, seed=8),
    LinearJsdCase("skip-forward-kl-sum-labels-none", beta=0.0, reduction="sum", labels=False, skip=True, seed=9),
    LinearJsdCase(
        "skip-bf16-reverse-kl-none",
        beta=1.0,
        shape=(2, 7),
        dtype="bfloat16",
        reduction="none",
        **CAPS,
        skip=True,
        prompt=3,
        seed=10,
    ),  # fmt: skip
]
GPU_CASES = [
    LinearJsdCase(
        f"gpu-beta-{beta}",
        beta=beta,
        shape=(1024,),
        student_width=256,
        teacher_width=384,
        vocab=50000,
        teacher_vocab=50064,
        dtype="bfloat16",
        bias=beta == 0.5,
        reduction=reduction,
        small_chunks=False,
        seed=20 + i,
        **CAPS,
    )
    for i, (beta, reduction) in enumerate([(0.0, "mean"), (0.5, "none"), (1.0, "sum")])
]


def make_inputs(case, device):
    """hidden states, weights, biases (None without), labels (None for labels=False): seeded on the CPU."""
    gen = torch.Generator().manual_seed(case.seed)
    n, teacher_vocab = math.prod(case.shape), case.teacher_vocab or case.vocab

    def head(width, vocab):
        return torch.randn((vocab, width), generator=gen) * (2.0 / width**0.5)

    student_hidden = torch.randn((*case.shape, case.student_width), generator=gen)
    student_weight = head(case.student_width, case.vocab)
    teacher_hidden = torch.randn((*case.shape, case.teacher_width), generator=gen)
    teacher_weight = head(case.teacher_width, teacher_vocab)
    student_bias = torch.randn(case.vocab, generator=gen) * 0.5 if case.bias else None
    teacher_bias = torch.randn(teacher_vocab, generator=gen) * 0.5 if case.bias else None
    teacher_weight[case.vocab :] = float("nan")  # a padded head's extra rows: never read
    if teacher_bias is not None:
        teacher_bias[case.vocab :] = float("nan")
    labels = torch.randint(0, case.vocab, (n,), generator=gen)
    labels[1::4] = -100
    labels[: case.prompt] = -100
    upstream = torch.randn(case.shape, generator=gen)
    dtype = TORCH_DTYPES[case.dtype]
    move = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    tensors = [student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias]
    return dict(
        tensors=[move(t) for t in tensors],
        labels=labels.reshape(case.shape).to(device) if case.labels else None,
        upstream=upstream.to(device),
    )


def run_torch(case, inputs):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs["tensors"]]
    h_s, w_s, h_t, w_t, b_s, b_t = leaves
    loss = fastce_torch.linear_jsd(
        h_s, w_s, h_t, w_t, inputs["labels"], student_bias=b_s, teacher_bias=b_t, backend="kernel", **case.kwargs()
    )
    assert loss.dtype == torch.float32
    weighting = inputs["upstream"] if case.reduction == "none" else case.scalar_upstream
    (loss * weighting).sum().backward()
    assert all(t is None or t.grad is None for t in (h_t, w_t, b_t)), "the teacher got a gradient"
    return loss.detach(), [None if t is None else t.grad for t in (h_s, w_s, b_s)]


def run_jax(case, inputs):
    import jax
    import jax.numpy as jnp

    fastce_jax = optional_jax()
    arrays = [None if t is None else exchange.to_jax(t) for t in inputs["tensors"]]
    labels = None if inputs["labels"] is None else exchange.labels_to_jax(inputs["labels"])
    weighting = exchange.to_jax(inputs["upstream"]) if case.reduction == "none" else case.scalar_upstream

    def objective(h_s, w_s, h_t, w_t, b_s, b_t):
        loss = fastce_jax.linear_jsd(
            h_s, w_s, h_t, w_t, labels, student_bias=b_s, teacher_bias=b_t, backend="kernel", **case.kwargs()
        )
        return jnp.sum(loss * weighting), loss

    with jax.default_matmul_precision("float32"):
        (_, loss), grads = jax.value_and_grad(objective, argnums=tuple(range(6)), has_aux=True)(*arrays)
    assert loss.dtype == jnp.float32
    for grad in grads[2:4] + grads[5:]:
        assert grad is None or not np.any(np.asarray(grad, np.float32)), "the teacher got a nonzero cotangent"
    to_torch = exchange.to_torch
    return to_torch(loss), [None if g is None else to_torch(g) for g in (grads[0], grads[1], grads[4])]


def bounds(case, inputs, exact):
    """The tolerances of the module's docstring."""
    as64 = lambda t: None if t is None else t.detach().double().cpu().numpy()  # noqa: E731
    h_s, w_s, h_t, w_t, b_s, b_t = (as64(t) for t in inputs["tensors"])
    n, vocab = math.prod(case.shape), case.vocab
    u, u_g = LOGIT_ROUNDOFF[case.dtype], GRAD_ROUNDOFF[case.dtype]  # u: the products' rounding
    u_logits = LOGIT_ROUNDOFF["float32" if case.logits_dtype else case.dtype]
    d_s = u_logits * exact.student_logits_abs.max(axis=-1)  # (N,) the logits' errors
    d_t = u_logits * exact.teacher_logits_abs.max(axis=-1)
    r = exact.logits
    # Each row's own gradients (upstream 1): how far the logits' errors move its loss.
    labels = None if inputs["labels"] is None else inputs["labels"].cpu().numpy()
    logits_s = (h_s.reshape(n, -1) @ w_s.T + (0 if b_s is None else b_s)).reshape(n, vocab)
    logits_t = (h_t.reshape(n, -1) @ w_t[:vocab].T + (0 if b_t is None else b_t[:vocab])).reshape(n, vocab)
    rows = jsd_reference(logits_s, logits_t, labels, **dict(case.options(), reduction="none"))
    l1_s = np.abs(np.nan_to_num(rows.grad)).sum(axis=-1)
    l1_t = np.abs(np.nan_to_num(rows.teacher_grad)).sum(axis=-1)
    per_row = RTOL * r.loss_scale + d_s * l1_s + d_t * l1_t
    g = np.abs(r.upstream)
    if case.reduction == "none":
        loss_bound = per_row.reshape(case.shape)
    else:
        loss_bound = np.sum(g * per_row) + RTOL * np.sum(g * np.abs(np.nan_to_num(r.token_loss)))
    grad = np.abs(np.nan_to_num(r.grad.reshape(n, vocab)))
    S = (
        RTOL * r.grad_scale.reshape(n, vocab)
        + 2 * ((d_s + d_t) / case.temperature)[:, None] * r.grad_terms.reshape(n, vocab)
        + u_g * grad
    )
    roundings = 2 if case.accumulate else 1 + case.max_chunks()  # of d weight: the products and the chunks' sums
    h_abs, w_abs = np.abs(h_s.reshape(n, -1)), np.abs(w_s)
    return dict(
        loss=loss_bound,
        hidden=(S @ w_abs + u * (grad @ w_abs)).reshape(h_s.shape),
        weight=S.T @ h_abs + roundings * u * (grad.T @ h_abs),
        bias=S.sum(axis=0) + (1 + case.max_chunks()) * u * grad.sum(axis=0),
    )


def run_case(case, device):
    found = {"torch": fastce_torch, "jax": optional_jax()}
    found = [name for name, module in found.items() if callable(getattr(module, "linear_jsd", None))]
    if not found:
        pytest.skip("no package has linear_jsd yet")
    inputs = make_inputs(case, device)
    as64 = lambda t: None if t is None else t.detach().double().cpu().numpy()  # noqa: E731
    h_s, w_s, h_t, w_t, b_s, b_t = (as64(t) for t in inputs["tensors"])
    labels = None if inputs["labels"] is None else inputs["labels"].cpu().numpy()
    upstream = as64(inputs["upstream"]) if case.reduction == "none" else case.scalar_upstream
    exact = linear_jsd_reference(
        h_s, w_s, h_t, w_t, labels, student_bias=b_s, teacher_bias=b_t, upstream=upstream, **case.options()
    )
    tol = bounds(case, inputs, exact)
    runners = {"torch": run_torch, "jax": run_jax}
    outs = {name: runners[name](case, inputs) for name in found}
    for name, (loss, (g_hidden, g_weight, g_bias)) in outs.items():
        assert_within(loss, np.asarray(exact.logits.loss), tol["loss"], f"{name} loss")
        assert_within(g_hidden, exact.grad_hidden, tol["hidden"], f"{name} d student_hidden")
        if labels is not None:  # an ignored row's d hidden: exactly 0 (skipped or not)
            assert not g_hidden[torch.from_numpy(labels == -100).to(g_hidden.device)].any(), name
        assert_within(g_weight, exact.grad_weight, tol["weight"], f"{name} d student_weight")
        if b_s is None:
            assert g_bias is None
        else:
            assert_within(g_bias, exact.grad_bias, tol["bias"], f"{name} d student_bias")
    if len(found) < 2:
        pytest.skip(f"only {found} have linear_jsd: that side checked, the other and the pair comparison skipped")
    # The packages against each other: each within the bounds of the exact value, so twice them apart at most.
    (t_loss, t_grads), (j_loss, j_grads) = outs["torch"], outs["jax"]
    assert_within(t_loss, j_loss.float().cpu().numpy().astype(np.float64), 2 * tol["loss"], "torch vs jax loss")
    for got, want, name in zip(t_grads, j_grads, ("hidden", "weight", "bias")):
        if got is not None:
            assert_within(got, want.float().cpu().numpy().astype(np.float64), 2 * tol[name], f"torch vs jax d {name}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_linear_jsd_matches_the_reference(case, device):
    run_case(case, device)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_linear_jsd_real_vocabularies_on_gpu(case, device):
    run_case(case, device)
