"""Fused linear CE against the unfused path and three bare matmuls at one shape, with the SM clock and power that
nvidia-smi samples (every 50 ms) during each measurement: whether a gap between them is the card's clock under
sustained load or the work itself. `PYTHONPATH=. python -m bench.tools.linear_clocks [NxHxV]` (~1 min on an H200;
writes clocks-samples.csv and linear-clocks.json to $OUT, default /tmp).

Per implementation and round: one event-timed call after 2 s idle (single_ms), a do_bench median over 2 s
(do_bench_ms) and the mean / lowest SM clock, mean power and throttle reasons during it; then 40 interleaved
iterations (each implementation once per iteration, event-timed) in one thermal state."""

import datetime
import json
import os
import subprocess
import sys
import time

import torch
import triton.testing

import fastce_torch


def main():

    N, H, V = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8192x4096x128256").split("x"))
    out = os.environ.get("OUT", "/tmp")
    log = open(f"{out}/clocks-samples.csv", "w")
    smi = subprocess.Popen(
        [
            "nvidia-smi",
            "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
            "--format=csv,noheader,nounits",
            "-lms",
            "50",
        ],
        stdout=log,
    )
    torch.manual_seed(0)
    h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16).requires_grad_()
    lab = torch.randint(0, V, (N,), device="cuda")
    lab[::7] = -100
    buf = torch.empty(N, V, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty_like(h)
    dw = torch.empty_like(w)

    def fused():
        torch.autograd.grad(fastce_torch.linear_cross_entropy(h, w, lab), (h, w))

    def fused32():
        torch.autograd.grad(fastce_torch.linear_cross_entropy(h, w, lab, accumulate_in_float32=True), (h, w))

    def unfused():
        torch.autograd.grad(fastce_torch.cross_entropy(h @ w.t(), lab), (h, w))

    def three():
        with torch.no_grad():
            torch.matmul(h, w.t(), out=buf)
            torch.matmul(buf, w, out=dh)
            torch.matmul(buf.t(), h, out=dw)

    impls = dict(three_matmuls=three, unfused=unfused, fused=fused, fused_f32acc=fused32)
    for f in impls.values():
        f()
        f()
    torch.cuda.synchronize()
    res = {}
    for rnd in range(2):
        for name, f in impls.items():
            time.sleep(2.0)
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record()
            f()
            e.record()
            torch.cuda.synchronize()
            single = s.elapsed_time(e)
            t0 = time.time()
            ms = triton.testing.do_bench(f, warmup=100, rep=2000, return_mode="median")
            t1 = time.time()
            res.setdefault(name, []).append(dict(single_ms=single, do_bench_ms=ms, t0=t0, t1=t1))
            print(f"round {rnd} {name:14s} single {single:7.2f} ms  do_bench {ms:7.2f} ms", flush=True)
    # interleaved: each iteration runs every impl once, event-timed, after 2 s idle
    time.sleep(2.0)
    times = {k: [] for k in impls}
    t0 = time.time()
    for _ in range(40):
        for name, f in impls.items():
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record()
            f()
            e.record()
            times[name].append((s, e))
    torch.cuda.synchronize()
    t1 = time.time()
    inter = {k: sorted(s.elapsed_time(e) for s, e in v)[len(v) // 2] for k, v in times.items()}
    print("interleaved medians:", {k: round(v, 2) for k, v in inter.items()}, flush=True)
    smi.terminate()
    time.sleep(0.3)
    log.close()
    # clocks per window

    rows = []
    for line in open(f"{out}/clocks-samples.csv"):
        p = [x.strip() for x in line.split(",")]
        try:
            ts = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, float(p[1]), float(p[3]), float(p[4]), p[5]))
        except Exception:
            pass

    def window(a, b):
        sel = [r for r in rows if a <= r[0] <= b]
        if not sel:
            return {}
        return dict(
            sm_mhz=sum(r[1] for r in sel) / len(sel),
            min_sm=min(r[1] for r in sel),
            watts=sum(r[2] for r in sel) / len(sel),
            temp=max(r[3] for r in sel),
            throttle=sorted({r[4] for r in sel}),
        )

    # nvidia-smi timestamps are local time of the device; offset against time.time() estimated from the first sample
    for name, lst in res.items():
        for r in lst:
            r.update(window(r["t0"], r["t1"]))
            print(
                name, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if k not in ("t0", "t1")}
            )
    print("interleaved window", window(t0, t1))
    json.dump(
        dict(shape=[N, H, V], rounds=res, interleaved=inter, interleaved_window=window(t0, t1)),
        open(f"{out}/linear-clocks.json", "w"),
        indent=1,
    )


if __name__ == "__main__":
    main()
