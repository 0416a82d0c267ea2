"""fastce_torch.linear_jsd (issue 38) against float64 (jsd_checks.expected on the float64 logits h W^T + b of both
heads, its d logits chained through the products by float64 autograd): every beta kind, the reductions, soft-capping,
biases, labels=None and a padded teacher head, in several chunks; skip_ignored_rows (the chunk loops over the kept
rows only: the logits matmuls counted, the same loss and gradients as the default loop and as float64, nothing to
skip or nothing kept, under torch.compile); every row ignored and the refused second backward; bad input names its
argument. CPU: Triton's interpreter; --gpu: CUDA."""

import sys

import pytest
import torch

from fastce_torch import linear_jsd
from shared_tests import tolerances

from . import checks
from .jsd_checks import EPS32, bad, check_loss, expected, generator, linear_inputs
from .test_compile import ops_in, recording_backend

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning",
    "ignore:invalid value:RuntimeWarning",
    "ignore:overflow:RuntimeWarning",
    "ignore:Conversion of an array:DeprecationWarning",
)

module = sys.modules["fastce_torch.linear.engine"]  # the chunk loops' engine: its matmuls and kept-row search spied on
VOCAB = 70  # linear_inputs' student vocabulary
CHUNK = 4  # rows per chunk of the workspace_bytes the tests pass (two float32 chunks of logits)


def run_linear(student, teacher, labels, options, upstream=None, matmul_rows=None, **keywords):
    """One linear_jsd call in chunks of at most CHUNK rows and its backward (of sum(upstream * loss) for "none"):
    (loss, the student leaves holding their gradients, the logits matmuls' rows in the forward, in the backward)."""
    leaves = [None if t is None else t.clone().requires_grad_() for t in student]
    rows = [] if matmul_rows is None else matmul_rows
    rows.clear()
    loss = linear_jsd(
        leaves[0], leaves[1], teacher[0], teacher[1], labels, student_bias=leaves[2], teacher_bias=teacher[2],
        workspace_bytes=CHUNK * VOCAB * 8, backend="kernel", **options, **keywords,
    )  # fmt: skip
    forward = list(rows)
    (loss if upstream is None else loss * upstream).sum().backward()
    return loss.detach(), [leaf for leaf in leaves if leaf is not None], forward, rows[len(forward) :]


def check_linear(loss, leaves, student, teacher, labels, options, upstream=None):
    """linear_jsd's loss and its student leaves' gradients (hidden, weight, bias when given) against float64."""
    vocab = student[1].shape[0]
    hidden64 = [None if t is None else t.detach().double().cpu().requires_grad_() for t in student]
    student_logits = torch.nn.functional.linear(*hidden64)
    t64 = [None if t is None else t.double().cpu() for t in teacher]
    teacher_logits = torch.nn.functional.linear(t64[0], t64[1][:vocab], None if t64[2] is None else t64[2][:vocab])
    ref_loss, d_logits, magnitude = expected(student_logits, teacher_logits, labels, upstream=upstream, **options)
    check_loss(loss, ref_loss, magnitude, options["reduction"])
    ref_grads = torch.autograd.grad(student_logits, [t for t in hidden64 if t is not None], d_logits)
    scale = magnitude.max() * 4  # the products' float32 sums: a few terms of this size
    for leaf, ref, name in zip(leaves, ref_grads, ("hidden", "weight", "bias")):
        bound = 16 * EPS32 * scale * ref.abs().max() + tolerances.FLOOR
        tolerances.check(leaf.grad.double().cpu().numpy(), ref.numpy(), bound.item(), f"d {name}")


# --- against float64 ----------------------------------------------------------------------------------------------

LINEAR_CASES = [
    # beta, reduction, temperature, softcaps, labels, bias
    pytest.param(0.0, "mean", 1.0, (0.0, 0.0), True, True, id="fkl-mean"),
    pytest.param(0.3, "none", 0.8, (6.0, 0.0), True, False, id="mixture-none-softcap"),
    pytest.param(0.5, "sum", 1.3, (0.0, 4.0), False, True, id="jsd-sum-nolabels"),
    pytest.param(1.0, "none", 1.0, (5.0, 5.0), False, True, id="rkl-none"),
]


