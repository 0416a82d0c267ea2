"""fastce_torch.jsd (issue 38) against float64 (jsd_checks.py: the loss from the definition of TRL's generalized JSD
and the student's gradient by float64 torch autograd of it), for every beta kind (0, 0.3, 0.5, 1), temperature, both
soft-cappings, every reduction and ignore pattern, a padded teacher, NaN rows; with linear_jsd (whose own tests are
test_linear_jsd.py): the teacher gets no gradient, a call without gradients keeps nothing, torch.compile(fullgraph=
True) of a step with both; bad input names its argument. CPU: Triton's interpreter (tiny shapes; small tiles force
multi-tile rows); --gpu: CUDA."""

import numpy as np
import pytest
import torch

from fastce_torch import jsd, linear_jsd
from fastce_torch.losses.jsd import launch as jsd_kernels
from fastce_torch.losses.jsd.options import JsdOptions
from shared_tests import tolerances
from shared_tests.reference_distill import jsd as jsd_reference

from .jsd_checks import bad, check_grad, check_loss, expected, generator, linear_inputs
from .test_compile import ops_in, recording_backend

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning",
    "ignore:invalid value:RuntimeWarning",
    "ignore:overflow:RuntimeWarning",
    "ignore:Conversion of an array:DeprecationWarning",
)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 64 columns: V = 257 is five tiles, the last one partial (the GPU's defaults are 4096)."""
    monkeypatch.setattr(jsd_kernels, "JSD_FORWARD_BLOCK", 64)
    monkeypatch.setattr(jsd_kernels, "JSD_BACKWARD_BLOCK", 64)


# --- jsd against float64 ------------------------------------------------------------------------------------------

BETAS = [0.0, 0.3, 0.5, 1.0]
CASES = {
    # multi-tile rows (V = 257 in tiles of 64), "mean", two ignored rows
    "mean-multitile": dict(shape=(9,), vocab=257, pad=0, dtype=torch.float32, reduction="mean", ignored=(1, 8)),
    # 3-D, labels=None, "none" with an upstream, temperature and both soft-cappings, a padded teacher (-inf columns)
    "none-softcaps-padded": dict(
        shape=(2, 3),
        vocab=100,
        pad=7,
        dtype=torch.float32,
        reduction="none",
        labels=False,
        temperature=0.7,
        student_softcapping=5.0,
        teacher_softcapping=3.0,
    ),  # fmt: skip
    # bf16 student and float16 teacher, "sum", the student's soft-capping alone, a first and last row ignored
    "sum-bf16": dict(
        shape=(6,),
        vocab=130,
        pad=0,
        dtype=torch.bfloat16,
        teacher_dtype=torch.float16,
        reduction="sum",
        ignored=(0, 5),
        temperature=1.5,
        student_softcapping=4.0,
    ),  # fmt: skip
}


def case_inputs(device, shape, vocab, pad, dtype, teacher_dtype=None, ignored=(), labels=True, seed=0, **_):
    gen = generator(seed)
    student = (3 * torch.randn(*shape, vocab, generator=gen) + 2).to(dtype)
    teacher = (3 * torch.randn(*shape, vocab + pad, generator=gen) - 1).to(teacher_dtype or dtype)
    if pad:
        teacher[..., vocab:] = float("-inf")  # a padded teacher head: only the first V_s columns are compared
    flat = torch.randint(0, vocab, shape, generator=gen).reshape(-1)
    for row in ignored:
        flat[row] = -100
    label_tensor = flat.reshape(shape).to(device) if labels else None
    return student.to(device), teacher.to(device), label_tensor


def options_of(case, beta):
    keys = ("temperature", "reduction", "student_softcapping", "teacher_softcapping")
    return dict(beta=beta, **{key: case[key] for key in keys if key in case})


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("name", list(CASES))
def test_jsd_matches_float64(device, poisoned, small_tiles, name, beta):
    case = CASES[name]
    student, teacher, labels = case_inputs(device, **case)
    options = options_of(case, beta)
    leaf = student.clone().requires_grad_()
    loss = jsd(leaf, teacher, labels, backend="kernel", **options)
    upstream = None
    if options["reduction"] == "none":
        upstream = torch.rand(loss.shape, generator=generator(1)).to(device)
        assert loss.shape == student.shape[:-1]
    (loss * (1 if upstream is None else upstream)).sum().backward()
    ref_loss, ref_grad, magnitude = expected(student, teacher, labels, upstream=upstream, **options)
    check_loss(loss, ref_loss, magnitude, options["reduction"])
    assert leaf.grad.dtype == student.dtype
    check_grad(leaf.grad, ref_grad, magnitude)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_ignored_rows_and_all_ignored(device, poisoned, beta):
    """Ignored rows are never read (NaN there changes nothing), loss and gradient 0; an all-ignored "mean" is 0 with
    a zero gradient; the teacher's -inf columns inside V_s carry no mass (beta < 1: p_t = 0 terms add 0)."""
    student, teacher, labels = case_inputs(device, (5,), 40, 0, torch.float32, ignored=(2,), seed=3)
    student[2], teacher[2] = float("nan"), float("nan")
    if beta < 1:
        teacher[:, 7] = float("-inf")
    leaf = student.clone().requires_grad_()
    loss = jsd(leaf, teacher, labels, beta=beta, backend="kernel")
    loss.backward()
    ref_loss, ref_grad, magnitude = expected(student, teacher, labels, beta=beta)
    check_loss(loss, ref_loss, magnitude, "mean")
    check_grad(leaf.grad, ref_grad, magnitude)
    assert torch.equal(leaf.grad[2], torch.zeros_like(leaf.grad[2]))

    leaf = student.clone().requires_grad_()
    loss = jsd(leaf, teacher, torch.full_like(labels, -7), beta=beta, ignore_index=-7, backend="kernel")
    loss.backward()
    assert loss.item() == 0.0 and not leaf.grad.any()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_nan_row_stays_in_its_row(device, poisoned, beta):
    """NaN in a student row or a teacher row: that row's loss and every element of its gradient are NaN; the
    other rows are exact."""
    student, teacher, _ = case_inputs(device, (4,), 50, 3, torch.float32, seed=4)
    student[1, 10] = float("nan")
    teacher[3, 20] = float("nan")
    leaf = student.clone().requires_grad_()
    loss = jsd(leaf, teacher, beta=beta, reduction="none", backend="kernel")
    loss.sum().backward()
    ref_loss, ref_grad, magnitude = expected(student, teacher, beta=beta, reduction="none")
    ref_loss[[1, 3]] = float("nan")
    ref_grad[[1, 3]] = float("nan")
    check_loss(loss, ref_loss, magnitude, "none")
    check_grad(leaf.grad, ref_grad, magnitude)


# --- the forward's segments ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "programs, segments, beta",
    [(18, 3, 0.0), (18, 3, 0.3), (18, 3, 1.0), (1, 1, 0.3)],
    ids=["fkl-3-segments", "mixture-3-segments", "rkl-3-segments", "mixture-1-segment"],
)
def test_forward_segments_match_float64(device, poisoned, monkeypatch, programs, segments, beta):
    """The forward with each row split into S segments of whole 64-column tiles: V = 300 in 3 segments of 128, 128
    and 44 columns (the last one ragged, a partial tile), and S = 1 (5 tiles; the other tests' rows are split
    whenever they have several tiles). A NaN row stays NaN, an ignored row holding NaN
    is never read; loss, both logsumexps and the gradient against the float64 reference (reference_distill)."""
    monkeypatch.setattr(jsd_kernels, "JSD_FORWARD_BLOCK", 64)
    monkeypatch.setattr(jsd_kernels, "JSD_BACKWARD_BLOCK", 64)
    monkeypatch.setattr(jsd_kernels, "JSD_FORWARD_PROGRAMS", programs)
    n_rows, vocab = 6, 300
    assert jsd_kernels.forward_segments(n_rows, vocab, 64) == (segments, 64 * (5 if segments == 1 else 2))
    student, teacher, labels = case_inputs(device, (n_rows,), vocab, 4, torch.float32, ignored=(4,), seed=11)
    student[1, 280] = float("nan")  # in the last segment
    student[4], teacher[4] = float("nan"), float("nan")  # ignored: never read
    options = dict(beta=beta, temperature=0.9, student_softcapping=6.0)
    leaf = student.clone().requires_grad_()
    loss = jsd(leaf, teacher, labels, reduction="none", backend="kernel", **options)
    upstream = torch.rand(n_rows, generator=generator(12)).to(device)
    (loss * upstream).sum().backward()
    ref = jsd_reference(
        student.cpu().numpy(), teacher.cpu().numpy(), labels.cpu().numpy(), reduction="none",
        upstream=upstream.cpu().numpy(), **options,
    )  # fmt: skip
    assert np.isnan(ref.loss[1]) and ref.loss[4] == 0.0
    tolerances.assert_loss(loss.detach().cpu().numpy(), ref, dtype=loss.dtype)
    tolerances.assert_grad(leaf.grad.cpu().numpy(), ref, "float32")
    out = jsd_kernels.new_stats(n_rows, device)
    jsd_kernels.jsd_forward(student, teacher, labels, JsdOptions(**options), out)
    for got, want, what in ((out[1], ref.lse_s, "lse_s"), (out[2], ref.lse_t, "lse_t")):
        bound = tolerances.RTOL * ref.loss_scale + tolerances.FLOOR
        tolerances.check(got.double().cpu().numpy(), np.where(ref.counted, want, 0.0), bound, what)


