"""Where fastce_torch's fused linear cross-entropy spends its device time against the unfused path, shape by shape,
from the profiler: `PYTHONPATH=. python -m bench.tools.linear_profile [--shapes NxHxV,...] [--json PATH]`
(~1 min on an H200 for the five shapes of `python -m bench --linear`; on a CPU with TRITON_INTERPRET=1 it runs at a
tiny shape, where only the operation counts mean anything).

For each shape, after two untimed calls, `--calls` calls of each of
  fused      fastce_torch.linear_cross_entropy(hidden, weight, labels), its defaults (the 256 MiB workspace);
  unfused    fastce_torch.cross_entropy(hidden @ weight.T, labels) through autograd (the logits materialised);
  products   the three bare products of the unfused path (logits, d hidden, d weight), cuBLAS, nothing else
run under torch.profiler (CUDA activity). Every kernel is charged to the aten operation that launched it: the
products (aten::mm / addmm / addmm_ / matmul out=) are named by role from their shapes (logits: (rows, H) @ (H, V);
d hidden: (rows, V) @ (V, H); d weight: a (V, H) or (H, V) result with rows as the inner dimension) and given their
TFLOP/s; the rest (fastce's Triton kernels, fills, casts) is summed apart, with its largest kernels named. Busy =
the sum of kernel times, span = first kernel start to last kernel end (busy < span: the device waited on the host).
What it answers: whether the fused loop's gap to the unfused path lies in its products (their count and inner
dimension, the chunk rows), in its CE kernels or between kernels.
"""

import argparse
import json
from collections import defaultdict

import torch

from bench import envinfo
from bench import linear as linear_bench
from bench.linear_shapes import LINEAR_SHAPES, LinearShape, parse_linear_shapes

# Where each product operation's two operands sit among its profiled input shapes (an out= tensor comes last).
PRODUCT_OPS = {"aten::mm": 0, "aten::addmm": 1, "aten::addmm_": 1}
ROLES = ("logits", "d hidden", "d weight")


def product_role(op_name, input_shapes, shape):
    """(role, m, k, n) of a product operation from its profiled input shapes, or None if it is none of the three."""
    first = PRODUCT_OPS[op_name]
    operands = input_shapes[first : first + 2]
    if len(operands) < 2 or any(len(s) != 2 for s in operands):
        return None
    (m, k), (k2, n) = operands
    if k != k2:
        return None
    if n == shape.V and k == shape.H:
        return "logits", m, k, n
    if k == shape.V and n == shape.H:
        return "d hidden", m, k, n
    if {m, n} == {shape.V, shape.H}:
        return "d weight", m, k, n
    return None


def _device_time_us(event):
    """Device time of the kernels an operation launched itself (not its children's)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _is_device_kernel(event):
    return event.device_type == torch.autograd.DeviceType.CUDA


def breakdown(events, shape, calls):
    """{role: {count, inner_dims, ms, tflops}, 'other': {ms, top}, 'busy_ms', 'span_ms'} per call, from the
    profiler's events of `calls` calls."""
    roles = {role: {"count": 0, "inner_dims": set(), "us": 0.0, "flops": 0.0} for role in ROLES}
    for event in events:
        if _is_device_kernel(event) or event.name not in PRODUCT_OPS:
            continue
        found = product_role(event.name, event.input_shapes or [], shape)
        if found is None:
            continue
        role, m, k, n = found
        entry = roles[role]
        entry["count"] += 1
        entry["inner_dims"].add(k)
        entry["us"] += _device_time_us(event)
        entry["flops"] += 2.0 * m * k * n
    kernels = [e for e in events if _is_device_kernel(e)]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    span_us = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) if kernels else 0.0
    products_us = sum(entry["us"] for entry in roles.values())
    other_by_name = defaultdict(float)
    product_names = {k.name for e in events if e.name in PRODUCT_OPS for k in getattr(e, "kernels", ())}
    for kernel in kernels:
        if kernel.name not in product_names:
            other_by_name[kernel.name] += kernel.time_range.elapsed_us()
    result = {}
    for role, entry in roles.items():
        ms = entry["us"] / 1e3 / calls
        result[role] = {
            "count": entry["count"] // calls,
            "inner_dims": sorted(entry["inner_dims"]),
            "ms": ms,
            "tflops": entry["flops"] / calls / (ms * 1e-3) / 1e12 if ms > 0 else None,
        }
    top = sorted(other_by_name.items(), key=lambda item: -item[1])[:4]
    result["other"] = {
        "ms": max(busy_us - products_us, 0.0) / 1e3 / calls,  # the bare products have nothing else
        "top": [(name[:60], us / 1e3 / calls) for name, us in top],
    }
    result["busy_ms"] = busy_us / 1e3 / calls
    result["span_ms"] = span_us / 1e3 / calls
    return result


