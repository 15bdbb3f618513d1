// Selection attention forward (NSA selected branch): the interface between the torch binding
// (sel_fwd_binding.cpp) and the CUDA kernel (sel_fwd.cu). Plain C++ and CUDA runtime only, so the
// kernel compiles with nvcc alone.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace nsa_cuda_sel {

// Strides are in elements; the last dim of every tensor is contiguous.
struct SelFwdParams {
  const void* q;              // [B, Tq, HQ, dk]
  const void* k;              // [B, Tk, H, dk]
  const void* v;              // [B, Tk, H, dv]
  const int32_t* indices;     // [B, Tq, H, n]; -1 = no block
  const int32_t* seq_start;   // [Tq] packed index of each query's sequence start, or nullptr
  void* o;                    // [B, Tq, HQ, dv]
  int64_t q_stride[3];        // b, t, h
  int64_t k_stride[3];
  int64_t v_stride[3];
  int64_t o_stride[3];
  int64_t idx_stride[3];
  int batch, tq, tk, num_q_heads, num_kv_heads, head_dim_qk, head_dim_v, num_selected;
  int sel_block;
  int q_start;                // position of query row 0 (dense layout only)
  float scale_log2;           // softmax scale * log2(e): the kernel works with exp2
  int tile;                   // keys per shared-memory tile (set by the launcher)
};

// Bytes of dynamic shared memory one program needs with `tile` keys per tile.
size_t sel_fwd_smem_bytes(const SelFwdParams& p, int tile);

// Chooses the tile that fits the device's opt-in shared memory, launches one program per
// (query, kv head, batch), and returns the launch error (cudaSuccess when all went well).
// is_bf16 selects bfloat16 inputs; otherwise float16.
cudaError_t sel_fwd_launch(SelFwdParams p, bool is_bf16, cudaStream_t stream);

}  // namespace nsa_cuda_sel