# --- the teacher, dtypes, no-grad -----------------------------------------------------------------------------------


def test_teacher_gets_no_gradient(device):
    student, teacher, labels = case_inputs(device, (3,), 30, 2, torch.float32, seed=6)
    s, t = student.clone().requires_grad_(), teacher.clone().requires_grad_()
    jsd(s, t, labels, backend="kernel").backward()
    assert s.grad is not None and t.grad is None
    assert not jsd(student, t, labels, backend="kernel").requires_grad  # only the teacher requires grad

    hs, ht = linear_inputs(device, True, n=3, vocab=20, vocab_teacher=22)[:2]
    hs = [x.clone().requires_grad_() for x in hs]
    ht = [x.clone().requires_grad_() for x in ht]
    loss = linear_jsd(hs[0], hs[1], ht[0], ht[1], student_bias=hs[2], teacher_bias=ht[2], reduction="none",
                      backend="kernel")  # fmt: skip
    loss.sum().backward()
    assert all(x.grad is not None for x in hs) and all(x.grad is None for x in ht)


def test_dtypes(device):
    """float32 loss for bf16 logits; a float64 student is computed in float64 (plain torch) whatever the backend."""
    student, teacher, labels = case_inputs(device, (3,), 20, 0, torch.bfloat16, seed=7)
    assert jsd(student, teacher, labels, backend="kernel").dtype == torch.float32
    loss64 = jsd(student.double(), teacher.double(), labels, backend="kernel", beta=0.3)
    ref, _, _ = expected(student, teacher, labels, beta=0.3)
    assert loss64.dtype == torch.float64
    torch.testing.assert_close(loss64.cpu(), ref, rtol=1e-12, atol=1e-12)


