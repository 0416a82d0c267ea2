"""fastce_torch's kernels against the repository's float64 reference and its tolerance model
(shared_tests/reference.py, shared_tests/tolerances.py; CPU: Triton's interpreter; --gpu: the H200)."""

import math
import os
import subprocess
import sys

import pytest
import torch

import fastce_torch
from fastce_torch import cross_entropy
from shared_tests import tolerances

from .checks import assert_grad, assert_loss, expected

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning", "ignore::DeprecationWarning", "ignore:invalid value:RuntimeWarning"
)

# The interpreter's time grows with N * V: on the CPU the vocabularies that each reach another layout (one tile,
# 2 and 4 chunks of 16384 with a partial last one, over 65536, 2**18 + 3 with a last chunk of 3 columns); the real
# model vocabularies 128256 and 256000 are more chunks of the same layout and run with --gpu (256000 also in the
# shared table, shared_tests/cases.py BIG).
VOCABS = [
    1000,
    32000,
    50257,
    70000,
    pytest.param(128256, marks=pytest.mark.gpu),
    pytest.param(256000, marks=pytest.mark.gpu),
    262147,
]
ALL_OPTIONS = dict(logit_softcapping=30.0, logit_scaling=0.5, label_smoothing=0.1, z_loss=1e-3)


def random_problem(shape, vocab, dtype, device, seed, ignore_every=5, ignore_index=-100):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn((*shape, vocab), generator=generator, dtype=torch.float64) * 2.0).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=generator)
    labels.view(-1)[::ignore_every] = ignore_index
    return logits.to(device), labels.to(device)


def run_kernel(logits, labels, reduction="none", inplace=False, **options):
    """Loss and gradient from the kernels; with inplace, logits are a non-leaf whose buffer backward may reuse."""
    leaf = logits.detach().clone().requires_grad_()
    x = leaf.clone() if inplace else leaf
    loss = cross_entropy(x, labels, reduction=reduction, backend="kernel", **options)
    (loss.sum() if reduction == "none" else loss).backward()
    return loss, leaf.grad


