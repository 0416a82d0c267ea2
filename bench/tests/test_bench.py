"""CPU tests of the benchmark's own logic: shapes, floors, the GPU run's orchestration (with the CUDA-only
timers stubbed, the implementations real), the JSON schema and RESULTS.md. Run: pytest bench/tests"""

import json

import pytest

from bench import jax_setup

jax_setup.configure(interpret_only=True)

from bench import report, runner, shapes  # noqa: E402
from bench.shapes import Shape  # noqa: E402

TOP_KEYS = {"device", "date", "commit", "versions", "copy_bandwidth_TBps", "rows"}
ROW_KEYS = {"impl", "N", "V", "dtype", "fwd_ms", "fwdbwd_ms", "peak_extra_bytes"}


def test_parse_shapes():
    assert shapes.parse_shapes("8192x32000, 512x256000:fp32") == (Shape(8192, 32000), Shape(512, 256000, "float32"))
    with pytest.raises(ValueError):
        shapes.parse_shapes("8192by32000")


def test_floors_match_the_anchor_numbers():
    # h200-2026-11-30.md: at 4.27 TB/s, N=8192 bf16 V=32000: 0.123 / 0.246 / 0.369 ms.
    row = report.add_ratios({"N": 8192, "V": 32000, "dtype": "bfloat16", "fwd_ms": 0.246, "fwdbwd_ms": 0.738}, 4.27)
    assert report.floor_ms(row, 1, 4.27) == pytest.approx(0.1228, abs=1e-3)
    assert row["fwd_over_1pass"] == pytest.approx(2.0, rel=1e-2)
    assert row["fwdbwd_over_3pass"] == pytest.approx(2.0, rel=1e-2)
    assert row["fwdbwd_over_2pass"] == pytest.approx(3.0, rel=1e-2)


@pytest.fixture
def fake_gpu(monkeypatch):
    """run_gpu on the CPU: device name, bandwidth, CUDA timers and memory stubbed; losses and JAX timing real."""
    import torch

    from bench import jax_measure, torch_measure

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch_measure, "copy_bandwidth_TBps", lambda: 1.0)
    monkeypatch.setattr(torch_measure, "bench_ms", lambda fn, *a: (fn(), 1.5)[1])
    monkeypatch.setattr(torch_measure, "peak_extra_bytes", lambda fn: (fn(), 1024)[1])
    real_measure = torch_measure.measure
    monkeypatch.setattr(torch_measure, "measure", lambda f, s, **kw: real_measure(f, s, device="cpu", **kw))
    monkeypatch.setattr(jax_measure, "has_gpu", lambda: True)
    monkeypatch.setattr(report, "RESULTS_MD", report.RESULTS_MD)


def test_run_gpu_orchestration_and_json_schema(fake_gpu, tmp_path, monkeypatch):
    impls = ["fastce_torch", "torch_eager_fp32", "torch_eager", "liger", "fastce_jax", "xla"]
    result = runner.run_gpu((Shape(8, 300),), impls, quick=True)
    assert TOP_KEYS <= set(result) <= TOP_KEYS | {"failures"}
    measured = {r["impl"] for r in result["rows"]}
    assert {"torch_eager_fp32", "torch_eager", "xla"} <= measured
    for row in result["rows"]:
        assert ROW_KEYS <= set(row)
        assert isinstance(row["peak_extra_bytes"], int) and row["fwd_ms"] > 0
    losses = [r["loss"] for r in result["rows"] if r["impl"].startswith("torch")]
    assert max(losses) - min(losses) < 2e-2  # the same seeded problem for every torch implementation
    if "liger" not in measured:  # not installed, or (installed, on the CPU) its kernels fail: recorded, run went on
        assert any(f["impl"] == "liger" for f in result["failures"])

    json_path = report.write_json(result, tmp_path / "run.json")
    assert json.loads(json_path.read_text())["rows"]
    monkeypatch.setattr(report, "RESULTS_MD", tmp_path / "RESULTS.md")
    md = report.write_results_md(json_path).read_text()
    assert "| impl | N | V |" in md and "Fake GPU" in md and "torch_eager_fp32" in md


def test_sharded_torch_smoke(tmp_path):
    """bench.tools.sharded_torch's code paths on two gloo processes (tiny shapes, plain-torch backend)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "sharded.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "bench.tools.sharded_torch", "--smoke", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    losses = {name: r["loss"] for name, r in row["impls"].items()}
    assert set(losses) == {"fastce_torch", "fastce_torch_dtensor", "torch_loss_parallel"}
    assert max(losses.values()) - min(losses.values()) < 1e-5 * abs(losses["torch_loss_parallel"]), losses
