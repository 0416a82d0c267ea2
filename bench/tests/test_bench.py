"""CPU tests of the benchmark's own logic: shapes, floors, the GPU run's orchestration (with the CUDA-only
timers stubbed, the implementations real), the JSON schema and RESULTS.md. Run: pytest bench/tests"""

import json
import os

import pytest

from bench import jax_setup

jax_setup.configure(interpret_only=True)

from bench import TORCH_IMPLS, report, runner, shapes, worker  # noqa: E402
from bench.shapes import Shape  # noqa: E402

TOP_KEYS = {"device", "date", "commit", "versions", "copy_bandwidth_TBps", "rows"}
ROW_KEYS = {"impl", "N", "V", "dtype", "fwd_ms", "fwdbwd_ms", "peak_extra_bytes"}


def test_parse_shapes():
    assert shapes.parse_shapes("8192x32000, 512x256000:fp32") == (Shape(8192, 32000), Shape(512, 256000, "float32"))
    with pytest.raises(ValueError):
        shapes.parse_shapes("8192by32000")


def test_floors_match_the_anchor_numbers():
    # At 4.27 TB/s (an H200's copy bandwidth), N=8192 bf16 V=32000: 0.123 / 0.246 / 0.369 ms.
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
    monkeypatch.setattr(torch_measure, "graph_ms", lambda fn, *a: (fn(), 0.75)[1])
    monkeypatch.setattr(torch_measure, "prime_capture", lambda: None)
    real_measure = torch_measure.measure
    monkeypatch.setattr(torch_measure, "measure", lambda f, s, **kw: real_measure(f, s, device="cpu", **kw))
    real_graph = torch_measure.measure_graph
    monkeypatch.setattr(torch_measure, "measure_graph", lambda f, s, **kw: real_graph(f, s, device="cpu", **kw))
    monkeypatch.setattr(jax_measure, "has_gpu", lambda: True)
    monkeypatch.setattr(report, "RESULTS_MD", report.RESULTS_MD)


def test_run_gpu_orchestration_and_json_schema(fake_gpu, tmp_path, monkeypatch):
    impls = ["fastce_torch", "torch_eager_fp32", "torch_eager", "liger", "fastce_jax", "fastce_jax_noalias", "xla"]
    result = runner.run_gpu((Shape(8, 300),), impls, quick=True, isolate=False)
    assert TOP_KEYS <= set(result) <= TOP_KEYS | {"failures"}
    measured = {r["impl"] for r in result["rows"]}
    assert {"torch_eager_fp32", "torch_eager", "xla", "fastce_jax", "fastce_jax_noalias"} <= measured
    for row in result["rows"]:
        assert ROW_KEYS <= set(row)
        assert isinstance(row["peak_extra_bytes"], int) and row["fwd_ms"] > 0
        if row["impl"] in TORCH_IMPLS:  # kernel time and call time apart, for every torch implementation
            assert row["fwdbwd_graph_ms"] == 0.75 and "fwdbwd_undonated_ms" not in row
            assert row["fwdbwd_graph_over_3pass"] == pytest.approx(0.75 / report.floor_ms(row, 3, 1.0))
            # and the leaf-logits .backward() call beside the non-leaf autograd.grad one
            assert row["fwdbwd_leaf_ms"] == 1.5 and row["peak_extra_leaf_bytes"] == 1024
            assert row["fwdbwd_leaf_over_3pass"] == pytest.approx(1.5 / report.floor_ms(row, 3, 1.0))
        else:  # every JAX implementation also without donated logits
            assert row["fwdbwd_undonated_ms"] > 0 and "fwdbwd_graph_ms" not in row
            assert row["fwdbwd_undonated_over_3pass"] > 0
    # The same seeded problem for every torch implementation: each loss within its own rounding of the float32 one
    # (torch_eager computes bf16 logits' loss in bf16: on the GPU it lands about one bf16 ulp, 2**-7 relative, away).
    losses = {r["impl"]: r["loss"] for r in result["rows"] if r["impl"] in TORCH_IMPLS}
    exact = losses["torch_eager_fp32"]
    for impl, loss in losses.items():
        allowed = 1e-4 * abs(exact) if impl in ("torch_eager_fp32", "fastce_torch") else 2**-6 * abs(exact)
        assert abs(loss - exact) <= allowed, (impl, loss, exact)
    if "liger" not in measured:  # not installed, or (installed, on the CPU) its kernels fail: recorded, run went on
        assert any(f["impl"] == "liger" for f in result["failures"])

    json_path = report.write_json(result, tmp_path / "run.json")
    assert json.loads(json_path.read_text())["rows"]
    monkeypatch.setattr(report, "RESULTS_MD", tmp_path / "RESULTS.md")
    md = report.write_results_md(json_path).read_text()
    assert "| impl | N | V |" in md and "Fake GPU" in md and "torch_eager_fp32" in md
    header = next(line for line in md.splitlines() if line.startswith("| impl"))
    for heading in ("fwd ms", "(torch: non-leaf, JAX: donated)", "leaf .backward() ms", "leaf/3-pass floor",
                    "CUDA graph fwd+bwd ms", "graph/3-pass floor", "JAX not donated ms"):  # fmt: skip
        assert f"{heading} |" in header, heading
    assert "| 0.750 |" in md  # the stubbed graph time, rendered from the JSON