@pytest.mark.parametrize("beta, reduction, temperature, caps, with_labels, bias", LINEAR_CASES)
def test_linear_jsd_matches_float64(device, poisoned, beta, reduction, temperature, caps, with_labels, bias):
    """Chunks of 4 rows (a workspace of 4 rows of both logits: three chunks, the last one short); the teacher's
    weight has more rows than the student's (its first V_s are used)."""
    student, teacher, labels = linear_inputs(device, bias)
    labels = labels if with_labels else None
    options = dict(beta=beta, temperature=temperature, reduction=reduction, student_softcapping=caps[0],
                   teacher_softcapping=caps[1])  # fmt: skip
    upstream = torch.rand(student[0].shape[:-1], generator=generator(2)).to(device) if reduction == "none" else None
    loss, leaves, _, _ = run_linear(student, teacher, labels, options, upstream)
    check_linear(loss, leaves, student, teacher, labels, options, upstream)


def test_linear_jsd_all_ignored_and_backward_twice(device):
    student, teacher, labels = linear_inputs(device, True, n=4, vocab=20, vocab_teacher=20)
    leaves = [t.clone().requires_grad_() for t in student]
    loss = linear_jsd(*leaves[:2], *teacher[:2], torch.full_like(labels, -100), student_bias=leaves[2],
                      backend="kernel")  # fmt: skip
    loss.backward(retain_graph=True)
    assert loss.item() == 0.0 and not any(leaf.grad.any() for leaf in leaves)
    with pytest.raises(RuntimeError, match="backward through the same loss twice"):
        loss.backward()


# --- skip_ignored_rows --------------------------------------------------------------------------------------------


@pytest.fixture
def matmul_rows(monkeypatch):
    """The rows of every logits matmul the chunk loops run, two a chunk (the student's, then the teacher's), in call
    order (each chunk's gradient products have the student's rows)."""
    return checks.chunk_logits_rows(monkeypatch, module)


@pytest.fixture
def searches(monkeypatch):
    """The function named by each kept-row search that skip_ignored_rows makes (one host synchronisation each)."""
    found = []
    original = module.kept_rows

    def spy(labels, ignore_index, chunking, function):
        if chunking.skip_ignored_rows and labels is not None:
            found.append(function)
        return original(labels, ignore_index, chunking, function)

    monkeypatch.setattr(module, "kept_rows", spy)
    return found


N_ROWS = 22
IGNORED = {
    "none": lambda i: i < 0,
    "prompt-and-interleaved": lambda i: (i < 9) | (i % 3 == 1),  # 9 of 22 rows kept, from row 9 on
    "all": lambda i: i >= 0,
}
TRANSFORMS = dict(temperature=0.8, student_softcapping=6.0, teacher_softcapping=4.0)


def skip_inputs(device, pattern, seed=40):
    """linear_inputs with biases (a padded teacher head) over N_ROWS rows, the rows of `pattern` ignored."""
    student, teacher, labels = linear_inputs(device, True, n=N_ROWS, seed=seed)
    labels = torch.randint(0, VOCAB, (N_ROWS,), generator=generator(seed)).to(device)
    labels[IGNORED[pattern](torch.arange(N_ROWS, device=device))] = -100
    return student, teacher, labels


def upstream_for(reduction, device):
    return torch.rand(N_ROWS, generator=generator(41)).to(device) + 0.5 if reduction == "none" else None


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_skip_ignored_rows_matches_the_default_and_float64(device, poisoned, matmul_rows, searches, beta, reduction):
    """Biases, temperature, both soft-cappings, a padded teacher head: with the keyword both heads' logits matmuls
    run on the kept rows only (the forward; "none" also in its backward, which recomputes them), found once per call
    (one synchronisation, the eager "none" backward reusing the forward's); the loss and gradients are the default
    loop's and float64's, the ignored rows' losses and d hidden exactly 0. Every buffer allocated with torch.empty
    starts as NaN, so rows the skipping leaves unwritten would show."""
    student, teacher, labels = skip_inputs(device, "prompt-and-interleaved")
    n_kept = int((labels != -100).sum())
    options = dict(beta=beta, reduction=reduction, **TRANSFORMS)
    upstream = upstream_for(reduction, device)
    runs = {skip: run_linear(student, teacher, labels, options, upstream, matmul_rows, skip_ignored_rows=skip)
            for skip in (False, True)}  # fmt: skip
    (loss, leaves, forward, backward), (loss0, leaves0, forward0, backward0) = runs[True], runs[False]
    assert searches == ["linear_jsd"]
    assert sum(forward0) == 2 * N_ROWS and sum(forward) == 2 * n_kept
    assert len(forward) == 2 * -(-n_kept // CHUNK) and max(forward) <= CHUNK
    recomputed = reduction == "none"
    assert backward == (forward if recomputed else []) and backward0 == (forward0 if recomputed else [])
    torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-7)
    for leaf, leaf0 in zip(leaves, leaves0, strict=True):
        torch.testing.assert_close(leaf.grad, leaf0.grad, rtol=1e-5, atol=1e-7)
    assert not leaves[0].grad[labels == -100].any()
    if reduction == "none":
        assert not loss[labels == -100].any()
    check_linear(loss, leaves, student, teacher, labels, options, upstream)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("pattern", ["none", "no-labels", "all"])