def test_no_grad_keeps_nothing(device):
    """Without a gradient to compute (torch.no_grad, or a student not requiring grad) nothing is saved for a
    backward and the result has no graph."""
    student, teacher, labels = case_inputs(device, (4,), 20, 0, torch.float32, seed=8)
    hs, ht, _ = linear_inputs(device, True, n=4, vocab=20, vocab_teacher=20)
    packed = []

    def pack(tensor):
        packed.append(tensor)
        return tensor

    s = student.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), torch.no_grad():
        results = [
            jsd(s, teacher, labels, backend="kernel"),
            jsd(s, teacher, labels, backend="kernel", reduction="none"),
            linear_jsd(*hs[:2], *ht[:2], labels, backend="kernel", reduction="none"),
            linear_jsd(hs[0].requires_grad_(), *hs[1:2], *ht[:2], labels, backend="kernel"),
        ]
    assert not packed and all(r.grad_fn is None for r in results)


# --- bad input ----------------------------------------------------------------------------------------------------


BAD_JSD = [
    bad(dict(beta=-0.1), ValueError, "beta"),
    bad(dict(beta=1.5), ValueError, "beta"),
    bad(dict(beta=float("nan")), ValueError, "beta"),
    bad(dict(beta=True), TypeError, "beta"),
    bad(dict(beta="0.5"), TypeError, "beta"),
    bad(dict(temperature=0.0), ValueError, "temperature"),
    bad(dict(temperature=float("inf")), ValueError, "temperature"),
    bad(dict(student_softcapping=-1.0), ValueError, "student_softcapping"),
    bad(dict(teacher_softcapping=float("inf")), ValueError, "teacher_softcapping"),
    bad(dict(reduction="avg"), ValueError, "reduction"),
    bad(dict(backend="triton"), ValueError, "backend"),
    bad(dict(ignore_index=1.5), TypeError, "ignore_index"),
    bad(dict(teacher_logits=torch.zeros(4, 9)), ValueError, "teacher_logits"),  # V_t < V_s
    bad(dict(teacher_logits=torch.zeros(5, 10)), ValueError, "teacher_logits"),  # other rows
    bad(dict(teacher_logits=torch.zeros(4, 10, dtype=torch.int64)), TypeError, "teacher_logits"),
    bad(dict(student_logits=torch.zeros(4, 10, dtype=torch.int32)), TypeError, "student_logits"),
    bad(dict(labels=torch.zeros(5, dtype=torch.int64)), ValueError, "labels"),
    bad(dict(labels=torch.zeros(4)), TypeError, "labels"),
]


