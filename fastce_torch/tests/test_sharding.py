"""Vocab-parallel cross-entropy (process_group= and DTensor Shard(-1)) against the float64 reference.

Each test launches `vocab_parallel_check` under torch.distributed.run: gloo processes on the CPU (the kernels
through Triton's interpreter, so the shapes are tiny), or, with --gpu, NCCL over two GPUs at a mid shape.
"""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow  # gloo processes under torch.distributed.run: started first under pytest-xdist


def segments(*argument_sets, common=()):
    """One launch for several argument sets (`--then` between them, `common` in each): every set is checked and
    reported on its own, in the same processes, so the imports and the interpreter's warm-up are paid once."""
    joined = []
    for arguments in argument_sets:
        joined += [*(["--then"] if joined else []), *common, *arguments]
    return joined


def run_ranks(n_ranks, *args, timeout=900, module="fastce_torch.tests.vocab_parallel_check"):
    from fastce_torch.core.launch import INTERPRETED

    argument_sets = [[]]
    for arg in args:
        if arg == "--then":
            argument_sets.append([])
        else:
            argument_sets[-1].append(arg)
    if not INTERPRETED:  # CPU kernels need Triton's interpreter (a CUDA machine runs test_two_gpus_nccl)
        argument_sets = [s for s in argument_sets if not ("--device=cpu" in s and "--backend=kernel" in s)]
        if not argument_sets:
            pytest.skip("CPU kernels need Triton's interpreter (a CUDA machine runs test_two_gpus_nccl instead)")
    args = segments(*argument_sets)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n_ranks}",
        "-m",
        module,
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    report = [
        line
        for line in done.stdout.splitlines()
        if "FAIL" in line or line.startswith(("vocab-parallel", "linear-parallel"))
    ]
    assert done.returncode == 0, "\n".join(report + [done.stderr[-3000:]])
    # One summary line per argument set (`--then` separates them), each of them ok.
    n_ok = sum(line.endswith(": ok") for line in report)
    assert n_ok == args.count("--then") + 1, done.stdout[-2000:]


# Under torch.compile(fullgraph=True) (--compile): each case compiled and eager, both against the float64 reference
# and each other; the recorded graphs hold two O(N) all-reduces in the forward, no collective in the backward, no
# host synchronisation. Also: unequal widths give NaN, vocab_start= is refused as a graph break, a second backward
# raises, dynamic=True keeps one graph. The reductions, every option at once and the edge cases, each compile costing
# seconds on the CPU (each option alone is a constant in the same graph: the eager --poisoned set runs each).
COMPILE_CASES = (
    "--only=mean,sum,none,all-options,all-options-3d,n-items-float,n-items-tensor,all-ignored,ignore-real-class,"
    "bad-labels-none,nonfinite-rows-mean,not-inplace,n0"
)


# The plain-torch backend under compile: each reduction, n_items as a tensor, 3-D rows, bad labels, no rows, and every
# option at once (each option alone under compile is the kernel backend's run above; eager, both backends run all).
REFERENCE_COMPILE_CASES = "--only=mean,sum,none,all-options,all-options-3d,n-items-tensor,bad-labels-none,n0"


# Each set: --poisoned (every case eager on NaN-filled torch.empty buffers), --second-order (create_graph=True
# through the vocab-parallel loss, process group and DTensor: each rank's columns of H v against the float64
# reference's, the cross-rank terms through a differentiable all-reduce), --compile (above). The compiled sets are
# launches of their own: under pytest-xdist they run beside the eager ones, and the oldest-torch CI job, for which
# torch.compile and DTensor are what changes between releases, runs the kernels' (with the 2-D mesh; .ci/run says
# why not the plain-torch backend's).
TWO_RANKS = {
    "kernel": (
        ["--backend=kernel", "--local-vocab=20", "--poisoned"],
        ["--backend=kernel", "--local-vocab=20", "--second-order"],
        # temperature, token_weights and the entropy's gradient (vocab_parallel_rl.py), process group and DTensor.
        ["--backend=kernel", "--local-vocab=20", "--rl"],
        # Local rows wider than one chunk (16384): the kernel's in-launch combine of chunks, then across ranks.
        [
            "--backend=kernel",
            "--local-vocab=17000",
            "--rows=3",
            "--only=all-options,smoothing-sum,nonfinite-rows,bad-labels-none",
        ],
    ),
    "kernel-compiled": (
        ["--backend=kernel", "--local-vocab=20", "--compile=aot_eager", COMPILE_CASES],
        # The default backend (on the CPU inductor compiles C++ around the custom ops: ~25 s a graph).
        ["--backend=kernel", "--local-vocab=20", "--compile=inductor", "--only=all-options-mean"],
    ),
    "reference": (
        ["--backend=reference", "--local-vocab=20", "--poisoned"],
        ["--backend=reference", "--local-vocab=20", "--second-order"],
        ["--backend=reference", "--local-vocab=20", "--rl"],
    ),
    "reference-compiled": (
        ["--backend=reference", "--local-vocab=20", "--compile=aot_eager", REFERENCE_COMPILE_CASES],
    ),
}