def check(shape, vocab, dtype, device, seed=0, **options):
    logits, labels = random_problem(shape, vocab, dtype, device, seed, ignore_index=options.get("ignore_index", -100))
    loss, grad = run_kernel(logits, labels, **options)
    ref = expected(logits, labels, **options)
    assert grad.dtype == dtype
    assert_loss(loss, ref)
    assert_grad(grad, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", VOCABS)
def test_vocab_sizes_and_dtypes(vocab, dtype, device, poisoned):
    check((3,), vocab, dtype, device, seed=vocab)


@pytest.mark.parametrize(
    "options",
    [
        dict(logit_softcapping=30.0),
        dict(logit_softcapping=3.0),
        dict(logit_scaling=0.125),
        dict(logit_scaling=-2.0),
        dict(label_smoothing=0.1),
        dict(label_smoothing=1.0),
        dict(z_loss=1e-4),
        dict(z_loss=0.5),
        ALL_OPTIONS,
        dict(ignore_index=7),
    ],
    ids=str,
)
# 50257: 4 chunks, the last one partial (128256, 8 chunks, with --gpu).
@pytest.mark.parametrize("vocab", [1000, 50257, pytest.param(128256, marks=pytest.mark.gpu)])
def test_options(options, vocab, device, poisoned):
    for dtype in (torch.float32, torch.bfloat16):
        check((4,), vocab, dtype, device, seed=11, **options)


def test_inplace_backward_writes_into_logits(device, poisoned):
    logits, labels = random_problem((6,), 70000, torch.bfloat16, device, seed=3)
    leaf = logits.clone().requires_grad_()
    intermediate = leaf.clone()
    seen = []
    intermediate.register_hook(seen.append)
    cross_entropy(intermediate, labels, backend="kernel", **ALL_OPTIONS).backward()
    assert seen[0].data_ptr() == intermediate.data_ptr()  # the gradient lives in the logits' buffer
    assert_grad(leaf.grad, expected(logits, labels, reduction="mean", **ALL_OPTIONS))


def test_leaf_logits_are_never_overwritten(device):
    logits, labels = random_problem((4,), 1000, torch.float32, device, seed=4)
    leaf = logits.clone().requires_grad_()
    view_of_leaf = leaf[:, :1000]
    cross_entropy(view_of_leaf, labels, backend="kernel").backward()
    assert torch.equal(leaf.detach(), logits) and leaf.grad.data_ptr() != leaf.data_ptr()


def test_overwriting_saved_logits_fails_loudly(device):
    """exp saves its output for backward; the in-place gradient must not silently corrupt it."""
    logits, labels = random_problem((4,), 1000, torch.float32, device, seed=5)
    leaf = (logits / 4).requires_grad_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        cross_entropy(torch.exp(leaf), labels, backend="kernel").backward()


def test_three_dims_strided_rows_and_int32_labels(device, poisoned):
    logits, labels = random_problem((2, 3), 50257, torch.bfloat16, device, seed=6)
    wide = torch.randn(2, 3, 50257 + 61, device=device).to(torch.bfloat16)
    wide[..., :50257] = logits
    strided = wide[..., :50257]
    assert not strided.is_contiguous()
    loss, grad = run_kernel(strided, labels.to(torch.int32), **ALL_OPTIONS)
    ref = expected(logits, labels, **ALL_OPTIONS)
    assert loss.shape == (2, 3)
    assert_loss(loss, ref)
    assert_grad(grad, ref)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n_items", [None, 37, "tensor"])
def test_reductions(reduction, n_items, device, poisoned):
    logits, labels = random_problem((5, 4), 1000, torch.float32, device, seed=8)
    if n_items == "tensor":
        n_items = torch.tensor(23, device=device)
    loss, grad = run_kernel(logits, labels, reduction=reduction, n_items=n_items, inplace=True)
    ref = expected(logits, labels, reduction=reduction, n_items=n_items)
    assert loss.shape == ()
    assert_loss(loss, ref)
    assert_grad(grad, ref)


def test_reduction_over_many_rows_and_chunks(device, poisoned):
    """The in-kernel reduction sums rows in groups of 64 (a partial last group; whole groups only), then the group
    sums; chunked rows finish in any order. The smallest shapes with each property (the interpreter runs a program
    per row and chunk): 140 rows are groups of 64, 64 and 12 (a partial last one, three group sums); 128 rows two
    whole groups; 3 rows of 300000 columns each 19 chunks of 16384 (one row ignored)."""
    for shape, vocab, reduction in (((2, 70), 8, "mean"), ((4, 32), 1000, "mean"), ((3,), 300000, "sum")):
        logits, labels = random_problem(shape, vocab, torch.float32, device, seed=vocab, ignore_every=3)
        loss, grad = run_kernel(logits, labels, reduction=reduction, inplace=True)
        ref = expected(logits, labels, reduction=reduction)
        assert_loss(loss, ref)
        assert_grad(grad, ref)


def test_all_ignored_mean_is_zero_with_zero_gradient(device, poisoned):
    logits, labels = random_problem((8,), 32000, torch.bfloat16, device, seed=9)
    labels.fill_(-100)
    loss, grad = run_kernel(logits, labels, reduction="mean", inplace=True)
    assert loss.item() == 0.0 and not torch.isnan(grad).any() and bool((grad == 0).all())


def test_out_of_range_labels_are_nan_and_isolated(device, poisoned):
    logits, labels = random_problem((6,), 1000, torch.float32, device, seed=10)
    labels[1], labels[4] = 1000, -5
    loss, grad = run_kernel(logits, labels)
    ref = expected(logits, labels)
    assert torch.isnan(loss[[1, 4]]).all() and torch.isnan(grad[[1, 4]]).all()
    assert_loss(loss, ref)
    assert_grad(grad, ref)  # NaN exactly in the bad rows
    assert torch.isnan(cross_entropy(logits, labels, backend="kernel")).item()
    with pytest.raises(ValueError, match=r"labels\[1\] = 1000 is outside \[0, 1000\)"):
        cross_entropy(logits, labels, backend="kernel", validate_labels=True)


@pytest.mark.parametrize("options", [{}, dict(logit_softcapping=20.0, z_loss=1e-3)], ids=str)
def test_minus_inf_padding_is_finite_with_zero_gradient(options, device, poisoned):
    logits, labels = random_problem((4,), 32000, torch.bfloat16, device, seed=12)
    logits[:, 31000:] = float("-inf")  # a vocabulary padded to a multiple
    labels = labels % 31000
    loss, grad = run_kernel(logits, labels, **options)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert bool((grad[:, 31000:] == 0).all())
    ref = expected(logits, labels, **options)
    assert_loss(loss, ref)
    assert_grad(grad, ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_row_is_nan_and_others_untouched(bad, device, poisoned):
    logits, labels = random_problem((5,), 70000, torch.float32, device, seed=13)
    labels[2] = 17
    logits[2, 69999] = bad
    loss, grad = run_kernel(logits, labels)
    assert torch.isnan(loss[2]) and torch.isnan(grad[2]).any()
    others = [0, 1, 3, 4]
    ref = expected(logits[others], labels[others])
    assert_loss(loss[others], ref)
    assert_grad(grad[others], ref)


def test_empty_batch_and_single_class(device):
    logits = torch.randn(0, 1000, device=device)
    labels = torch.zeros(0, dtype=torch.long, device=device)
    assert cross_entropy(logits, labels, backend="kernel", reduction="sum").item() == 0.0
    assert cross_entropy(logits, labels, backend="kernel", reduction="mean").item() == 0.0
    assert cross_entropy(logits, labels, backend="kernel", reduction="none").shape == (0,)
    check((3,), 1, torch.float32, device, seed=14)


def test_module_matches_functional(device):
    logits, labels = random_problem((4,), 1000, torch.float32, device, seed=15)
    module = fastce_torch.CrossEntropyLoss(reduction="sum", label_smoothing=0.1, z_loss=1e-3, backend="kernel")
    expected = cross_entropy(logits, labels, reduction="sum", label_smoothing=0.1, z_loss=1e-3, backend="kernel")
    assert torch.equal(module(logits, labels), expected)
    assert "z_loss=0.001" in repr(module)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, y: cross_entropy(x.long(), y), TypeError, "logits"),
        (lambda x, y: cross_entropy(x, y.float()), TypeError, "labels"),
        (lambda x, y: cross_entropy(x, y[:2]), ValueError, "leading shape"),
        (lambda x, y: cross_entropy(x, y, reduction="avg"), ValueError, "reduction"),
        (lambda x, y: cross_entropy(x, y, backend="cuda"), ValueError, "backend"),
        (lambda x, y: cross_entropy(x, y, n_items=0), ValueError, "n_items"),
        (lambda x, y: cross_entropy(x, y, logit_softcapping=-1.0), ValueError, "logit_softcapping"),
        (lambda x, y: cross_entropy(x, y, label_smoothing=1.5), ValueError, "label_smoothing"),
        # float64 is accepted and computed in float64 (shared_tests/test_shared_training.py); float8 is not.
        (lambda x, y: cross_entropy(x.to(torch.float8_e4m3fn), y, backend="kernel"), TypeError, "logits"),
        (lambda x, y: cross_entropy(x[:, :0], y), ValueError, "vocabulary"),
    ],
)
def test_bad_arguments_are_named(call, error, match, device):
    logits, labels = random_problem((4,), 100, torch.float32, device, seed=16)
    with pytest.raises(error, match=match):
        call(logits, labels)


