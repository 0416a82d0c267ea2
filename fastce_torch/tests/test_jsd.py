"""fastce_torch.jsd / linear_jsd (issue 38) against float64: the loss from the definition of TRL's generalized JSD
and the student's gradient by float64 torch autograd of it (independent of the kernels' closed-form gradient), for
every beta kind (0, 0.3, 0.5, 1), temperature, both soft-cappings, every reduction and ignore pattern, a padded
teacher, NaN rows; the teacher gets no gradient; bad input names its argument; torch.compile(fullgraph=True); a call
without gradients keeps nothing. CPU: Triton's interpreter (tiny shapes; small tiles force multi-tile rows);
--gpu: CUDA."""

import numpy as np
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from fastce_torch import jsd, linear_jsd
from fastce_torch.jsd_contract import JsdOptions
from fastce_torch.kernels import jsd as jsd_kernels
from shared_tests import tolerances
from shared_tests.reference_distill import jsd as jsd_reference

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning",
    "ignore:invalid value:RuntimeWarning",
    "ignore:overflow:RuntimeWarning",
    "ignore:Conversion of an array:DeprecationWarning",
)

EPS32 = 2.0**-23


# --- the float64 expectation ----------------------------------------------------------------------------------------


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


# --- linear_jsd against float64 -----------------------------------------------------------------------------------

LINEAR_CASES = [
    # beta, reduction, temperature, softcaps, labels, bias
    pytest.param(0.0, "mean", 1.0, (0.0, 0.0), True, True, id="fkl-mean"),
    pytest.param(0.3, "none", 0.8, (6.0, 0.0), True, False, id="mixture-none-softcap"),
    pytest.param(0.5, "sum", 1.3, (0.0, 4.0), False, True, id="jsd-sum-nolabels"),
    pytest.param(1.0, "none", 1.0, (5.0, 5.0), False, True, id="rkl-none"),
]


def linear_inputs(device, bias, n=11, h_s=16, h_t=24, vocab=70, vocab_teacher=75, seed=5):
    gen = generator(seed)
    student = [torch.randn(n, h_s, generator=gen), 0.4 * torch.randn(vocab, h_s, generator=gen)]
    teacher = [torch.randn(n, h_t, generator=gen), 0.4 * torch.randn(vocab_teacher, h_t, generator=gen)]
    student.append(torch.randn(vocab, generator=gen) if bias else None)
    teacher.append(torch.randn(vocab_teacher, generator=gen) if bias else None)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[[0, n // 2]] = -100
    move = [None if t is None else t.to(device) for t in (*student, *teacher, labels)]
    return move[:3], move[3:6], move[6]


@pytest.mark.parametrize("beta, reduction, temperature, caps, with_labels, bias", LINEAR_CASES)
def test_linear_jsd_matches_float64(device, poisoned, beta, reduction, temperature, caps, with_labels, bias):
    """Chunks of 4 rows (a workspace of 4 rows of both logits: three chunks, the last one short); the teacher's
    weight has more rows than the student's (its first V_s are used)."""
    student, teacher, labels = linear_inputs(device, bias)
    labels = labels if with_labels else None
    vocab = student[1].shape[0]
    options = dict(beta=beta, temperature=temperature, reduction=reduction, student_softcapping=caps[0],
                   teacher_softcapping=caps[1])  # fmt: skip
    leaves = [None if t is None else t.clone().requires_grad_() for t in student]
    loss = linear_jsd(
        leaves[0], leaves[1], teacher[0], teacher[1], labels, student_bias=leaves[2], teacher_bias=teacher[2],
        workspace_bytes=4 * vocab * 8, backend="kernel", **options,
    )  # fmt: skip
    upstream = torch.rand(loss.shape, generator=generator(2)).to(device) if reduction == "none" else None
    (loss * (1 if upstream is None else upstream)).sum().backward()

    hidden64 = [None if t is None else t.detach().double().cpu().requires_grad_() for t in student]
    student_logits = torch.nn.functional.linear(*hidden64)
    t64 = [None if t is None else t.double().cpu() for t in teacher]
    teacher_logits = torch.nn.functional.linear(t64[0], t64[1][:vocab], None if t64[2] is None else t64[2][:vocab])
    ref_loss, d_logits, magnitude = expected(student_logits, teacher_logits, labels, upstream=upstream, **options)
    check_loss(loss, ref_loss, magnitude, reduction)
    present = [t for t in hidden64 if t is not None]
    ref_grads = torch.autograd.grad(student_logits, present, d_logits)
    scale = magnitude.max() * 4  # the products' float32 sums: a few terms of this size
    for leaf, ref, name in zip([t for t in leaves if t is not None], ref_grads, ("hidden", "weight", "bias")):
        bound = 16 * EPS32 * scale * ref.abs().max() + tolerances.FLOOR
        tolerances.check(leaf.grad.double().cpu().numpy(), ref.numpy(), bound.item(), f"d {name}")


def test_linear_jsd_all_ignored_and_backward_twice(device):
    student, teacher, labels = linear_inputs(device, True, n=4, vocab=20, vocab_teacher=20)
    leaves = [t.clone().requires_grad_() for t in student]
    loss = linear_jsd(*leaves[:2], *teacher[:2], torch.full_like(labels, -100), student_bias=leaves[2],
                      backend="kernel")  # fmt: skip
    loss.backward(retain_graph=True)
    assert loss.item() == 0.0 and not any(leaf.grad.any() for leaf in leaves)
    with pytest.raises(RuntimeError, match="backward through the same loss twice"):
        loss.backward()


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


def bad(kwargs, error, name):
    # Tensors get their shape and dtype in the id, not their random values: pytest-xdist workers must collect the
    # same ids.
    def describe(value):
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)}-{str(value.dtype).removeprefix('torch.')}"
        return repr(value)

    return pytest.param(kwargs, error, name, id=",".join(f"{k}={describe(v)}" for k, v in kwargs.items()))


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


