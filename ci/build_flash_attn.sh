#!/usr/bin/env bash
# Build flash-attn (FlashAttention-2) from its sdist on a GPU host without a package index, in the
# background, into a --target site dir (it takes tens of minutes: docs/performance.md).
#
#   ci/build_flash_attn.sh start        # detach the build (setsid nohup) and return at once
#   ci/build_flash_attn.sh status       # running / built / failed, and the log's last lines
#   ci/build_flash_attn.sh wait [SECS]  # block until done (default 600 s); exit 0 built,
#                                       #   1 failed, 2 still running when SECS ran out
#   ci/build_flash_attn.sh env          # the PYTHONPATH line that makes `import flash_attn` work
#
# Inputs (environment):
#   FA_SDIST   the sdist (default: the newest .carry/flash_attn-*.tar.gz); fetch it where an index
#              is reachable with: FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download --no-deps
#              --no-build-isolation flash-attn==2.8.3.post2 -d .carry
#   FA_SITE    the --target dir (default build/flash_attn/site, kept between runs on one host)
#   FLASH_ATTN_CUDA_ARCHS  default: the visible GPU's compute capability (e.g. 90)
#   MAX_JOBS   default: the number of CPUs
# The build uses every core: take timings you will quote only after it has finished.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
STATE="$ROOT/build/flash_attn"
FA_SITE="${FA_SITE:-$STATE/site}"
LOG="$STATE/build.log"
PID_FILE="$STATE/build.pid"
RC_FILE="$STATE/build.rc"
TOOLS="$STATE/tools"
mkdir -p "$STATE"

importable() {
  PYTHONPATH="$FA_SITE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
    'import flash_attn, flash_attn_2_cuda; print("flash_attn", flash_attn.__version__)' 2>/dev/null
}

running() {
  [[ -f "$PID_FILE" ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null
}

# torch's BuildExtension compiles in parallel only with ninja; use the carried wheel if the host
# has none.
ensure_ninja() {
  if command -v ninja >/dev/null 2>&1 || "$PYTHON" -c 'import ninja' 2>/dev/null; then
    return
  fi
  local wheel
  wheel="$(ls -t "$ROOT"/.carry/ninja-*.whl 2>/dev/null | head -n 1 || true)"
  if [[ -z "$wheel" ]]; then
    echo "warning: no ninja on this host and none in .carry/: the build will be serial" >&2
    return
  fi
  "$PYTHON" -m pip install --no-index --no-deps --target "$TOOLS" "$wheel" >/dev/null
  export PATH="$TOOLS/bin:$PATH"
  export PYTHONPATH="$TOOLS${PYTHONPATH:+:$PYTHONPATH}"
}

start() {
  if importable >/dev/null; then
    echo "already built: $(importable) in $FA_SITE"
    return 0
  fi
  if running; then
    echo "already running (pid $(cat "$PID_FILE")), log: $LOG"
    return 0
  fi
  local sdist="${FA_SDIST:-$(ls -t "$ROOT"/.carry/flash_attn-*.tar.gz 2>/dev/null | head -n 1 || true)}"
  if [[ -z "$sdist" || ! -f "$sdist" ]]; then
    echo "no flash-attn sdist: set FA_SDIST or put flash_attn-*.tar.gz in .carry/" >&2
    return 1
  fi
  local archs="${FLASH_ATTN_CUDA_ARCHS:-$("$PYTHON" -c \
    'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")')}"
  local jobs="${MAX_JOBS:-$(nproc)}"
  ensure_ninja
  rm -f "$RC_FILE"
  echo "building $(basename "$sdist") for sm_$archs with MAX_JOBS=$jobs into $FA_SITE; log: $LOG"
  FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="$archs" MAX_JOBS="$jobs" \
    setsid nohup bash -c '
      "$1" -m pip install -v --no-index --no-build-isolation --no-deps --target "$2" "$3"
      echo $? > "$4"' _ "$PYTHON" "$FA_SITE" "$sdist" "$RC_FILE" >"$LOG" 2>&1 </dev/null &
  echo $! >"$PID_FILE"
  echo "started pid $(cat "$PID_FILE") at $(date -u +%H:%M:%SZ)"
}

status() {
  if importable >/dev/null; then
    echo "built: $(importable) in $FA_SITE"
    return 0
  fi
  if running; then
    local step
    step="$(grep -o '\[[0-9]*/[0-9]*\]' "$LOG" 2>/dev/null | tail -n 1 || true)"
    echo "running (pid $(cat "$PID_FILE")), ninja step ${step:-?}, log: $LOG"
    return 2
  fi
  if [[ -f "$RC_FILE" ]]; then
    echo "failed: pip exited $(cat "$RC_FILE"); last lines of $LOG:"
    tail -n 30 "$LOG"
    return 1
  fi
  echo "not started"
  return 1
}

wait_for() {
  local deadline=$((SECONDS + ${1:-600}))
  while running && ((SECONDS < deadline)); do
    sleep 10
  done
  status
}

case "${1:-status}" in
  start) start ;;
  status) status ;;
  wait) wait_for "${2:-600}" ;;
  env) echo "export PYTHONPATH=$FA_SITE\${PYTHONPATH:+:\$PYTHONPATH}" ;;
  *) echo "usage: $0 start|status|wait [SECS]|env" >&2; exit 64 ;;
esac
