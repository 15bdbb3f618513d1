#!/usr/bin/env bash
# GPU host without a package index: one nox session on the host's own torch and triton, timed.
#
#   [WHEELS=.carry/nox] [OUT=...] bash ci/gpu_nox.sh SESSION [-- PYTEST_ARGS...]
#   bash ci/gpu_nox.sh gpu_parity-2.11 -- --durations=40
#
# Where python3 has no nox, it installs nox from the wheels in $WHEELS (nox and its pure-Python
# dependencies, fetched on a machine with an index: `pip download nox --python-version 3.12
# --only-binary=:all: -d WHEELS`) into a folder on PYTHONPATH. The session runs with
# NSA_NOX_SYSTEM_PACKAGES=1 (the packages built from this checkout, no install). The whole log
# goes to $OUT/nox_<session>.log; the last lines printed are the session's tier times and its
# wall time.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ $# -ge 1 ]] || { echo "usage: bash ci/gpu_nox.sh SESSION [-- PYTEST_ARGS...]" >&2; exit 2; }
session="$1"
shift
OUT="${OUT:-artifacts/gpu_nox}"
mkdir -p "$OUT"
if ! python3 -c "import nox" 2>/dev/null; then
  site="$(mktemp -d)/nox_site"
  python3 -m pip install --quiet --no-index --no-deps --target "$site" "${WHEELS:-.carry/nox}"/*.whl ||
    { echo "gpu_nox: could not install nox from ${WHEELS:-.carry/nox}" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
log="$OUT/nox_${session}.log"
t0=$(date +%s)
NSA_NOX_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1 python3 -m nox -s "$session" "$@" >"$log" 2>&1
rc=$?
dt=$(( $(date +%s) - t0 ))
grep -E "GPU tiers:|] [a-z0-9+-]+: (ok|FAILED) in|^nox > tiers:|passed|failed|error" "$log" | tail -20
echo "nox -s $session: exit $rc in $dt s ($(( dt / 60 )) min $(( dt % 60 )) s); log $log"
exit $rc
