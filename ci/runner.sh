#!/usr/bin/env bash
# The runner (ci/runner.py) with the right Python: $PYTHON if set, else python3.
#
#   bash ci/runner.sh [--quick] [--tiers NAME,...] [--out DIR] [--skip-benches]
#
# Where the three nsa packages are not installed in that Python (a GPU host that has torch and
# triton but no package index), they run from this checkout through PYTHONPATH, and it says so.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-python3}"
if ! "$python" -c "import nsa_core, nsa_kernels, nsa_bench" 2>/dev/null; then
  echo "runner: nsa-core, nsa-kernels and nsa-bench are not installed in $python:" \
    "running them from this checkout (PYTHONPATH)" >&2
  export PYTHONPATH="$PWD/packages/nsa-core/src:$PWD/packages/nsa-kernels/src:$PWD/packages/nsa-bench/src${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" ci/runner.py "$@"
