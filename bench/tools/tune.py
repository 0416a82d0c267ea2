"""`python -m bench.tools.tune`: sweep fastce's launch parameters on the GPU.

fastce_torch: the forward and backward launchers timed per candidate config against the copy bandwidth (--json: every
row). fastce_jax: each SEARCH candidate set on fastce_jax.losses.cross_entropy.launch's constants, re-traced and timed.
"""

import argparse
import itertools
from unittest import mock

from .. import jax_setup
from ..progress import say
from ..report import write_json
from ..shapes import STANDARD_SHAPES, parse_shapes

JAX_KNOBS_MODULE = "fastce_jax.losses.cross_entropy.launch"
SEARCH = [  # (stage timed, {knob: candidates})
    ("fwd", {"FORWARD_BLOCK": (2048, 4096, 8192), "FORWARD_WARPS": (2, 4, 8), "FORWARD_STAGES": (1, 3)}),
    ("fwd", {"CHUNK": (8192, 16384, 32768, 65536)}),
    ("bwd", {"BACKWARD_BLOCK": (1024, 2048, 4096, 8192), "BACKWARD_WARPS": (4, 8)}),
]


def _jax_timer(shape):
    import jax

    import fastce_jax

    from ..jax_impls import make_inputs
    from ..jax_measure import bench_ms

    logits, labels = make_inputs(shape)

    def time_stage(stage):
        def loss(x, y):  # a new function each time, so jit traces again and reads the current constants
            return fastce_jax.cross_entropy(x, y)

        fn = jax.jit(loss) if stage == "fwd" else jax.jit(jax.value_and_grad(loss))
        return bench_ms(lambda: fn(logits, labels), 30.0, 5)

    return time_stage


def _sweep(module, stage, knobs, time_stage, base_fwd):
    """[(ms, candidate)] of every candidate set on the module's constants (the defaults back after each)."""
    results = []
    for candidate in (dict(zip(knobs, values)) for values in itertools.product(*knobs.values())):
        try:
            with mock.patch.multiple(module, **candidate):
                ms = time_stage("fwd") if stage == "fwd" else time_stage("fwdbwd") - base_fwd
        except Exception as exc:  # noqa: BLE001 - e.g. a tile too big for the registers
            say(f"  {stage} {candidate}: failed {type(exc).__name__}: {str(exc)[:120]}")
            continue
        results.append((ms, candidate))
        say(f"  {stage} {candidate}: {ms:.3f} ms")
    return results


def tune_fastce_jax(shapes):
    import importlib

    module = importlib.import_module(JAX_KNOBS_MODULE)
    for shape in shapes:
        time_stage = _jax_timer(shape)
        base_fwd, base_fwdbwd = time_stage("fwd"), time_stage("fwdbwd")
        say(f"fastce_jax {shape}: defaults fwd {base_fwd:.3f} ms, fwd+bwd {base_fwdbwd:.3f} ms")
        for stage, knobs in SEARCH:
            missing = [k for k in knobs if not hasattr(module, k)]
            if missing:
                say(f"  {JAX_KNOBS_MODULE} has no {missing}: skipped")
                continue
            results = _sweep(module, stage, knobs, time_stage, base_fwd)
            if results:
                best_ms, best = min(results, key=lambda r: r[0])
                defaults = {k: getattr(module, k) for k in knobs}
                print(f"fastce_jax {shape} {stage}: best {best} {best_ms:.3f} ms (defaults {defaults})")


TORCH_SHAPES = [(8192, 32000), (8192, 128256), (8192, 256000), (512, 256000)]


def tune_fastce_torch(json_path=None):
    """Every candidate launcher config timed; the best four per shape printed, every row written to json_path."""
    import torch

    from fastce_torch.core.options import Options
    from fastce_torch.losses.cross_entropy import launch as ce_launch

    from ..torch_measure import bench_ms, copy_bandwidth_TBps  # timed with do_bench's default 25 / 100 ms

    bandwidth = copy_bandwidth_TBps()
    print(f"copy bandwidth {bandwidth:.2f} TB/s")
    rows = []
    for n_rows, vocab in TORCH_SHAPES:
        logits = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16)
        labels = torch.randint(0, vocab, (n_rows,), device="cuda")
        labels[::7] = -100
        grad_loss = torch.ones((), device="cuda").expand(n_rows)
        one_pass_ms = logits.numel() * 2 / bandwidth / 1e9
        options = Options()
        for block, warps, chunk, stages in itertools.product(
            [2048, 4096, 8192], [2, 4, 8], [8192, 16384, 65536], [1, 3]
        ):
            # Each candidate as a config of its own (the module constants are cached per V, never changed here).
            config = ce_launch.forward_config(vocab, block=block, chunk=max(chunk, block), warps=warps, stages=stages)
            ms = bench_ms(lambda: ce_launch.forward(logits, labels, options, config=config), 25, 100)
            candidate = dict(block=block, warps=warps, chunk=chunk, stages=stages)
            rows.append(dict(kernel="forward", N=n_rows, V=vocab, **candidate, ms=ms, ratio=ms / one_pass_ms))
        _, lse, _ = ce_launch.forward(logits, labels, options)
        backward_args = (grad_loss, logits, labels, lse, logits, options)
        for block, warps in itertools.product([1024, 2048, 4096, 8192], [4, 8]):
            config = ce_launch.backward_config(vocab, block=block, warps=warps)
            ms = bench_ms(lambda: ce_launch.backward(*backward_args, config=config), 25, 100)
            candidate = dict(block=block, warps=warps, chunk=0)
            rows.append(dict(kernel="backward", N=n_rows, V=vocab, **candidate, ms=ms, ratio=ms / (2 * one_pass_ms)))
        del logits, backward_args
        for kernel in ("forward", "backward"):
            timed = (r for r in rows if r["kernel"] == kernel and r["V"] == vocab and r["N"] == n_rows)
            for r in sorted(timed, key=lambda r: r["ms"])[:4]:
                candidate = f"block={r['block']} warps={r['warps']} chunk={r['chunk']} stages={r.get('stages', '-')}"
                print(f"{kernel:8s} N={n_rows} V={vocab} {candidate}: {r['ms']:.3f} ms = {r['ratio']:.2f}x floor")
    if json_path:
        write_json(dict(copy_bandwidth_TBps=bandwidth, rows=rows), json_path)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.tools.tune", description=__doc__.split("\n")[0])
    parser.add_argument("--package", choices=("fastce_torch", "fastce_jax"), default="fastce_torch")
    parser.add_argument("--shapes", type=parse_shapes, default=STANDARD_SHAPES, help="fastce_jax only")
    parser.add_argument("--json", help="fastce_torch only: write every timed candidate here")
    args = parser.parse_args(argv)
    jax_setup.configure()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.tools.tune needs a GPU (interpreted kernel times mean nothing)")
    if args.package == "fastce_torch":
        tune_fastce_torch(args.json)
    else:
        tune_fastce_jax(args.shapes)


if __name__ == "__main__":
    main()
