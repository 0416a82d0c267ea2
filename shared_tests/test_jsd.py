"""jsd (issue 38) in both packages on the same buffers (DLPack), against the float64 reference
(reference_distill.jsd) and against each other: every beta in {0, 0.3, 0.5, 1}, temperatures, soft-capping of
either model, the three reductions, ignore patterns (some rows, none, all, labels=None, ignore_index a real class),
a padded teacher vocabulary (V_t > V_s, its extra columns NaN or huge: never read), NaN rows, -inf columns,
float32 and bfloat16. linear_jsd: test_linear_jsd.py.

Tolerances are the repository's model (tolerances.py) with the reference's error magnitudes: loss
RTOL * loss_scale per row (M = M_s + M_t plus the terms' sizes, reference_distill.error_scales), gradient
RTOL * grad_scale + ulps of the student's dtype (the gradient is rounded once from float32); the packages against
each other the same scales with ULPS_PAIR. The teacher gets no gradient: torch leaves a teacher that requires grad
without one, JAX's cotangent for it is zero. The buffers both packages read (zero-copy in JAX) are never written.
"""

import dataclasses
import math

import numpy as np
import pytest
import torch

from . import exchange, summary
from .harness import as_f64, bits, optional_jax
from .reference_distill import jsd as jsd_reference
from .tolerances import ULPS_PAIR, check, grad_bound, loss_bound, reference_ulps

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class JsdCase:
    name: str
    beta: float = 0.5
    shape: tuple = (2, 5)  # leading shape of both logits (and of labels)
    vocab: int = 37  # V_s
    teacher_vocab: int | None = None  # V_t (None: V_s)
    teacher_pad: str = "nan"  # the teacher's columns past V_s: "nan" or "big" (+40: would dominate if read)
    dtype: str = "float32"
    temperature: float = 1.0
    student_softcapping: float = 0.0
    teacher_softcapping: float = 0.0
    reduction: str = "mean"
    ignore: str = "some"  # "some" (1 in 4, the first row among them), "none", "all", "labels-none", "class"
    ignore_index: int = -100
    special: str = ""  # "nan-rows", "neg-inf-shared" (both -inf in the same columns), "student-neg-inf"
    scalar_upstream: float = 1.0  # d objective / d loss for "mean" / "sum"
    teacher_requires_grad: bool = False  # torch: the teacher requires grad (gets none); jax: always checked
    jit: bool = False  # jax: the loss under jax.jit
    seed: int = 0

    @property
    def id(self):
        return f"{self.name}-{self.dtype}"

    def kwargs(self):
        return dict(
            beta=self.beta,
            temperature=self.temperature,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            student_softcapping=self.student_softcapping,
            teacher_softcapping=self.teacher_softcapping,
        )


CAPS = dict(student_softcapping=4.0, teacher_softcapping=3.0)
CASES = [
    JsdCase("forward-kl", beta=0.0, scalar_upstream=1.3, seed=1),
    JsdCase("reverse-kl-sum", beta=1.0, reduction="sum", temperature=0.7, student_softcapping=4.0, seed=2),
    JsdCase("mixture-0.3-none", beta=0.3, reduction="none", shape=(2, 3), temperature=1.3, teacher_softcapping=3.0),
    JsdCase("mixture-0.5-labels-none", ignore="labels-none", teacher_requires_grad=True, jit=True, seed=4),
    JsdCase("padded-teacher-nan", beta=0.5, teacher_vocab=45, reduction="none", **CAPS, seed=5),
    JsdCase("padded-teacher-big-forward-kl", beta=0.0, teacher_vocab=41, teacher_pad="big", temperature=0.8, seed=6),
    JsdCase("padded-teacher-reverse-kl", beta=1.0, teacher_vocab=40, reduction="none", jit=True, seed=7),
    JsdCase("ignore-real-class", beta=0.3, ignore="class", ignore_index=3, reduction="sum", seed=8),
    JsdCase("all-ignored", beta=1.0, ignore="all", seed=9),
    JsdCase("nan-rows-forward-kl", beta=0.0, special="nan-rows", reduction="none", seed=10),
    JsdCase("nan-rows-reverse-kl", beta=1.0, special="nan-rows", seed=11),
    JsdCase("nan-rows-mixture", beta=0.3, special="nan-rows", reduction="none", seed=12),
    JsdCase("neg-inf-shared-reverse-kl", beta=1.0, special="neg-inf-shared", reduction="none", seed=13),
    JsdCase("neg-inf-shared-mixture", beta=0.5, special="neg-inf-shared", temperature=0.6, seed=14),
    JsdCase("student-neg-inf-mixture", beta=0.3, special="student-neg-inf", reduction="none", seed=15),
    JsdCase("wide", beta=0.3, shape=(3,), vocab=300, teacher_vocab=310, temperature=0.8, **CAPS, seed=16),
    JsdCase("bf16-mixture", beta=0.5, dtype="bfloat16", temperature=1.4, **CAPS, scalar_upstream=0.7, seed=17),
    JsdCase("bf16-forward-kl-none", beta=0.0, dtype="bfloat16", reduction="none", teacher_vocab=40, seed=18),
    JsdCase("bf16-reverse-kl", beta=1.0, dtype="bfloat16", reduction="sum", student_softcapping=5.0, seed=19),
]
# --gpu only: the kernels' multi-block rows at real vocabulary sizes, a padded teacher head, every beta.
GPU_CASES = [
    JsdCase(
        f"gpu-beta-{beta}", beta=beta, shape=(4, 96), vocab=32000, teacher_vocab=32064, dtype=dtype, seed=40 + i, **CAPS
    )
    for i, (beta, dtype) in enumerate([(0.0, "bfloat16"), (0.3, "float32"), (0.5, "bfloat16"), (1.0, "bfloat16")])
] + [JsdCase("gpu-none-f32", beta=0.5, shape=(512,), vocab=50257, reduction="none", temperature=0.7, seed=45)]


