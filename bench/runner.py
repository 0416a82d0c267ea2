"""The GPU run: one worker process per pass and implementation (bench/worker.py), so no framework's allocator,
compiled state or failed capture reaches another's numbers. A dead worker's shape is marked failed and a fresh
worker takes the rest; the parent merges the parts and adds the floor ratios."""

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from . import JAX_IMPLS, TORCH_IMPLS, envinfo
from .progress import say
from .report import add_ratios
from .worker import run_pass

WORKER_TIMEOUT_S = 300


def _key(item):
    return (item["impl"], item["N"], item["V"], item["dtype"])


def _shape_key(impl, shape):
    return (impl, shape.N, shape.V, shape.dtype)


def worker_command(pass_name, impls, shapes, quick, json_path) -> list:
    command = [sys.executable, "-m", "bench", "--worker", pass_name, "--impls", ",".join(impls)]
    command += ["--json", str(json_path)]
    if shapes:
        command += ["--shapes", ",".join(f"{s.N}x{s.V}:{s.dtype}" for s in shapes)]
    return command + (["--quick"] if quick else [])


def _forward_output(stream, tail):
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        if line.strip():
            tail.append(line.strip())


def _die_with_parent():
    """In the worker, before exec (Linux): SIGKILL when the parent dies, so no orphan holds the GPU."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn_worker(pass_name, impls, shapes, quick, timeout_s=WORKER_TIMEOUT_S):
    """One worker process: (its JSON part or {}, None or why it ended abnormally); its output goes to stderr."""
    root = str(envinfo.REPO_ROOT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="bench-worker-") as tmp:
        json_path = Path(tmp) / "part.json"
        command = worker_command(pass_name, impls, shapes, quick, json_path)
        proc = subprocess.Popen(
            command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )  # fmt: skip
        tail = collections.deque(maxlen=5)
        reader = threading.Thread(target=_forward_output, args=(proc.stdout, tail), daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout_s)
            why = None if rc == 0 else f"worker exited with status {rc}"
        except subprocess.TimeoutExpired:
            why = f"worker killed after {timeout_s} s"
        # Its own session: the worker and anything it started (e.g. compile workers, which would also keep the
        # output pipe open) go, whether it finished or hung.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=10)
        part = json.loads(json_path.read_text()) if json_path.exists() else {}
    if why and tail:
        why += f": {tail[-1][-300:]}"
    return part, why


def _run_until_done(launch, pass_name, impl, shapes, quick, on_row, on_failure, on_lost):
    """Workers for (pass, impl) until every shape is measured or failed; on_lost(shape, why) for the shape a dead
    worker was on (and for any a finished worker did not report)."""
    remaining = list(shapes)
    while remaining:
        part, why = launch(pass_name, [impl], remaining, quick)
        done = set()
        for row in part.get("rows", []):
            on_row(row)
            done.add(_key(row))
        for fail in part.get("failures", []):
            on_failure(fail)
            if "N" not in fail:  # the implementation did not load: nothing more to try
                return
            done.add(_key(fail))
        left = [s for s in remaining if _shape_key(impl, s) not in done]
        if why is None and part.get("complete"):
            for shape in left:
                on_lost(shape, "the worker finished without reporting this shape")
            return
        if why is None and len(left) == len(remaining):  # stopped early without progress: never loop forever
            why = "worker stopped without reporting anything"
        if why is not None:
            if left:
                on_lost(left[0], why)  # the shape it was on
                left = left[1:]
            else:
                say(f"{pass_name} {impl}: every shape reported, then {why}")
        remaining = left


def run_gpu(shapes, impls, quick=False, isolate=True, worker_timeout_s=WORKER_TIMEOUT_S) -> dict:
    """Every pass of the GPU run; with isolate=False the passes run in this process (tests)."""

    fastce_versions = {}

    def launch(pass_name, impl_list, pass_shapes, quick):
        if isolate:
            part, why = spawn_worker(pass_name, impl_list, pass_shapes, quick, worker_timeout_s)
        else:
            part, why = run_pass(pass_name, impl_list, pass_shapes, quick), None
        fastce_versions.update(part.get("fastce_versions", {}))
        return part, why

    say(f"GPU run: {len(shapes)} shape(s) x {len(impls)} implementation(s), one process per pass and implementation")
    env, why = launch("bandwidth", [], (), quick)
    if why:
        say(f"bandwidth worker: {why}")
    device, bandwidth = env.get("device", "unknown"), env.get("copy_bandwidth_TBps", 0.0)
    rows, failures = {}, []

    def lost_as_failure(impl, stage):
        def on_lost(shape, why):
            failures.append({"impl": impl, "stage": stage, "error": why, "N": shape.N, "V": shape.V,
                             "dtype": shape.dtype})  # fmt: skip
            say(f"{impl} {shape}: FAILED ({why})")

        return on_lost

    def add_row(row):
        rows[_key(row)] = dict(row)

    torch_selected = [i for i in impls if i in TORCH_IMPLS]
    jax_selected = [i for i in impls if i in JAX_IMPLS]
    for impl in torch_selected:
        lost = lost_as_failure(impl, "crash")
        _run_until_done(launch, "torch-eager", impl, shapes, quick, add_row, failures.append, lost)
    for impl in torch_selected:
        measured = [s for s in shapes if _shape_key(impl, s) in rows]

        def add_graph(row):
            if _key(row) in rows:
                rows[_key(row)].update({k: v for k, v in row.items() if k.startswith("fwdbwd_graph")})

        def graph_lost(shape, why):
            rows[_shape_key(impl, shape)].update({"fwdbwd_graph_ms": None, "fwdbwd_graph_error": why})

        def graph_failure(fail):  # the graph worker could not even load the implementation
            for shape in measured:
                graph_lost(shape, fail["error"])

        _run_until_done(launch, "torch-graph", impl, measured, quick, add_graph, graph_failure, graph_lost)
    for impl in jax_selected:
        _run_until_done(launch, "jax", impl, shapes, quick, add_row, failures.append, lost_as_failure(impl, "crash"))

    # Table order: implementations in ALL_IMPLS order, shapes in the order given.
    order = {k: i for i, k in enumerate(_shape_key(impl, s) for impl in torch_selected + jax_selected for s in shapes)}
    merged = [add_ratios(rows[k], bandwidth) for k in sorted(rows, key=lambda k: order.get(k, len(order)))]
    result = {"device": device, "date": envinfo.today(), "commit": envinfo.git_commit(),
              "versions": envinfo.versions(fastce_versions), "copy_bandwidth_TBps": bandwidth,
              "rows": merged}  # fmt: skip
    # failures only when something failed, so a clean run has exactly the documented keys
    return result | ({"failures": failures} if failures else {})


def merge_results(results) -> dict:
    """One result from several runs' JSON (a row measured twice: the later file's), ratios recomputed against the
    first run's copy bandwidth."""
    if not results:
        raise ValueError("nothing to merge")
    first = results[0]
    devices = {r["device"] for r in results}
    if len(devices) > 1:
        raise ValueError(f"refusing to merge runs from different devices: {sorted(devices)}")
    rows, failures = {}, []
    for result in results:
        for row in result["rows"]:
            rows[_key(row)] = dict(row)
        failures += result.get("failures", [])
    bandwidth = first["copy_bandwidth_TBps"]
    merged = {**{k: first[k] for k in ("device", "date", "commit", "versions")}, "copy_bandwidth_TBps": bandwidth,
              "rows": [add_ratios(row, bandwidth) for row in rows.values()],
              "merged_from": [{"source": r.get("_source", "?"), **{k: r[k] for k in ("commit", "date",
                              "copy_bandwidth_TBps")}} for r in results]}  # fmt: skip
    for result in results[1:]:
        merged["versions"] = {**result["versions"], **merged["versions"]}
    if failures:
        merged["failures"] = failures
    return merged
