#!/usr/bin/env bash
# GPU host: torch.compile of NSA checked and timed in one call.
#
#   [SEQLENS=8k,64k] [PHASES="tests bench profile"] bash ci/gpu_compile.sh
#
# tests: the compile tests and the tests of what a traced call runs (the folded cuDNN compressed
# runs, the fused core, the selected branch, the default routes), in the triton-gpu, gpu and slow
# tiers, 8 pytest-xdist workers each. bench: `nsa-bench layer` of nsa_core and nsa_module, eager
# and compiled, in one run. profile: ci/profile_compiled.py at 8k and 64k, forward+backward.
# Logs go to $OUT (or artifacts/gpu_compile); the last lines printed are the test counts and the
# bench table.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SEQLENS="${SEQLENS:-8k,64k}"
PHASES="${PHASES:-tests bench profile}"
source ci/gpu_host.sh
gpu_run_start artifacts/gpu_compile
source ci/tiers.sh

TESTS=(
  packages/nsa-kernels/tests/test_compile_gpu.py
  packages/nsa-kernels/tests/test_default_routes_gpu.py
  packages/nsa-kernels/tests/compressed
  packages/nsa-kernels/tests/core
  packages/nsa-kernels/tests/selected
)
if [[ " $PHASES " == *" tests "* ]]; then
  for tier in triton-gpu gpu slow; do
    echo "== tests: $tier" >&2
    tier_command cmd "$tier" "${TESTS[@]}" || continue
    timeout "${TEST_TIMEOUT:-400}" "${cmd[@]}" -n 8 -q -rs -p no:cacheprovider --durations=15 \
      >"$OUT/tests_$tier.log" 2>&1
    echo "tests $tier: exit $? | $(tail -1 "$OUT/tests_$tier.log")" | tee -a "$OUT/summary.txt"
  done
fi

if [[ " $PHASES " == *" bench "* ]]; then
  echo "== bench: nsa-bench layer $SEQLENS, eager and compiled" >&2
  timeout "${BENCH_TIMEOUT:-450}" python3 -m nsa_bench.cli layer --seqlens "$SEQLENS" \
    --head-dims 128/128 --no-steps \
    --methods nsa_core,nsa_core_compiled,nsa_module,nsa_module_compiled \
    --out "$OUT/layer" 2>"$OUT/layer.log"
  echo "bench layer: exit $?" | tee -a "$OUT/summary.txt"
fi

if [[ " $PHASES " == *" profile "* ]]; then
  for t in 8192 65536; do
    echo "== profile: T=$t fwd+bwd" >&2
    timeout 300 python3 ci/profile_compiled.py --seqlen "$t" --mode fwd+bwd --out "$OUT" \
      >"$OUT/profile_$t.log" 2>&1
    echo "profile $t: exit $?" | tee -a "$OUT/summary.txt"
    head -6 "$OUT/profile_$t.log"
  done
fi

cat "$OUT/summary.txt"
[[ -f "$OUT/layer/layer.md" ]] && cat "$OUT/layer/layer.md"
exit 0
