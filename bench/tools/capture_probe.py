"""Which CUDA-graph capture of the loss's forward+backward fails, and with what first error (GPU; under a minute).

    PYTHONPATH=. python -m bench.tools.capture_probe [--shape 8192x32000] [--impls fastce_torch,torch_eager,liger]
                                                     [--json out.json]

Every case (a capture variant x an implementation) runs in a fresh process, so its first attempt is the process's
first CUDA-graph capture; each case then tries the same capture a second time in that process (does a failure
happen only the first time?) and checks the device afterwards (is the context left broken?). For a failed attempt
the whole exception chain is printed: torch.cuda.graph's exit reports only "operation failed due to a previous
error during capture", the body's own error is its __context__.

Variants (inputs: the bench's non-leaf logits, bench.torch_impls.make_inputs, unless said otherwise):
  old-harness               inputs and 2 eager calls on the default stream, 3 warm-up calls on a side stream,
                            capture on torch.cuda.graph's own (never used) capture stream
  old-harness-no-sync       the same without the explicit torch.cuda.synchronize() before the capture
                            (torch.cuda.graph's __enter__ still synchronises)
  default-stream-warmup     warm-up on the default stream only, capture on torch.cuda.graph's own stream
  same-stream               warm-up on a side stream and capture on that stream; inputs on the default stream
  inputs-on-capture-stream  inputs, eager calls, warm-up and capture all on one side stream
  primed-old-harness        a trivial capture (x.add_(1)) first, then old-harness
  bench-recipe              what bench.torch_measure.measure_graph does: primed, inputs-on-capture-stream
  inputs-inside-capture     the non-leaf logits made inside the captured region (from static values)
  leaf-backward             leaf logits, `loss.backward()` into .grad (set to None before warm-up and capture)
  thread-local-mode         old-harness, capture_error_mode="thread_local"
  relaxed-mode              old-harness, capture_error_mode="relaxed"
  single-thread-autograd    old-harness with torch.autograd.set_multithreading_enabled(False) (the backward runs on
                            the calling thread instead of autograd's device thread)
"""

import argparse
import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = (
    "old-harness",
    "old-harness-no-sync",
    "default-stream-warmup",
    "same-stream",
    "inputs-on-capture-stream",
    "primed-old-harness",
    "bench-recipe",
    "inputs-inside-capture",
    "leaf-backward",
    "thread-local-mode",
    "relaxed-mode",
    "single-thread-autograd",
)
# The full set for fastce_torch; the variants that tell most for the others.
SHORT = ("old-harness", "same-stream", "inputs-on-capture-stream", "bench-recipe", "leaf-backward", "relaxed-mode")
CASE_TIMEOUT_S = 60


