#!/usr/bin/env bash
# Everything the H200 checks in one go (device time is scarce): the GPU test suites, the side-by-side benchmark and
# the transformers training-step comparison. Logs and results land in ${OUT:-/tmp/fastce-h200}.
# Usage (repo root, liger wheel in .whl/): BENCH_COMMIT=$(git rev-parse HEAD) bash bench/run_h200.sh
set -uo pipefail
OUT=${OUT:-/tmp/fastce-h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
timeout 300 python3 -m pytest fastce_torch fastce_jax examples --gpu -q -p no:cacheprovider -W ignore::DeprecationWarning \
  >"$OUT/gpu-tests.log" 2>&1; tail -3 "$OUT/gpu-tests.log"
FASTCE_SHARED_SUMMARY="$OUT/shared-summary.json" timeout 200 python3 -m pytest shared_tests --gpu -q -p no:cacheprovider \
  -W ignore::DeprecationWarning >"$OUT/shared-tests.log" 2>&1; tail -12 "$OUT/shared-tests.log"
timeout 420 python3 -m bench --results-md 2>"$OUT/bench-progress.log" | tail -20
cp bench/results/*.json bench/results/*.png bench/RESULTS.md "$OUT/" 2>/dev/null
timeout 200 python3 bench/transformers_step.py --json "$OUT/transformers-step.json" 2>&1 | tail -12
