// fused_add_rmsnorm_capture: SGLang's fused_add_rmsnorm that also writes the new residual into a
// capture-buffer slot, in the same kernel:
//   s        = float(input) + float(residual)                      (fp32, per element)
//   residual = round(s);  buffer[:, slot*H:(slot+1)*H] = round(s)  (the value SGLang captures)
//   input    = round(s * rsqrt(sum(s*s) / H + eps) * float(weight))
// Numerics follow SGLang's RMSNorm.forward_native (with residual) and FlashInfer's
// fused_add_rmsnorm: the norm reads the *unrounded* fp32 sum s, not the residual rounded to its
// dtype; the residual is stored in its dtype; fp32 sum of squares; mean = sum / H; one rounding of
// the output. (Only the order of the fp32 sum of squares and rsqrtf's last bit differ from torch.)
//
// Bytes per row: reads 2*H (input, residual) + H weight (L2-resident after the first rows),
// writes 3*H (input, residual, buffer slot): the capture costs exactly one extra write of H
// elements over fused_add_rmsnorm. Floor = 5*T*H*elem / copy bandwidth.
//
// Launch: one block per row, the whole row in registers: thread t holds packs t, t+B, ... (B =
// threads per block, VPT packs per thread; a pack is one 16-byte vector, or one element when the
// layout does not allow vectors). Both tensors are loaded once (all loads issued before the first
// use; 8 packs at a time when a thread holds more than 8, which only the scalar layout does), the
// residual and the buffer slot are written, a block reduction gives rsqrt, and the output is
// written from the registers. Threads per block: <= 1024 while T < 256 rows (spread a row over
// many threads when few rows fill the GPU), <= 256 from T >= 256 on (more, smaller blocks per SM to
// overlap one block's reduction with others' loads), capped by the registers the row needs; this
// holds the whole row for H <= 16384 (every dtype, vector or scalar). Wider rows use a two-pass
// kernel (pass 1: sum of squares; pass 2: re-read, mostly from L2, and write; nothing is written
// before pass 2, so the old residual is still there to re-read).
// The buffer store is streaming (st.global.cs): it is read again only by the draft model, after the
// whole target forward; input/residual are what the next layer reads, so they keep L2.
// CUDA-graph safe: no allocation, no host sync, current stream.
//
// This file holds the kernels and their launch (no ATen: see common.h); fused_add_rmsnorm_capture_op.cpp
// the op's tensor-facing half (checks, device guard, stream, dtype dispatch).
#include <type_traits>

#include "common.cuh"
#include "fused_add_rmsnorm_capture_launch.h"

namespace eagle3 {
namespace {

// VEC elements per access: one 16-byte vector (8 bf16/fp16, 4 fp32) or one element.
template <typename T, int VEC>
struct Pack {
  static_assert(VEC == 1 || VEC * sizeof(T) == 16, "a pack is one element or one 16-byte vector");
  using Raw = std::conditional_t<VEC == 1, T, uint4>;
  union {
    Raw raw;
    T e[VEC];
  };
  __device__ __forceinline__ void load(const T* p) { raw = *reinterpret_cast<const Raw*>(p); }
  __device__ __forceinline__ void store(T* p) const { *reinterpret_cast<Raw*>(p) = raw; }
  __device__ __forceinline__ void store_streaming(T* p) const {
    if constexpr (VEC == 1) {
      *p = raw;
    } else {
      __stcs(reinterpret_cast<uint4*>(p), raw);
    }
  }
};

// Most threads per block for VPT packs of VEC fp32 values held per thread (register budget).
__host__ __device__ constexpr int max_threads_for(int floats_per_thread) {
  return floats_per_thread <= 8 ? 1024 : (floats_per_thread <= 32 ? 512 : 256);
}

template <typename T, int VEC, int VPT>
__global__ void __launch_bounds__(max_threads_for(VEC * VPT))
    fused_row_kernel(T* __restrict__ input, int64_t input_stride, T* __restrict__ residual, int64_t residual_stride,
                     const T* __restrict__ weight, T* __restrict__ out, int64_t out_stride, int H, float eps) {
  using P = Pack<T, VEC>;
  const int packs = H / VEC;
  const int64_t row = blockIdx.x;
  T* in_row = input + row * input_stride;
  T* res_row = residual + row * residual_stride;
  T* out_row = out + row * out_stride;

  // Packs this thread owns: p = threadIdx.x + i * blockDim.x for i < mine (one count instead of VPT
  // predicates). With the grouped loads below this keeps the scalar VPT = 32 layout (512 threads, so
  // at most 128 registers) free of local memory on sm_90a, where it had a 48-56 byte stack frame
  // (tests/test_build.py checks every kernel for STACK:0 / LOCAL:0).
  const int tid = static_cast<int>(threadIdx.x);
  const int mine = tid < packs ? (packs - 1 - tid) / static_cast<int>(blockDim.x) + 1 : 0;

  // Loads of input and residual are issued kGroup packs at a time before their first use (all of
  // them when VPT <= kGroup); the fp32 sums and the sum of squares are formed in pack order i, so
  // the grouping changes no result.
  constexpr int kGroup = VPT < 8 ? VPT : 8;
  float s[VPT][VEC];
  float sumsq = 0.f;
#pragma unroll
  for (int i0 = 0; i0 < VPT; i0 += kGroup) {
    P a[kGroup], b[kGroup];
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const int i = i0 + u;
      const int p = threadIdx.x + i * blockDim.x;
      if (i < mine) {
        a[u].load(in_row + p * VEC);
        b[u].load(res_row + p * VEC);
      }
    }
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const int i = i0 + u;
      const int p = threadIdx.x + i * blockDim.x;
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[i][j] = 0.f;
      if (i < mine) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float v = to_float(a[u].e[j]) + to_float(b[u].e[j]);  // unrounded: the norm reads this
          s[i][j] = v;
          sumsq += v * v;
          b[u].e[j] = from_float<T>(v);  // the residual, stored in its dtype
        }
        b[u].store(res_row + p * VEC);
        b[u].store_streaming(out_row + p * VEC);
      }
    }
  }
  P w[VPT];  // issue the weight loads before the reduction so they overlap it
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int p = threadIdx.x + i * blockDim.x;
    if (i < mine) w[i].load(weight + p * VEC);
  }
  const float rstd = rsqrtf(block_sum<>(sumsq) / static_cast<float>(H) + eps);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int p = threadIdx.x + i * blockDim.x;
    if (i < mine) {
      P o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.e[j] = from_float<T>(s[i][j] * rstd * to_float(w[i].e[j]));
      o.store(in_row + p * VEC);
    }
  }
}