@dataclasses.dataclass
class JsdInputs:
    student: torch.Tensor  # (..., V_s) in the case's dtype, on the device
    teacher: torch.Tensor  # (..., V_t)
    labels: torch.Tensor | None  # (...) int64, or None
    upstream: torch.Tensor  # (...) float32 cotangent for "none"


def make_inputs(case, device):
    """Fresh random logits (the teacher correlated with the student, as a distillation pair is), seeded on the
    CPU and then moved: the same numbers on every device."""
    gen = torch.Generator().manual_seed(case.seed)
    n, vocab = math.prod(case.shape), case.vocab
    teacher_vocab = case.teacher_vocab or vocab
    student = torch.randn((n, vocab), generator=gen, dtype=torch.float64) * 2.0
    teacher = torch.empty((n, teacher_vocab), dtype=torch.float64)
    teacher[:, :vocab] = 0.6 * student + torch.randn((n, vocab), generator=gen, dtype=torch.float64) * 1.6 + 0.3
    teacher[:, vocab:] = float("nan") if case.teacher_pad == "nan" else 40.0

    labels = torch.randint(0, vocab, (n,), generator=gen)
    if case.ignore == "some":
        labels[::4] = case.ignore_index
        labels[-1] = 0 if case.ignore_index != 0 else 1  # at least one counted row
    elif case.ignore == "all":
        labels[:] = case.ignore_index
    elif case.ignore == "class":
        labels[::3] = case.ignore_index  # ignore_index is a real class: those rows are ignored, the rest count
    if case.special == "nan-rows":
        assert n >= 4 and case.ignore == "some"
        student[1, vocab // 2] = float("nan")  # a counted row with a NaN in the student
        teacher[2, vocab // 3] = float("nan")  # a counted row with a NaN in the teacher
        student[0, 1] = teacher[0, 2] = float("nan")  # an ignored row (labels[0]): never read
        labels[1] = labels[2] = 5
    elif case.special == "neg-inf-shared":
        # vocabulary padding in both heads (the last V/8 columns) and a few shared -inf columns
        shared = torch.zeros(vocab, dtype=torch.bool)
        shared[vocab - vocab // 8 :] = True
        shared[torch.randperm(vocab, generator=gen)[:3]] = True
        student[:, shared] = teacher[:, :vocab][:, shared] = float("-inf")
    elif case.special == "student-neg-inf":
        student[torch.rand((n, vocab), generator=gen) < 0.1] = float("-inf")
    dtype = TORCH_DTYPES[case.dtype]
    upstream = torch.randn(case.shape, generator=gen, dtype=torch.float32)
    return JsdInputs(
        student=student.reshape(*case.shape, vocab).to(dtype).to(device),
        teacher=teacher.reshape(*case.shape, teacher_vocab).to(dtype).to(device),
        labels=None if case.ignore == "labels-none" else labels.reshape(case.shape).to(device),
        upstream=upstream.to(device),
    )


def run_reference(case, inputs):
    as64 = lambda t: t.detach().to("cpu", torch.float64).numpy()  # noqa: E731  exactly the values the kernels read
    return jsd_reference(
        as64(inputs.student),
        as64(inputs.teacher),
        None if inputs.labels is None else inputs.labels.cpu().numpy(),
        upstream=as64(inputs.upstream) if case.reduction == "none" else case.scalar_upstream,
        **case.kwargs(),
    )


def run_torch(case, inputs):
    student = inputs.student.detach().requires_grad_()
    teacher = inputs.teacher.detach().requires_grad_(case.teacher_requires_grad)
    loss = fastce_torch.jsd(student, teacher, inputs.labels, backend="kernel", **case.kwargs())
    assert loss.dtype == torch.float32 and loss.shape == (case.shape if case.reduction == "none" else ())
    if case.reduction == "none":
        loss.backward(inputs.upstream)
    else:
        (loss * case.scalar_upstream).backward()
    assert teacher.grad is None, "the teacher got a gradient"
    grad = student.grad if student.grad is not None else torch.zeros_like(student)
    return loss.detach(), grad


def run_jax(case, inputs):
    import jax
    import jax.numpy as jnp

    fastce_jax = optional_jax()
    student, teacher = exchange.to_jax(inputs.student), exchange.to_jax(inputs.teacher)
    assert exchange.same_buffer(student, inputs.student), "DLPack import copied a contiguous tensor"
    labels = None if inputs.labels is None else exchange.labels_to_jax(inputs.labels)

    def loss_fn(s, t):
        return fastce_jax.jsd(s, t, labels, backend="kernel", **case.kwargs())

    loss, vjp = jax.vjp(jax.jit(loss_fn) if case.jit else loss_fn, student, teacher)
    assert loss.dtype == jnp.float32 and loss.shape == (case.shape if case.reduction == "none" else ())
    if case.reduction == "none":
        cotangent = exchange.to_jax(inputs.upstream)
    else:
        cotangent = jnp.full((), case.scalar_upstream, jnp.float32)
    grad, teacher_grad = vjp(cotangent)
    assert grad.dtype == student.dtype and grad.shape == student.shape
    assert not np.any(np.asarray(teacher_grad, np.float32)), "the teacher got a nonzero cotangent"
    return exchange.to_torch(loss), exchange.to_torch(grad)


def compare(case, inputs, outputs, ref):
    """Each package against the reference, then the two against each other; records the differences."""
    from fastce_torch.core.launch import INTERPRETED

    truncating = INTERPRETED and not inputs.student.is_cuda  # Triton's interpreter truncates to bf16
    stats = {}
    for package, (loss, grad) in outputs.items():
        assert grad.dtype == inputs.student.dtype and grad.shape == inputs.student.shape, package
        ulps = reference_ulps(case.dtype, truncating_bf16=truncating and package == "torch")
        loss64, grad64 = as_f64(loss), as_f64(grad)
        _, stats[f"{package}_ref_loss_tol_used"] = check(loss64, ref.loss, loss_bound(ref), f"{package} loss")
        bound = grad_bound(ref, grad64, case.dtype, ulps=ulps)
        _, stats[f"{package}_ref_grad_tol_used"] = check(grad64, ref.grad, bound, f"{package} gradient")
    if len(outputs) < 2:
        return
    (t_loss, t_grad), (j_loss, j_grad) = ((as_f64(a), as_f64(b)) for a, b in (outputs["torch"], outputs["jax"]))
    stats["loss_abs_diff"], stats["pair_loss_tol_used"] = check(t_loss, j_loss, loss_bound(ref), "torch vs jax loss")
    both = np.maximum(np.abs(np.nan_to_num(t_grad)), np.abs(np.nan_to_num(j_grad)))
    stats["grad_abs_diff"], stats["pair_grad_tol_used"] = check(
        t_grad, j_grad, grad_bound(ref, both, case.dtype, ulps=ULPS_PAIR), "torch vs jax gradient"
    )
    summary.record(case.dtype, "cuda" if inputs.student.is_cuda else "cpu", stats)


def run_case(case, device):
    inputs = make_inputs(case, device)
    snapshots = [bits(inputs.student).clone(), bits(inputs.teacher).clone()]
    ref = run_reference(case, inputs)
    found = {"torch": fastce_torch, "jax": optional_jax()}
    found = {name: module for name, module in found.items() if callable(getattr(module, "jsd", None))}
    if not found:
        pytest.skip("no package has jsd yet")
    runners = {"torch": run_torch, "jax": run_jax}
    outputs = {name: runners[name](case, inputs) for name in found}
    # The buffers both frameworks read (zero-copy in JAX) are never written by either backward.
    assert torch.equal(bits(inputs.student), snapshots[0]) and torch.equal(bits(inputs.teacher), snapshots[1])
    compare(case, inputs, outputs, ref)
    if len(found) < 2:
        pytest.skip(f"only {sorted(found)} have jsd: that side checked, the other and the pair comparison skipped")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_jsd_matches_the_reference(case, device):
    run_case(case, device)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_jsd_real_vocabularies_on_gpu(case, device):
    run_case(case, device)


# --- bad input: both packages raise the same exception type with the same message, naming the argument first ---

BAD_OPTIONS = [
    (dict(beta=1.5), ValueError, "beta"),
    (dict(beta=-0.1), ValueError, "beta"),
    (dict(beta=float("nan")), ValueError, "beta"),
    (dict(beta=True), TypeError, "beta"),
    (dict(beta="0.5"), TypeError, "beta"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature=1e-39), ValueError, "temperature"),  # 1 / temperature overflows float32
    (dict(temperature=True), TypeError, "temperature"),
    (dict(student_softcapping=-1.0), ValueError, "student_softcapping"),
    (dict(teacher_softcapping=-2.0), ValueError, "teacher_softcapping"),
    (dict(teacher_softcapping=float("inf")), ValueError, "teacher_softcapping"),
    (dict(student_softcapping="1"), TypeError, "student_softcapping"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(backend="triton"), ValueError, "backend"),
]


def bad_input_calls(module, to_array):
    """(what, call, exception type, the argument's name) for jsd and linear_jsd, arrays made by `to_array`."""
    gen = torch.Generator().manual_seed(0)
    x = lambda *shape: to_array(torch.randn(shape, generator=gen))  # noqa: E731
    s, t, y = x(4, 9), x(4, 9), to_array(torch.tensor([1, 2, -100, 3], dtype=torch.int32))
    h_s, w_s, h_t, w_t = x(4, 6), x(9, 6), x(4, 5), x(9, 5)
    calls = [(f"jsd {o}", lambda o=o: module.jsd(s, t, y, **o), e, n) for o, e, n in BAD_OPTIONS]
    calls += [
        (f"linear_jsd {o}", lambda o=o: module.linear_jsd(h_s, w_s, h_t, w_t, y, **o), e, n) for o, e, n in BAD_OPTIONS
    ]
    calls += [
        ("teacher rows differ", lambda: module.jsd(s, x(3, 9), None), ValueError, "teacher_logits"),
        ("teacher vocabulary smaller", lambda: module.jsd(s, x(4, 8), None), ValueError, "teacher_logits"),
        ("empty vocabulary", lambda: module.jsd(x(4, 0), t, None), ValueError, "student_logits"),
        ("labels shape", lambda: module.jsd(s, t, y[:3]), ValueError, "labels"),
        ("float labels", lambda: module.jsd(s, t, to_array(torch.zeros(4))), TypeError, "labels"),
        ("integer logits", lambda: module.jsd(y, y, None), TypeError, "student_logits"),
        (
            "integer teacher",
            lambda: module.jsd(s, to_array(torch.zeros(4, 9, dtype=torch.int32))),
            TypeError,
            "teacher_logits",
        ),  # fmt: skip
        ("student width", lambda: module.linear_jsd(h_s, x(9, 7), h_t, w_t), ValueError, "student_weight"),
        ("teacher width", lambda: module.linear_jsd(h_s, w_s, h_t, x(9, 4)), ValueError, "teacher_weight"),
        ("teacher head smaller", lambda: module.linear_jsd(h_s, w_s, h_t, x(8, 5)), ValueError, "teacher_weight"),
        ("teacher hidden rows", lambda: module.linear_jsd(h_s, w_s, x(3, 5), w_t), ValueError, "teacher_hidden"),
        ("integer hidden", lambda: module.linear_jsd(y, w_s, h_t, w_t), TypeError, "student_hidden"),
        ("bias shape", lambda: module.linear_jsd(h_s, w_s, h_t, w_t, student_bias=x(8)), ValueError, "student_bias"),
        ("integer bias", lambda: module.linear_jsd(h_s, w_s, h_t, w_t, teacher_bias=y), TypeError, "teacher_bias"),
        ("linear labels shape", lambda: module.linear_jsd(h_s, w_s, h_t, w_t, y[:2]), ValueError, "labels"),
        ("workspace", lambda: module.linear_jsd(h_s, w_s, h_t, w_t, workspace_bytes=0), ValueError, "workspace_bytes"),
    ]
    return calls


def raised(call, error):
    with pytest.raises(error) as info:
        call()
    return str(info.value)


def test_bad_input_raises_the_same_message_naming_the_argument():
    """Every bad argument of jsd / linear_jsd: the same exception type and message in both packages (CPU, no
    kernel runs), starting with the argument's name."""
    jax_module = optional_jax()
    if jax_module is None:
        pytest.skip("fastce_jax is not importable")
    torch_calls = bad_input_calls(fastce_torch, lambda t: t)
    jax_calls = bad_input_calls(jax_module, exchange.to_jax)
    for (what, torch_call, error, name), (_, jax_call, _, _) in zip(torch_calls, jax_calls):
        torch_message, jax_message = raised(torch_call, error), raised(jax_call, error)
        assert torch_message == jax_message, (what, torch_message, jax_message)
        assert torch_message.startswith(name), (what, torch_message)
