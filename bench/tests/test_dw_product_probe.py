"""bench/tools/dw_product_probe.py's d weight kernel against the float64 product: with and without the previous
gradient (accumulate), with its load before or after the K loop (prefetch), into a float32 or a 16-bit gradient,
V and H not multiples of the blocks, K a multiple of BLOCK_K and not. Without --gpu the kernel runs in Triton's
interpreter with float32 operands (bf16 tl.dot is wrong there); with --gpu on CUDA, bf16 operands as well."""

import importlib
import os
import subprocess
import sys

import pytest
import torch

import fastce_torch  # noqa: F401  (before triton: selects the interpreter without CUDA)
from bench.tools import dw_product_probe as probe
from fastce_torch import kernels
from fastce_torch.tests import checks

DEVICE = "cpu" if kernels.INTERPRETED else "cuda"
OPERAND_DTYPES = [torch.float32] if kernels.INTERPRETED else [torch.float32, torch.bfloat16]

# (V, H, K, config): edges in V and H, K both a multiple of BLOCK_K and not, one tile of H.
CASES = [
    (100, 48, 32, dict(block_m=32, block_n=32, block_k=16)),
    (70, 40, 21, dict(block_m=32, block_n=16, block_k=16)),
    (64, 16, 9, dict(block_m=16, block_n=16, block_k=16)),
]