constexpr int kTwoPassThreads = 1024;

template <typename T, int VEC>
__global__ void __launch_bounds__(kTwoPassThreads)
    fused_two_pass_kernel(T* __restrict__ input, int64_t input_stride, T* __restrict__ residual,
                          int64_t residual_stride, const T* __restrict__ weight, T* __restrict__ out,
                          int64_t out_stride, int H, float eps) {
  using P = Pack<T, VEC>;
  const int packs = H / VEC;
  const int64_t row = blockIdx.x;
  T* in_row = input + row * input_stride;
  T* res_row = residual + row * residual_stride;
  T* out_row = out + row * out_stride;
  float sumsq = 0.f;
  for (int p = threadIdx.x; p < packs; p += blockDim.x) {
    P a, b;
    a.load(in_row + p * VEC);
    b.load(res_row + p * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float v = to_float(a.e[j]) + to_float(b.e[j]);
      sumsq += v * v;
    }
  }
  // block_sum's barrier also orders every pass-1 read before any pass-2 write.
  const float rstd = rsqrtf(block_sum<>(sumsq) / static_cast<float>(H) + eps);
  for (int p = threadIdx.x; p < packs; p += blockDim.x) {
    P a, b, w, o;
    a.load(in_row + p * VEC);
    b.load(res_row + p * VEC);
    w.load(weight + p * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float v = to_float(a.e[j]) + to_float(b.e[j]);
      b.e[j] = from_float<T>(v);
      o.e[j] = from_float<T>(v * rstd * to_float(w.e[j]));
    }
    b.store(res_row + p * VEC);
    b.store_streaming(out_row + p * VEC);
    o.store(in_row + p * VEC);
  }
}

template <typename T, int VEC, int VPT>
void launch_row(const FusedArgs& a, int threads, cudaStream_t stream) {
  fused_row_kernel<T, VEC, VPT><<<static_cast<unsigned>(a.rows), threads, 0, stream>>>(
      static_cast<T*>(a.input), a.input_stride, static_cast<T*>(a.residual), a.residual_stride,
      static_cast<const T*>(a.weight), static_cast<T*>(a.out), a.out_stride, a.H, a.eps);
}

// Packs per thread tried in order; the scalar path needs more of them to hold H = 16384.
template <int VEC>
constexpr int kMaxVpt = VEC == 1 ? 32 : 8;

template <typename T, int VEC>
cudaError_t launch_fused(const FusedArgs& a, cudaStream_t stream) {
  const int packs = a.H / VEC;
  const int preferred = a.rows >= 256 ? 256 : 1024;
  int vpt = 0, threads = 0;
  for (int limit : {preferred, 1024}) {
    for (int c = 1; c <= kMaxVpt<VEC> && vpt == 0; c *= 2) {
      const int need = ((packs + c - 1) / c + 31) / 32 * 32;
      if (need <= limit && need <= max_threads_for(c * VEC)) {
        vpt = c;
        threads = need;
      }
    }
    if (vpt != 0) break;
  }
  switch (vpt) {
    case 1: launch_row<T, VEC, 1>(a, threads, stream); break;
    case 2: launch_row<T, VEC, 2>(a, threads, stream); break;
    case 4: launch_row<T, VEC, 4>(a, threads, stream); break;
    case 8: launch_row<T, VEC, 8>(a, threads, stream); break;
    case 16:
      if constexpr (kMaxVpt<VEC> >= 16) launch_row<T, VEC, 16>(a, threads, stream);
      break;
    case 32:
      if constexpr (kMaxVpt<VEC> >= 32) launch_row<T, VEC, 32>(a, threads, stream);
      break;
    default:
      fused_two_pass_kernel<T, VEC><<<static_cast<unsigned>(a.rows), kTwoPassThreads, 0, stream>>>(
          static_cast<T*>(a.input), a.input_stride, static_cast<T*>(a.residual), a.residual_stride,
          static_cast<const T*>(a.weight), static_cast<T*>(a.out), a.out_stride, a.H, a.eps);
  }
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t launch_fused_add_rmsnorm_capture(const FusedArgs& args, cudaStream_t stream) {
  return args.vectorizable ? launch_fused<T, kVecElems<T>>(args, stream) : launch_fused<T, 1>(args, stream);
}

template cudaError_t launch_fused_add_rmsnorm_capture<c10::BFloat16>(const FusedArgs&, cudaStream_t);
template cudaError_t launch_fused_add_rmsnorm_capture<c10::Half>(const FusedArgs&, cudaStream_t);
template cudaError_t launch_fused_add_rmsnorm_capture<float>(const FusedArgs&, cudaStream_t);

}  // namespace eagle3
