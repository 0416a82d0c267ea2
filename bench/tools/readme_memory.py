"""The README's shifted-labels examples, measured: `PYTHONPATH=. python -m bench.tools.readme_memory [--json PATH]`.

Slice, shift=1 and padded labels: per form the loss (checked equal), the peak extra memory of forward + backward and
whether the logits' gradient is their own buffer. On the CPU (Triton's interpreter) pass a tiny --shape.
"""

import argparse
import math

import torch

import fastce_torch  # noqa: F401  (before triton: chooses Triton's interpreter on a CPU machine)
from fastce_torch import cross_entropy

from .. import torch_measure
from ..progress import aligned
from ..report import write_json

HIDDEN = 64
FORMS = ("slice", "shift", "padded labels")


def parse_shape(text):
    batch, seq, vocab = (int(part) for part in text.lower().split("x"))
    return batch, seq, vocab


def loss_of(form, logits, input_ids):
    if form == "slice":
        return cross_entropy(logits[:, :-1], input_ids[:, 1:], backend="kernel")
    if form == "shift":
        return cross_entropy(logits, input_ids, shift=1, backend="kernel")
    labels = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-100)
    return cross_entropy(logits, labels, backend="kernel")


def measure(form, hidden, projection, input_ids):
    """(loss, hidden's gradient, peak extra bytes or None, whether the logits' gradient is their buffer)."""
    hidden.grad = None
    logits = hidden @ projection  # an intermediate, as lm_head's output: the in-place backward may use its buffer
    seen = {}
    logits.register_hook(lambda grad: seen.update(same=grad.data_ptr() == logits.data_ptr()))

    def forward_backward():
        seen["loss"] = loss_of(form, logits, input_ids)
        seen["loss"].backward(inputs=[hidden])

    peak = torch_measure.peak_extra_bytes(forward_backward) if hidden.is_cuda else forward_backward()
    return seen["loss"].detach(), hidden.grad.detach().clone(), peak, seen["same"]


def run(shape, device, dtype, seed=0):
    batch, seq, vocab = shape
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, HIDDEN, generator=generator).to(device, dtype).requires_grad_()
    projection = (torch.randn(HIDDEN, vocab, generator=generator) / HIDDEN**0.5).to(device, dtype)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    input_ids[0, : seq // 4] = -100  # some ignored tokens, as a padded batch has
    measure("shift", hidden, projection, input_ids)  # warm-up: kernel compiles, cuBLAS workspace
    rows = []
    for form in FORMS:
        loss, grad, peak, same = measure(form, hidden, projection, input_ids)
        rows.append(dict(form=form, loss=float(loss), peak_extra_bytes=peak, grad_in_logits_buffer=same, grad=grad))
    for row in rows[1:]:
        if not math.isclose(row["loss"], rows[0]["loss"], rel_tol=1e-5, abs_tol=1e-6):
            raise AssertionError(f"{row['form']} loss {row['loss']} != slice loss {rows[0]['loss']}")
        torch.testing.assert_close(row["grad"], rows[0]["grad"], rtol=1e-2, atol=1e-5, msg=row["form"])
    for row in rows:
        del row["grad"]
    return dict(device=torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu",
                torch=torch.__version__, shape=dict(batch=batch, seq=seq, vocab=vocab),
                dtype=str(dtype).removeprefix("torch."), rows=rows,
                logits_bytes=batch * seq * vocab * torch.finfo(dtype).bits // 8)  # fmt: skip


def table(result):
    shape = result["shape"]
    rows = [("form", "loss", "peak extra", "gradient in the logits' buffer")]
    for row in result["rows"]:
        peak = "n/a" if row["peak_extra_bytes"] is None else f"{row['peak_extra_bytes'] / 2**20:.1f} MiB"
        rows.append((row["form"], f"{row['loss']:.6f}", peak, "yes" if row["grad_in_logits_buffer"] else "no"))
    caption = f"{shape['batch']}x{shape['seq']}x{shape['vocab']} {result['dtype']} on {result['device']}"
    return f"{caption} (logits {result['logits_bytes'] / 2**20:.0f} MiB)\n" + aligned(rows, rule=False)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, default=(8, 1025, 32000), help="BATCHxSEQxVOCAB")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    result = run(args.shape, args.device, getattr(torch, args.dtype))
    print(table(result))
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
