#!/usr/bin/env bash
# GPU host: the GPU test tiers of ci/tiers.py, each with pytest-xdist workers, in one call.
#
#   [TIERS="triton-gpu gpu fa2 cuda slow"] [WORKERS=N] [TIER_TIMEOUT=540] [OUT=...] bash ci/gpu_tiers.sh
#
# Runs from the checkout with PYTHONPATH (no index needed). One pytest process per tier with
# WORKERS workers (default: ci/gpu_workers.py's number for the cards and cores here) spread over
# the visible GPUs (a tier the table marks serial runs in one process); each
# tier's log, with its slowest tests (--durations), goes to $OUT/tier_<name>.log. The last lines
# printed are one line per tier: its exit status, its wall time and pytest's closing line.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source ci/gpu_host.sh
gpu_run_start artifacts/gpu_tiers
source ci/tiers.sh

TIERS="${TIERS:-triton-gpu gpu fa2 cuda slow}"
read -r planned_workers worker_gpus < <(python3 ci/gpu_workers.py --explain)
WORKERS="${WORKERS:-$planned_workers}"
: >"$OUT/summary.txt"
for tier in $TIERS; do
  tier_command cmd "$tier" packages || { echo "unknown tier $tier" | tee -a "$OUT/summary.txt"; continue; }
  workers=(-n "$WORKERS" --worker-gpus "$worker_gpus")
  parallel=$(python3 -c "import sys; sys.path.insert(0, 'ci'); import tiers
print(next(t.parallel for t in tiers.TIERS if t.name == sys.argv[1]))" "$tier")
  [[ "$parallel" == "True" ]] || workers=()
  echo "== tier $tier: ${cmd[*]} ${workers[*]}" >&2
  t0=$(date +%s)
  timeout --kill-after=15 "${TIER_TIMEOUT:-540}" "${cmd[@]}" "${workers[@]}" -q -rfEs \
    -p no:cacheprovider --durations=15 >"$OUT/tier_$tier.log" 2>&1
  rc=$?
  echo "tier $tier: exit $rc in $(( $(date +%s) - t0 )) s | $(tail -1 "$OUT/tier_$tier.log")" |
    tee -a "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
