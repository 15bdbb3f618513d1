#!/usr/bin/env bash
# GPU host with two or more GPUs: context-parallel NSA checked against one GPU, then timed.
#
#   [CP_ARGS=...] bash ci/gpu_cp.sh [WORLD_SIZES] [SEQLENS]
#   (defaults: 1,2,4,8 and 128k,256k; world sizes above the visible GPU count become
#   skipped rows, longer lengths after an out-of-memory one too)
#
# Runs from the checkout with PYTHONPATH (no index needed). The GPU test compares 2 and 4 NCCL
# ranks with one GPU (bf16, the spec's bounds); `nsa-bench cp` times forward + backward per
# world size and length with the exchanges apart. Logs and the bench's CSV/JSON go to $OUT (or
# artifacts/gpu_cp); the last lines printed are the test count and the bench's table.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORLD_SIZES="${1:-1,2,4,8}"
SEQLENS="${2:-128k,256k}"
source ci/gpu_host.sh
gpu_run_start artifacts/gpu_cp

source ci/tiers.sh
echo "== tests: context parallel on GPUs" >&2
if tier_command cmd gpu packages/nsa-kernels/tests/test_context_parallel_gpu.py; then
  timeout "${TEST_TIMEOUT:-240}" "${cmd[@]}" -q -rs -p no:cacheprovider >"$OUT/tests_cp.log" 2>&1
  echo "tests cp: exit $? | $(tail -1 "$OUT/tests_cp.log")" | tee -a "$OUT/summary.txt"
fi

echo "== bench: nsa-bench cp $WORLD_SIZES $SEQLENS" >&2
timeout "${BENCH_TIMEOUT:-330}" python3 -m nsa_bench.cli cp --world-sizes "$WORLD_SIZES" \
  --seqlens "$SEQLENS" --iters 3 --warmup 1 --comm-iters 1 --out "$OUT/cp" ${CP_ARGS:-} \
  >"$OUT/cp.md" 2>"$OUT/cp.log"
echo "bench cp: exit $?" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/cp.log"
cat "$OUT/summary.txt"
cat "$OUT/cp.md"
exit 0
