#!/usr/bin/env bash
# GPU host: the FA-2 and CUDA-selection GPU tests and the FA-2 bench, logs under $OUT.
#
#   OUT=/some/folder ci/gpu_fa2_cuda.sh [PHASE ...]     PHASE: env cuda fa2 bench (default: all)
#
# Runs from the repo copy with the host's python3 (torch with CUDA, no package index): the three
# packages come from PYTHONPATH, flash_attn from the site dir ci/build_flash_attn.sh builds into.
# A run that must fit a 10-minute slot can be split, for example:
#   ci/build_flash_attn.sh start && OUT=... ci/gpu_fa2_cuda.sh env cuda     # while FA-2 builds
#   ci/build_flash_attn.sh wait 540                                          # repeat until built
#   OUT=... ci/gpu_fa2_cuda.sh fa2 bench
# Each phase is capped at PHASE_TIMEOUT seconds (default 540). BENCH_T / BENCH_D override the
# bench's lengths and head dims. The last thing printed is a short table of what ran.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:?set OUT to the folder that receives the logs}"
LOGS="$OUT/fa2_cuda"
PYTHON="${PYTHON:-python3}"
PHASE_TIMEOUT="${PHASE_TIMEOUT:-540}"
BENCH_T="${BENCH_T:-16,64,128,256,512,1024,2048,4096,8192,16384}"
BENCH_D="${BENCH_D:-64,128}"
mkdir -p "$LOGS"
cd "$ROOT" || exit 1

FA_SITE_LINE="$(ci/build_flash_attn.sh env)"
eval "$FA_SITE_LINE"
export PYTHONPATH="$ROOT/packages/nsa-core/src:$ROOT/packages/nsa-kernels/src:$ROOT/packages/nsa-bench/src:$PYTHONPATH"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/build/torch_extensions}"
export NSA_DEBUG_LOG=1 NSA_DEBUG_LOG_LIMIT=5

# torch.utils.cpp_extension.load needs ninja; fall back to the wheel carried in .carry/.
if ! command -v ninja >/dev/null 2>&1 && ! "$PYTHON" -c 'import ninja' 2>/dev/null; then
  wheel="$(ls -t .carry/ninja-*.whl 2>/dev/null | head -n 1 || true)"
  if [[ -n "$wheel" ]]; then
    "$PYTHON" -m pip install --no-index --no-deps --target build/tools "$wheel" >/dev/null
    export PATH="$ROOT/build/tools/bin:$PATH" PYTHONPATH="$ROOT/build/tools:$PYTHONPATH"
  fi
fi

SUMMARY=()
record() {  # phase, status, detail, seconds
  SUMMARY+=("$(printf '%-7s %-8s %6ss  %s' "$1" "$2" "$4" "$3")")
}

pytest_counts() {  # the final "N passed, M failed ..." line of a pytest log
  grep -E '^=+ .*(passed|failed|skipped|error).* in [0-9.]+s' "$1" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//'
}

source ci/tiers.sh

run_pytest() {  # phase, log name, tier of ci/tiers.py, folder
  local phase="$1" log="$LOGS/$2"
  local start=$SECONDS rc cmd
  tier_command cmd "$3" "$4" || { record "$phase" FAIL "no tier $3 under $4" 0; return; }
  timeout "$PHASE_TIMEOUT" "${cmd[@]}" -rA -v -s >"$log" 2>&1
  rc=$?
  local status=ok
  ((rc == 0)) || status=FAIL
  ((rc == 124)) && status=TIMEOUT
  ((rc == 5)) && status=NONE  # nothing collected
  record "$phase" "$status" "$(pytest_counts "$log") ($(basename "$log"))" $((SECONDS - start))
}

phase_env() {
  local start=$SECONDS
  {
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi || true
    git rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
    "$PYTHON" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0), "sm%d%d" % torch.cuda.get_device_capability(0))
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton missing:", exc)
try:
    import flash_attn
    print("flash_attn", flash_attn.__version__)