def chain(exc) -> list:
    """Every exception of the chain, outermost first: type and first line of the message."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        out.append(f"{type(exc).__name__}: {text}"[:400])
        exc = exc.__cause__ or exc.__context__
    return out


def run_case(variant, impl, shape_text) -> dict:
    """One case in this process: two capture attempts, then a device check."""
    import torch

    from bench import torch_impls, torch_measure
    from bench.shapes import parse_shapes

    (shape,) = parse_shapes(shape_text)
    loss_fn = torch_impls.LOADERS[impl]()
    mode = {"thread-local-mode": "thread_local", "relaxed-mode": "relaxed"}.get(variant, "global")
    threads = torch.autograd.set_multithreading_enabled(False) if variant == "single-thread-autograd" else None
    if variant in ("primed-old-harness", "bench-recipe"):
        torch_measure.prime_capture()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    on_side = torch.cuda.stream(side)
    leaf = variant == "leaf-backward"
    with on_side if variant in ("inputs-on-capture-stream", "bench-recipe") else contextlib.nullcontext():
        logits, labels = (torch_impls.make_leaf_inputs if leaf else torch_impls.make_inputs)(shape, "cuda")
    static = logits.detach().clone() if variant == "inputs-inside-capture" else None
    anchor = torch.zeros((), dtype=logits.dtype, device="cuda", requires_grad=True)

    def step():
        if leaf:
            logits.grad = None
            loss_fn(logits, labels).backward()
            return logits.grad
        if static is not None:
            inner = anchor.expand(*static.shape).contiguous()
            with torch.no_grad():
                inner.copy_(static)
            return torch.autograd.grad(loss_fn(inner, labels), inner)[0]
        return torch.autograd.grad(loss_fn(logits, labels), logits)[0]

    capture_stream = side if variant in ("same-stream", "inputs-on-capture-stream", "bench-recipe") else None
    eager_stream = side if variant in ("inputs-on-capture-stream", "bench-recipe") else None
    attempts = []
    for attempt in range(2):
        record = {"attempt": attempt + 1}
        try:
            with torch.cuda.stream(eager_stream) if eager_stream is not None else contextlib.nullcontext():
                for _ in range(2):  # the bench's untimed eager calls (compile, autotune)
                    step()
            if variant == "default-stream-warmup":
                for _ in range(3):
                    step()
            else:
                warm = capture_stream or side
                warm.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warm):
                    for _ in range(3):
                        step()
                torch.cuda.current_stream().wait_stream(warm)
            if variant != "old-harness-no-sync":
                torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            t0 = time.perf_counter()
            with torch.cuda.graph(graph, stream=capture_stream, capture_error_mode=mode):
                out = step()
            record["capture_s"] = round(time.perf_counter() - t0, 3)
            graph.replay()
            torch.cuda.synchronize()
            record["ok"] = True
            record["replay_finite"] = bool(torch.isfinite(out.float()).all())
            del out
            graph.reset()
        except Exception as exc:  # noqa: BLE001 - the failure is the finding
            record["ok"] = False
            record["errors"] = chain(exc)
        if leaf:
            logits.grad = None
        attempts.append(record)
    try:
        torch.ones(4, device="cuda").sum().item()
        device_ok = "ok"
    except Exception as exc:  # noqa: BLE001
        device_ok = chain(exc)[0]
    if threads is not None:
        torch.autograd.set_multithreading_enabled(True)
    return {"variant": variant, "impl": impl, "attempts": attempts, "device_after": device_ok}


def spawn_case(variant, impl, shape_text) -> dict:
    command = [sys.executable, "-m", "bench.tools.capture_probe", "--case", variant, impl, "--shape", shape_text]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "impl": impl, "process": f"timed out after {CASE_TIMEOUT_S} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()][-3:]
    return {"variant": variant, "impl": impl, "process": f"exited with status {done.returncode}", "tail": tail}


def cases(impls):
    out = []
    for impl in impls:
        if impl == "liger":
            try:
                import liger_kernel  # noqa: F401
            except ModuleNotFoundError:
                print("liger: not importable, skipped")
                continue
        out += [(variant, impl) for variant in (VARIANTS if impl == "fastce_torch" else SHORT)]
    return out


def report(results) -> str:
    lines = []
    for r in results:
        head = f"{r['impl']:13s} {r['variant']:25s}"
        if "process" in r:
            lines.append(f"{head} PROCESS {r['process']} {' | '.join(r.get('tail', []))}")
            continue
        marks = " ".join("ok" if a["ok"] else "FAIL" for a in r["attempts"])
        lines.append(f"{head} attempts: {marks:9s} device after: {r['device_after']}")
        for a in r["attempts"]:
            for depth, error in enumerate(a.get("errors", [])):
                lines.append(f"{'':40s}#{a['attempt']} {'  ' * depth}{'<- ' if depth else ''}{error}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.capture_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8192x32000:bfloat16")
    parser.add_argument("--impls", default="fastce_torch,torch_eager,liger")
    parser.add_argument("--jobs", type=int, default=4, help="cases run at once (each its own process)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--case", nargs=2, metavar=("VARIANT", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case[0], args.case[1], args.shape)), flush=True)
        return 0
    todo = cases([i.strip() for i in args.impls.split(",") if i.strip()])
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda case: spawn_case(*case, args.shape), todo))
    print(f"capture probe, {args.shape}, {len(todo)} cases in {time.perf_counter() - t0:.0f} s")
    print(report(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"shape": args.shape, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