def test_checked_options_are_reused_but_never_skip_a_check(device):
    """Options checked once are reused for equal plain values; values equal to a cached key but of another type, or
    invalid ones, still go through every check, however often the valid call ran before."""
    import numpy as np

    logits, labels = random_problem((4,), 100, torch.float32, device, seed=16)
    calls = [
        (dict(ignore_index=-100.0), TypeError, "ignore_index"),
        (dict(ignore_index=np.int64(-100)), TypeError, "ignore_index"),
        (dict(ignore_index=True), TypeError, "ignore_index"),
        (dict(label_smoothing=float("nan")), ValueError, "label_smoothing"),
        (dict(z_loss=1e-40), ValueError, "float32"),
    ]
    for _ in range(2):
        want = cross_entropy(logits, labels, backend="reference", label_smoothing=0.1)
        got = cross_entropy(logits, labels, backend="reference", label_smoothing=0.1)
        assert torch.equal(want, got)
        for kwargs, error, match in calls:
            with pytest.raises(error, match=match):
                cross_entropy(logits, labels, backend="reference", **kwargs)


def test_reference_backend_matches_float64(device):
    logits, labels = random_problem((2, 3), 1000, torch.bfloat16, device, seed=17)
    labels[0, 1] = 5000
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy(leaf, labels, reduction="none", backend="reference", **ALL_OPTIONS)
    loss.nan_to_num().sum().backward()
    ref = expected(logits, labels, **ALL_OPTIONS)
    assert_loss(loss, ref)
    # The bad label's row stays NaN though nan_to_num cuts its loss off before the sum (as the kernels give it).
    assert_grad(leaf.grad, ref)


FLOAT64_OPTIONS = [
    dict(),
    dict(logit_softcapping=3.0),
    dict(logit_scaling=-0.7),
    dict(label_smoothing=0.1),
    dict(z_loss=1e-3),
    dict(logit_softcapping=3.0, logit_scaling=0.7, label_smoothing=0.1, z_loss=1e-3, ignore_index=2),
]