except Exception as exc:  # not built yet is a normal state here
    print("flash_attn not importable:", exc)
PY
    ci/build_flash_attn.sh status || true
  } >"$LOGS/env.txt" 2>&1
  record env ok "$(grep -m1 '^device' "$LOGS/env.txt")" $((SECONDS - start))
}

phase_cuda() {
  run_pytest cuda cuda_sel_tests.log cuda packages/nsa-kernels/tests/selected/cuda
  grep -h '^cuda_sel ' "$LOGS/cuda_sel_tests.log" >"$LOGS/cuda_sel_mae.txt" || true
}

phase_fa2() {
  if ! "$PYTHON" -c 'import flash_attn' 2>/dev/null; then
    record fa2 SKIP "flash_attn not importable: $(ci/build_flash_attn.sh status | head -n 1)" 0
  fi
  # Without flash_attn the fa2-marked tests skip with that reason; the fallback tests (the "gpu"
  # tier's part of tests/fa2) still run.
  run_pytest fa2 fa2_tests.log fa2 packages/nsa-kernels/tests/fa2
  run_pytest fa2 fa2_fallback_tests.log gpu packages/nsa-kernels/tests/fa2
  local varlen
  varlen="$(grep -cE '^PASSED .*fa2_gpu_varlen' "$LOGS/fa2_tests.log" || true)"
  local varlen_bad
  varlen_bad="$(grep -cE '^(FAILED|ERROR) .*fa2_gpu_varlen' "$LOGS/fa2_tests.log" || true)"
  record fa2 info "-k fa2_gpu_varlen: $varlen passed, $varlen_bad failed" 0
}

bench_once() {  # name, extra args...
  local name="$1"
  shift
  local start=$SECONDS rc
  timeout "$PHASE_TIMEOUT" "$PYTHON" -m nsa_bench.cli fa2 --csv "$LOGS/$name.csv" \
    --seqlens "$BENCH_T" "$@" >"$LOGS/$name.txt" 2>"$LOGS/$name.log"
  rc=$?
  local status=ok
  ((rc == 0)) || status=FAIL
  ((rc == 124)) && status=TIMEOUT
  record bench "$status" "$name.csv, $(grep -c '_FA2_MIN_LEN' "$LOGS/$name.txt") cutoffs" \
    $((SECONDS - start))
}

phase_bench() {
  local build_state=0
  ci/build_flash_attn.sh status >/dev/null 2>&1 || build_state=$?
  if ((build_state == 2)); then
    record bench WARN "flash-attn is still compiling: these timings are not quotable" 0
  fi
  bench_once fa2_bench_fwd --head-dims "$BENCH_D" --modes fwd --methods fa2,flex,sdpa
  bench_once fa2_bench_fwd_bwd --head-dims 128 --modes fwd_bwd --methods fa2,sdpa
}

PHASES=("$@")
((${#PHASES[@]})) || PHASES=(env cuda fa2 bench)
for phase in "${PHASES[@]}"; do
  case "$phase" in
    env) phase_env ;;
    cuda) phase_cuda ;;
    fa2) phase_fa2 ;;
    bench) phase_bench ;;
    *) echo "unknown phase $phase (env cuda fa2 bench)" >&2; exit 64 ;;
  esac
done

{
  echo
  for name in fa2_bench_fwd fa2_bench_fwd_bwd; do
    [[ -f "$LOGS/$name.txt" ]] || continue
    echo "== $name"
    cat "$LOGS/$name.txt"
  done
  [[ -s "$LOGS/cuda_sel_mae.txt" ]] && { echo "== cuda_sel parity"; cat "$LOGS/cuda_sel_mae.txt"; }
  echo
  echo "phase   status   time    detail        (logs: $LOGS)"
  printf '%s\n' "${SUMMARY[@]}"
} | tee "$LOGS/summary.txt"
grep -qE '^\S+ +(FAIL|TIMEOUT)' "$LOGS/summary.txt" && exit 1
exit 0
