"""fastce_torch.linear_jsd's precision keywords (linear_cross_entropy's, the same meaning) against the float64
reference (shared_tests/reference_distill.py) on the bf16 inputs themselves:
- logits_dtype="float32": both models' logits stay float32. The JSD gradient p_s - p_t is a difference of nearly
  equal numbers, so logits rounded to bf16 move it by percents at a realistic logit spread (randn weights scaled to
  a logit std of 10, as Liger-Kernel 0.8.5's test_logits_projection_is_not_rounded_to_input_dtype); float32 logits
  leave only the gradients' own bf16 rounding. The bf16-logits run is asserted clearly worse, so the test fails if
  the keyword were ignored.
- accumulate_in_float32=True over many chunks: the weight gradient summed in float32 and rounded once.
- the chunks' buffers (float32 logits of both models, the student's gradient chunk in bf16) and the workspace
  accounting (4 bytes a teacher logit, 4 + 2 a student logit in a pass with gradients); bad keywords.
"""

import pytest
import torch

from fastce_torch import linear_jsd
from fastce_torch.losses.jsd import launch as jsd_kernels
from shared_tests.distill_precision import check_float32_accumulation, check_float32_logits
from shared_tests.reference_distill import linear_jsd as linear_jsd_reference

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

LOGIT_STD = 10.0


def spread_inputs(device, n=16, width=64, vocab=256, seed=0, std=LOGIT_STD):
    """bf16 (student hidden, weight, teacher hidden, weight) with logits of standard deviation about std."""
    gen = torch.Generator().manual_seed(seed)

    def head():
        return torch.randn(vocab, width, generator=gen) * (std / width**0.5)

    tensors = [torch.randn(n, width, generator=gen), head(), torch.randn(n, width, generator=gen), head()]
    return [t.to(device=device, dtype=torch.bfloat16) for t in tensors]


def student_grads(inputs, **keywords):
    h_s, w_s, h_t, w_t = inputs
    leaves = [h_s.clone().requires_grad_(), w_s.clone().requires_grad_()]
    linear_jsd(leaves[0], leaves[1], h_t, w_t, backend="kernel", **keywords).backward()
    for leaf in leaves:
        assert leaf.grad.dtype == torch.bfloat16 and torch.isfinite(leaf.grad).all()
    return [leaf.grad.double().cpu().numpy() for leaf in leaves]


def exact(inputs, **options):
    return linear_jsd_reference(*(t.double().cpu().numpy() for t in inputs), None, **options)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_float32_logits_keep_the_gradient(device, poisoned, beta):
    """Measured on the CPU (N=16, H=64, V=256, std 10): max relative error of d hidden / d weight 2.6-4.1e-3 / 3.9-
    5.9e-3 with float32 logits, 1.9-3.4e-2 / 1.3-4.5e-2 with bf16 logits (2.3-13x worse)."""
    inputs = spread_inputs(device)
    want = exact(inputs, beta=beta)
    grads = {dtype: student_grads(inputs, beta=beta, logits_dtype=dtype) for dtype in (None, "float32")}
    check_float32_logits(grads["float32"], grads[None], want)


def test_float32_logits_workspace_and_buffers(device, monkeypatch):
    """With gradients: student logits float32, teacher logits float32, d student logits into a bf16 chunk; the
    workspace of 3 rows x V x (4 + 2 + 4) bytes holds 3 rows per chunk. Without gradients, 4 + 4 bytes a row."""
    inputs = spread_inputs(device, n=7, width=16, vocab=40, std=2.0)
    seen = {"forward": [], "backward": []}
    forward, backward = jsd_kernels.jsd_forward, jsd_kernels.jsd_backward

    def spy_forward(student, teacher, *rest):
        seen["forward"].append((student.shape[0], student.dtype, teacher.dtype))
        return forward(student, teacher, *rest)

    def spy_backward(upstream, student, teacher, labels, stats, grad, *rest):
        seen["backward"].append((student.dtype, grad.dtype, grad.data_ptr() == student.data_ptr()))
        return backward(upstream, student, teacher, labels, stats, grad, *rest)

    monkeypatch.setattr(jsd_kernels, "jsd_forward", spy_forward)
    monkeypatch.setattr(jsd_kernels, "jsd_backward", spy_backward)
    student_grads(inputs, logits_dtype=torch.float32, workspace_bytes=3 * 40 * 10)
    assert seen["forward"] == [(3, torch.float32, torch.float32)] * 2 + [(1, torch.float32, torch.float32)]
    assert seen["backward"] == [(torch.float32, torch.bfloat16, False)] * 3
    seen["forward"].clear()
    with torch.no_grad():
        linear_jsd(*inputs, logits_dtype="float32", workspace_bytes=3 * 40 * 8, backend="kernel")
    assert [rows for rows, *_ in seen["forward"]] == [3, 3, 1]


def test_accumulate_in_float32_over_many_chunks(device):
    """16 chunks of one row (float32 logits): the float32 accumulator rounds d weight once, so it matches one chunk's
    product (itself one rounding) to within a bf16 ulp and the float64 reference to the products' rounding; the
    default rounds every chunk (distill_precision.check_float32_accumulation)."""
    inputs = spread_inputs(device, n=16, width=32, vocab=64, seed=1, std=4.0)
    options = dict(beta=0.5, reduction="sum", logits_dtype="float32")
    one_chunk = student_grads(inputs, **options)[1]
    chunks = dict(workspace_bytes=64 * 10, **options)
    accumulated = student_grads(inputs, accumulate_in_float32=True, **chunks)[1]
    want = exact(inputs, beta=0.5, reduction="sum").grad_weight
    check_float32_accumulation(one_chunk, accumulated, want)


@pytest.mark.parametrize(
    "keywords, error, name",
    [
        (dict(logits_dtype=torch.bfloat16), ValueError, "logits_dtype"),
        (dict(logits_dtype="float64"), ValueError, "logits_dtype"),
        (dict(logits_dtype=1), ValueError, "logits_dtype"),
        (dict(accumulate_in_float32=1), TypeError, "accumulate_in_float32"),
        (dict(accumulate_in_float32=None), TypeError, "accumulate_in_float32"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__,
)
def test_bad_precision_keywords_name_the_argument(keywords, error, name):
    heads = (torch.randn(4, 5), torch.randn(10, 5), torch.randn(4, 6), torch.randn(12, 6))
    with pytest.raises(error, match=name):
        linear_jsd(*heads, backend="kernel", **keywords)