@pytest.mark.parametrize("backend", ["auto", "kernel", "reference"])
@pytest.mark.parametrize("reduction, n_items", [("none", None), ("mean", None), ("sum", None), ("mean", 5), ("sum", 3)])
@pytest.mark.parametrize("options", FLOAT64_OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_float64_passes_gradcheck(backend, reduction, n_items, options, device):
    """float64 logits are computed in float64 whatever the backend: torch.autograd.gradcheck's finite differences
    (float64, 1e-6 steps) agree with the backward, and the loss is float64 within 1e-12 of the float64 reference."""
    generator = torch.Generator().manual_seed(21)
    logits = (torch.randn(2, 3, 7, generator=generator, dtype=torch.float64) * 2.0).to(device)
    labels = torch.randint(0, 7, (2, 3), generator=generator).to(device)
    labels[0, 1] = options.get("ignore_index", -100)
    kwargs = dict(reduction=reduction, n_items=n_items, backend=backend, **options)
    leaf = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: cross_entropy(x, labels, **kwargs), (leaf,))
    loss = cross_entropy(leaf, labels, **kwargs)
    assert loss.dtype == torch.float64
    ref = expected(logits, labels, reduction=reduction, n_items=n_items, **options)
    tolerances.check(loss.detach().cpu().numpy(), ref.loss, tolerances.loss_bound(ref, tolerances.RTOL64), "loss")


# The sm_90 compile check (about 200 variants, seconds each without a warm Triton cache) in slices that run in
# parallel under pytest-xdist: slice k of COMPILE_SLICES runs compile_check.main over every COMPILE_SLICES-th variant.
COMPILE_SLICES = 4
COMPILE_SLICE_SCRIPT = """
import itertools, sys
from fastce_torch import compile_check
every, k, n = compile_check.variants, int(sys.argv[1]), int(sys.argv[2])
print("variants", sum(1 for _ in every()))
compile_check.variants = lambda: itertools.islice(every(), k, None, n)
compile_check.main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("part", range(COMPILE_SLICES))
def test_kernels_compile_for_h200(part):
    """Every kernel variant compiles for sm_90 with the real compiler (no GPU needed): catches what the
    interpreter does not check (non-power-of-two blocks, unsupported ops). The slices together are
    `python -m fastce_torch.compile_check`."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    command = [sys.executable, "-c", COMPILE_SLICE_SCRIPT, str(part), str(COMPILE_SLICES)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    total = int(result.stdout.split("variants ")[1].split()[0])
    assert total > 100, result.stdout
    assert f"compiled {len(range(part, total, COMPILE_SLICES))} kernel variants for sm_90" in result.stdout


# --- GPU only ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_more_than_2_31_elements(device):
    n_rows, vocab = 9000, 256000  # 2.3e9 elements: 64-bit row offsets
    generator = torch.Generator(device=device).manual_seed(18)
    logits = torch.randn(n_rows, vocab, device=device, dtype=torch.bfloat16, generator=generator)
    labels = torch.randint(0, vocab, (n_rows,), device=device, generator=generator)
    labels[::7] = -100
    x = logits.requires_grad_()
    loss = cross_entropy(x, labels, reduction="none", backend="kernel")
    loss.sum().backward()
    rows = torch.tensor([0, 1, 4095, 8388, 8999])  # 8388 * 256000 > 2**31
    ref = expected(logits.detach()[rows], labels[rows])
    assert_loss(loss[rows], ref)
    assert_grad(x.grad[rows], ref)


@pytest.mark.gpu
def test_peak_extra_memory_is_near_zero(device):
    n_rows, vocab = 8192, 128256
    labels = torch.randint(0, vocab, (n_rows,), device=device)
    hidden = torch.randn(n_rows, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    projection = torch.randn(64, vocab, device=device, dtype=torch.bfloat16)
    cross_entropy(hidden @ projection, labels, backend="kernel").backward()  # cuBLAS workspace, kernel compiles
    logits = hidden @ projection  # an intermediate, as from lm_head
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = cross_entropy(logits, labels, backend="kernel")
    loss.backward(inputs=[hidden])
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    logits_bytes = n_rows * vocab * 2
    # hidden's gradient (8192x64 bf16 = 1 MiB) is the only sizeable allocation; the loss itself adds ~100 KiB
    assert extra < 0.01 * logits_bytes, f"peak extra {extra / 2**20:.1f} MiB"
    assert math.isfinite(loss.item())
