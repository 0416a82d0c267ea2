"""bench.tools.linear_chunk_probe's whole-loop schedules (float32; Triton's interpreter on a CPU, the kernels on a GPU
where torch has one): the overlapped loop gives the serial loop's dh and dW bitwise, and both are the gradients of
the chunks' summed mean losses."""

import pytest
import torch

import fastce_torch  # noqa: F401  (before the probe's triton import: selects the interpreter without CUDA)
from bench.tools.linear_chunk_probe import chunk_loops
from fastce_torch import kernels

DEVICE = "cpu" if kernels.INTERPRETED else "cuda"


@pytest.mark.parametrize("n_rows, chunk", [(24, 8), (21, 8)])  # whole chunks, and a short last chunk
def test_overlapped_loop_matches_the_serial_loop_and_the_reference(n_rows, chunk):
    torch.manual_seed(0)
    hidden_size, vocab = 16, 40
    hidden = torch.randn(n_rows, hidden_size, device=DEVICE)
    weight = torch.randn(vocab, hidden_size, device=DEVICE) / hidden_size**0.5
    labels = torch.randint(0, vocab, (n_rows,), device=DEVICE)
    labels[3] = -100
    serial, overlapped, matmuls_only = chunk_loops(hidden, weight, labels, chunk)
    expected = [t.clone() for t in serial()]
    for buffer in overlapped():  # poison what the serial loop wrote: the overlapped loop must write it all again
        buffer.fill_(float("nan"))
    got = overlapped()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss = sum(
        torch.nn.functional.cross_entropy(h64[start : start + chunk] @ w64.t(), labels[start : start + chunk])
        for start in range(0, n_rows, chunk)
    )
    dh, dw = torch.autograd.grad(loss, (h64, w64))
    # TF32 is off by default in torch's matmuls, so the GPU's float32 products keep this tolerance too.
    torch.testing.assert_close(expected[0].double(), dh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(expected[1].double(), dw, rtol=1e-4, atol=1e-5)
    matmuls_only()  # runs (its numbers are not gradients: the logits go into the products unchanged)