BAD_LINEAR = [
    bad(dict(student_weight=torch.randn(10, 7)), ValueError, "student_weight"),
    bad(dict(teacher_weight=torch.randn(12, 8)), ValueError, "teacher_weight"),
    bad(dict(teacher_weight=torch.randn(9, 6)), ValueError, "teacher_weight"),  # V_t < V_s
    bad(dict(teacher_hidden=torch.randn(3, 6)), ValueError, "teacher_hidden"),
    bad(dict(student_bias=torch.randn(11)), ValueError, "student_bias"),
    bad(dict(teacher_bias=torch.randn(10, dtype=torch.float64).int()), TypeError, "teacher_bias"),
    bad(dict(student_hidden=torch.randn(4, 5).int()), TypeError, "student_hidden"),
    bad(dict(labels=torch.zeros(3, dtype=torch.int64)), ValueError, "labels"),
    bad(dict(workspace_bytes=0), ValueError, "workspace_bytes"),
    bad(dict(beta=2.0), ValueError, "beta"),
]


@pytest.mark.parametrize("kwargs, error, name", BAD_LINEAR)
def test_linear_jsd_bad_input_names_the_argument(kwargs, error, name):
    arguments = dict(
        student_hidden=torch.randn(4, 5), student_weight=torch.randn(10, 5), teacher_hidden=torch.randn(4, 6),
        teacher_weight=torch.randn(12, 6), labels=None, backend="kernel",
    )  # fmt: skip
    arguments.update(kwargs)
    heads = [arguments.pop(key) for key in ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")]
    with pytest.raises(error, match=name):
        linear_jsd(*heads, **arguments)


# --- torch.compile ------------------------------------------------------------------------------------------------


def recording_backend():
    """aot_eager that keeps the forward and backward FX graphs it is given."""
    graphs = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")), graphs


def ops_in(graph_modules):
    return {str(node.target) for gm in graph_modules for node in gm.graph.nodes if node.op == "call_function"}


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
