"""The GPU run: copy bandwidth, then every torch implementation on every shape, then every JAX one, then the
CUDA-graph replay of every torch row (last: a failed capture can leave memory held for the rest of the process).

Torch goes first and empties its cache before JAX starts, so the two allocators never hold big buffers at the
same time (JAX allocates on demand: bench.jax_setup). One implementation failing (missing package, OOM, a
kernel error) is recorded and the run goes on.
"""

import gc
import sys

from . import JAX_IMPLS, TORCH_IMPLS, envinfo
from .progress import Unavailable, failure, say
from .report import add_ratios


def _row(impl, shape, measured, bandwidth):
    row = {"impl": impl, "N": shape.N, "V": shape.V, "dtype": shape.dtype, **measured}
    return add_ratios(row, bandwidth)


def _extra_times(row) -> str:
    text = ""
    if "fwdbwd_graph_ms" in row:
        graph = row["fwdbwd_graph_ms"]
        text += (
            f", CUDA graph {graph:.3f} ms" if graph is not None else f", no CUDA graph ({row['fwdbwd_graph_error']})"
        )
    if "fwdbwd_undonated_ms" in row:
        text += f", not donated {row['fwdbwd_undonated_ms']:.3f} ms"
    return text


def _run_framework(impls, loaders, measure, shapes, bandwidth, rows, failures, counter, measure_kwargs):
    for impl in impls:
        try:
            loss_fn = loaders[impl]()
        except Exception as exc:  # noqa: BLE001 - a missing or broken package must not stop the run
            failures.append(failure(impl, None, "load", exc))
            say(f"{impl}: skipped ({failures[-1]['error']})")
            counter[0] += len(shapes)
            continue
        for shape in shapes:
            counter[0] += 1
            try:
                measured = measure(loss_fn, shape, **measure_kwargs)
                rows.append(_row(impl, shape, measured, bandwidth))
                r = rows[-1]
                say(
                    f"[{counter[0]}/{counter[1]}] {impl:16s} {shape}: fwd {r['fwd_ms']:.3f} ms, fwd+bwd "
                    f"{r['fwdbwd_ms']:.3f} ms ({r.get('fwdbwd_over_2pass', 0):.2f}x 2-pass floor), "
                    f"peak extra {r['peak_extra_bytes'] / 2**20:.1f} MiB, loss {r['loss']:.4f}{_extra_times(r)}"
                )
            except Exception as exc:  # noqa: BLE001 - OOM and kernel errors are results too
                failures.append(failure(impl, shape, "measure", exc))
                say(f"[{counter[0]}/{counter[1]}] {impl:16s} {shape}: FAILED {failures[-1]['error']}")
            gc.collect()


def _add_graph_times(impls, loaders, measure_graph, shapes, bandwidth, rows, timing):
    """fwdbwd_graph_ms (or None and fwdbwd_graph_error) into each torch row measured above, its ratios updated."""
    for impl in impls:
        measured = {(r["N"], r["V"], r["dtype"]): r for r in rows if r["impl"] == impl}
        if not measured:
            continue
        loss_fn = loaders[impl]()
        for shape in shapes:
            row = measured.get((shape.N, shape.V, shape.dtype))
            if row is None:
                continue
            try:
                row.update(measure_graph(loss_fn, shape, **timing))
            except Exception as exc:  # noqa: BLE001 - the eager row stands; the graph column says why it is empty
                row.update({"fwdbwd_graph_ms": None, "fwdbwd_graph_error": failure(impl, shape, "graph", exc)["error"]})
            add_ratios(row, bandwidth)
            say(f"CUDA graph: {impl:16s} {shape}{_extra_times(row)}")
            gc.collect()


def run_gpu(shapes, impls, quick=False) -> dict:
    import torch

    from . import torch_impls, torch_measure

    device = torch.cuda.get_device_name()
    say(f"GPU run on {device}: {len(shapes)} shape(s) x {len(impls)} implementation(s)")
    bandwidth = torch_measure.copy_bandwidth_TBps()
    say(f"device-to-device copy bandwidth {bandwidth:.2f} TB/s")
    rows, failures = [], []
    counter = [0, len(shapes) * len(impls)]
    timing = {"warmup_ms": 25, "rep_ms": 100} if quick else {"warmup_ms": 100, "rep_ms": 500}

    torch_selected = [i for i in impls if i in TORCH_IMPLS]
    _run_framework(
        torch_selected, torch_impls.LOADERS, torch_measure.measure, shapes, bandwidth, rows, failures, counter, timing
    )
    torch.cuda.empty_cache()

    jax_selected = [i for i in impls if i in JAX_IMPLS]
    if jax_selected:
        try:
            try:
                from . import jax_impls, jax_measure
            except ModuleNotFoundError as exc:
                raise Unavailable(f"jax is not installed ({exc})") from exc
            if not jax_measure.has_gpu():
                raise Unavailable("jax sees no GPU (a CPU-only jaxlib?)")
        except Exception as exc:  # noqa: BLE001
            for impl in jax_selected:
                failures.append(failure(impl, None, "load", exc))
            say(f"JAX implementations skipped: {failures[-1]['error']}")
            counter[0] += len(shapes) * len(jax_selected)
        else:
            _run_framework(
                jax_selected,
                jax_impls.LOADERS,
                jax_measure.measure,
                shapes,
                bandwidth,
                rows,
                failures,
                counter,
                {"batch_target_ms": 20.0 if quick else 50.0},
            )

    _add_graph_times(torch_selected, torch_impls.LOADERS, torch_measure.measure_graph, shapes, bandwidth, rows, timing)
    fastce_versions = {}
    for name in ("fastce_torch", "fastce_jax"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            fastce_versions[name] = module.__version__
    result = {
        "device": device,
        "date": envinfo.today(),
        "commit": envinfo.git_commit(),
        "versions": envinfo.versions(fastce_versions),
        "copy_bandwidth_TBps": bandwidth,
        "rows": rows,
    }
    if failures:  # only when something failed, so a clean run has exactly the documented keys
        result["failures"] = failures
    return result
