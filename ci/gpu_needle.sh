#!/usr/bin/env bash
# GPU host: `nsa-bench needle`, each model trained on a GPU of its own, side by side.
#
#   [NEEDLE_ARGS=...] bash ci/gpu_needle.sh [VARIANTS]     (default nsa,window,random)
#
# Variant i runs on GPU i mod (GPU count), the variants given to one GPU one after the other, each
# with the same flags (budget, steps, settings, seeds) and its own output folder under $OUT; then
# `nsa-bench needle --merge` writes the joint tables. On one GPU this is the plain sequential
# run. NEEDLE_ARGS reaches every run (e.g. "--budget-s 240 --lengths 2048,4096,8192,16384").
# The last lines printed are the merged Markdown tables.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VARIANTS="${1:-nsa,window,random}"
source ci/gpu_host.sh
gpu_run_start artifacts/gpu_needle
GPUS=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
IFS=, read -r -a variants <<<"$VARIANTS"

run_on_gpu() {  # GPU VARIANT...: the variants one after the other on that GPU
  local gpu="$1"; shift
  for variant in "$@"; do
    echo "== needle $variant on GPU $gpu" >&2
    CUDA_VISIBLE_DEVICES="$gpu" python3 -m nsa_bench.cli needle --variants "$variant" \
      --out "$OUT/$variant" ${NEEDLE_ARGS:-} >"$OUT/$variant.md" 2>"$OUT/$variant.log"
    echo "needle $variant (GPU $gpu): exit $? | $(grep '^# train ' "$OUT/$variant.log" | tail -1)" |
      tee -a "$OUT/summary.txt"
  done
}

for ((gpu = 0; gpu < GPUS; gpu++)); do
  mine=()
  for ((i = gpu; i < ${#variants[@]}; i += GPUS)); do mine+=("${variants[i]}"); done
  ((${#mine[@]})) && run_on_gpu "$gpu" "${mine[@]}" &
done
wait

dirs=()
for variant in "${variants[@]}"; do dirs+=("$OUT/$variant"); done
python3 -m nsa_bench.cli needle --out "$OUT" --merge "${dirs[@]}" >"$OUT/needle_merged.md" 2>>"$OUT/summary.txt"
echo "merge: exit $?" | tee -a "$OUT/summary.txt"
source ci/pack_out.sh
# Back from a host that returns few files: the tables, the summary and the checkpoints (so that
# `--eval-only` can rerun the evaluation); JSON, CSV, PNGs and logs in logs.tar.gz.
pack_out "$OUT" needle.md summary.txt $(for v in "${variants[@]}"; do echo "$v/$v.pt"; done)
cat "$OUT/summary.txt"
cat "$OUT/needle.md"
exit 0
