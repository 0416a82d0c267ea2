"""bench.tools.distill_step on a CPU: a tiny float32 shape through every row, the kernels interpreted
(backend="kernel"), the GPU timers stubbed as in test_rl_step, torch.compile standing in for itself (the GPU run
compiles), Liger made missing (the failure path of a peer that does not import). Skipped until issue 38's linear_jsd
is in both packages."""

import sys

import pytest

from bench import jax_setup

jax_setup.configure(interpret_only=True)

import torch  # noqa: E402

import fastce_jax  # noqa: E402
import fastce_torch  # noqa: E402
from bench import jax_measure, linear, report, torch_measure  # noqa: E402
from bench.tools import distill_step  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
    pytest.mark.skipif(
        not (hasattr(fastce_torch, "linear_jsd") and hasattr(fastce_jax, "linear_jsd")),
        reason="linear_jsd (issue 38) is not in both packages yet",
    ),
    pytest.mark.skipif(
        not fastce_torch.core.launch.INTERPRETED, reason="the kernels on CPU tensors need TRITON_INTERPRET=1"
    ),
]


def test_every_row_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(linear, "DEVICE", "cpu")
    monkeypatch.setattr(torch_measure, "bench_ms", lambda fn, warmup, rep: (fn(), 2.0)[1])
    monkeypatch.setattr(torch_measure, "peak_extra_bytes", lambda fn: (fn(), 3 << 20)[1])
    monkeypatch.setattr(jax_measure, "bench_ms", lambda call, batch_target_ms=50.0: (call(), 4.0)[1])
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as if not installed
    # A mixture beta at T = 1 (every row) and reverse KL at T = 2 (the rows timed at any temperature); errors over
    # the first 5 of the 8 rows (row 0 ignored). 8 rows: the interpreted kernels run a program per row.
    monkeypatch.setattr(distill_step, "CONFIGS", ((0.3, 1.0), (1.0, 2.0)))
    monkeypatch.setattr(distill_step, "ERROR_ROWS", 5)
    shape = distill_step.DistillShape(8, 8, 12, 40, "float32")
    result = distill_step.run((shape,), backend="kernel")

    assert [(f["impl"], f["stage"]) for f in result["failures"]] == [("liger_jsd", "unavailable")] * 2
    rows = {(r["impl"], r.get("beta"), r.get("temperature")): r for r in result["rows"]}
    suffixes = ("448mib", "f32logits", "skip", "448mib_skip")
    variants = (f"fastce_{f}_{v}" for f in ("torch", "jax") for v in suffixes)
    every = ("fastce_torch", "trl_eager", "trl_compile", "fastce_jax", "xla_jsd", *variants)
    any_temperature = ("fastce_torch", "trl_eager", "fastce_jax")
    floors = {(name, None, None) for name in ("matmul_floor", "matmul_floor_kept", "matmul_chunked")}
    floors |= {("matmul_chunked_448mib", None, None)}
    assert set(rows) == floors | {(i, 0.3, 1.0) for i in every} | {(i, 1.0, 2.0) for i in any_temperature}
    assert rows["matmul_floor", None, None]["fwdbwd_ms"] == 8.0  # four products, 2.0 each (stubbed)
    assert rows["matmul_floor", None, None]["product_rows"] == 8
    assert rows["matmul_floor_kept", None, None]["product_rows"] == 6  # rows 0 and 7 ignored
    assert rows["matmul_chunked", None, None]["over_floor"] == 0.25  # one timed loop of chunks (stubbed)
    assert rows["matmul_chunked", None, None]["chunk_rows"] == 8  # the tiny shape fits one chunk
    assert rows["fastce_torch", 0.3, 1.0]["over_floor"] == 0.25
    # float32 inputs: every row's loss and the student's gradients within float32 rounding of float64.
    for (impl, beta, t), row in rows.items():
        if not impl.startswith("matmul_") and impl != "trl_compile":
            assert row["loss_error"] < 1e-6 and row["grad_hidden_rel_rms"] < 1e-5, (impl, beta, t)
            assert row["grad_weight_rel_rms"] < 1e-5, (impl, beta, t)
            assert abs(row["loss"] - rows["trl_eager", beta, t]["loss"]) < 1e-5, (impl, beta, t)
    # The RESULTS.md section: the newest distill JSON, the table and the target lines.
    report.write_json(result, tmp_path / "2026-12-04-h200-distill-a-0000000.json")
    (found,) = report.newest_runs("*-distill-*.json", tmp_path)
    text = report.distill_markdown(report.read_json(found), found.name)
    assert "| fastce_torch | 0.3 | 1.0 | 8 | 8 | 12 | 40 |" in text
    assert "- 8x8x12x40, beta 1.0, T 2.0: fastce_torch / trl_eager 1.00x (target < 1x)" in text
    assert "; fastce_jax_448mib_skip / matmul_floor_kept 0.50x (target <= 1.2x);" in text  # 4.0 ms (stubbed) / 8.0
    assert text.count("- not measured: liger_jsd") == 1  # the same failure at each (beta, T), listed once