def test_skip_ignored_rows_with_nothing_to_skip_or_nothing_kept(device, poisoned, matmul_rows, pattern, reduction):
    """No row ignored, or labels=None: the plain loop (every row's matmuls, the same results bit for bit); every row
    ignored: no matmul at all, a zero loss and zero gradients."""
    student, teacher, labels = skip_inputs(device, "all" if pattern == "all" else "none")
    labels = None if pattern == "no-labels" else labels
    options = dict(beta=0.5, reduction=reduction, **TRANSFORMS)
    upstream = upstream_for(reduction, device)
    runs = {skip: run_linear(student, teacher, labels, options, upstream, matmul_rows, skip_ignored_rows=skip)
            for skip in (False, True)}  # fmt: skip
    loss, leaves, forward, backward = runs[True]
    if pattern == "all":
        assert forward == backward == []
        assert not loss.any() and not any(leaf.grad.any() for leaf in leaves)
        return
    assert (forward, backward) == tuple(runs[False][2:]) and sum(forward) == 2 * N_ROWS
    assert torch.equal(loss, runs[False][0])
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, runs[False][1], strict=True))


def test_skip_ignored_rows_under_fullgraph_compile(device, matmul_rows):
    """The keyword reaches the custom ops (a field of their schema): under torch.compile(fullgraph=True) a step with a
    "none" and a "mean" linear_jsd runs every logits matmul on the kept rows only (the "none" backward's op finds
    them again), no graph break; loss and gradients equal eager's."""
    student, teacher, labels = skip_inputs(device, "prompt-and-interleaved")
    n_kept = int((labels != -100).sum())
    weights = torch.linspace(0.5, 1.5, N_ROWS, device=device)
    common = dict(teacher_bias=teacher[2], workspace_bytes=CHUNK * VOCAB * 8, backend="kernel", skip_ignored_rows=True)

    def step(hidden, weight):
        rows = linear_jsd(hidden, weight, *teacher[:2], labels, beta=0.0, reduction="none", **common)
        mean = linear_jsd(hidden, weight, *teacher[:2], labels, beta=1.0, **TRANSFORMS, **common)
        return (rows * weights).sum() + mean

    def run(function):
        leaves = [t.clone().requires_grad_() for t in student[:2]]
        matmul_rows.clear()
        loss = function(*leaves)
        loss.backward()
        return [loss.detach(), *(leaf.grad for leaf in leaves)], list(matmul_rows)

    eager, eager_rows = run(step)
    torch._dynamo.reset()
    backend, graphs = recording_backend()
    try:
        compiled, compiled_rows = run(torch.compile(step, fullgraph=True, backend=backend))
    finally:
        torch._dynamo.reset()
    # Both heads' rows: the "none" forward and its backward, the "mean" forward.
    assert sum(eager_rows) == sum(compiled_rows) == 3 * 2 * n_kept, (eager_rows, compiled_rows)
    forward_ops, backward_ops = ops_in(graphs["forward"]), ops_in(graphs["backward"])
    assert {"fastce.linear_jsd_forward.default", "fastce.linear_jsd_reduced.default"} <= forward_ops, forward_ops
    assert "fastce.linear_jsd_backward.default" in backward_ops, backward_ops
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_skip_ignored_rows_refuses_cuda_graph_capture(device):
    """It synchronises (the number of kept rows), which capture forbids: a clear error naming linear_jsd, not a
    capture failure."""
    student, teacher, labels = skip_inputs(device, "prompt-and-interleaved")

    def call():
        return linear_jsd(*student[:2], *teacher[:2], labels, student_bias=student[2], skip_ignored_rows=True)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()  # warm-up
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="linear_jsd: skip_ignored_rows"):
            with torch.cuda.graph(graph, stream=stream):
                call()


# --- bad input ----------------------------------------------------------------------------------------------------

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
    bad(dict(skip_ignored_rows=1), TypeError, "skip_ignored_rows"),
    bad(dict(skip_ignored_rows="yes"), TypeError, "skip_ignored_rows"),
    bad(dict(skip_ignored_rows=None), TypeError, "skip_ignored_rows"),
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
