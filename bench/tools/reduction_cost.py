"""What the in-kernel "mean" costs the forward: `PYTHONPATH=. python -m bench.tools.reduction_cost [TAG]`.

Times fastce_torch's forward launch alone (do_bench medians, best of two) with reduction "none" and "mean" on the
benchmark's shapes, after checking the reduced loss against F.cross_entropy. TAG labels the printed lines, e.g.
to compare two checkouts run with different PYTHONPATHs.
"""

import sys

import torch
import triton.testing

from fastce_torch import kernels

SHAPES = [(8192, 32000), (8192, 128256), (512, 256000), (8192, 256000)]
OPTIONS = kernels.Options()


def forward_us(logits, labels, reduction):
    return 1e3 * min(
        triton.testing.do_bench(
            lambda: kernels.forward(logits, labels, OPTIONS, reduction=reduction),
            warmup=50,
            rep=300,
            return_mode="median",
        )
        for _ in range(2)
    )


def main():
    tag = sys.argv[1] if len(sys.argv) > 1 else "fastce_torch"
    for n_rows, vocab in SHAPES:
        logits = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16)
        labels = torch.randint(0, vocab, (n_rows,), device="cuda")
        labels[::7] = -100
        expected = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100)
        got = kernels.forward(logits, labels, OPTIONS, reduction="mean")[0]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        print(
            f"{tag} N={n_rows} V={vocab}: none {forward_us(logits, labels, 'none'):.1f} us, "
            f"mean {forward_us(logits, labels, 'mean'):.1f} us"
        )


if __name__ == "__main__":
    main()
