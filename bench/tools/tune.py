"""`python -m bench.tools.tune`: sweep fastce's launch parameters on the GPU.

fastce_torch: delegates to bench/tools/tune_kernels.py (kernel-level times of the forward and backward launchers).
fastce_jax: the kernels read module constants of fastce_jax.kernels (FWD_MAX_BLOCK, ...) when a jit traces, so
this sets each candidate, re-traces, times the stage it affects (host timing as in bench.jax_measure; "bwd" is
fwd+bwd minus the default fwd), restores the defaults and prints the best per shape. Knobs the package does not
have are reported and skipped; edit SEARCH to change the candidates.
"""

import argparse
import itertools
import sys

from .. import jax_setup
from ..progress import say
from ..shapes import STANDARD_SHAPES, parse_shapes

JAX_KNOBS_MODULE = "fastce_jax.kernels"
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
    defaults = {k: getattr(module, k) for k in knobs}
    results = []
    try:
        for values in itertools.product(*knobs.values()):
            candidate = dict(zip(knobs, values))
            for k, v in candidate.items():
                setattr(module, k, v)
            try:
                ms = time_stage("fwd") if stage == "fwd" else time_stage("fwdbwd") - base_fwd
            except Exception as exc:  # noqa: BLE001 - e.g. a tile too big for the registers
                say(f"  {stage} {candidate}: failed {type(exc).__name__}: {str(exc)[:120]}")
                continue
            results.append((ms, candidate))
            say(f"  {stage} {candidate}: {ms:.3f} ms")
    finally:
        for k, v in defaults.items():
            setattr(module, k, v)
    return defaults, results


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
            defaults, results = _sweep(module, stage, knobs, time_stage, base_fwd)
            if results:
                best_ms, best = min(results, key=lambda r: r[0])
                print(f"fastce_jax {shape} {stage}: best {best} {best_ms:.3f} ms (defaults {defaults})")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.tools.tune", description=__doc__.split("\n")[0])
    parser.add_argument("--package", choices=("fastce_torch", "fastce_jax"), default="fastce_torch")
    parser.add_argument("--shapes", type=parse_shapes, default=STANDARD_SHAPES, help="fastce_jax only")
    parser.add_argument("--json", help="fastce_torch only: passed to bench.tools.tune_kernels")
    args = parser.parse_args(argv)
    jax_setup.configure()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.tools.tune needs a GPU (interpreted kernel times mean nothing)")
    if args.package == "fastce_torch":
        from . import tune_kernels

        sys.argv = ["python -m bench.tools.tune_kernels"] + (["--json", args.json] if args.json else [])
        tune_kernels.main()
    else:
        tune_fastce_jax(args.shapes)


if __name__ == "__main__":
    main()
