#!/usr/bin/env bash
# Compile the experimental CUDA selection kernel for sm_80 and sm_90 (compile only, no GPU needed)
# and print ptxas's registers / spills per kernel; syntax-check its torch binding with the host
# compiler against the installed torch's headers.
#
#   ci/compile_cuda.sh            # nvcc from PATH (or $CUDA_HOME/bin), python3 with torch
#   ARCHS="80 90 100" ci/compile_cuda.sh
#
# Exit status is non-zero when a compile fails or a kernel spills registers.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CSRC="$ROOT/packages/nsa-kernels/src/nsa_kernels/selected/cuda/csrc"
ARCHS="${ARCHS:-80 90}"
PYTHON="${PYTHON:-python3}"
NVCC="${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

"$NVCC" --version | tail -n 1
# torch's extension builds disable the implicit half conversions; compile the same way.
NVCC_FLAGS=(-std=c++17 -O3 -lineinfo -Xptxas -v
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)

status=0
printf '\n%-6s %-22s %10s %12s %12s %10s\n' arch kernel registers spill_st_B spill_ld_B static_smem_B
for arch in $ARCHS; do
  log="$WORK/ptxas_sm$arch.log"
  if ! "$NVCC" "${NVCC_FLAGS[@]}" -gencode "arch=compute_$arch,code=sm_$arch" \
      -c "$CSRC/sel_fwd.cu" -o "$WORK/sel_fwd_sm$arch.o" >"$log" 2>&1; then
    cat "$log"
    echo "FAILED: nvcc for sm_$arch" >&2
    status=1
    continue
  fi
  # ptxas prints, per entry function: "Compiling entry function '<mangled>'", then
  # "N bytes stack frame, S bytes spill stores, L bytes spill loads", then "Used R registers".
  awk -v arch="sm_$arch" '
    /Compiling entry function/ {
      name = $0; sub(/.*sel_fwd_kernelI/, "", name); sub(/EEvN.*/, "", name)
      kernel = (name ~ /bfloat16/) ? "sel_fwd_kernel<bf16>" : "sel_fwd_kernel<fp16>"
    }
    /spill stores/ { st = $5; ld = $9 }
    /Used [0-9]+ registers/ {
      regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
      smem = 0; if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ bytes smem/, "", smem) }
      printf "%-6s %-22s %10s %12s %12s %10s\n", arch, kernel, regs, st, ld, smem
      if (st + 0 > 0 || ld + 0 > 0) spilled = 1
    }
    END { exit spilled }
  ' "$log" || { echo "SPILLS on sm_$arch" >&2; status=1; }
done

echo
echo "binding: host-compiler syntax check of sel_fwd_binding.cpp against the installed torch"
INCLUDES="$("$PYTHON" - <<'PY'
import sysconfig
import torch.utils.cpp_extension as ext
print(" ".join(["-isystem" + p for p in ext.include_paths()] + ["-isystem" + sysconfig.get_paths()["include"]]))
PY
)"
CXX_STD="$("$PYTHON" - <<'PY'
import torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
print("-std=c++20" if (major, minor) >= (2, 10) else "-std=c++17")
PY
)"
# nvcc may be a wrapper script: ask it where its own headers are.
CUDA_INC="$("$NVCC" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 \
  | sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -n 1 | sed 's/ *$//')"
TORCH_INC="$("$PYTHON" -c 'import torch.utils.cpp_extension as e; print(e.include_paths()[0])')"
# CPU-only torch wheels ship the CUDA headers but not this generated one; an empty stand-in is
# enough for a syntax check (a CUDA build of torch has the real file and it is used instead).
if [[ ! -f "$TORCH_INC/c10/cuda/impl/cuda_cmake_macros.h" ]]; then
  mkdir -p "$WORK/stub/c10/cuda/impl"
  echo '#pragma once' >"$WORK/stub/c10/cuda/impl/cuda_cmake_macros.h"
  INCLUDES="$INCLUDES -isystem$WORK/stub"
fi
# shellcheck disable=SC2086
if "${CXX:-g++}" "$CXX_STD" -fsyntax-only -Wall -Wextra -Werror \
    -DTORCH_EXTENSION_NAME=nsa_cuda_sel -DTORCH_API_INCLUDE_EXTENSION_H \
    $INCLUDES -isystem"$CUDA_INC" "$CSRC/sel_fwd_binding.cpp"; then
  echo "binding: ok ($CXX_STD)"
else
  echo "FAILED: binding syntax check" >&2
  status=1
fi
exit "$status"
