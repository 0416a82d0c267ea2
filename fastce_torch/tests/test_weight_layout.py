"""linear_cross_entropy(..., weight_layout="hv"): an (H, V) kernel used as stored, torch's side; and every linear
custom op's fake gradients in the layout of the real ones (a transposed weight's gradient is transposed).

The values are checked in shared_tests/test_weight_layout.py (both packages against the float64 reference); here
what only torch shows: no weight-sized copy anywhere in the forward and backward (every op run is recorded by a
TorchDispatchMode: the one weight-sized tensor made is the gradient, allocated in the kernel's own (H, V) layout and
handed to .grad as it is, same data_ptr, contiguous), the positive control (a transposed copy is seen when there is
one), and the path under torch.compile(fullgraph=True), for linear_cross_entropy and for linear_jsd with a transposed
student weight; the custom ops' fake implementations (core/custom_ops.fake_grads) against their real outputs, strides
included (torch.library.opcheck).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastce_torch
from fastce_torch.core.custom_ops import Needs
from fastce_torch.core.options import Options
from fastce_torch.linear.engine import Chunking
from fastce_torch.losses.jsd.options import JsdOptions

N, H, V = 10, 16, 70


class WeightSized(TorchDispatchMode):
    """Records (op, output data_ptr) of every op whose output is shaped (V, H) or (H, V) (the interpreter's own
    host copies of kernel arguments are flat: not counted)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 2 and sorted(t.shape) == sorted((V, H)):
                self.seen.append((str(func.overloadpacket), t.untyped_storage().data_ptr()))
        return out


def inputs(device, reduction="mean"):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(N, H, generator=gen).to(device).requires_grad_()
    kernel = (torch.randn(H, V, generator=gen) * 0.3).to(device).requires_grad_()  # (H, V), as Flax stores it
    labels = torch.randint(0, V, (N,), generator=gen).to(device)
    labels[::4] = -100
    return hidden, kernel, labels


MAKERS = {"empty_like", "zeros_like", "empty_strided", "empty", "zeros"}  # allocations (the gradient)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_hv_makes_no_weight_sized_copy(reduction, device):
    hidden, kernel, labels = inputs(device)
    with WeightSized() as mode:
        loss = fastce_torch.linear_cross_entropy(
            hidden, kernel, labels, weight_layout="hv", backend="kernel", chunk_rows=4, reduction=reduction
        )
        loss.sum().backward()
    made = [(op, ptr) for op, ptr in mode.seen if op.split(".")[-1] in MAKERS]
    assert len(made) == 1, mode.seen  # the gradient only: no copy of the weight, no re-layout of its gradient
    assert kernel.grad.shape == (H, V) and kernel.grad.is_contiguous()
    assert kernel.grad.untyped_storage().data_ptr() == made[0][1]  # .grad is the buffer the products wrote
    writes = {op for op, _ in mode.seen} - {op for op, _ in made}
    assert not writes & {"aten.clone", "aten.copy_", "aten._to_copy", "aten.contiguous"}, mode.seen


def test_a_transposed_copy_is_seen(device):
    """The control: handing ``kernel.t().contiguous()`` in the default layout copies the weight, and the mode
    sees that copy (so the test above can fail)."""
    hidden, kernel, labels = inputs(device)
    with WeightSized() as mode:
        loss = fastce_torch.linear_cross_entropy(hidden, kernel.t().contiguous(), labels, backend="kernel")
        loss.backward()
    assert any(op in ("aten.clone", "aten.copy_", "aten._to_copy") for op, _ in mode.seen), mode.seen