@pytest.mark.parametrize("kwargs, error, name", BAD_JSD)
def test_jsd_bad_input_names_the_argument(kwargs, error, name):
    arguments = dict(student_logits=torch.randn(4, 10), teacher_logits=torch.randn(4, 12), backend="kernel")
    arguments.update(kwargs)
    with pytest.raises(error, match=name):
        jsd(arguments.pop("student_logits"), arguments.pop("teacher_logits"), **arguments)


# --- torch.compile ------------------------------------------------------------------------------------------------


def test_fullgraph_compile_matches_eager(device):
    """A step with jsd on logits ("mean") and linear_jsd ("none", then summed) compiles without a graph break;
    the custom ops are in the graphs (linear_jsd's precision keywords travel through them); loss and gradients equal
    eager's."""
    student, teacher, labels = case_inputs(device, (2, 3), 40, 2, torch.float32, ignored=(1,), seed=9)
    hs, ht, _ = linear_inputs(device, True, n=6, vocab=40, vocab_teacher=42)

    def step(logits, hidden, weight):
        a = jsd(logits * 1.0, teacher, labels, beta=0.5, temperature=0.9, backend="kernel")
        b = linear_jsd(hidden, weight, ht[0], ht[1], labels.reshape(-1), teacher_bias=ht[2], beta=0.0,
                       reduction="none", backend="kernel", logits_dtype="float32").sum()  # fmt: skip
        c = linear_jsd(hidden, weight, ht[0], ht[1], beta=1.0, backend="kernel", accumulate_in_float32=True)
        return a + b + c

    def run(function):
        leaves = [t.clone().requires_grad_() for t in (student, hs[0], hs[1])]
        loss = function(*leaves)
        loss.backward()
        return [loss.detach()] + [leaf.grad for leaf in leaves]

    eager = run(step)
    torch._dynamo.reset()
    backend, graphs = recording_backend()
    compiled = run(torch.compile(step, fullgraph=True, backend=backend))
    forward_ops, backward_ops = ops_in(graphs["forward"]), ops_in(graphs["backward"])
    for op in ("jsd_forward", "linear_jsd_forward", "linear_jsd_reduced"):
        assert f"fastce.{op}.default" in forward_ops, forward_ops
    for op in ("jsd_backward", "linear_jsd_backward"):
        assert f"fastce.{op}.default" in backward_ops, backward_ops
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- GPU only -----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_qwen_vocabulary_on_the_gpu(device, poisoned, beta):
    """V_s = 151936 (Qwen2), a padded teacher of 152064 columns, bf16, the default tiles (4096): against float64."""
    gen = torch.Generator(device=device).manual_seed(10)
    student = (4 * torch.randn(24, 151936, device=device, generator=gen)).to(torch.bfloat16)
    teacher = (4 * torch.randn(24, 152064, device=device, generator=gen)).to(torch.bfloat16)
    teacher[:, 151936:] = float("-inf")
    labels = torch.randint(0, 151936, (24,), device=device, generator=gen)
    labels[::5] = -100
    leaf = student.clone().requires_grad_()
    options = dict(beta=beta, temperature=0.8, student_softcapping=30.0)
    loss = jsd(leaf, teacher, labels, backend="kernel", **options)
    loss.backward()
    ref_loss, ref_grad, magnitude = expected(student, teacher, labels, **options)
    check_loss(loss, ref_loss, magnitude, "mean")
    check_grad(leaf.grad, ref_grad, magnitude)
