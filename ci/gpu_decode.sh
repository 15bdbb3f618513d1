#!/usr/bin/env bash
# GPU host: the fused decode path checked and timed in one call.
#
#   [TESTS=1] [SWEEP=1] [DECODE_ARGS=...] bash ci/gpu_decode.sh
#
# Runs the decode GPU tests (interpreter-tier tests compiled on the GPU included), then
# `nsa-bench decode` at B in {1, 8, 32} x S in {4k, 16k, 64k, 128k} with the layer step and the
# dense baselines, and with SWEEP=1 a tile/chunk sweep and a per-kernel profile at B=1, S=64k.
# Logs and the bench's CSV/JSON/PNG/Markdown go to $OUT (or artifacts/gpu_decode); the last
# lines printed are the test counts, the table and the targets.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source ci/gpu_host.sh
gpu_run_start artifacts/gpu_decode

source ci/tiers.sh

if [[ "${TESTS:-1}" == 1 ]]; then
  for tier in gpu triton-gpu; do
    echo "== tests: decode ($tier tier)" >&2
    tier_command cmd "$tier" packages/nsa-kernels/tests/decode || continue
    timeout "${TEST_TIMEOUT:-300}" "${cmd[@]}" -q -rs -p no:cacheprovider >"$OUT/tests_$tier.log" 2>&1
    echo "tests decode $tier: exit $? | $(tail -1 "$OUT/tests_$tier.log")" | tee -a "$OUT/summary.txt"
    grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests_$tier.log" | head -20 >&2
  done
fi

if [[ "${SWEEP:-0}" == 1 ]]; then
  echo "== bench: decode sweep B=1 S=64k" >&2
  timeout "${SWEEP_TIMEOUT:-200}" python3 -m nsa_bench.cli decode --batch-sizes 1 --seqlens 65536 --sweep \
    --sweep-chunks --no-layer --profile --iters 30 --repeats 3 --out "$OUT/sweep" >"$OUT/sweep.log" 2>&1
  echo "bench decode sweep: exit $?" | tee -a "$OUT/summary.txt"
  grep -E '"sweep"' "$OUT/sweep.log" | python3 -c "
import json, sys
for line in sys.stdin:
    row = json.loads(line)
    print('sweep B=1 S=64k best 5:', row['sweep'][:5])" | tee -a "$OUT/summary.txt"
  grep -E "_kernel " "$OUT/sweep.log" | head -6
fi

echo "== bench: nsa-bench decode ${DECODE_ARGS:-}" >&2
timeout "${BENCH_TIMEOUT:-300}" python3 -m nsa_bench.cli decode --out "$OUT/decode" \
  ${DECODE_ARGS:-} >"$OUT/decode.log" 2>"$OUT/decode.err"
echo "bench decode: exit $?" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/decode.err"
cat "$OUT/summary.txt"
[[ -f "$OUT/decode/decode.md" ]] && cat "$OUT/decode/decode.md"
tail -1 "$OUT/decode.log"
source ci/pack_out.sh
pack_out "$OUT" summary.txt decode/decode.md decode/decode.csv decode/decode.json decode/decode.png
exit 0