@pytest.mark.parametrize("argument_sets", sorted(TWO_RANKS))
def test_two_ranks(argument_sets):
    run_ranks(2, *segments(*TWO_RANKS[argument_sets], common=["--device=cpu"]))


def test_three_ranks():
    run_ranks(3, *segments(
        # Explicit vocab_start; also checks that unequal widths without it give NaN, and that overlapping slices
        # raise.
        ["--backend=kernel", "--widths=10,15,12", "--poisoned"],
        ["--backend=kernel", "--widths=10,15,12", "--rl"],
        ["--backend=reference", "--widths=10,15,12", "--poisoned"],
        ["--backend=reference", "--widths=10,15,12", "--second-order"],
        # Three ranks under compile: every option at once (with the compile-only checks); each reduction and bad
        # labels compiled are the two-rank launch's (the same graph: the group's size is not in it) and, uneven, the
        # DTensor set below's.
        ["--backend=kernel", "--local-vocab=12", "--compile=aot_eager", "--only=all-options-mean"],
        # V = 37 on 3 ranks: Shard's chunks of 13, 13, 11 (a DTensor); the process-group calls with vocab_start= are
        # checked to be refused under fullgraph=True, and unequal widths without it to give NaN.
        ["--backend=kernel", "--widths=13,13,11", "--compile=aot_eager", "--only=mean,none,all-options-mean"],
        common=["--device=cpu"],
    ))  # fmt: skip


def test_four_ranks_2d_mesh():
    # Also a (data, tensor) 2x2 DTensor mesh: rows sharded, vocabulary sharded, Partial sums. Plain-torch backend
    # (the per-shard numbers are the same functions as in the tests above; four interpreters would be slow).
    run_ranks(4, "--device=cpu", "--backend=reference", "--local-vocab=10")


@pytest.mark.gpu
def test_two_gpus_nccl_compiled():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    run_ranks(2, "--device=cuda", "--backend=kernel", "--size=mid", "--compile=aot_eager", COMPILE_CASES)


@pytest.mark.gpu
def test_two_gpus_nccl_inductor():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    # Every dtype of all-options-mean (float64 by the plain-torch path) plus the compile-only checks: a few inductor
    # compiles, so that the two-GPU stage keeps to its time.
    run_ranks(2, "--device=cuda", "--backend=kernel", "--size=mid", "--compile=inductor", "--only=all-options-mean")


@pytest.mark.gpu
def test_one_gpu_nccl_one_rank():
    # The eager path's combine kernels on a GPU where only one is lent: every case, one NCCL rank, poisoned buffers;
    # then the RL keywords (temperature, token weights, the entropy's gradient, log_probs) through the group path.
    cuda = ["--device=cuda", "--backend=kernel", "--size=mid"]
    run_ranks(1, *cuda, "--poisoned", "--then", *cuda, "--rl")


@pytest.mark.gpu
def test_one_gpu_nccl_one_rank_inductor():
    # torch.compile(fullgraph=True) over the vocab-parallel call with NCCL's functional collectives, on the one GPU
    # that is always lent (the two-GPU runs are test_two_gpus_nccl_compiled / _inductor).
    run_ranks(1, "--device=cuda", "--backend=kernel", "--size=mid", "--compile=inductor", "--only=all-options-mean")


@pytest.mark.gpu
def test_two_gpus_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    cuda = ["--device=cuda", "--backend=kernel", "--size=mid"]
    run_ranks(2, *cuda, "--then", *cuda, "--rl")


@pytest.mark.gpu
def test_two_gpus_nccl_hessian_vector_product():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    run_ranks(2, "--device=cuda", "--backend=kernel", "--local-vocab=300", "--rows=16", "--second-order")


def test_arguments_without_a_process_group():
    import fastce_torch

    logits, labels = torch.randn(3, 5), torch.tensor([0, 4, 2])
    with pytest.raises(ValueError, match="vocab_start"):
        fastce_torch.cross_entropy(logits, labels, vocab_start=5)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            fastce_torch.cross_entropy(logits, labels, process_group=object())
