#!/usr/bin/env bash
# Release jobs: fastce_torch on the torch and Triton releases newer than the pinned CI stack. .ci/run starts
# `releases.sh prepare` in the background during its main suite and `releases.sh run` after it; each job runs a
# representative subset, so the whole script stays within ~6 minutes on the 2-core CI machine. Measured there on 2026-12-03 from a clean tree while five other sessions shared its CPU (load
# 6-9): 4 min 11 s wall, 3 min 38 s of CPU: environments 108 s, then 44 / 41 / 57 s for the three jobs (113, 113 and
# 119 passed, 50 skipped each: 45 of them shared cases whose torch side passed, 5 GPU-only tests).
#
# Environments, built cheaply:
#   .ci-venv-releases     torch 2.13.0 (CPU build, from disk) + triton 3.8.0 + the test tools; no jax (the shared
#                         suite then checks the torch side only: shared_tests/harness.py skips the jax half).
#   .ci-overlay-triton39  triton 3.9.0 alone (pip install --no-deps --target), put first on PYTHONPATH over the venv
#                         above: `import triton` and importlib.metadata both find it before the venv's 3.8.0; the job
#                         checks which triton it imported before running anything.
#   .ci-overlay-torch214  torch 2.14.1 (its CUDA build from disk: no CPU build is on the machine) with what it pins
#                         (triton 3.8.0, the CUDA 13 libraries its import loads even without a GPU), over the same
#                         venv, which gives numpy and the test tools.
# Constraints per release: .ci/constraints-triton38.txt, -triton39.txt, -torch214.txt.
#
# The subset each job runs, and why (measured per test with --durations on the shared CPU, load ~10: the kept set
# sums to ~200 s of test time per job there against ~540 s for the first draft):
#   - fastce_torch/tests/test_cross_entropy.py: every kernel option, dtype, reduction and edge case, interpreted, and
#     test_kernels_compile_for_h200, the sm_90 compile check of every kernel variant with the release's own compiler
#     (what the interpreter cannot check). Left out: the 90 float64 gradchecks (same kernels, float64), the
#     V=128256 / 256000 parametrisations (10-23 s each; V=70000 and 262147 keep the multi-chunk and odd-width paths),
#     and test_reduction_over_many_rows_and_chunks (93 s; the reduction kernel runs in every reduced case kept).
#   - fastce_torch/tests/test_linear_cross_entropy.py, the eager tests: the fused linear loss's chunk loop and custom
#     ops. Left out: gradchecks, torch.compile tests (CPU inductor builds take minutes; the torch.compile path is
#     version-sensitive in torch, not Triton, and the oldest-torch job covers it for 2.11), and
#     test_chunking_keywords_reach_the_custom_ops (55 s of plumbing). Autocast tests only in the torch 2.14 job.
#   - fastce_torch/tests/test_launch_cache.py -k "other_triton or read_once": the launch cache (a reproduction of
#     Triton 3.6.0's launch path) is refused at import on this release, naming it, and launches take Triton's own path
#     with right results.
#   - shared_tests/test_shared_cases.py::test_case, the torch side against the float64 reference (no jax here: each
#     case reports "skipped" after its torch checks passed), in bfloat16, the training dtype: 45 of its 135 cases.
#   - fastce_torch/tests/test_versions.py: the import-time range check stays quiet on a tested release.
#   The torch 2.14 job runs Triton 3.8.0, as the triton-3.8 job does: test_options, test_vocab_sizes_and_dtypes and
#   the sm_90 compile check (Triton's alone) are left to that job (~26 CPU seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0
step() { echo "== [${SECONDS}s] $*"; }

# `releases.sh prepare` builds the environments (mostly unpacking: .ci/run starts it in the background while its main
# suite runs), `releases.sh run` runs the jobs on them; no argument does both.
VENV_PY=.ci-venv-releases/bin/python
prepare() {
    step "environments"
    python3 -m venv .ci-venv-releases
    # torch first and alone (the CPU build on disk; an unpinned torch would pull a CUDA build), then the rest.
    $VENV_PY -m pip install -q -c .ci/constraints-triton38.txt torch==2.13.0
    $VENV_PY -m pip install -q -c .ci/constraints-triton38.txt triton numpy pytest pytest-xdist hypothesis
    rm -rf .ci-overlay-triton39 .ci-overlay-torch214
    $VENV_PY -m pip install -q --no-deps --no-compile --target .ci-overlay-triton39 -c .ci/constraints-triton39.txt triton
    # With its dependencies (the CUDA 13 libraries: torch 2.14.1's import loads them, GPU or not; ~5 GB unpacked).
    $VENV_PY -m pip install -q --no-compile --target .ci-overlay-torch214 -c .ci/constraints-torch214.txt torch
    step "environments ready"
}

KERNEL_TESTS=(fastce_torch/tests/test_cross_entropy.py fastce_torch/tests/test_linear_cross_entropy.py
    fastce_torch/tests/test_versions.py)
SHARED=(shared_tests/test_shared_cases.py::test_case)

run_job() {  # name, PYTHONPATH overlay ("" for none), expected "torch triton", extra -k for the linear tests,
    # extra -k for the whole selection
    local name=$1 overlay=$2 expected=$3 linear_k=$4 whole_k=${5:-}
    local path=.
    [ -n "$overlay" ] && path=".:$overlay"
    step "job $name"
    local found
    found=$(PYTHONPATH=$path $VENV_PY -c "import torch, triton; print(torch.__version__.split('+')[0], triton.__version__)")
    if [ "$found" != "$expected" ]; then
        echo "job $name: expected torch/triton $expected, imported $found" >&2
        return 1
    fi
    PYTHONPATH=$path $VENV_PY -m pytest -q -p no:cacheprovider -n 2 "${KERNEL_TESTS[@]}" \
        fastce_torch/tests/test_launch_cache.py "${SHARED[@]}" -k "($SELECTION $linear_k)) $whole_k"
}

# One -k expression; run_job closes the linear tests' clause with its extra terms.
SELECTION="(test_cross_entropy and not gradcheck and not 128256 and not 256000 and not many_rows_and_chunks) \
    or test_versions or (test_launch_cache and (other_triton or read_once)) or (test_case and bfloat16) \
    or (test_linear_cross_entropy and not gradcheck and not compile and not chunking_keywords_reach"

run_jobs() {
    # Every job runs even when one fails; the script fails at the end if any did.
    failed=()
    run_job triton-3.8 "" "2.13.0 3.8.0" "and not autocast" || failed+=(triton-3.8)
    run_job triton-3.9 .ci-overlay-triton39 "2.13.0 3.9.0" "and not autocast" || failed+=(triton-3.9)
    # torch 2.14.1 pins Triton 3.8.0, the triton-3.8 job's: the kernel grids and the sm_90 compile check (Triton's
    # alone) are that job's; this one keeps what goes through torch (autograd, custom ops, autocast, the cases).
    run_job torch-2.14 .ci-overlay-torch214 "2.14.1 3.8.0" "" \
        "and not test_options and not test_vocab_sizes_and_dtypes and not test_kernels_compile_for_h200" ||
        failed+=(torch-2.14)
    step "release jobs done"
    times  # CPU time (user, system) of this shell and of its children
    if [ ${#failed[@]} -gt 0 ]; then
        echo "release jobs failed: ${failed[*]}" >&2
        exit 1
    fi
}

case "${1:-all}" in
    prepare) prepare ;;
    run) run_jobs ;;
    all) prepare && run_jobs ;;
    *) echo "usage: $0 [prepare|run]" >&2 && exit 2 ;;
esac
