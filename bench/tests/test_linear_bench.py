"""CPU test of `python -m bench --linear`'s orchestration: tiny shapes, the CUDA timers stubbed, the fastce
implementations real (on CPU tensors they run fastce's torch reference), the correctness check and the table."""

import inspect

import pytest

import fastce_torch
from bench import linear, linear_shapes, report, torch_measure
from bench.linear_shapes import LinearShape, parse_linear_shapes

# The _f32acc / _1GiB rows pass their settings as keywords of linear_cross_entropy; a package without them runs
# the default rows only.
KEYWORDS = set(inspect.signature(fastce_torch.linear_cross_entropy).parameters)


def runnable(impls):
    settings = {f"fastce_torch_linear{suffix}": s for suffix, s in linear_shapes.FASTCE_SETTINGS.items()}
    return [i for i in impls if set(settings.get(i, {})) <= KEYWORDS]


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(linear, "DEVICE", "cpu")
    monkeypatch.setattr(torch_measure, "bench_ms", lambda fn, warmup, rep: (fn(), 2.0)[1])
    monkeypatch.setattr(torch_measure, "peak_extra_bytes", lambda fn: (fn(), 3 << 20)[1])
    monkeypatch.setattr(linear, "PEAK_MATMUL", (32, 16, 24))  # bench_ms stubbed at 2 ms


def test_run_linear_quick_on_tiny_shapes(on_cpu):
    shape = LinearShape(64, 16, 300, "float32")
    impls = runnable(["fastce_torch_linear", "fastce_torch_linear_1GiB", "matmul+fastce_torch"])
    result = linear.run_linear(quick=True, shapes=(shape,), impls=impls)
    assert {r["impl"] for r in result["rows"]} == set(impls)
    for row in result["rows"]:
        assert row["fwdbwd_ms"] == 2.0
        assert row["effective_TFLOPs"] == pytest.approx(6 * 64 * 16 * 300 / 2e-3 / 1e12)
        assert row["extra_beyond_grads_bytes"] == (3 << 20) - (64 * 16 + 300 * 16) * 2
    losses = {r["loss"] for r in result["rows"]}
    assert max(losses) - min(losses) < 1e-5  # the same loss from both
    assert result["check"]["ok"] and result["check"]["loss_rel"] < 1e-5
    peak = 2 * 32 * 16 * 24 / 2e-3 / 1e12
    assert result["peak_matmul"] == {"shape": [32, 16, 24], "TFLOPs": pytest.approx(peak)}
    for row in result["rows"]:
        assert row["of_peak"] == pytest.approx(row["effective_TFLOPs"] / peak)
    table = report.linear_table(result)
    assert "fastce_torch_linear" in table and "of matmul" in table and "of peak" in table


def test_accuracy_columns_against_float32(on_cpu):
    """Every row has its gradients' rms error relative to a float32 computation: on float32 inputs (CPU: torch's
    float32 matmuls either way) tiny; on bf16 inputs of bf16 size, and the f32acc setting never worse by much."""
    impls = runnable(["fastce_torch_linear", "fastce_torch_linear_f32acc", "matmul+fastce_torch", "torch_linear_ce"])
    shape32 = LinearShape(64, 16, 300, "float32")
    shape16 = LinearShape(64, 32, 300, "bfloat16")
    result = linear.run_linear(impls=impls, shapes=(shape32, shape16), with_jax=False)
    names = {r["impl"] for r in result["rows"]}
    import torch.nn.functional as F

    if hasattr(F, "linear_cross_entropy"):
        assert "torch_linear_ce" in names and "note" not in result
    else:
        assert "no torch_linear_ce row" in result["note"]
    assert names >= set(impls) - {"torch_linear_ce"}
    for row in result["rows"]:
        errors = (row["grad_weight_rel_rms"], row["grad_hidden_rel_rms"])
        if row["dtype"] == "float32":
            assert max(errors) < 1e-5, row
        else:
            assert 1e-5 < max(errors) < 2e-2, row  # bf16 rounding shows, a wrong formula would be ~1
    table = report.linear_table(result)
    assert "dW rel rms err" in table and "e-0" in table


def test_parse_linear_shapes():
    assert parse_linear_shapes("4096x4096x128256, 8x4x10:float32") == (
        LinearShape(4096, 4096, 128256),
        LinearShape(8, 4, 10, "float32"),
    )
    assert LinearShape(8192, 3584, 152064) in linear_shapes.LINEAR_SHAPES
    assert LinearShape(4096, 4096, 128256) in linear_shapes.LINEAR_SHAPES
    with pytest.raises(ValueError, match="NxHxV"):
        parse_linear_shapes("8192x4096")