def test_hv_under_torch_compile(device):
    from fastce_torch.tests.test_compile import ops_in, recording_backend

    hidden, kernel, labels = inputs(device)

    def loss_of(h, k):
        return fastce_torch.linear_cross_entropy(h, k, labels, weight_layout="hv", backend="kernel", chunk_rows=4)

    def run(fn):
        hidden.grad = kernel.grad = None
        loss = fn(hidden, kernel)
        loss.backward()
        return loss.detach(), hidden.grad, kernel.grad

    expected = run(loss_of)
    torch._dynamo.reset()
    backend, graphs = recording_backend()
    got = run(torch.compile(loss_of, fullgraph=True, backend=backend))
    torch._dynamo.reset()
    assert "fastce.linear_cross_entropy_reduced.default" in ops_in(graphs["forward"])
    assert got[2].shape == (H, V) and got[2].is_contiguous()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_weight_layout(device):
    hidden, kernel, labels = inputs(device)
    with pytest.raises(ValueError, match="weight_layout"):
        fastce_torch.linear_cross_entropy(hidden, kernel, labels, weight_layout="VH")
    with pytest.raises(ValueError, match="weight_layout"):  # an (H, V) kernel declared (V, H) ... and vice versa
        fastce_torch.linear_cross_entropy(hidden, kernel.t(), labels, weight_layout="hv")


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate_in_float32", [False, True])
def test_hv_peak_memory_and_values_match_vh_on_cuda(accumulate_in_float32, device):
    """On CUDA (cuBLAS writes the column-major gradient through addmm's operand swap, also with the float32
    accumulator's out_dtype): the same peak memory as the (V, H) layout (a transposed copy of the bf16 weight or of
    its gradient would add 64 MiB) and the same loss and gradients."""
    n, width, vocab = 4096, 1024, 32000
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, width, device=device, dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(vocab, width, device=device, dtype=torch.bfloat16, generator=gen) * 0.03
    labels = torch.randint(0, vocab, (n,), device=device, generator=gen)
    results, peaks = {}, {}
    for layout, w in (("vh", weight), ("hv", weight.t().contiguous())):
        h, w = hidden.clone().requires_grad_(), w.clone().requires_grad_()
        kw = dict(weight_layout=layout, accumulate_in_float32=accumulate_in_float32)
        fastce_torch.linear_cross_entropy(h, w, labels, **kw).backward()  # warm-up (kernels, cuBLAS workspace)
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss = fastce_torch.linear_cross_entropy(h, w, labels, **kw)
        loss.backward()
        torch.cuda.synchronize()
        peaks[layout] = torch.cuda.max_memory_allocated() - start
        results[layout] = (loss.detach(), h.grad, w.grad if layout == "vh" else w.grad.t())
        assert w.grad.is_contiguous() and w.grad.shape == w.shape
    assert peaks["hv"] <= peaks["vh"] + (1 << 20), peaks
    for a, b in zip(results["hv"], results["vh"]):  # cuBLAS may pick other kernels for the transposed problem
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_jsd_transposed_weight_under_torch_compile(reduction, device):
    """linear_jsd with a student weight that is the transposed view of an (H, V) kernel, under
    torch.compile(fullgraph=True): the custom ops' fake gradients must have the layout the chunk loops give the real
    ones (the weight's own, core/custom_ops.fake_grads), or the compiled graph's stride checks fail; the loss and
    gradients are eager's, the weight's gradient (H, V) contiguous as with linear_cross_entropy's weight_layout="hv"."""
    from fastce_torch.tests.test_compile import ops_in, recording_backend

    hidden, kernel, labels = inputs(device)
    teacher_hidden = torch.randn(N, H, generator=torch.Generator().manual_seed(6)).to(device)
    teacher_weight = torch.randn(V, H, generator=torch.Generator().manual_seed(7)).to(device) * 0.3

    def loss_of(h, k):
        loss = fastce_torch.linear_jsd(
            h, k.t(), teacher_hidden, teacher_weight, labels, reduction=reduction, backend="kernel",
            workspace_bytes=4 * V * 8,
        )  # fmt: skip
        return loss.sum()

    def run(fn):
        hidden.grad = kernel.grad = None
        loss = fn(hidden, kernel)
        loss.backward()
        return loss.detach(), hidden.grad, kernel.grad

    expected = run(loss_of)
    torch._dynamo.reset()
    backend, graphs = recording_backend()
    got = run(torch.compile(loss_of, fullgraph=True, backend=backend))
    torch._dynamo.reset()
    op = "reduced" if reduction == "mean" else "forward"
    assert f"fastce.linear_jsd_{op}.default" in ops_in(graphs["forward"])
    assert got[2].shape == (H, V) and got[2].is_contiguous()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def linear_op_calls(device):
    """(op, arguments) of every linear custom op that returns the weight's gradient, with a transposed weight (an
    (H, V) kernel's .t()): linear_cross_entropy's reduced forward and per-token backward, linear_jsd's reduced
    forward and per-row backward (each op's trailing settings: its records' fields, core/custom_ops.op_schema)."""
    hidden, kernel, labels = inputs(device)
    hidden, weight = hidden.detach(), kernel.detach().t()
    teacher = torch.randn(N, H, generator=torch.Generator().manual_seed(6)).to(device)
    needs = Needs(True, True, False)
    chunking = Chunking(workspace_bytes=4 * V * 8, chunk_rows=4)
    ops = torch.ops.fastce
    denominator = (labels != -100).sum().to(torch.float32).reshape(1)
    losses, lse = ops.linear_cross_entropy_forward(hidden, weight, None, labels, *Options(), *chunking, None)
    grad_rows = torch.rand(N, device=device)
    stats = ops.linear_jsd_forward(hidden, weight, None, teacher, weight, None, labels, *JsdOptions(), *chunking)
    return [
        (ops.linear_cross_entropy_reduced, (hidden, weight, None, labels, denominator, *Options(), *chunking, *needs,
                                            None, None)),
        (ops.linear_cross_entropy_backward, (grad_rows, lse, lse, hidden, weight, None, labels, lse, lse, *Options(),
                                             *chunking, *needs, False, False, None)),
        (ops.linear_jsd_reduced, (hidden, weight, None, teacher, weight, None, labels, denominator.reshape(()),
                                  *JsdOptions(), *chunking, *needs)),
        (ops.linear_jsd_backward, (grad_rows, hidden, weight, None, teacher, weight, None, labels, *stats[1:],
                                   *JsdOptions(), *chunking, *needs)),
    ]  # fmt: skip


def test_linear_ops_fake_gradients_have_the_real_layout(device):
    """Each linear op's fake implementation gives the weight's gradient the strides the chunk loop gives the real one
    (the weight's own layout), as torch.library.opcheck's fake-tensor test compares them: a compiled graph plans
    its buffers from the fake ones."""
    for op, args in linear_op_calls(device):
        grad_weight = op(*args)[-2]  # (loss,) grad_hidden, grad_weight, grad_bias
        assert grad_weight.shape == (V, H) and grad_weight.stride() == (1, V), (op, grad_weight.stride())
        torch.library.opcheck(op.default, args, test_utils=("test_faketensor",))
