"""One pass of the GPU run in this process: `python -m bench --worker PASS --impls IMPL --shapes ... --json PART`
(bench/runner.py starts one per pass and implementation and merges their JSON parts)."""

import json
import os
import sys
from pathlib import Path

from .progress import Unavailable, error_text, failure, load, note_failure, say

PASSES = ("bandwidth", "torch-eager", "torch-graph", "jax")


def _timing(quick):
    return {"warmup_ms": 25, "rep_ms": 100} if quick else {"warmup_ms": 100, "rep_ms": 500}


def _fastce_versions() -> dict:
    loaded = (sys.modules.get(name) for name in ("fastce_torch", "fastce_jax"))
    return {module.__name__: module.__version__ for module in loaded if hasattr(module, "__version__")}


def _summary(row) -> str:
    parts = []
    for key, label in (("fwd_ms", "fwd"), ("fwdbwd_ms", "fwd+bwd"), ("fwdbwd_leaf_ms", "leaf fwd+bwd"),
                       ("fwdbwd_undonated_ms", "not donated"), ("fwdbwd_graph_ms", "CUDA graph")):  # fmt: skip
        if key in row:
            parts.append(f"{label} {row[key]:.3f} ms" if row[key] is not None else f"no {label}")
    for key in ("fwdbwd_leaf_error", "fwdbwd_graph_error"):
        if key in row:
            parts.append(f"({row[key]})")
    if "peak_extra_bytes" in row:
        parts.append(f"peak extra {row['peak_extra_bytes'] / 2**20:.1f} MiB, loss {row['loss']:.4f}")
    return ", ".join(parts)


def run_pass(pass_name, impls, shapes, quick=False, emit=None) -> dict:
    """One pass of the GPU run, in this process. Returns (and hands to `emit` after every shape, so a crash keeps
    what was measured) {"pass", "rows", "failures", "complete", ...}; complete is False where a graph pass stopped
    after a failed capture."""
    part = {"pass": pass_name, "rows": [], "failures": [], "complete": False}
    emit = emit or (lambda part: None)
    if pass_name == "bandwidth":
        import torch

        from . import torch_measure

        part["device"] = torch.cuda.get_device_name()
        say(f"GPU {part['device']}")
        part["copy_bandwidth_TBps"] = torch_measure.copy_bandwidth_TBps()
        say(f"device-to-device copy bandwidth {part['copy_bandwidth_TBps']:.2f} TB/s")
    elif pass_name in ("torch-eager", "torch-graph"):
        _torch_pass(pass_name, impls, shapes, quick, part, emit)
    elif pass_name == "jax":
        _jax_pass(impls, shapes, quick, part, emit)
    else:
        raise ValueError(f"unknown pass {pass_name!r}; known: {', '.join(PASSES)}")
    part["complete"] = not part.pop("stopped", False)
    part["fastce_versions"] = _fastce_versions()
    emit(part)
    return part


def _torch_pass(pass_name, impls, shapes, quick, part, emit):
    from . import torch_impls, torch_measure

    timing = _timing(quick)
    graph = pass_name == "torch-graph"
    if graph:
        try:
            torch_measure.prime_capture()
        except Exception as exc:  # noqa: BLE001 - the real captures still run and say what fails
            say(f"priming capture failed: {error_text(exc)}")
    for impl in impls:
        loss_fn = load(impl, torch_impls.LOADERS[impl], part["failures"])
        if loss_fn is None:
            continue
        for shape in shapes:
            base = {"impl": impl, "N": shape.N, "V": shape.V, "dtype": shape.dtype}
            if graph:
                try:
                    measured = torch_measure.measure_graph(loss_fn, shape, **timing)
                except Exception as exc:  # noqa: BLE001 - the eager row stands; the graph cell says why it is empty
                    measured = {"fwdbwd_graph_ms": None, "fwdbwd_graph_error": error_text(exc)}
                part["rows"].append({**base, **measured})
            else:
                try:
                    part["rows"].append({**base, **torch_measure.measure(loss_fn, shape, **timing)})
                except Exception as exc:  # noqa: BLE001 - OOM and kernel errors are results too
                    note_failure(part["failures"], f"{impl:16s} {shape}", impl, shape, "measure", exc)
                    emit(part)
                    continue
            say(f"{pass_name} {impl:16s} {shape}: {_summary(part['rows'][-1])}")
            emit(part)
            if graph and part["rows"][-1]["fwdbwd_graph_ms"] is None:
                part["stopped"] = True  # a fresh process takes the remaining shapes
                return


def _jax_pass(impls, shapes, quick, part, emit):
    try:
        try:
            from . import jax_impls, jax_measure
        except ModuleNotFoundError as exc:
            raise Unavailable(f"jax is not installed ({exc})") from exc
        if not jax_measure.has_gpu():
            raise Unavailable("jax sees no GPU (a CPU-only jaxlib?)")
    except Exception as exc:  # noqa: BLE001
        part["failures"] += [failure(impl, None, "load", exc) for impl in impls]
        say(f"JAX implementations skipped: {part['failures'][-1]['error']}")
        return
    for impl in impls:
        loss_fn = load(impl, jax_impls.LOADERS[impl], part["failures"])
        if loss_fn is None:
            continue
        for shape in shapes:
            try:
                measured = jax_measure.measure(loss_fn, shape, batch_target_ms=20.0 if quick else 50.0)
                part["rows"].append({"impl": impl, "N": shape.N, "V": shape.V, "dtype": shape.dtype, **measured})
                say(f"jax {impl:16s} {shape}: {_summary(part['rows'][-1])}")
            except Exception as exc:  # noqa: BLE001
                note_failure(part["failures"], f"jax {impl:16s} {shape}", impl, shape, "measure", exc)
            emit(part)


def worker_main(pass_name, impls, shapes, quick, json_path) -> int:
    """`python -m bench --worker PASS`: run_pass, its JSON rewritten (atomically) after every shape."""
    json_path = Path(json_path)

    def emit(part):
        tmp = json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(part, indent=1) + "\n")
        os.replace(tmp, json_path)

    run_pass(pass_name, impls, shapes, quick, emit)
    return 0