def test_optional_implementations_are_reported_not_fatal(on_cpu):
    shape = LinearShape(32, 8, 50, "float32")
    result = linear.run_linear(quick=False, impls=["fastce_torch_linear", "liger_flce"], shapes=(shape,))
    assert [r["impl"] for r in result["rows"]] == ["fastce_torch_linear"]
    failures = result.get("failures", [])
    assert all(f["impl"] == "liger_flce" for f in failures)


def test_a_failed_measurement_is_recorded(on_cpu, monkeypatch):
    """An implementation that raises while measured (an OOM on the GPU) is a failure record with its shape as text,
    the other rows kept (the path a GPU run takes for Liger's kernels on CPU tensors)."""

    def out_of_memory(hidden, weight, labels):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setitem(linear.LOADERS, "out_of_memory", lambda: out_of_memory)
    shape = LinearShape(32, 8, 50, "float32")
    result = linear.run_linear(impls=["fastce_torch_linear", "out_of_memory"], shapes=(shape,), with_jax=False)
    assert [r["impl"] for r in result["rows"]] == ["fastce_torch_linear"]
    assert result["failures"] == [
        {"impl": "out_of_memory", "stage": "measure", "error": "RuntimeError: CUDA out of memory", "shape": str(shape)}
    ]


def test_jax_rows_join_the_table(on_cpu, monkeypatch):
    """bench.jax_linear's rows (stubbed here: its own CPU plumbing test runs the real thing) land in the table with
    the throughput columns against the torch matmul of the same run and XLA's temp size as their memory."""
    from bench import jax_linear, jax_measure

    shape = LinearShape(32, 8, 50, "float32")

    def fake_run(shapes, say):
        (s,) = shapes
        base = {"N": s.N, "H": s.H, "V": s.V, "dtype": s.dtype}
        return {
            "rows": [
                {
                    "impl": "jax_three_matmuls",
                    **base,
                    "fwdbwd_ms": 1.0,
                    "peak_extra_bytes": 0,
                    "extra_beyond_grads_bytes": 0,
                },
                {
                    "impl": "fastce_jax_linear",
                    **base,
                    "fwdbwd_ms": 2.0,
                    "peak_extra_bytes": 5 << 20,
                    "extra_beyond_grads_bytes": 5 << 20,
                    "peak_extra_kind": "xla_temp_size",
                    "loss": 1.0,
                },
            ],
            "failures": [],
        }

    monkeypatch.setattr(jax_linear, "run", fake_run)
    monkeypatch.setattr(jax_measure, "has_gpu", lambda: True)
    monkeypatch.setattr(linear, "matmul_tflops", lambda shape: 12.0)
    result = linear.run_linear(impls=["fastce_torch_linear"], shapes=(shape,), with_jax=True)
    jax_row = next(r for r in result["rows"] if r["impl"] == "fastce_jax_linear")
    assert jax_row["effective_TFLOPs"] == pytest.approx(6 * 32 * 8 * 50 / 2e-3 / 1e12)
    assert jax_row["of_matmul"] == pytest.approx(jax_row["effective_TFLOPs"] / 12.0)
    assert jax_row["extra_beyond_grads_bytes"] == 5 << 20
    assert "jax_three_matmuls" in {r["impl"] for r in result["rows"]}
    assert "(temp)" in report.linear_table(result)


def test_ignored_fractions_are_rows(on_cpu):
    """--ignored: each shape at each fraction (the first part of every sequence ignored), fastce with and without
    skip_ignored_rows; both give the same loss at each fraction."""
    from bench import __main__ as cli

    impls = runnable(["fastce_torch_linear", "fastce_torch_linear_skip"])
    shape = LinearShape(40, 16, 300, "float32")
    result = linear.run_linear(impls=impls, shapes=(shape,), with_jax=False, ignored=(0.0, 0.5, 0.9))
    rows = {(r["impl"], r["ignored"]): r for r in result["rows"]}
    assert set(rows) == {(impl, f) for impl in impls for f in (0.0, 0.5, 0.9)}
    for f in (0.0, 0.5, 0.9):
        losses = [rows[impl, f]["loss"] for impl in impls]
        assert max(losses) - min(losses) < 1e-6 and all(loss > 0 for loss in losses)
    assert "| 90% |" in report.linear_table(result)
    assert linear_shapes.ignored_rows(LinearShape(4096, 8, 8, ignored=0.9)).reshape(4, 1024)[:, :922].all()
    assert linear_shapes.ignored_rows(LinearShape(14, 8, 8)).nonzero()[0].tolist() == [0, 7]
    assert cli.parse_args(["--linear", "--ignored"]).ignored == (0.0, 0.5, 0.9)
    assert cli.parse_args(["--linear", "--ignored", "0.25"]).ignored == (0.25,)
    with pytest.raises(ValueError, match="--ignored"):
        linear_shapes.parse_ignored("1.0")
