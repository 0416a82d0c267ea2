"""Probe (temporary): where linear_jsd's time goes above the matmul floor at (8192, 1536, 3584, 151936)."""

import torch
from triton.testing import do_bench

import fastce_torch
from fastce_torch import contract
from fastce_torch.kernels import jsd as K

N, HS, HT, V = 8192, 1536, 3584, 151936
dev, bf = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
hs = torch.randn(N, HS, device=dev, dtype=bf, generator=g)
ht = torch.randn(N, HT, device=dev, dtype=bf, generator=g)
ws = (torch.randn(V, HS, device=dev, dtype=bf, generator=g) * 0.02).requires_grad_()
wt = torch.randn(V, HT, device=dev, dtype=bf, generator=g) * 0.02
labels = torch.randint(0, V, (N,), device=dev, generator=g)
labels[::7] = -100
hs.requires_grad_()


def ms(fn):
    return do_bench(fn, warmup=5, rep=40)


floor = sum(
    ms(lambda a=a, b=b: torch.mm(a, b))
    for a, b in [
        (hs, ws.detach().t()),
        (ht, wt.t()),
        (torch.empty(N, V, device=dev, dtype=bf), ws.detach()),
        (torch.empty(V, N, device=dev, dtype=bf), hs.detach()),
    ]
)
print(f"floor {floor:.2f} ms")
for rows in (384, 768, 1536):
    a = torch.empty(rows, V, device=dev, dtype=bf)
    t = ms(lambda: torch.mm(hs[:rows].detach(), ws.detach().t(), out=a)) * N / rows
    print(f"student logits gemm at {rows} rows, scaled to N: {t:.2f} ms")
for beta in (0.0, 0.5):
    opts = contract.check_jsd_options(
        beta=beta,
        temperature=1.0,
        ignore_index=-100,
        reduction="mean",
        student_softcapping=0.0,
        teacher_softcapping=0.0,
        backend="auto",
    )
    for rows in (384, 1536):
        s = torch.randn(rows, V, device=dev, dtype=bf)
        t = torch.randn(rows, V, device=dev, dtype=bf)
        out = tuple(torch.empty(rows, device=dev) for _ in range(4))
        up = torch.ones((), device=dev)
        try:
            f = ms(lambda: K.jsd_forward(s, t, labels[:rows], opts, out))
            b = ms(lambda: K.jsd_backward(up, s, t, labels[:rows], out[1:], s, opts))
            gb = rows * V * 2 / 1e6
            print(
                f"beta {beta} rows {rows}: fwd {f:.3f} ms ({2 * gb / f:.0f} GB/s), bwd {b:.3f} ms ({3 * gb / b:.0f} GB/s); scaled to N fwd+bwd {(f + b) * N / rows:.2f} ms"
            )
        except Exception as e:  # noqa: BLE001
            print("kernel timing failed", type(e).__name__, e)
    for wsb in (256 << 20, 512 << 20, 1 << 30):

        def step():
            loss = fastce_torch.linear_jsd(hs, ws, ht, wt, labels, beta=beta, workspace_bytes=wsb)
            loss.backward()
            hs.grad = None
            ws.grad = None

        print(f"beta {beta} workspace {wsb >> 20} MiB: {ms(step):.2f} ms")
