"""shift=k in fastce_torch: the paths the shared test (shared_tests/test_shift.py) does not take. The eager in-place
backward writes the whole gradient into the logits' own buffer (the sliced call's backward allocates a zero-filled
logits-sized one), torch.compile (one graph, dynamic shapes), the reference backend, torch.func.grad, the module."""

import math
import sys

import pytest
import torch

from fastce_torch import CrossEntropyLoss, cross_entropy, linear_cross_entropy

from .test_compile import VOCAB, SlicedHead, counting_backend, run

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning",
    "ignore:invalid value:RuntimeWarning",
    "ignore:Conversion of an array:DeprecationWarning",
)


def inputs(device, batch=2, seq=6, vocab=33, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=generator)
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels[0, 2] = -100
    return logits.to(device), labels.to(device)


def test_inplace_gradient_is_the_logits_buffer(device):
    leaf, labels = inputs(device)
    leaf.requires_grad_()
    logits = leaf * 1.0  # an intermediate, as an LM head's output
    loss = cross_entropy(logits, labels, shift=1, backend="kernel")
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad.data_ptr() == logits.data_ptr() and grad.shape == logits.shape, "the gradient took new memory"
    assert not grad[:, -1].any()
    # What the shift saves: the sliced call's backward builds a fresh, zero-padded (batch, seq, V) gradient.
    logits = leaf * 1.0
    sliced = cross_entropy(logits[:, :-1], labels[:, 1:], backend="kernel")
    (sliced_grad,) = torch.autograd.grad(sliced, logits)
    assert sliced_grad.data_ptr() != logits.data_ptr()
    torch.testing.assert_close(grad, sliced_grad, rtol=0, atol=0)
    torch.testing.assert_close(loss, sliced, rtol=1e-6, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shift", [1, 2, 6, 8])
def test_reference_backend_equals_the_sliced_call(reduction, shift, device):
    logits, labels = inputs(device)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, labels, shift=shift, reduction=reduction, backend="reference", label_smoothing=0.1)
    y = logits.clone().requires_grad_()
    kept = max(labels.shape[-1] - shift, 0)
    sliced = cross_entropy(
        y[:, :kept], labels[:, shift:], reduction=reduction, backend="reference", label_smoothing=0.1
    )
    assert loss.shape == sliced.shape == (() if reduction != "none" else (2, kept))
    torch.testing.assert_close(loss, sliced, rtol=1e-6, atol=1e-7)
    loss.sum().backward()
    sliced.sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-7)


def test_torch_func_grad(device):
    logits, labels = inputs(device)

    def shifted(x):
        return cross_entropy(x, labels, shift=1, backend="kernel", z_loss=1e-3)

    def sliced(x):
        return cross_entropy(x[:, :-1], labels[:, 1:], backend="kernel", z_loss=1e-3)

    got, want = torch.func.grad(shifted)(logits), torch.func.grad(sliced)(logits)
    assert got.shape == logits.shape and not got[:, -1].any()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_module_and_linear(device):
    logits, labels = inputs(device)
    module = CrossEntropyLoss(reduction="none", shift=2, backend="kernel")
    assert "shift=2" in repr(module)
    torch.testing.assert_close(module(logits, labels), cross_entropy(logits, labels, reduction="none", shift=2))
    hidden = torch.randn(2, 6, 8, device=device)
    weight = torch.randn(33, 8, device=device)
    got = linear_cross_entropy(hidden, weight, labels, shift=1, reduction="none", backend="kernel")
    want = linear_cross_entropy(hidden[:, :-1], weight, labels[:, 1:], reduction="none", backend="kernel")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_ignore_index_that_the_labels_cannot_hold_raises(device):
    logits, labels = inputs(device)
    with pytest.raises(ValueError, match="shift pads the labels"):
        cross_entropy(logits, labels.int(), shift=1, ignore_index=2**40)
    labels[labels == -100] = 5  # no label is ignored now
    loss = cross_entropy(logits, labels, shift=1, ignore_index=2**40, reduction="none")  # int64 labels hold it
    torch.testing.assert_close(loss, cross_entropy(logits[:, :-1], labels[:, 1:], reduction="none"))
    assert math.isfinite(loss.sum().item())


class ShiftedHead(SlicedHead):
    """SlicedHead's README example written with shift=1 instead of the slice."""

    def forward(self, hidden, input_ids, n_items=None):
        return cross_entropy(self.proj(hidden), input_ids, n_items=n_items, shift=1, **self.options)


@pytest.mark.parametrize("options", [dict(backend="kernel"), dict(backend="kernel", reduction="none")], ids=str)
def test_compile_dynamic_fullgraph_equals_the_sliced_eager_call(device, options):
    torch.manual_seed(0)
    sliced = SlicedHead(**options).to(device)
    shifted = ShiftedHead(**options).to(device)
    shifted.load_state_dict(sliced.state_dict())
    torch._dynamo.reset()
    backend, graphs = counting_backend()
    compiled = torch.compile(shifted, dynamic=True, fullgraph=True, backend=backend)
    for batch, seq in ((3, 8), (2, 11)):
        generator = torch.Generator().manual_seed(batch * seq)
        hidden = torch.randn(batch, seq, 32, generator=generator).to(device)
        ids = torch.randint(0, VOCAB, (batch, seq), generator=generator).to(device)
        ids[0, :3] = -100
        expected = run(sliced, hidden, ids)
        got = run(compiled, hidden, ids)
        assert got[0].shape == expected[0].shape
        for value, reference in zip(got[:2], expected[:2]):
            torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)
        for name, grad in expected[2].items():
            torch.testing.assert_close(got[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    computing = [gm for gm in graphs if any(node.op == "call_function" for node in gm.graph.nodes)]
    assert len(computing) == 1, f"{len(computing)} graphs: dynamo broke the graph or recompiled"
    torch._dynamo.reset()


def test_dtensor_is_refused(device, monkeypatch):
    """DTensor inputs with shift raise NotImplementedError (a real DTensor: vocab_parallel_check's shift case)."""
    logits, labels = inputs(device)
    api = sys.modules["fastce_torch.losses.cross_entropy.api"]  # where cross_entropy looks the name up
    monkeypatch.setattr(api, "is_dtensor", lambda tensor: tensor is logits)
    with pytest.raises(NotImplementedError, match="shift"):
        cross_entropy(logits, labels, shift=1)


@pytest.mark.gpu
def test_shift_allocates_no_logits_sized_gradient_on_gpu(device):
    batch, seq, vocab = 8, 1025, 32000
    hidden = torch.randn(batch, seq, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    projection = torch.randn(64, vocab, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (batch, seq), device=device)
    cross_entropy(hidden @ projection, labels, shift=1).backward()  # kernel compiles, cuBLAS workspace
    logits_bytes = batch * seq * vocab * 2
    peaks = {}
    for name in ("shift", "slice"):
        hidden.grad = None
        logits = hidden @ projection
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if name == "shift":
            loss = cross_entropy(logits, labels, shift=1)
        else:
            loss = cross_entropy(logits[:, :-1], labels[:, 1:])
        loss.backward(inputs=[hidden])
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - before
        del logits, loss
    # hidden's gradient (1 MiB) and O(N) buffers only; the slice's backward adds a whole zero-filled gradient.
    assert peaks["shift"] < 0.02 * logits_bytes, peaks
    assert peaks["slice"] > 0.9 * logits_bytes, peaks
