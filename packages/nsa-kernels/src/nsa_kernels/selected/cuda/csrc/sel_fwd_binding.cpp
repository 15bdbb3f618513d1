// torch binding of the selection-attention forward kernel (sel_fwd.cu): checks the tensors,
// fills SelFwdParams and launches on the current stream.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

#include "sel_fwd.h"

namespace {

void check_4d(const at::Tensor& t, const char* name, const char* layout) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 4, name, " must be ", layout, ", got ", t.sizes());
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) <= 1, name, " must be contiguous in its last dim");
}

// The kernel moves fp16/bf16 values in pairs (4-byte words).
void check_pairs(const at::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 4 == 0, name,
              " must be 4-byte aligned");
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(t.size(d) <= 1 || t.stride(d) % 2 == 0, name, " needs even strides, got ",
                t.strides());
  }
}

void copy_strides(const at::Tensor& t, int64_t* out) {
  for (int d = 0; d < 3; ++d) out[d] = t.stride(d);
}

}  // namespace

at::Tensor sel_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& block_indices, const c10::optional<at::Tensor>& seq_start,
                   int64_t sel_block, double scale, int64_t q_start) {
  check_4d(q, "q", "[B, Tq, HQ, dk]");
  check_4d(k, "k", "[B, Tk, H, dk]");
  check_4d(v, "v", "[B, Tk, H, dv]");
  check_4d(block_indices, "block_indices", "[B, Tq, H, n]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "cuda_sel needs float16 or bfloat16 inputs, got ", dtype);
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "q, k, v dtypes differ");
  TORCH_CHECK(block_indices.scalar_type() == at::kInt, "block_indices must be int32");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device() &&
                  block_indices.device() == q.device(),
              "q, k, v, block_indices must be on one device");

  const int64_t batch = q.size(0), tq = q.size(1), hq = q.size(2), dk = q.size(3);
  const int64_t tk = k.size(1), h = k.size(2), dv = v.size(3);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch, "batch sizes differ");
  TORCH_CHECK(k.size(3) == dk, "k head dim ", k.size(3), " != q head dim ", dk);
  TORCH_CHECK(v.size(1) == tk && v.size(2) == h, "k and v differ in tokens or heads");
  TORCH_CHECK(h > 0 && hq % h == 0, "query heads ", hq, " not a multiple of kv heads ", h);
  TORCH_CHECK(dk % 2 == 0 && dv % 2 == 0 && dk <= 256 && dv <= 256,
              "cuda_sel needs even head dims <= 256, got dk=", dk, ", dv=", dv);
  TORCH_CHECK(block_indices.size(0) == batch && block_indices.size(1) == tq &&
                  block_indices.size(2) == h,
              "block_indices must be [B, Tq, H, n], got ", block_indices.sizes());
  TORCH_CHECK(sel_block >= 1, "sel_block must be >= 1");
  TORCH_CHECK(tq < (int64_t{1} << 31) && tk < (int64_t{1} << 31) && batch <= 65535 && h <= 65535,
              "shape too large for the launch grid");
  for (const auto* t : {&q, &k, &v}) check_pairs(*t, t == &q ? "q" : (t == &k ? "k" : "v"));

  const int32_t* seq_start_ptr = nullptr;
  if (seq_start.has_value()) {
    const at::Tensor& s = *seq_start;
    TORCH_CHECK(batch == 1, "packed sequences need B == 1");
    TORCH_CHECK(s.is_cuda() && s.scalar_type() == at::kInt && s.dim() == 1 && s.size(0) == tq &&
                    s.is_contiguous(),
                "seq_start must be a contiguous int32 CUDA tensor [Tq]");
    seq_start_ptr = s.data_ptr<int32_t>();
  } else {
    TORCH_CHECK(q_start >= 0 && q_start + tq <= tk, "queries [", q_start, ", ", q_start + tq,
                ") need keys up to that position, k holds ", tk);
  }

  const c10::cuda::CUDAGuard guard(q.device());
  auto o = at::empty({batch, tq, hq, dv}, q.options());
  if (o.numel() == 0) return o;

  nsa_cuda_sel::SelFwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.indices = block_indices.data_ptr<int32_t>();
  p.seq_start = seq_start_ptr;
  p.o = o.data_ptr();
  copy_strides(q, p.q_stride);
  copy_strides(k, p.k_stride);
  copy_strides(v, p.v_stride);
  copy_strides(o, p.o_stride);
  copy_strides(block_indices, p.idx_stride);
  p.batch = static_cast<int>(batch);
  p.tq = static_cast<int>(tq);
  p.tk = static_cast<int>(tk);
  p.num_q_heads = static_cast<int>(hq);
  p.num_kv_heads = static_cast<int>(h);
  p.head_dim_qk = static_cast<int>(dk);
  p.head_dim_v = static_cast<int>(dv);
  p.num_selected = static_cast<int>(block_indices.size(3));
  p.sel_block = static_cast<int>(sel_block);
  p.q_start = static_cast<int>(q_start);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);  // log2(e)

  int device = 0;
  int max_smem = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t need = nsa_cuda_sel::sel_fwd_smem_bytes(p, 16);
  TORCH_CHECK(need <= static_cast<size_t>(max_smem), "cuda_sel needs ", need,
              " bytes of shared memory for G=", hq / h, ", dk=", dk, ", dv=", dv,
              "; this GPU allows ", max_smem);

  const cudaError_t err =
      nsa_cuda_sel::sel_fwd_launch(p, dtype == at::kBFloat16, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "cuda_sel launch failed: ", cudaGetErrorString(err));
  return o;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sel_fwd", &sel_fwd, "NSA selected attention forward (CUDA, experimental)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("block_indices"), pybind11::arg("seq_start"), pybind11::arg("sel_block"),
        pybind11::arg("scale"), pybind11::arg("q_start"));
}