@pytest.mark.parametrize("v, h, k, config", CASES)
@pytest.mark.parametrize(
    "accumulate, schedule", [(True, "prefetch"), (True, "after"), (True, "persistent"), (False, "after"),
                             (False, "persistent")]
)  # fmt: skip
@pytest.mark.parametrize("operand_dtype", OPERAND_DTYPES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_d_weight_product_matches_float64(v, h, k, config, accumulate, schedule, operand_dtype, grad_dtype):
    generator = torch.Generator().manual_seed(v + h + k)
    dlogits = (torch.randn(k, v, generator=generator) * 0.1).to(DEVICE, operand_dtype)
    hidden = torch.randn(k, h, generator=generator).to(DEVICE, operand_dtype)
    previous = torch.randn(v, h, generator=generator).to(DEVICE, grad_dtype)
    # Without accumulate every element must be written: start from NaN.
    grad = previous.clone() if accumulate else torch.full_like(previous, float("nan"))
    keywords = probe.schedule_keywords(schedule, DEVICE)
    probe.dw_product(dlogits, hidden, grad, accumulate=accumulate, num_warps=4, num_stages=2, **keywords, **config)
    exact = dlogits.double().t() @ hidden.double() + (previous.double() if accumulate else 0.0)
    bound = probe.product_bound(dlogits, hidden) + (previous.float().abs() if accumulate else 0.0) * 2**-24
    assert probe.out_of_bound(grad, exact, bound) == 0
    # The bound is tight enough to see a wrong tile: drop the previous gradient and the check fails.
    if accumulate:
        assert probe.out_of_bound(grad - previous, exact, bound) > 0


def test_rejects_mismatched_shapes_and_strides():
    dlogits = torch.zeros(8, 30, device=DEVICE)
    hidden = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="grad_weight must be"):
        probe.dw_product(dlogits, hidden, torch.zeros(16, 30, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        probe.dw_product(dlogits, hidden, torch.zeros(16, 30, device=DEVICE).t())
    with pytest.raises(ValueError, match="need dlogits"):
        probe.dw_product(dlogits, hidden[:4], torch.zeros(30, 16, device=DEVICE))


def test_parse_shapes():
    assert probe.parse_shapes("128256x4096x1024, 10x20x30") == [(128256, 4096, 1024), (10, 20, 30)]
    with pytest.raises(Exception, match="VxHxK"):
        probe.parse_shapes("1x2")


def test_the_probe_flow_checks_and_times_every_variant(capsys):
    # The GPU mode's body on tiny float32 inputs with a stub timer: every config, gradient dtype and prefetch setting
    # is run, checked against float64 and timed, beside cuBLAS's products.
    configs = probe.parse_configs("16x16x16x4x2,32x16x16x4x2")
    timed = []

    def timer(fn):
        fn()
        timed.append(fn)
        return 2.0

    results, failures = probe.run_probe([(70, 48, 20)], configs, device=DEVICE, dtype=torch.float32, timer=timer)
    (entry,) = results["shapes"]
    assert failures == 0, entry["checks"]
    cublas = 3 if DEVICE == "cuda" else 2
    # float32 operands: one gradient dtype (float32), in every schedule.
    assert len(timed) == cublas + len(probe.SCHEDULES) * len(configs) == len(entry["timings_ms"])
    assert all(check == "0 elements beyond the bound" for check in entry["checks"].values()), entry["checks"]
    out = capsys.readouterr().out
    assert "32x16x16 w4 s2 C float32 prefetch" in out and "16x16x16 w4 s2 C float32 persistent" in out
    assert {v["schedule"] for v in entry["variants"]} == set(probe.SCHEDULES)


@pytest.mark.skipif(DEVICE == "cuda", reason="the refusal without CUDA")
def test_gpu_mode_needs_cuda():
    with pytest.raises(SystemExit, match="CUDA"):
        probe.main(["--shapes", "8x8x8"])


def test_compiles_for_h200_without_spills():
    """The real compiler (sm_90, no GPU needed) accepts the kernel for bf16 and float32 gradients in every schedule
    (the persistent one's flattened loop included), with wgmma and no register spills at a two-blocks-per-SM config:
    what the interpreter cannot check."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    command = [sys.executable, "-m", "bench.tools.dw_product_probe", "--compile-only", "--configs", "128x128x64x8x3"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 * len(probe.SCHEDULES), lines
    assert all("'wgmma': 4" in line and "'spill_stores': 0" in line for line in lines), lines


def test_the_patched_fused_loss_gives_the_package_gradients():
    # triton_d_weight swaps only the d weight product of fastce_torch's chunk loop (first chunk written, later chunks
    # added, a short last chunk) and puts the package's function back afterwards.
    package = importlib.import_module("fastce_torch.linear.chunks")
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(30, 24, generator=generator).to(DEVICE).requires_grad_()
    weight = (torch.randn(70, 24, generator=generator) * 0.2).to(DEVICE).requires_grad_()
    labels = torch.randint(0, 70, (30,), generator=generator).to(DEVICE)
    labels[::5] = -100
    original = package.accumulate_grads

    def gradients():
        loss = fastce_torch.linear_cross_entropy(hidden, weight, labels, backend="kernel", chunk_rows=8)
        return torch.autograd.grad(loss, (hidden, weight))

    expected = gradients()
    # The gradient buffers start as NaN: a first chunk that read its uninitialised output would show.
    # BLOCK_K 16 (tl.dot's least on a GPU) over chunks of 8 rows and a last chunk of 6: the masked K loop.
    config = dict(block_m=32, block_n=16, block_k=16, num_warps=4, num_stages=2)
    for schedule in probe.SCHEDULES:
        with checks.poisoned_allocations(), probe.triton_d_weight(config, schedule):
            assert package.accumulate_grads is not original
            got = gradients()
        assert package.accumulate_grads is original
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)  # d hidden: the package's own products
        torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)


def test_the_loop_flow_times_and_checks_both_settings(capsys):
    from bench.linear_shapes import LinearShape

    timed = []

    def timer(fn):
        fn()
        timed.append(fn)
        return 3.0

    shape = LinearShape(40, 16, 60, "float32")
    best = {(60, 16, 16, "float32"): dict(config=dict(block_m=32, block_n=16, block_k=16), schedule="persistent", ms=1)}
    rows, failures = probe.run_loop([shape], best, timer, device=DEVICE, backend="kernel", chunk_rows=16)
    assert failures == 0, rows
    assert [r["settings"] for r in rows] == ["default", "accumulate_in_float32"] and len(timed) == 4
    assert rows[0]["config"] == dict(block_m=32, block_n=16, block_k=16) and rows[0]["chunk_rows"] == 16
    assert all(r["triton_dw_error"] < 1e-5 for r in rows), rows
    assert "Triton d weight" in capsys.readouterr().out
