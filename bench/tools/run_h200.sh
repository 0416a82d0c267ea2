#!/usr/bin/env bash
# The H200 checks, by stage; a device call allows 600 s, so give each call stages that fit. The suites run over
# XDIST pytest-xdist workers (default 8 of the machine's 16 cores; XDIST=0 runs them in one process, where each takes
# close to the whole 560 s timeout: compiles dominate). With 8 workers the torch stage took 130 s. Stages (minutes):
#   tests (fastce_torch, examples, bench/tests with --gpu), tests-jax (fastce_jax --gpu), shared (shared_tests --gpu),
#   sanitizer (compute-sanitizer memcheck with the allocators' pools off: kernel tests of both packages, the shared
#     fuzz and class-weight cases, the vocab-parallel check on one NCCL rank; seven processes at once, ~2-8);
#   bench (`python -m bench --results-md`, every pass and implementation in a worker process of its own; ~5.5), or
#     bench-torch and bench-jax in two calls, joined afterwards on any machine (no GPU needed) with
#       python -m bench --merge bench-torch.json bench-jax.json --results-md
#   linear-quick (fused linear CE at one shape with a float32 check; ~1), linear-a and linear-b (the fused linear
#     table's five shapes in two calls, ~4-5 each; RESULTS.md renders both), linear-ignored (one shape at 0/50/90%
#     ignored labels, with and without skip_ignored_rows, both packages; ~4);
#   host (host time per eager call: bench.tools.overhead; ~2); transformers (training step, four modes; ~2-3);
#   rl (the RL step's LM head, bench/tools/rl_step.py: each of its two shapes in a process of its own, torch and JAX
#     rows, ~4 each before issue 47's five rows, not yet timed with them: prefer rl-a / rl-b, one shape per call
#     with 580 s); JSON and logs $OUT/rl-step-{a,b}.*;
#   distill (issue 38's distillation heads, bench/tools/distill_step.py: each of its two shapes in a process of its own,
#     torch and JAX rows at four (beta, T), ~4 each; or distill-a / distill-b, one shape per call with more slack);
#     JSON and logs $OUT/distill-{a,b}.*; DISTILL_IMPLS (a comma list of row names, e.g.
#     fastce_torch_skip,fastce_jax_skip,fastce_torch_448mib_skip,fastce_jax_448mib_skip) runs those rows only (default:
#     all; the two matmul floors always run);
#   two-gpus (the tests that need two GPUs; kind nvidia-h200-x2), two-gpus-bench (sharded_torch with its per-rank
#     breakdown, sharded_jax; x2, ~3), two-gpus-linear-bench (sharded_linear_torch; x2, ~1-2), one-rank-breakdown
#     (sharded_torch as a one-rank NCCL group at the two-GPU run's local shard shapes; < 2);
#   outside-liger (Liger-Kernel's own CE and fused linear test files with fastce substituted, then on Liger itself:
#     bench/tools/outside_suites.py; needs the liger wheel in .whl/ and Liger's tests in .outside/liger-tests, see
#     bench/NOTES.md; ~3-6).
# The probes whose questions are settled (bench/NOTES.md, "Settled probes") had stages here; git history keeps them.
# Logs and results land in ${OUT:-/tmp/fastce-h200}. Usage from the repo root, liger wheel in .whl/:
#   BENCH_COMMIT=$(git rev-parse HEAD) bash bench/tools/run_h200.sh tests transformers bench
set -uo pipefail
OUT=${OUT:-/tmp/fastce-h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
XDIST=${XDIST:-8}
PYTEST="python3 -m pytest --gpu -q -p no:cacheprovider -W ignore::DeprecationWarning"
[ "$XDIST" != 0 ] && PYTEST="$PYTEST -n $XDIST"
for stage in "$@"; do
  case "$stage" in
    tests)
      timeout -s INT 560 $PYTEST -rfE fastce_torch examples bench/tests >"$OUT/gpu-tests.log" 2>&1
      tail -8 "$OUT/gpu-tests.log" ;;
    tests-jax)
      timeout -s INT 560 $PYTEST -rfE fastce_jax >"$OUT/gpu-tests-jax.log" 2>&1; tail -8 "$OUT/gpu-tests-jax.log" ;;
    two-gpus)
      timeout -s INT 420 $PYTEST -rfE fastce_torch/tests/test_sharding.py fastce_jax/tests/test_sharding.py \
        fastce_jax/tests/test_rl_sharding.py \
        fastce_torch/tests/test_training_loops.py fastce_torch/tests/test_linear_sharding.py \
        -k "two_gpus or second_gpu or sharding or shard_map" \
        >"$OUT/gpu-tests-two.log" 2>&1; tail -8 "$OUT/gpu-tests-two.log" ;;
    two-gpus-bench)
      # Vocab-parallel torch against DTensor loss_parallel with each rank's breakdown; JAX rows- and vocab-sharded
      # against XLA with the collectives of the compiled HLO.
      timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.tools.sharded_torch \
        --json "$OUT/h200x2-sharded-torch.json" >"$OUT/sharded-torch.log" 2>&1; tail -14 "$OUT/sharded-torch.log"
      timeout 240 python3 -m bench.tools.sharded_jax --json "$OUT/h200x2-sharded-jax.json" >"$OUT/sharded-jax.log" 2>&1
      tail -14 "$OUT/sharded-jax.log" ;;
    one-rank-breakdown)
      timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m bench.tools.sharded_torch \
        --shapes 8192x64128,8192x128000 --json "$OUT/h200-one-rank-sharded-torch.json" >"$OUT/one-rank.log" 2>&1
      tail -12 "$OUT/one-rank.log" ;;
    two-gpus-linear-bench)
      timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.tools.sharded_linear_torch \
        --json "$OUT/h200x2-linear-sharded.json" >"$OUT/linear-sharded.log" 2>&1; tail -14 "$OUT/linear-sharded.log" ;;
    shared)
      FASTCE_SHARED_SUMMARY="$OUT/shared-summary.json" timeout -s INT 560 $PYTEST shared_tests >"$OUT/shared-tests.log" 2>&1
      tail -15 "$OUT/shared-tests.log" ;;
    host)
      timeout 200 python3 -m bench.tools.overhead --json "$OUT/overhead.json" >"$OUT/overhead.log" 2>&1
      tail -45 "$OUT/overhead.log" ;;
    rl|rl-a|rl-b)
      # Shape a: Qwen2.5-7B's head (8192 x 3584 x 152064); b: Llama-3-8B's at 16384 tokens.
      for part in a b; do
        [ "$stage" != rl ] && [ "$stage" != "rl-$part" ] && continue
        shape=8192x3584x152064; [ $part = b ] && shape=16384x4096x128256
        timeout $([ "$stage" = rl ] && echo 285 || echo 580) python3 -m bench.tools.rl_step --shapes $shape \
          --json "$OUT/rl-step-$part.json" >"$OUT/rl-step-$part.log" 2>"$OUT/rl-step-$part-progress.log"
        echo "rl-step $part: exit $?"; tail -48 "$OUT/rl-step-$part.log"; grep -E "FAILED|skipped" "$OUT/rl-step-$part-progress.log"
      done ;;
    distill|distill-a|distill-b)
      # Shape a: Qwen2.5-1.5B's head taught by Qwen2.5-7B's hidden states (8192 x 1536 x 3584 x 151936); b: Llama-3.2-1B
      # taught by Llama-3.1-8B (8192 x 2048 x 4096 x 128256). Liger's row needs the wheel in .whl/.
      for part in a b; do
        [ "$stage" != distill ] && [ "$stage" != "distill-$part" ] && continue
        shape=8192x1536x3584x151936; [ $part = b ] && shape=8192x2048x4096x128256
        timeout $([ "$stage" = distill ] && echo 290 || echo 580) python3 -m bench.tools.distill_step --shapes $shape \
          ${DISTILL_IMPLS:+--impls "$DISTILL_IMPLS"} \
          --json "$OUT/distill-$part.json" >"$OUT/distill-$part.log" 2>"$OUT/distill-$part-progress.log"
        echo "distill $part: exit $?"; tail -36 "$OUT/distill-$part.log"
        grep -E "FAILED|skipped" "$OUT/distill-$part-progress.log"
      done ;;
    transformers)
      timeout 400 python3 -m bench.tools.transformers_step --json "$OUT/transformers-step.json" 2>&1 | tail -12 ;;
    bench)
      timeout 560 python3 -m bench --results-md 2>"$OUT/bench-progress.log" | tail -50
      grep -E "FAILED|Traceback|killed|exited with|no CUDA graph|no leaf|priming" "$OUT/bench-progress.log" | tail -20
      cp bench/RESULTS.md "$OUT/"; cp $(ls -t bench/results/*.json | head -1) $(ls -t bench/results/*.png | head -1) "$OUT/" 2>/dev/null ;;
    bench-torch|bench-jax)
      timeout 560 python3 -m bench --frameworks "${stage#bench-}" --json "$OUT/$stage.json" \
        2>"$OUT/$stage-progress.log" | tail -32
      grep -E "FAILED|Traceback|killed|exited with|no CUDA graph|no leaf|priming" "$OUT/$stage-progress.log" | tail -20 ;;
    linear-quick)
      timeout 300 python3 -m bench --linear --quick --json "$OUT/linear-quick.json" 2>"$OUT/linear-quick.log" | tail -12
      grep -E "vs float32|FAILED" "$OUT/linear-quick.log" ;;
    linear)
      timeout 590 python3 -m bench --linear --json "$OUT/linear.json" 2>"$OUT/linear-progress.log" | tail -24 ;;
    linear-a|linear-b)
      shapes=4096x4096x128256,8192x4096x128256,8192x3584x152064
      [ "$stage" = linear-b ] && shapes=8192x2304x256000,32768x4096x128256
      timeout 560 python3 -m bench --linear --linear-shapes "$shapes" --json "$OUT/$stage.json" \
        2>"$OUT/$stage-progress.log" | tail -24 ;;
    linear-ignored)
      timeout 560 python3 -m bench --linear --ignored --linear-shapes 8192x4096x128256 \
        --json "$OUT/linear-ignored.json" 2>"$OUT/linear-ignored-progress.log" | tail -24 ;;
    outside-liger)
      timeout 580 python3 -m bench.tools.outside_suites --liger-tests .outside/liger-tests --baseline --timeout 280 \
        --workers "$XDIST" --json "$OUT/outside-liger.json" >"$OUT/outside-liger.log" 2>&1
      head -60 "$OUT/outside-liger.log" ;;
    sanitizer)
      # compute-sanitizer memcheck, several processes at once (memcheck is mostly host-bound instrumentation), each one
      # pytest process (-v: the log names every test that ran, so a run cut off by its timeout still says what was
      # covered; invalid accesses print inline as they happen). The framework pools are off so that an access past a
      # tensor's end lands outside its own allocation and is reported, not absorbed by a cached block.
      export PYTORCH_NO_CUDA_MEMORY_CACHING=1 XLA_PYTHON_CLIENT_ALLOCATOR=platform FASTCE_FUZZ_EXAMPLES=40
      # compute-sanitizer itself crashed (SIGSEGV, no Python fault) at random points in processes that run JAX: a
      # crashed run is run again (at most three times in all) without the tests it passed; XLA's command buffers and
      # GEMM autotuning are off (neither stopped the crashes); the JAX linear tests, where it crashed every time among
      # the other processes, run after them, alone.
      memcheck() {
        local name=$1 log=$OUT/memcheck-$1.log done_ids=() attempt; shift
        for attempt in 1 2 3; do
          [ $attempt -gt 1 ] && log=$OUT/memcheck-$name-retry$((attempt - 1)).log
          timeout -s INT -k 30 ${SANITIZER_S:-150} compute-sanitizer --tool memcheck --print-limit 20 "$@" \
            "${done_ids[@]}" >"$log" 2>&1
          [ $? = 139 ] && ! grep -q "ERROR SUMMARY" "$log" || break
          mapfile -t -O ${#done_ids[@]} done_ids < <(grep " PASSED" "$log" | sed 's/ PASSED.*//; s/^/--deselect=/')
        done
      }
      pyv="python3 -m pytest --gpu -v -p no:cacheprovider -W ignore::DeprecationWarning -o console_output_style=classic"
      # Every kernel test of both packages but torch.compile's (inductor's compiles, not fastce's kernels), the peak
      # memory ones (the pools off change what they measure), CUDA-graph capture (without the pool every allocation is a
      # cudaMalloc, which capture refuses) and float64 gradcheck (the same kernels on tiny shapes, hundreds of calls
      # per test: 19 of them took 400 s).
      skip="not compile and not fullgraph and not inductor and not memory and not capture and not gradcheck"
      memcheck torch-ce $pyv fastce_torch/tests/test_cross_entropy.py -k "$skip" &
      memcheck torch-linear $pyv fastce_torch/tests/test_linear_cross_entropy.py -k "$skip" &
      export XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0"
      memcheck jax $pyv fastce_jax/tests/test_kernels.py -k "$skip" &
      # The shared cases one framework per process where they can be (the fuzz compares both in each example).
      memcheck shared-fuzz $pyv shared_tests/test_fuzz.py &
      for framework in torch jax; do
        memcheck shared-weights-$framework $pyv shared_tests/test_class_weights.py -k "(against_reference \
          or test_linear_cross_entropy or several_vocab_chunks or gpu_large_vocab) and $framework" &
      done
      memcheck vocab-parallel --target-processes all python3 -m torch.distributed.run --standalone \
        --nproc-per-node 1 -m fastce_torch.tests.vocab_parallel_check --device=cuda --backend=kernel --rows=37 \
        --local-vocab=300 --poisoned &
      wait
      memcheck jax-linear $pyv fastce_jax/tests/test_linear_cross_entropy.py -k "$skip"
      unset PYTORCH_NO_CUDA_MEMORY_CACHING XLA_PYTHON_CLIENT_ALLOCATOR FASTCE_FUZZ_EXAMPLES XLA_FLAGS
      # NCCL's communicator init probes its kernels and gets cudaErrorNoKernelImageForDevice (8 "Program hit" reports
      # in the vocab-parallel log): API return codes, not memory accesses.
      for log in "$OUT"/memcheck-*.log; do
        echo "== $(basename "$log"): $(grep -c ' PASSED' "$log") passed, $(grep -c ' FAILED' "$log") failed," \
          "$(grep -cE '^========= +(Invalid|Uninitialized|Malloc|Leaked)' "$log") invalid accesses," \
          "$(grep -c '^========= Program hit' "$log") API errors"
        grep -E "ERROR SUMMARY|[0-9]+ (passed|failed)|^vocab-parallel:|^rank .* FAIL|^FAILED" "$log" | tail -4
        grep -m6 -E "^========= +Invalid" "$log"
        grep -q "ERROR SUMMARY" "$log" || echo "   no ERROR SUMMARY (crashed or cut off); last: $(grep -E '::' "$log" | tail -1)"
      done ;;
  esac
done
