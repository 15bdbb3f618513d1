// NSA selected-branch attention, forward, as a plain CUDA kernel (experimental).
//
// One program (thread block) per (query row, kv head, batch) serves the G query heads of that kv
// head, so every selected key/value is read from global memory once for the whole group. The
// program walks its selected blocks in index order; each block's keys p with p <= t are staged
// through shared memory in tiles, and the G heads keep an online softmax (running max m, running
// sum l, unnormalised output acc) in fp32. Scores are kept in the log2 domain (q is pre-multiplied
// by scale * log2(e)) so the exponentials are exp2.
//
// Semantics (NSA-SPEC, selected branch): query t, head h of group g attends in one softmax to the
// union of tokens p with p // sel_block in indices[t, g] and p <= t. Index -1 is padding and a
// repeated index counts once. A query with no such token gets 0.

#include "sel_fwd.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

namespace nsa_cuda_sel {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTiles[] = {64, 32, 16};

// fp16 / bf16 element and pair conversions through intrinsics (torch builds with the implicit
// half conversions disabled).
template <typename T>
struct Elem;

template <>
struct Elem<__half> {
  using Pair = __half2;
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Elem<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) {
    return __bfloat1622float2(x);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

// Shared memory, in 4-byte words. K rows are padded to an odd number of words so that the 32
// lanes of a warp, each reading a different key row at the same column, hit 32 different banks.
struct SmemLayout {
  int q, p, acc, m, l, alpha, idx, k, v;  // offsets
  int k_row;                              // words per staged K row
  int total;
};

__host__ __device__ inline SmemLayout smem_layout(int g, int dk, int dv, int n, int tile) {
  SmemLayout s;
  s.k_row = (dk / 2) | 1;
  int w = 0;
  s.q = w;     w += g * dk;     // q of the G heads, fp32, pre-scaled
  s.p = w;     w += g * tile;   // scores, then probabilities, of the current tile
  s.acc = w;   w += g * dv;     // unnormalised outputs, fp32 (8-byte aligned: dk and tile even)
  s.m = w;     w += g;          // running max (log2 domain)
  s.l = w;     w += g;          // running sum
  s.alpha = w; w += g;          // rescale factor of the current tile
  s.idx = w;   w += n;          // selected block indices
  s.k = w;     w += tile * s.k_row;
  s.v = w;     w += tile * (dv / 2);
  s.total = w;
  return s;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sel_fwd_kernel(const SelFwdParams p) {
  using E = Elem<T>;
  using T2 = typename E::Pair;
  extern __shared__ __align__(16) float smem[];

  const int row = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g_size = p.num_q_heads / p.num_kv_heads;
  const int dk = p.head_dim_qk;
  const int dv = p.head_dim_v;
  const int dk2 = dk / 2;
  const int dv2 = dv / 2;
  const int n = p.num_selected;
  const int tile = p.tile;
  const SmemLayout L = smem_layout(g_size, dk, dv, n, tile);

  float* q_s = smem + L.q;
  float* p_s = smem + L.p;
  float* acc_s = smem + L.acc;
  float2* acc2_s = reinterpret_cast<float2*>(acc_s);
  float* m_s = smem + L.m;
  float* l_s = smem + L.l;
  float* alpha_s = smem + L.alpha;
  int* idx_s = reinterpret_cast<int*>(smem + L.idx);
  T2* k_s = reinterpret_cast<T2*>(smem + L.k);
  T2* v_s = reinterpret_cast<T2*>(smem + L.v);

  // Position of this query and where its sequence's keys start (packed sequences restart at 0).
  int64_t key_base = 0;
  int t = p.q_start + row;
  if (p.seq_start != nullptr) {
    key_base = p.seq_start[row];
    t = row - static_cast<int>(key_base);
  }
  const int64_t key_limit = p.seq_start != nullptr ? t + 1 : min(static_cast<int64_t>(t) + 1,
                                                                  static_cast<int64_t>(p.tk));

  const T* q_ptr = static_cast<const T*>(p.q) + b * p.q_stride[0] + row * p.q_stride[1] +
                   static_cast<int64_t>(kv_head) * g_size * p.q_stride[2];
  for (int e = tid; e < g_size * dk; e += kThreads) {
    const int g = e / dk;
    const int c = e - g * dk;
    q_s[e] = E::to_float(q_ptr[g * p.q_stride[2] + c]) * p.scale_log2;
  }
  for (int e = tid; e < g_size * dv2; e += kThreads) acc2_s[e] = make_float2(0.f, 0.f);
  for (int g = tid; g < g_size; g += kThreads) {
    m_s[g] = -CUDART_INF_F;
    l_s[g] = 0.f;
  }
  const int32_t* idx_ptr = p.indices + b * p.idx_stride[0] + row * p.idx_stride[1] +
                           kv_head * p.idx_stride[2];
  for (int s = tid; s < n; s += kThreads) idx_s[s] = idx_ptr[s];
  __syncthreads();

  const T* k_head = static_cast<const T*>(p.k) + b * p.k_stride[0] + kv_head * p.k_stride[2] +
                    key_base * p.k_stride[1];
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_stride[0] + kv_head * p.v_stride[2] +
                    key_base * p.v_stride[1];

  // Every thread reads the same indices from shared memory, so the control flow below is uniform
  // across the block and the barriers inside the loops are safe.
  for (int s = 0; s < n; ++s) {
    const int j = idx_s[s];
    if (j < 0) continue;
    bool repeated = false;
    for (int r = 0; r < s; ++r) repeated |= idx_s[r] == j;
    if (repeated) continue;
    const int64_t begin = static_cast<int64_t>(j) * p.sel_block;
    const int64_t end = min(begin + p.sel_block, key_limit);

    for (int64_t k0 = begin; k0 < end; k0 += tile) {
      const int count = static_cast<int>(min(static_cast<int64_t>(tile), end - k0));

      for (int e = tid; e < count * dk2; e += kThreads) {
        const int r = e / dk2;
        const int c = e - r * dk2;
        k_s[r * L.k_row + c] = reinterpret_cast<const T2*>(k_head + (k0 + r) * p.k_stride[1])[c];
      }
      for (int e = tid; e < count * dv2; e += kThreads) {
        const int r = e / dv2;
        const int c = e - r * dv2;
        v_s[r * dv2 + c] = reinterpret_cast<const T2*>(v_head + (k0 + r) * p.v_stride[1])[c];
      }
      __syncthreads();

      // Scores of the G heads against the staged keys.
      for (int e = tid; e < g_size * count; e += kThreads) {
        const int g = e / count;
        const int r = e - g * count;
        const float2* qg = reinterpret_cast<const float2*>(q_s + g * dk);
        const T2* kr = k_s + r * L.k_row;
        float dot = 0.f;
#pragma unroll 4
        for (int c = 0; c < dk2; ++c) {
          const float2 kf = E::to_float2(kr[c]);
          const float2 qf = qg[c];
          dot = fmaf(qf.x, kf.x, dot);
          dot = fmaf(qf.y, kf.y, dot);
        }
        p_s[g * tile + r] = dot;
      }
      __syncthreads();

      // Online softmax, one warp per head: new max, probabilities in place, rescale factor.
      for (int g = warp; g < g_size; g += kWarps) {
        float* pg = p_s + g * tile;
        float tile_max = -CUDART_INF_F;
        for (int r = lane; r < count; r += 32) tile_max = fmaxf(tile_max, pg[r]);
        tile_max = warp_max(tile_max);
        const float m_old = m_s[g];
        const float m_new = fmaxf(m_old, tile_max);
        float sum = 0.f;
        for (int r = lane; r < count; r += 32) {
          const float e = exp2f(pg[r] - m_new);
          pg[r] = e;
          sum += e;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
          const float alpha = exp2f(m_old - m_new);  // 0 on the first tile (m_old = -inf)
          alpha_s[g] = alpha;
          l_s[g] = l_s[g] * alpha + sum;
          m_s[g] = m_new;
        }
      }
      __syncthreads();

      // acc = alpha * acc + P V, two output columns per thread and step.
      for (int e = tid; e < g_size * dv2; e += kThreads) {
        const int g = e / dv2;
        const int c = e - g * dv2;
        const float* pg = p_s + g * tile;
        const float alpha = alpha_s[g];
        float2 a = acc2_s[e];
        a.x *= alpha;
        a.y *= alpha;
        for (int r = 0; r < count; ++r) {
          const float pr = pg[r];
          const float2 vf = E::to_float2(v_s[r * dv2 + c]);
          a.x = fmaf(pr, vf.x, a.x);
          a.y = fmaf(pr, vf.y, a.y);
        }
        acc2_s[e] = a;
      }
      __syncthreads();
    }
  }

  T* o_ptr = static_cast<T*>(p.o) + b * p.o_stride[0] + row * p.o_stride[1] +
             static_cast<int64_t>(kv_head) * g_size * p.o_stride[2];
  for (int e = tid; e < g_size * dv; e += kThreads) {
    const int g = e / dv;
    const int c = e - g * dv;
    const float l = l_s[g];
    o_ptr[g * p.o_stride[2] + c] = E::from_float(l > 0.f ? acc_s[e] / l : 0.f);
  }
}

template <typename T>
cudaError_t launch_typed(const SelFwdParams& p, size_t smem, cudaStream_t stream) {
  const cudaError_t attr = cudaFuncSetAttribute(
      sel_fwd_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (attr != cudaSuccess) return attr;
  const dim3 grid(p.tq, p.num_kv_heads, p.batch);
  sel_fwd_kernel<T><<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

size_t sel_fwd_smem_bytes(const SelFwdParams& p, int tile) {
  const int g = p.num_q_heads / p.num_kv_heads;
  return sizeof(float) *
         static_cast<size_t>(smem_layout(g, p.head_dim_qk, p.head_dim_v, p.num_selected, tile).total);
}

cudaError_t sel_fwd_launch(SelFwdParams p, bool is_bf16, cudaStream_t stream) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int max_smem = 0;
  err = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  p.tile = 0;
  for (int tile : kTiles) {
    if (sel_fwd_smem_bytes(p, tile) <= static_cast<size_t>(max_smem)) {
      p.tile = tile;
      break;
    }
  }
  if (p.tile == 0) return cudaErrorInvalidConfiguration;
  if (p.tq == 0 || p.batch == 0 || p.num_kv_heads == 0) return cudaSuccess;
  const size_t smem = sel_fwd_smem_bytes(p, p.tile);
  return is_bf16 ? launch_typed<__nv_bfloat16>(p, smem, stream)
                 : launch_typed<__half>(p, smem, stream);
}

}  // namespace nsa_cuda_sel
