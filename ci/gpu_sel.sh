#!/usr/bin/env bash
# Triton selected attention on a GPU host: GPU parity tests, then the prefill bench against
# fla-core's selection kernel (same block indices), the GQA group sweep and a tile-config sweep.
# Run from the repository root; it takes minutes of GPU time (docs/performance.md).
#
#   OUT=/some/dir ci/gpu_sel.sh
#
# Inputs (environment, all optional):
#   OUT          output folder (default: artifacts/gpu_sel)
#   SEL_TESTS    full | quick | none   (default full: every GPU test of the selection kernels;
#                quick: the G sweep, varlen, determinism and a slice of the parity matrix)
#   SEL_T        prefill lengths (default 8192,16384,32768,65536)
#   SEL_GROUPS   G sweep at the largest T (default 1,2,4,8,16; "" skips it)
#   SEL_CONFIGS  ';'-separated SelConfig strings timed at the largest T (default: a small sweep of
#                warps/stages/key tiles; set to "" to skip)
#   SEL_BENCH_ARGS  extra arguments for `nsa-bench sel --prefill` (default --probe: the K/V
#                gather alone, the forward's bandwidth floor; "" for none)
#   SEL_ROWS     1 (default) runs the rows-mode sweep of `nsa-bench sel` (N = 1024 query rows at
#                the end of L keys) and its NSA_SEL_TRITON_MIN_LEN recommendation; 0 skips it.
#                SEL_SEEDS, its earlier name, is still read when SEL_ROWS is unset.
#   SEL_ROWS_METHODS  methods of that sweep (default triton,cuda,sdpa,reference: the experimental
#                CUDA kernel listed beside Triton; it is compiled on first use). SEL_SEEDS_METHODS,
#                its earlier name, is still read when SEL_ROWS_METHODS is unset.
#   SEL_CUDA_T   prefill lengths at which the CUDA kernel's forward is timed beside Triton and
#                fla-core (default 8192,65536; "" skips)
# Files in $OUT: env.txt, tests.log, bench.log (progress and stderr), sel_rows.{csv,txt},
# sel_prefill.{csv,json,txt}, sel_cuda.{csv,txt}. The last lines printed are the tables.
# Carried wheels: every .carry/*.whl (fla-core for the peer) is installed with --no-deps into a
# site dir on PYTHONPATH; without fla-core the bench reports the peer as unavailable.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/artifacts/gpu_sel}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
SITE="${SEL_SITE:-/tmp/nsa_sel_site}"
SEL_TESTS="${SEL_TESTS:-full}"
SEL_T="${SEL_T:-8192,16384,32768,65536}"
SEL_GROUPS="${SEL_GROUPS-1,2,4,8,16}"
# Each entry is timed forward and forward+backward at the largest T (the defaults: forward 4 warps
# x 2 stages, dq 4 x 3, dk/dv 4 warps x 2 stages x 32 rows; docs/selection.md has the sweeps).
DEFAULT_CONFIGS="tma=2;tma=2,kv_hint=2;fwd_stages=3;fwd_warps=8;block_l=32"
DEFAULT_CONFIGS+=";dq_stages=2;dq_warps=8;dkv_rows=64;dkv_rows=16;dkv_warps=8"
SEL_CONFIGS="${SEL_CONFIGS-$DEFAULT_CONFIGS}"
SEL_ROWS="${SEL_ROWS:-${SEL_SEEDS:-1}}"
SEL_ROWS_METHODS="${SEL_ROWS_METHODS:-${SEL_SEEDS_METHODS:-triton,cuda,sdpa,reference}}"
SEL_CUDA_T="${SEL_CUDA_T-8192,65536}"
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/build/torch_extensions}"

shopt -s nullglob
wheels=(.carry/*.whl)
if ((${#wheels[@]})); then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}" \
    >/tmp/nsa_sel_pip.log 2>&1 || { echo "warning: installing carried wheels failed:"; tail -n 5 /tmp/nsa_sel_pip.log; }
fi
export PYTHONPATH="$ROOT/packages/nsa-core/src:$ROOT/packages/nsa-kernels/src:$ROOT/packages/nsa-bench/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  "$PYTHON" - <<'PY'
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} cuda {torch.version.cuda} triton {triton.__version__}")
print(f"device {p.name} sm_{p.major}{p.minor} sms {p.multi_processor_count} "
      f"l2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")
try:
    import fla
    print("fla-core", fla.__version__)
except Exception as exc:
    print("fla-core unavailable:", exc)
PY
  git rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
} | tee "$OUT/env.txt"

tests_rc=0
case "$SEL_TESTS" in
  full) select=() ;;
  quick) select=(-k "group_sizes or varlen or deterministic or quick or load_paths or (matrix and 512-128-128)") ;;
  none) select=() ;;
  *) echo "SEL_TESTS must be full, quick or none" >&2; exit 2 ;;
esac
if [[ "$SEL_TESTS" != none ]]; then
  start=$SECONDS
  # The "gpu" tier of ci/tiers.py, narrowed to the selection's tests.
  source ci/tiers.sh
  tier_command gpu_tests gpu packages/nsa-kernels/tests/selected || exit 2
  timeout 330 "${gpu_tests[@]}" -q -x -p no:cacheprovider -n 4 "${select[@]}" >"$OUT/tests.log" 2>&1
  tests_rc=$?
  echo "gpu tests: rc=$tests_rc in $((SECONDS - start)) s; $(tail -n 1 "$OUT/tests.log")"
fi

if [[ "$SEL_ROWS" == 1 ]]; then
  start=$SECONDS
  timeout 240 "$PYTHON" -m nsa_bench.cli sel --mode rows --query-rows 1024 --heads 8 --dk 128 --dv 128 \
    --seqlens 64,128,256,512,1024,2048,4096 --dist many --iters 20 --warmup 5 \
    --methods "$SEL_ROWS_METHODS" --csv "$OUT/sel_rows.csv" >"$OUT/sel_rows.txt" 2>>"$OUT/bench.log"
  echo "rows bench: rc=$? in $((SECONDS - start)) s; $(tail -n 1 "$OUT/sel_rows.txt")"
fi

start=$SECONDS
timeout 420 "$PYTHON" -m nsa_bench.cli sel --prefill --seqlens "$SEL_T" --groups "$SEL_GROUPS" \
  --configs "$SEL_CONFIGS" --csv "$OUT/sel_prefill.csv" --json "$OUT/sel_prefill.json" \
  ${SEL_BENCH_ARGS---probe} >"$OUT/sel_prefill.txt" 2>>"$OUT/bench.log"
bench_rc=$?
echo "prefill bench: rc=$bench_rc in $((SECONDS - start)) s"
[[ $bench_rc -ne 0 ]] && tail -n 20 "$OUT/bench.log"

if [[ -n "$SEL_CUDA_T" ]]; then
  start=$SECONDS
  timeout 180 "$PYTHON" -m nsa_bench.cli sel --prefill --seqlens "$SEL_CUDA_T" --pass fwd \
    --methods triton,cuda,fla --csv "$OUT/sel_cuda.csv" >"$OUT/sel_cuda.txt" 2>>"$OUT/bench.log"
  echo "cuda-beside-triton bench: rc=$? in $((SECONDS - start)) s"
fi

echo
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -n 3
cat "$OUT/sel_rows.txt" 2>/dev/null
cat "$OUT/sel_prefill.txt" 2>/dev/null
cat "$OUT/sel_cuda.txt" 2>/dev/null
exit $(( tests_rc != 0 || bench_rc != 0 ))
