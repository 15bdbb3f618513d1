# Sourced by the ci/gpu_*.sh scripts, from the repository root: the start every run on a GPU host
# shares.
#
#   source ci/gpu_host.sh
#   gpu_run_start artifacts/gpu_x [EXTRA_PYTHONPATH]
#
# gpu_run_start sets OUT (unless the caller's environment did) and creates it, runs the three
# packages from this checkout (PYTHONPATH: their src folders, then EXTRA_PYTHONPATH; no package
# index needed) with unbuffered output, and writes the host's GPUs and versions to $OUT/gpu.txt.

gpu_run_start() {  # DEFAULT_OUT [EXTRA_PYTHONPATH]
  OUT="${OUT:-$1}"
  mkdir -p "$OUT"
  export PYTHONPATH="$PWD/packages/nsa-core/src:$PWD/packages/nsa-kernels/src:$PWD/packages/nsa-bench/src${2:+:$2}"
  export PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
}
