#!/usr/bin/env bash
# The runner one-shot: environment, routing + pairing, every test tier, the benches, and a
# Markdown report, all under artifacts/runner/<commit>/ (or --out DIR). Exit code is non-zero
# when any step failed. Uses the interpreter's installed packages; when the nsa packages are not
# installed it runs them from source.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if ! "$python" -c "import nsa_core, nsa_kernels, nsa_bench" 2>/dev/null; then
  export PYTHONPATH="$PWD/packages/nsa-core/src:$PWD/packages/nsa-kernels/src:$PWD/packages/nsa-bench/src${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" -m nsa_bench.cli runner "$@"