def implementations(hidden, weight, labels, **fused_settings):
    """{name: step()} for one shape's inputs: each step computes the loss and both gradients. fused_settings: keywords
    of the fused call (none: its defaults, what the tool reports)."""
    import fastce_torch

    def fused():
        loss = fastce_torch.linear_cross_entropy(hidden, weight, labels, **fused_settings)
        return torch.autograd.grad(loss, (hidden, weight))

    def unfused():
        return torch.autograd.grad(fastce_torch.cross_entropy(hidden @ weight.t(), labels), (hidden, weight))

    def products():
        with torch.no_grad():  # out= buffers from the caching allocator: no kernel, nothing but the three products
            logits = torch.mm(hidden, weight.t())
            torch.mm(logits, weight, out=torch.empty_like(hidden))
            torch.mm(logits.t(), hidden, out=torch.empty_like(weight))

    return {"fused": fused, "unfused": unfused, "products": products}


def profile_shape(shape, calls=3, **fused_settings):
    """{implementation: breakdown} at one shape (inputs on bench.linear's DEVICE)."""
    from torch.profiler import ProfilerActivity, profile

    hidden, weight, labels = linear_bench.make_inputs(shape)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if hidden.is_cuda else [])
    results = {}
    for name, step in implementations(hidden, weight, labels, **fused_settings).items():
        for _ in range(2):
            step()
        if hidden.is_cuda:
            torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(calls):
                step()
            if hidden.is_cuda:
                torch.cuda.synchronize()
        results[name] = breakdown(prof.events(), shape, calls)
    del hidden, weight, labels
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def format_shape(shape, results):
    lines = [f"{shape}"]
    header = f"  {'':22s}" + "".join(f"{name:>34s}" for name in results)
    lines.append(header)
    for role in ROLES:
        cells = []
        for entry in results.values():
            row = entry[role]
            if not row["count"]:
                cells.append(f"{'-':>34s}")
                continue
            tflops = "" if row["tflops"] is None else f" {row['tflops']:4.0f} TF/s"
            dims = "/".join(map(str, row["inner_dims"]))
            cells.append(f"{row['count']:>3d}x K={dims:>6s} {row['ms']:7.2f} ms{tflops:>10s}")
        lines.append(f"  {role + ' products':22s}" + "".join(cells))
    lines.append(f"  {'other kernels':22s}" + "".join(f"{e['other']['ms']:31.2f} ms" for e in results.values()))
    lines.append(
        f"  {'busy / span':22s}" + "".join(f"{e['busy_ms']:22.2f} / {e['span_ms']:5.2f} ms" for e in results.values())
    )
    for name, entry in results.items():
        top = ", ".join(f"{kernel} {ms:.2f}" for kernel, ms in entry["other"]["top"])
        lines.append(f"  {name} other: {top}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_linear_shapes, default=None, help="NxHxV[:dtype],...")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        linear_bench.DEVICE = "cpu"
    shapes = args.shapes or (LINEAR_SHAPES if torch.cuda.is_available() else (LinearShape(64, 32, 500, "float32"),))
    report = []
    for shape in shapes:
        results = profile_shape(shape, args.calls)
        print(format_shape(shape, results), flush=True)
        report.append({"shape": [shape.N, shape.H, shape.V, shape.dtype], "results": results})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": _device_name(),
                    "date": envinfo.today(),
                    "commit": envinfo.git_commit(),
                    "torch": torch.__version__,
                    "calls": args.calls,
                    "shapes": report,
                },
                f,
                indent=1,
            )
    return report


def _device_name():
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