def test_a_failed_graph_pass_keeps_the_eager_row(fake_gpu, monkeypatch):
    """The CUDA-graph pass runs after every eager and JAX row; where it raises, the row keeps its eager numbers and
    says why its graph column is empty."""
    from bench import torch_measure

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(torch_measure, "measure_graph", broken)
    result = runner.run_gpu((Shape(8, 300),), ["torch_eager_fp32", "xla"], quick=True, isolate=False)
    (row,) = [r for r in result["rows"] if r["impl"] == "torch_eager_fp32"]
    assert row["fwdbwd_ms"] > 0 and row["fwdbwd_graph_ms"] is None and "fwdbwd_graph_over_3pass" not in row
    assert "previous error during capture" in row["fwdbwd_graph_error"]
    assert any(r["impl"] == "xla" for r in result["rows"])


def test_uncapturable_implementation_gives_null_and_the_reason(monkeypatch, tmp_path):
    """An implementation that cannot be captured (here: a host synchronisation) is recorded as null with the
    reason, the row is kept, and RESULTS.md shows n/a and the reason."""
    from bench import torch_measure

    def refuse(fn, *args):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(torch_measure, "graph_ms", refuse)
    entry = torch_measure.graph_entry(lambda: None, 1, 1)
    assert entry == {
        "fwdbwd_graph_ms": None,
        "fwdbwd_graph_error": "RuntimeError: CUDA error: operation not permitted when stream is capturing",
    }
    row = report.add_ratios({"impl": "liger", "N": 8, "V": 300, "dtype": "bfloat16", "fwd_ms": 1.0, "fwdbwd_ms": 2.0,
                             "peak_extra_bytes": 0, "loss": 1.0, **entry}, 1.0)  # fmt: skip
    assert "fwdbwd_graph_over_3pass" not in row
    result = {"device": "Fake GPU", "date": "d", "commit": "c", "versions": {}, "copy_bandwidth_TBps": 1.0,
              "rows": [row]}  # fmt: skip
    monkeypatch.setattr(report, "RESULTS_MD", tmp_path / "RESULTS.md")
    md = report.write_results_md(report.write_json(result, tmp_path / "run.json")).read_text()
    assert "| n/a |" in md and "Not captured in a CUDA graph" in md and "stream is capturing" in md


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
    assert len(result["per_rank"]) == 2 and "fastce_torch" in done.stdout, done.stdout[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fastce_torch", "torch_eager", "torch_eager_fp32"])
def test_cuda_graph_capture_of_fwdbwd(impl):
    """On a GPU: the bench's capture of loss + autograd.grad works for these implementations, replays the same
    gradient as the eager call (fastce_torch writes it into the logits: compared on fresh inputs each time) and
    leaves no graph memory behind."""
    import torch

    from bench import torch_impls, torch_measure

    loss_fn = torch_impls.LOADERS[impl]()
    shape = Shape(64, 5000, "float32")
    logits, labels = torch_impls.make_inputs(shape, "cuda")
    (expected,) = torch.autograd.grad(loss_fn(logits, labels), logits)
    expected = expected.clone()
    torch_measure.prime_capture()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # as measure_graph: the inputs' autograd node on the capture stream
        logits, labels = torch_impls.make_inputs(shape, "cuda")
    captured = {}

    def fwdbwd():
        captured["grad"] = torch.autograd.grad(loss_fn(logits, labels), logits)[0]
        return captured["grad"]

    allocated = torch.cuda.memory_allocated()
    entry = torch_measure.graph_entry(fwdbwd, 5, 20, side)
    assert entry["fwdbwd_graph_ms"] is not None and entry["fwdbwd_graph_ms"] > 0, entry
    assert torch.cuda.memory_allocated() <= allocated + 2 * logits.numel() * 4  # the captured outputs only
    # The graph's gradient is of the values present at replay: fastce_torch's first replay overwrote its inputs,
    # so check the other implementations exactly and fastce_torch by the first warm-up call (eager, same inputs).
    if impl != "fastce_torch":
        torch.testing.assert_close(captured["grad"], expected)


def test_error_text_names_the_first_error_of_a_failed_capture():
    """torch.cuda.graph's exit raises its own "previous error during capture" over the body's exception; the
    recorded text must carry the body's (the cause)."""
    from bench.progress import error_text

    class Capture:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    with pytest.raises(RuntimeError) as info:
        with Capture():
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors...")
    text = error_text(info.value)
    assert text.startswith("RuntimeError: CUDA error: operation failed due to a previous error during capture")
    assert "[first error: RuntimeError: CUDA error: operation not permitted when stream is capturing]" in text
    assert error_text(ValueError("plain")) == "ValueError: plain"


def test_worker_command_round_trips_through_the_cli():
    from bench.__main__ import parse_args

    shapes_ = (Shape(8192, 32000), Shape(8192, 128256, "float32"))
    command = runner.worker_command("torch-graph", ["liger"], shapes_, True, "/tmp/part.json")
    assert command[1:3] == ["-m", "bench"]
    args = parse_args(command[3:])
    assert (args.worker, args.impls, args.shapes, args.quick) == ("torch-graph", ["liger"], shapes_, True)
    assert parse_args(runner.worker_command("bandwidth", [], (), False, "/tmp/b.json")[3:]).impls == []
    assert parse_args(["--frameworks", "jax"]).impls == ["fastce_jax", "fastce_jax_noalias", "xla"]


FAKE_WORKER = """
import json, os, sys, time
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1] if flag in args else ""
pass_name, impl, out = value("--worker"), value("--impls"), value("--json")
shapes = [s for s in value("--shapes").split(",") if s]
def write(part):
    open(out, "w").write(json.dumps({"pass": pass_name, "failures": [], "complete": False, **part}))
def row(shape, **measured):
    dims, dtype = shape.split(":")
    n, v = dims.split("x")
    return {"impl": impl, "N": int(n), "V": int(v), "dtype": dtype, **measured}
eager = dict(fwd_ms=1.0, fwdbwd_ms=2.0, peak_extra_bytes=0, loss=1.0)
if pass_name == "bandwidth":
    write({"device": "Fake GPU", "copy_bandwidth_TBps": 1.0, "rows": [], "complete": True})
elif pass_name == "torch-eager":  # crashes on the second shape of any list
    write({"rows": [row(shapes[0], **eager, fwdbwd_leaf_ms=3.0)], "complete": len(shapes) == 1})
    if len(shapes) > 1:
        print("Fatal Python error: Segmentation fault (fake)", flush=True)
        os._exit(139)
elif pass_name == "torch-graph":  # a failed capture stops the worker after its first shape
    first = row(shapes[0], fwdbwd_graph_ms=None, fwdbwd_graph_error="AcceleratorError: capture failed")
    write({"rows": [first] if len(shapes) > 1 else [row(shapes[0], fwdbwd_graph_ms=0.5)]})
elif pass_name == "jax":  # hangs while given more than one shape
    if len(shapes) > 1:
        print("jax worker hangs", flush=True)
        time.sleep(60)
    write({"rows": [row(shapes[0], **eager, fwdbwd_undonated_ms=2.5)], "complete": True})
"""


def test_dead_hung_and_stopped_workers_cost_only_their_shape(monkeypatch):
    """The parent's side of the isolation, through real subprocesses (a fake worker: no torch, no GPU): a crashed
    worker keeps the rows it wrote, the shape it was on is marked failed with its exit status and last output line,
    a fresh worker takes the rest; a hung one is killed at the timeout; a graph worker that stops after a failed
    capture is replaced for the remaining shapes; other implementations are untouched."""
    import sys

    real_command = runner.worker_command

    def command(pass_name, impls, shapes_, quick, json_path):
        real = real_command(pass_name, impls, shapes_, quick, json_path)
        return [sys.executable, "-c", FAKE_WORKER] + real[3:]

    monkeypatch.setattr(runner, "worker_command", command)
    shapes_ = (Shape(8, 300), Shape(8, 400), Shape(8, 500))
    result = runner.run_gpu(shapes_, ["torch_eager", "xla"], quick=True, worker_timeout_s=3)
    assert result["device"] == "Fake GPU" and result["copy_bandwidth_TBps"] == 1.0
    rows = {(r["impl"], r["V"]): r for r in result["rows"]}
    assert set(rows) == {("torch_eager", 300), ("torch_eager", 500), ("xla", 500)}
    lost = {(f["impl"], f["V"]): f["error"] for f in result["failures"]}
    assert lost[("torch_eager", 400)].startswith("worker exited with status 139: Fatal Python error: Segmentation")
    assert lost[("xla", 300)] == lost[("xla", 400)] == "worker killed after 3 s: jax worker hangs"
    assert rows[("torch_eager", 300)]["fwdbwd_graph_ms"] is None
    assert rows[("torch_eager", 300)]["fwdbwd_graph_error"] == "AcceleratorError: capture failed"
    assert rows[("torch_eager", 500)]["fwdbwd_graph_ms"] == 0.5 and rows[("torch_eager", 500)]["fwdbwd_leaf_ms"] == 3.0
    assert rows[("xla", 500)]["fwdbwd_undonated_ms"] == 2.5 and "fwdbwd_undonated_over_3pass" in rows[("xla", 500)]


def test_merge_two_runs(tmp_path, monkeypatch):
    def run(impl, bandwidth, commit):
        row = {"impl": impl, "N": 8, "V": 300, "dtype": "bfloat16", "fwd_ms": 1.0, "fwdbwd_ms": 2.0,
               "peak_extra_bytes": 0, "loss": 1.0}  # fmt: skip
        rows = [report.add_ratios(row, bandwidth)]
        return {"device": "Fake GPU", "date": "d", "commit": commit, "versions": {"torch": "t"},
                "copy_bandwidth_TBps": bandwidth, "rows": rows, "_source": commit}  # fmt: skip

    merged = runner.merge_results([run("fastce_torch", 1.0, "a"), run("fastce_jax", 2.0, "b")])
    assert [r["impl"] for r in merged["rows"]] == ["fastce_torch", "fastce_jax"]
    assert merged["rows"][1]["fwdbwd_over_3pass"] == merged["rows"][0]["fwdbwd_over_3pass"]  # one bandwidth
    assert [m["copy_bandwidth_TBps"] for m in merged["merged_from"]] == [1.0, 2.0]
    with pytest.raises(ValueError):
        runner.merge_results([run("x", 1.0, "a"), {**run("y", 1.0, "b"), "device": "Other GPU"}])
    monkeypatch.setattr(report, "RESULTS_MD", tmp_path / "RESULTS.md")
    md = report.write_results_md(report.write_json(merged, tmp_path / "m.json")).read_text()
    assert "merged from `a`" in md and "merged from `b`" in md


def test_worker_main_writes_its_part(fake_gpu, tmp_path):
    """What a worker process leaves for the parent: its rows in the JSON, rewritten after every shape."""
    path = tmp_path / "part.json"
    assert worker.worker_main("torch-eager", ["torch_eager_fp32"], (Shape(8, 300), Shape(4, 200)), True, path) == 0
    part = json.loads(path.read_text())
    assert part["complete"] and part["pass"] == "torch-eager" and not part["failures"]
    assert [(r["N"], r["V"]) for r in part["rows"]] == [(8, 300), (4, 200)]
    assert all(r["fwdbwd_leaf_ms"] == 1.5 and "fwdbwd_graph_ms" not in r for r in part["rows"])
    assert worker.worker_main("torch-graph", ["torch_eager_fp32"], (Shape(8, 300),), True, path) == 0
    assert json.loads(path.read_text())["rows"] == [
        {"impl": "torch_eager_fp32", "N": 8, "V": 300, "dtype": "bfloat16", "fwdbwd_graph_ms": 0.75}
    ]


@pytest.mark.gpu
def test_isolated_gpu_run_end_to_end(monkeypatch):
    """On a GPU: the real worker processes for a small shape: eager, leaf and CUDA-graph columns for the torch
    implementations (the first capture of each graph worker included), donated and not donated for JAX, nothing
    failed, and each framework's two losses agree (the frameworks draw different random inputs)."""
    # This module pins JAX to the CPU for its own interpreted tests; the workers it starts must see the GPU.
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        monkeypatch.delenv("JAX_PLATFORMS")
    shape = Shape(1024, 32000)
    result = runner.run_gpu((shape,), ["fastce_torch", "torch_eager_fp32", "fastce_jax", "xla"], quick=True)
    assert "failures" not in result, result["failures"]
    rows = {r["impl"]: r for r in result["rows"]}
    assert set(rows) == {"fastce_torch", "torch_eager_fp32", "fastce_jax", "xla"}
    for impl in ("fastce_torch", "torch_eager_fp32"):
        assert rows[impl]["fwdbwd_leaf_ms"] > 0 and rows[impl]["fwdbwd_graph_ms"] > 0, rows[impl]
    for impl in ("fastce_jax", "xla"):
        assert rows[impl]["fwdbwd_undonated_ms"] > 0
    for a, b in (("fastce_torch", "torch_eager_fp32"), ("fastce_jax", "xla")):
        assert abs(rows[a]["loss"] - rows[b]["loss"]) < 1e-4 * abs(rows[b]["loss"]), (a, b)


def test_results_md_holds_the_newest_fused_linear_tables(tmp_path):
    row = {"impl": "fastce_torch_linear", "N": 8, "H": 4, "V": 30, "dtype": "bfloat16", "fwdbwd_ms": 1.5,
           "peak_extra_bytes": 2**20, "extra_beyond_grads_bytes": 2**19, "effective_TFLOPs": 600.0,
           "of_matmul": 0.9, "grad_weight_rel_rms": 3e-3, "grad_hidden_rel_rms": 2e-3}  # fmt: skip
    for name, date, commit in (
        ("a-old", "2026-01-01", "old"),
        ("a-new", "2026-01-02", "new"),
        ("b-x", "2026-01-01", "x"),
    ):
        stage, tag = name.split("-")
        run = {"mode": "linear", "device": "Fake GPU", "date": date, "commit": commit, "torch": "t",
               "matmul_TFLOPs": {"N=8 H=4 V=30 bfloat16": 650.0}, "rows": [row]}  # fmt: skip
        report.write_json(run, tmp_path / f"{date}-h200-linear-{stage}-{tag}.json")
    latest = report.latest_linear_runs(tmp_path)
    assert [p.name for p in latest] == ["2026-01-02-h200-linear-a-new.json", "2026-01-01-h200-linear-b-x.json"]
    md = report.linear_markdown(report.read_json(latest[0]), "source.json")
    assert "commit new" in md and "| fastce_torch_linear | 8 | 4 | 30 |" in md and "1.50" in md
    # RESULTS.md itself carries the repository's newest committed tables.
    committed = report.results_markdown(report.read_json(report.RESULTS_DIR / "2026-12-02-nvidia-h200.json"))
    assert report.latest_linear_runs() and "## Fused linear cross-entropy" in committed


def test_host_time_markdown_shows_unmeasured_figures_as_a_dash():
    summary = dict.fromkeys(report.HOST_TIME_KEYS, 10.0) | {"launches_us": None, "fastce_python_us": None}
    run = {"device": "cpu", "commit": "abc", "date": "2026-01-01", "torch": "t", "calls": 2, "repeat": 1,
           "summary": summary | {"total_us": 318.94}}  # fmt: skip
    md = report.host_time_markdown(run, "source.json")
    assert "cpu, commit abc, 2026-01-01, torch t" in md and "the fastest of 1 means over 2 calls" in md
    assert "| 318.9 | 10.0 |" in md and "| the two compiled launchers' C calls | - |" in md
    assert "| N, V (bf16) |" not in md  # no part 2 without a GPU
    run["device_times"] = [{"N": 512, "V": 256000, "eager_ms": 0.4641, "kernels_ms": 0.2, "graph_ms": 0.199}]
    assert "| 512, 256000 | 0.464 | 0.200 | 0.199 |" in report.host_time_markdown(run, "source.json")
