"""bench/tools/gemm_ce_probe.py's GEMM + CE-epilogue kernel against torch: the stored logits against torch.matmul,
the per-row lse and loss against fastce_torch's reference cross-entropy over those logits. Without --gpu the kernels
run in Triton's interpreter with float32 operands (bf16 tl.dot is wrong there); with --gpu the same cases run on
CUDA, plus a bf16 case against fastce's CE forward kernel."""

import os
import subprocess
import sys

import pytest
import torch

import fastce_torch
from bench.tools import gemm_ce_probe
from fastce_torch import kernels
from shared_tests import tolerances

DEVICE = "cpu" if kernels.INTERPRETED else "cuda"

# (M, K, V, config): M and V not multiples of the blocks, K both a multiple of BLOCK_K and not, one V of exactly one
# tile, more row tiles than a group (GROUP_M = 8) with a partial last group.
CASES = [
    (37, 48, 300, dict(block_m=16, block_n=64, block_k=16)),
    (20, 40, 130, dict(block_m=16, block_n=32, block_k=16)),
    (9, 32, 64, dict(block_m=16, block_n=64, block_k=32)),
    (150, 16, 100, dict(block_m=16, block_n=32, block_k=16)),
]


@pytest.fixture
def nan_buffers(monkeypatch):
    """Buffers the probe allocates with torch.empty / empty_like start as NaN (integers as a huge negative), so an
    element the kernels forget to write shows up instead of a lucky zero."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(out):
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2**30))

    monkeypatch.setattr(gemm_ce_probe.torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(gemm_ce_probe.torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def make_inputs(m, k, v, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=generator)
    b = torch.randn(v, k, generator=generator) * 0.5
    labels = torch.randint(0, v, (m,), generator=generator)
    labels[torch.rand(m, generator=generator) < 0.25] = -100
    labels[0], labels[1], labels[2], labels[-1] = v - 1, 0, -100, v - 2  # last (partial) tile, first, ignored
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), labels.to(DEVICE)


def product_atol(a, b):
    # Two float32 dot products of length K, each within K eps32 sum_k |a_k b_k| of the exact value.
    k = a.shape[1]
    return 2 * k * tolerances.EPS32 * float((a.abs() @ b.abs().t()).max())


@pytest.mark.parametrize("m, k, v, config", CASES)
def test_logits_lse_and_loss_match_torch(m, k, v, config, nan_buffers):
    a, b, labels = make_inputs(m, k, v, seed=m + v)
    logits, lse, loss = gemm_ce_probe.linear_ce_chunk(a, b, labels, num_warps=4, num_stages=2, **config)
    torch.testing.assert_close(logits, torch.matmul(a, b.t()), rtol=0.0, atol=product_atol(a, b))
    # The epilogue's statistics are those of the stored logits: compare with a CE over exactly them.
    expected = fastce_torch.cross_entropy(logits, labels, reduction="none", backend="reference", return_lse=True)
    atol = gemm_ce_probe.loss_bound(logits, expected.lse)
    assert atol > 0
    torch.testing.assert_close(lse, expected.lse, rtol=0.0, atol=atol)
    torch.testing.assert_close(loss, expected.loss, rtol=0.0, atol=atol)
    assert bool((loss[labels == -100] == 0).all()) and bool(torch.isinf(lse[labels == -100]).all())


def test_strided_operands(nan_buffers):
    # a: rows of a wider buffer (row stride > K); b: a transposed (K, V) buffer, copied to K-contiguous rows.
    a_wide, b, labels = make_inputs(21, 40, 75, seed=9)
    a = a_wide[:, :24]
    b_kv = b[:, :24].t().contiguous()
    logits, lse, loss = gemm_ce_probe.linear_ce_chunk(
        a, b_kv.t(), labels, block_m=16, block_n=32, block_k=16, num_warps=4
    )
    b = b_kv.t()
    torch.testing.assert_close(logits, torch.matmul(a, b.t()), rtol=0.0, atol=product_atol(a, b))
    expected = fastce_torch.cross_entropy(logits, labels, reduction="none", backend="reference", return_lse=True)
    atol = gemm_ce_probe.loss_bound(logits, expected.lse)
    torch.testing.assert_close(loss, expected.loss, rtol=0.0, atol=atol)
    torch.testing.assert_close(lse, expected.lse, rtol=0.0, atol=atol)


def test_partials_without_the_epilogue_are_not_written(nan_buffers):
    # with_ce=False is the GEMM alone (the probe's timing baseline): same logits, partials untouched.
    a, b, labels = make_inputs(20, 32, 90, seed=3)
    c, part_max, part_sum, z_label = gemm_ce_probe.gemm_ce(a, b, labels, 16, 32, 16, 4, 2, with_ce=False)
    torch.testing.assert_close(c, torch.matmul(a, b.t()), rtol=0.0, atol=product_atol(a, b))
    assert part_max.shape == (20, 3) and bool(torch.isnan(part_max).all()) and bool(torch.isnan(z_label).all())


def test_labels_outside_the_vocabulary_give_nan():
    a, b, labels = make_inputs(12, 16, 70, seed=5)
    labels[4], labels[7] = 70, -3
    _, lse, loss = gemm_ce_probe.linear_ce_chunk(a, b, labels, block_m=16, block_n=32, block_k=16, num_warps=4)
    assert bool(torch.isnan(loss[[4, 7]]).all())
    kept = torch.ones(12, dtype=torch.bool, device=DEVICE)
    kept[[4, 7]] = False
    assert not bool(torch.isnan(loss[kept]).any()) and not bool(torch.isnan(lse).any())


def test_a_nan_logit_does_not_pass():
    # A NaN operand must reach the loss as NaN (and assert_close must then refuse it).
    a, b, labels = make_inputs(10, 16, 40, seed=7)
    a[3, 5] = float("nan")
    labels[3] = 1
    _, _, loss = gemm_ce_probe.linear_ce_chunk(a, b, labels, block_m=16, block_n=32, block_k=16, num_warps=4)
    assert bool(torch.isnan(loss[3]))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(loss, torch.where(torch.isnan(loss), 0.0, loss))


def test_bad_operands_are_refused():
    a, b, labels = make_inputs(8, 16, 40, seed=1)
    with pytest.raises(ValueError, match="a \\(M, K\\) and b \\(V, K\\)"):
        gemm_ce_probe.gemm_ce(a, b[:, :8], labels)
    with pytest.raises(ValueError, match="share one of"):
        gemm_ce_probe.gemm_ce(a, b.double(), labels)
    with pytest.raises(ValueError, match="labels must be"):
        gemm_ce_probe.gemm_ce(a, b, labels[:4])


def test_the_logits_bound_allows_one_ulp_of_rounding_not_two():
    ref = torch.tensor([[1.0, -3.0, 0.0078125, 100.0]], dtype=torch.bfloat16)
    ulp = torch.tensor([[2.0**-7, 2.0**-6, 2.0**-14, 0.5]])
    zero = torch.zeros(1, 4)
    assert gemm_ce_probe.logits_out_of_bound((ref.float() + ulp).bfloat16(), ref, zero) == 0
    assert gemm_ce_probe.logits_out_of_bound((ref.float() + 2 * ulp).bfloat16(), ref, zero) == 4
    assert gemm_ce_probe.logits_out_of_bound((ref.float() + 2 * ulp).bfloat16(), ref, ulp) == 0
    nan = ref.clone()
    nan[0, 1] = float("nan")
    assert gemm_ce_probe.logits_out_of_bound(nan, ref, zero) == 1  # NaN is never within the bound


def test_arguments_parse():
    args = gemm_ce_probe.parse_args([])
    assert args.shape == (1024, 4096, 128256)
    assert {gemm_ce_probe.config_name(c) for c in args.configs} >= {"128x256x64 w8 s3", "256x128x64 w8 s4"}
    args = gemm_ce_probe.parse_args(["--shape", "2048x2304x256000", "--configs", "128x128x64x8x3"])
    assert args.shape == (2048, 2304, 256000)
    assert args.configs == [dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)]
    for bad in (["--shape", "1024x4096"], ["--configs", "128x96x64x8x3"], ["--configs", "128x128x64x8"]):
        with pytest.raises(SystemExit):
            gemm_ce_probe.parse_args(bad)


def test_the_probe_flow_checks_and_times_every_config(capsys):
    # The GPU mode's body on tiny float32 inputs with a stub timer: each config is run, checked and timed.
    configs = gemm_ce_probe.parse_configs("16x32x16x4x2,16x64x16x4x2")
    timed = []

    def timer(fn):
        fn()
        timed.append(fn)
        return 2.0

    results, failures = gemm_ce_probe.run_probe(
        (24, 32, 100), configs, ignored=0.3, device=DEVICE, dtype=torch.float32, timer=timer
    )
    assert failures == 0, results["checks"]
    assert len(timed) == 3 + 3 * len(configs) and len(results["timings_ms"]) == len(timed)
    for name in ("16x32x16 w4 s2", "16x64x16 w4 s2"):
        checks = results["checks"][name]
        assert len(checks) == 3 and not any("MISMATCH" in c for c in checks), checks
    out = capsys.readouterr().out
    assert "(b) 16x64x16 w4 s2: GEMM + CE epilogue + combine" in out and "best 16x32x16 w4 s2" in out


@pytest.mark.skipif(DEVICE == "cuda", reason="the refusal without CUDA")
def test_gpu_mode_needs_cuda():
    with pytest.raises(SystemExit, match="CUDA"):
        gemm_ce_probe.main(["--shape", "8x8x8"])


def test_compiles_for_h200_without_spills():
    """The real compiler (sm_90, no GPU needed) accepts the kernel, with and without the epilogue, and ptxas reports
    no register spills for a config of the GPU mode: what the interpreter cannot check."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    command = [sys.executable, "-m", "bench.tools.gemm_ce_probe", "--compile-only", "--configs", "128x128x64x8x3"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("'wgmma': 4" in line and "'spill_stores': 0" in line for line in lines), lines


@pytest.mark.gpu
def test_bf16_on_the_gpu_matches_fastce_forward():
    a, b, labels = make_inputs(300, 256, 5000, seed=11, dtype=torch.bfloat16)
    for config in gemm_ce_probe.parse_configs("128x128x64x8x3,64x128x64x4x3"):
        logits, lse, loss = gemm_ce_probe.linear_ce_chunk(a, b, labels, **config)
        ref = torch.matmul(a, b.t())
        assert gemm_ce_probe.logits_out_of_bound(logits, ref, gemm_ce_probe.sum_bound(a, b)) == 0
        own_loss, own_lse, _ = kernels.forward(logits, labels, kernels.Options(), reduction="none")
        atol = gemm_ce_probe.loss_bound(logits, own_lse)
        torch.testing.assert_close(lse, own_lse, rtol=0.0, atol=atol)
        torch.testing.assert_close(loss, own_loss, rtol=0.0, atol=atol)
