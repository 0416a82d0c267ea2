"""`python -m bench`: the side-by-side benchmark (GPU), or the interpreted demo (CPU-only machines).

Exit status 1 when a fastce implementation failed or gave a wrong result (other implementations' failures are notes).
"""

import argparse
import sys
from pathlib import Path

from . import ALL_IMPLS, JAX_IMPLS, TORCH_IMPLS, jax_setup
from .linear_shapes import DEFAULT_IGNORED, parse_ignored
from .shapes import CPU_DEMO_SHAPES, CPU_DEMO_SHAPES_QUICK, QUICK_GPU_SHAPES, STANDARD_SHAPES, parse_shapes
from .worker import PASSES


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--shapes", type=parse_shapes, help="comma-separated NxV[:dtype] (dtype defaults to bfloat16)")
    add("--impls", default=",".join(ALL_IMPLS), help=f"comma-separated subset of {','.join(ALL_IMPLS)}")
    add("--quick", action="store_true", help="GPU: one small shape, shorter timing; CPU: the tiny interpreted demo")
    add("--json", type=Path, help="the results JSON (GPU default: bench/results/<date>-<device>.json; --quick and the "
        "CPU demo write one only when asked)")  # fmt: skip
    add("--linear", action="store_true", help="GPU: the fused linear + cross-entropy table instead (bench/linear.py); "
        "with --quick one shape and a correctness check of fastce_torch.linear_cross_entropy")  # fmt: skip
    add("--frameworks", default="torch,jax", help="GPU: a subset of torch,jax (split a run; join with --merge)")
    add("--merge", nargs="+", type=Path, metavar="JSON", help="join the results JSON of several runs into --json, "
        "measuring nothing; with --results-md also RESULTS.md")  # fmt: skip
    add("--worker", choices=PASSES, help="internal: one pass of the GPU run in this process, its part to --json")
    add("--linear-shapes", help="with --linear: comma-separated NxHxV[:dtype] instead of the standard linear shapes")
    add("--ignored", nargs="?", const=",".join(map(str, DEFAULT_IGNORED)), type=parse_ignored, help="with --linear: "
        "each shape with these fractions of its labels ignored (default 0,0.5,0.9), with and without "
        "skip_ignored_rows")  # fmt: skip
    add("--plot", type=Path, help="PNG of time vs V with the memory floors (needs matplotlib)")
    add("--results-md", nargs="?", const="", metavar="JSON", help="(re)write bench/RESULTS.md: from the given JSON "
        "without measuring, or with no value from this run's JSON")  # fmt: skip
    args = parser.parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = sorted(set(impls) - set(ALL_IMPLS))
    if unknown:
        parser.error(f"--impls: unknown {unknown}; known: {', '.join(ALL_IMPLS)}")
    frameworks = {f.strip() for f in args.frameworks.split(",") if f.strip()}
    if not frameworks or frameworks - {"torch", "jax"}:
        parser.error(f"--frameworks: expected a subset of torch,jax, got {args.frameworks!r}")
    allowed = (TORCH_IMPLS if "torch" in frameworks else ()) + (JAX_IMPLS if "jax" in frameworks else ())
    args.impls = [i for i in ALL_IMPLS if i in impls and i in allowed]
    if args.worker and not args.json:
        parser.error("--worker needs --json")
    return args


def render(json_path, plot_path=None):
    """RESULTS.md (and its plot) from a results JSON."""
    from . import plot, report

    result = report.read_json(json_path)
    plot_path = plot_path or Path(json_path).with_suffix(".png")
    plotted = plot.write_plot(result, plot_path)
    md = report.write_results_md(json_path, plot_path if plotted else None)
    print(f"wrote {md}" + (f" and {plot_path}" if plotted else " (no plot: matplotlib missing)"))


def failed_fastce(result) -> list:
    bad = [f"{f['impl']}: {f['error']}" for f in result.get("failures", [])
           if f["impl"].startswith("fastce") and f["stage"] != "unavailable"]  # fmt: skip
    return bad + [f"{r['impl']}[{r['backend']}] {r['N']}x{r['V']} {r['dtype']}: wrong result" for r in result["rows"]
                  if r.get("ok") is False and r["impl"].startswith("fastce")]  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    jax_setup.configure()  # before anything imports jax
    from . import envinfo, report

    if args.worker:
        from .worker import worker_main

        shapes = args.shapes or (QUICK_GPU_SHAPES if args.quick else STANDARD_SHAPES)
        return worker_main(args.worker, args.impls, shapes, args.quick, args.json)

    if args.results_md and not args.merge:  # render only
        render(args.results_md, args.plot)
        return 0

    import torch

    if args.linear and not args.merge:
        if not torch.cuda.is_available():
            print("--linear measures cuBLAS matmuls: it needs a GPU (the CPU tests cover correctness)")
            return 2
        from .linear import main_linear
        from .linear_shapes import parse_linear_shapes

        shapes = parse_linear_shapes(args.linear_shapes) if args.linear_shapes else None
        return main_linear(args.quick, args.json, shapes, args.ignored)

    if args.merge or torch.cuda.is_available():
        from .runner import merge_results, run_gpu

        shapes = args.shapes or (QUICK_GPU_SHAPES if args.quick else STANDARD_SHAPES)
        runs = [dict(report.read_json(path), _source=str(path)) for path in args.merge or ()]
        result = merge_results(runs) if args.merge else run_gpu(shapes, args.impls, quick=args.quick)
        print(f"\n{result['device']}, copy bandwidth {result['copy_bandwidth_TBps']:.2f} TB/s, "
              f"commit {result['commit']}\n")  # fmt: skip
        print(report.text_table(report.sort_rows(result["rows"])))
        default_json = report.RESULTS_DIR / f"{result['date']}-{envinfo.device_slug(result['device'])}.json"
        json_path = args.json or (None if args.quick and args.results_md is None and not args.merge else default_json)
    else:
        from . import cpu_demo

        shapes = args.shapes or (CPU_DEMO_SHAPES_QUICK if args.quick else CPU_DEMO_SHAPES)
        result = cpu_demo.run_cpu_demo(shapes, args.impls)
        print("\n" + cpu_demo.BANNER + "\n")
        print(cpu_demo.demo_table(result["rows"]))
        json_path = args.json

    for f in result.get("failures", []):
        where = f" {f['N']}x{f['V']} {f['dtype']}" if "N" in f else ""
        print(f"not measured: {f['impl']}{where} ({f['stage']}): {f['error']}")
    if json_path:
        report.write_json(result, json_path)
        print(f"wrote {json_path}")
    if json_path and args.results_md is not None and result.get("mode") != "cpu-demo":
        render(json_path, args.plot)  # RESULTS.md holds GPU results only
    elif args.plot:
        from .plot import write_plot

        print(f"wrote {args.plot}" if write_plot(result, args.plot) else "no plot (no matplotlib or no rows)")

    bad = failed_fastce(result)
    for line in bad:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
