#!/usr/bin/env bash
# GPU host: the whole NSA layer's GPU routes checked and timed in one call.
#
#   [TESTS="routes scoring compressed sliding combine decode"] [LAYER_ARGS=...] bash ci/gpu_layer.sh [SEQLENS] [HEAD_DIMS]
#   (defaults: every test set; 8k,16k,32k,64k and 128/128)
#
# Runs from the checkout with PYTHONPATH (no index needed); wheels under .carry/wheels (fla-core
# for the peer rows) are installed into a private folder first. Logs and the bench's CSV/JSON/
# Markdown go to $OUT (or artifacts/gpu_layer); the last lines printed are the test counts and the
# layer table.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SEQLENS="${1:-8k,16k,32k,64k}"
HEAD_DIMS="${2:-128/128}"
SITE=/tmp/nsa_site
if compgen -G ".carry/wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .carry/wheels/*.whl
fi
source ci/gpu_host.sh
gpu_run_start artifacts/gpu_layer "$SITE"

source ci/tiers.sh

run_tests() {  # name, folder or file, pytest args...: the "gpu" tier of ci/tiers.py there
  local name="$1" under="$2" cmd; shift 2
  echo "== tests: $name" >&2
  tier_command cmd gpu "$under" || return
  timeout "${TEST_TIMEOUT:-200}" "${cmd[@]}" -q -rs -p no:cacheprovider "$@" >"$OUT/tests_$name.log" 2>&1
  echo "tests $name: exit $? | $(tail -1 "$OUT/tests_$name.log")" | tee -a "$OUT/summary.txt"
}

# TESTS picks the sets (default all); LAYER_ARGS goes to the bench (e.g. "--methods nsa_core,fla").
# TESTS=none runs the bench alone.
TESTS="${TESTS:-routes scoring compressed sliding combine decode}"
[[ " $TESTS " == *" routes "* ]] && run_tests routes packages/nsa-kernels/tests/test_default_routes_gpu.py
[[ " $TESTS " == *" scoring "* ]] && run_tests scoring packages/nsa-kernels/tests/scoring/test_scoring_gpu.py
[[ " $TESTS " == *" scoring "* ]] && run_tests scoring_lse packages/nsa-kernels/tests/scoring/test_scoring_cmp_lse_gpu.py
[[ " $TESTS " == *" compressed "* ]] && run_tests compressed packages/nsa-kernels/tests/compressed/test_cmp_triton_gpu.py
[[ " $TESTS " == *" sliding "* ]] && run_tests sliding packages/nsa-kernels/tests/sliding
[[ " $TESTS " == *" combine "* ]] && run_tests combine packages/nsa-kernels/tests/combine
[[ " $TESTS " == *" decode "* ]] && run_tests decode packages/nsa-kernels/tests/decode -x

echo "== bench: nsa-bench layer $SEQLENS $HEAD_DIMS" >&2
timeout "${BENCH_TIMEOUT:-450}" python3 -m nsa_bench.cli layer --seqlens "$SEQLENS" \
  --head-dims "$HEAD_DIMS" --out "$OUT/layer" ${LAYER_ARGS:-} 2>"$OUT/layer.log"
echo "bench layer: exit $?" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/layer.log"
cat "$OUT/summary.txt"
[[ -f "$OUT/layer/layer.md" ]] && cat "$OUT/layer/layer.md"
source ci/pack_out.sh
pack_out "$OUT" summary.txt layer/layer.md layer/layer.csv layer/layer.json layer/layer.png
exit 0
