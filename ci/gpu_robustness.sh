#!/usr/bin/env bash
# GPU host: robustness of the Triton kernels in one call (ci/robustness/__init__.py says what
# each part checks): compute-sanitizer over a sweep of every kernel, 128k/256k tokens,
# randomized parity.
#
#   [SECTIONS="sanitize long parity"] [SEED=13] [CASES=200] [OUT=...] bash ci/gpu_robustness.sh
#
# Runs from the checkout with PYTHONPATH (no index needed; $PYTHON, default python3, must have
# torch and triton). Each part runs under its own timeout (SANITIZE_TIMEOUT, LONG_TIMEOUT,
# PARITY_TIMEOUT, in seconds) and writes <part>.json and <part>.log under $OUT (default
# artifacts/gpu_robustness); report.json and report.md merge them. The last lines printed are the
# summary: one PASS/FAIL line per part with its counts, then the verdict. Always exits 0 once the
# summary is printed (the verdict is in it and in report.json).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-artifacts/gpu_robustness}"
PY="${PYTHON:-python3}"
SECTIONS="${SECTIONS:-sanitize long parity}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/packages/nsa-core/src:$PWD/packages/nsa-kernels/src:$PWD/packages/nsa-bench/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  echo "compute-sanitizer: $(command -v compute-sanitizer || echo 'not on PATH')"
  echo "sections: $SECTIONS"
} 2>&1 | tee "$OUT/gpu.txt"

run_part() {  # PART TIMEOUT_S ARGS...: the part's output on the terminal and in $OUT/PART.log
  local part="$1" limit="$2"; shift 2
  rm -f "$OUT/$part.json"  # a result left by an earlier run must not stand in for this one
  echo "== $part (timeout ${limit}s)" >&2
  timeout --kill-after=15 "$limit" "$PY" ci/gpu_robustness.py "$part" --out "$OUT" "$@" 2>&1 |
    tee "$OUT/$part.log"
  echo "== $part: exit ${PIPESTATUS[0]}" >&2
}

for part in $SECTIONS; do
  case "$part" in
    sanitize) run_part sanitize "${SANITIZE_TIMEOUT:-480}" ;;
    long) run_part long "${LONG_TIMEOUT:-360}" ;;
    parity)
      limit="${PARITY_TIMEOUT:-420}"
      # The script stops itself (and says so) before the hard timeout, keeping its counts.
      run_part parity "$limit" --seed "${SEED:-13}" --cases "${CASES:-200}" --time-limit "$((limit - 45))"
      ;;
    *) echo "unknown section '$part' (known: sanitize long parity)" >&2 ;;
  esac
done

echo "== summary (details: $OUT/report.md)"
"$PY" ci/gpu_robustness.py report --out "$OUT" --sections "$SECTIONS"
source ci/pack_out.sh
pack_out "$OUT" report.md report.json gpu.txt
exit 0
