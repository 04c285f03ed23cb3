// draft_fc: out[M, N] = linear(norm(x[rows]), weight, bias)  (DESIGN.md §4 op 3; the exact math is
// eagle3_ops/reference.py draft_fc_ref: input norm over the K*H row, then one RMSNorm per H-wide
// chunk). x [R, KH], weight [N, KH], KH = K*H. Rounding: the skinny path accumulates in fp32 and
// rounds once at the end; the cuBLAS path (larger M, or layouts the skinny kernel cannot take) rounds
// the prepared input norm(x[rows]) to the dtype once, then follows torch.backends.cuda.matmul's
// flags (reduced-precision reductions / TF32 if the application enables them).
//
// Bytes / FLOPs: the weight (N*KH elements: 308 MB in bf16 at H=7168, K=3) is read once, x rows
// M*KH, out M*N; FLOPs = 2*M*N*KH. Up to M ~ 130-280 (device dependent, DESIGN.md §2) the weight
// read is the floor: ~72 us on H200, ~172 us on sm_120 at H=7168.
//
// Skinny path (bf16/fp16, M <= kCrossover[arch].skinny_max_m, 16-byte-aligned rows, chunk width a
// multiple of 8): fc_skinny_kernel, swap-AB mma.sync m16n8k16 (an sm_80+ instruction: the same code
// serves sm_90a and sm_120a; nothing is staged in shared memory, so sm_120's 99 KB per block does not
// constrain it). A block is 4 warps; warp w owns 16 weight rows (64 per block), all warps share one
// token tile of 8*NT tokens and one k range (a split), so the gathered x rows come from L1 for all
// four warps while each weight element is loaded exactly once, 16 bytes per load, without L1
// allocation, kUnroll 32-wide k slabs (8 loads = 128 B per thread) in flight before the MMAs.
// Thread (g = lane/4, t = lane%4) loads W[row g][k+8t, k+8t+8), W[row g+8][same] and
// x[token g][same]. The k order inside one MMA is free as long as A and B agree, so these 16-byte
// vectors ARE the fragments of two m16n8k16 MMAs (k slots {2t, 2t+1, 2t+8, 2t+9} <- k+8t..k+8t+3,
// then k+8t+4..k+8t+7): no shuffles, no shared memory (KERNELS.md fact 3).
// Grid (token tiles, weight tiles of 64 rows, S splits); every split lies inside one H-wide chunk.
// The skinny kernel writes fp32 partials [S][M][N], plus (with norms) per split and token the sums
// of x^2 and (x*input_norm_weight)^2 taken from the x fragments it loads anyway, into a workspace;
// fc_reduce_kernel sums the splits in the fixed order s = 0..S-1, multiplying each split's partial
// by its chunk's RMS scale (linearity, KERNELS.md "pre-fc norms": no K-wide pre-pass at all), adds
// bias and writes out. The norm weights g = input_norm_weight * chunk_norm_weight multiply the x
// fragments on the fly (rounded back to the dtype, as the stock path rounds its normalized input).
// With one split and no norm the skinny kernel writes out directly.
// Other cases (larger M, fp32, unaligned shapes): fc_prepare_kernel writes norm(x[rows]) in the
// dtype, then cuBLAS (at::addmm) multiplies; with no gather and no norm cuBLAS reads x directly.
//
// Deterministic: every sum has a fixed order, no atomics. Row indices outside [0, R) are never
// dereferenced; those output rows are NaN. No host sync, current stream.
//
// Memory (DESIGN.md §4: draft_fc_out does not allocate): the split-K partials / sums of squares, the
// prepared cuBLAS input and unit-stride copies of strided 1-D views (rows, bias, input_norm_weight;
// contiguous ones, the usual case, are used in place) live in a grow-only scratch cache, one byte
// buffer per (device, kind), guarded by a mutex per device (the same policy as the Triton backend's
// eagle3_ops/workspace.py). A call that fits the current buffer allocates nothing; a larger one
// replaces it by one at least 1.25x bigger. So after one eager call with the largest problem,
// draft_fc_out allocates nothing (cuBLAS's workspace is PyTorch's, allocated once per stream).
// Growth while the current stream is capturing a CUDA graph is ALLOWED (legal: the buffer comes from
// the graph's private pool). A buffer handed out during a capture is never freed afterwards (graphs
// replay into its address): when it is replaced it moves to a per-device retired list kept for the
// life of the process. A buffer no capture has seen is released on growth with record_stream on the
// current stream. Warm up eagerly with the largest M before capturing (SGLang does) and the graph
// pool holds none of it. All calls on one device share the scratch: they must be stream-ordered.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <type_traits>
#include <vector>

#include "common.cuh"
#include "ops.h"

namespace eagle3 {
namespace {

// ---- the crossover table of the CUDA backend -----------------------------------------------------
// M <= skinny_max_m: skinny kernel; above: cuBLAS on the prepared input. DESIGN ESTIMATES, NOT
// MEASUREMENTS (no GPU was available when this was written): update them from
// benchmarks/bench_draft_fc.py on the device and replace `basis` with the device, date and numbers.
struct FcCrossover {
  int sm_major;
  const char* device;
  int skinny_max_m;
  const char* basis;
};
constexpr FcCrossover kCrossover[] = {
    {9, "H200 (sm_90, 132 SMs, ~4.3 TB/s, ~790 TFLOP/s bf16)", 128,
     "estimate: weight-read floor up to M ~ 130-150 with mma.sync (KERNELS.md); 128 = 2 token tiles"},
    {12, "RTX PRO 6000 / RTX 5090 (sm_120, 1.79 TB/s)", 128,
     "estimate: memory-bound up to M ~ 280 (PRO 6000) / ~117 (5090)"},
};
constexpr int kDefaultSkinnyMaxM = 64;  // other GPUs: short skinny range, cuBLAS above (a guess)

// EAGLE3_OPS_CUDA_FC_SKINNY_MAX_M=<int> overrides the table (a tuning knob: benchmarks/bench_draft_fc.py
// forces each path with it to measure the crossover; read per call, it costs a getenv).
int skinny_max_m(int sm_major) {
  if (const char* forced = std::getenv("EAGLE3_OPS_CUDA_FC_SKINNY_MAX_M")) return std::atoi(forced);
  for (const auto& entry : kCrossover) {
    if (entry.sm_major == sm_major) return entry.skinny_max_m;
  }
  return kDefaultSkinnyMaxM;
}

// ---- launch shape ----------------------------------------------------------------------------------
constexpr int kThreads = 128;       // 4 warps
constexpr int kRowsPerWarp = 16;    // the MMA's M side: weight rows
constexpr int kRowsPerBlock = 64;
constexpr int kSlab = 32;           // k covered by one thread group (4 threads x 8 elements) per step
constexpr int kUnroll = 4;          // slabs loaded before the MMAs that use them
constexpr int kMaxTokenGroups = 8;  // token tile <= 64 tokens (8 groups of 8)
constexpr int kMaxSplits = 64;
// Resident skinny blocks per SM to aim for: each keeps 128 threads x 8 x 16 B = 16 KB of weight
// loads in flight; ~3 per SM cover the latency-bandwidth product of H200 (~4.3 TB/s x ~1 us / 132).
// A design estimate; more splits also cost S*M*N*4 bytes of workspace traffic.
constexpr int kBlocksPerSm = 3;
constexpr int kReduceThreads = 256;
constexpr int kPrepareThreads = 256;

struct FcArgs {
  const void* x;
  int64_t stride_x;
  const void* w;
  int64_t stride_w;
  const void* rows;  // nullptr: row m of x
  bool rows_are_int64;
  const void* in_w;     // input_norm_weight [KH] or nullptr
  const void* chunk_w;  // chunk_norm_weight [K, H] (flat [KH]) or nullptr
  const void* bias;     // [N] or nullptr
  void* out;
  int64_t stride_out;
  float* partial;  // [S][M][N] fp32, or nullptr: the skinny kernel writes out directly
  float* sumsq;    // [S][M][2] fp32 (sum x^2, sum (x*in_w)^2), or nullptr: no norm
  int64_t R;
  int M, N, KH;
  int CH, NC;  // chunk width and count: (H, K) with chunk norm, else (KH, 1)
  int splits_per_chunk, split_len, S;
  float eps;
};

__device__ __forceinline__ int64_t source_row(const FcArgs& a, int m) {
  if (a.rows == nullptr) return m;
  return a.rows_are_int64 ? static_cast<const int64_t*>(a.rows)[m]
                          : static_cast<int64_t>(static_cast<const int32_t*>(a.rows)[m]);
}

__device__ __forceinline__ float nan_f32() { return __int_as_float(0x7fc00000); }

// Two 16-bit values packed in one 32-bit register: conversions and the m16n8k16 MMA.
template <typename T>
struct Pair;

template <>
struct Pair<c10::BFloat16> {
  __device__ static float2 to_float2(uint32_t v) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  }
  __device__ static uint32_t from_float2(float2 f) {
    const __nv_bfloat162 h = __float22bfloat162_rn(f);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ static void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <>
struct Pair<c10::Half> {
  __device__ static float2 to_float2(uint32_t v) { return __half22float2(*reinterpret_cast<const __half2*>(&v)); }
  __device__ static uint32_t from_float2(float2 f) {
    const __half2 h = __float22half2_rn(f);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ static void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// One 16-byte weight load, streamed: read-only path, no L1 allocation (L1 is for the shared x rows),
// 256-byte L2 prefetch (the thread group reads 256 contiguous bytes of each row per iteration).
// Inline asm volatile keeps all kUnroll*2 loads of an iteration issued before the MMAs that
// consume them (plain loads were interleaved with the MMAs by the compiler, ~2 in flight). Zero
// when !pred (tails of k ranges and of the weight rows: nothing is read).
__device__ __forceinline__ uint4 load_weight16(const void* p, bool pred) {
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
      " mov.b32 %3, 0;\n @p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"(static_cast<int>(pred)));
  return v;
}

// 8 consecutive norm-weight values as fp32 (1 where the weight is absent).
template <typename T>
__device__ __forceinline__ void load_norm_weights8(const void* weight, int k, float (&f)[8]) {
  if (weight == nullptr) {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = 1.f;
    return;
  }
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(weight) + k));
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const float2 h = Pair<T>::to_float2(words[p]);
    f[2 * p] = h.x;
    f[2 * p + 1] = h.y;
  }
}

template <typename T, int NT, bool kNorm>
__global__ void __launch_bounds__(kThreads) fc_skinny_kernel(const FcArgs a) {
  static_assert(NT >= 1 && NT <= kMaxTokenGroups, "token tile of 8..64 tokens");
  using P = Pair<T>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int s = blockIdx.z;
  const int chunk = s / a.splits_per_chunk;
  const int k_lo = chunk * a.CH + (s - chunk * a.splits_per_chunk) * a.split_len;
  const int k_hi = min(k_lo + a.split_len, (chunk + 1) * a.CH);
  const int n0 = blockIdx.y * kRowsPerBlock + warp * kRowsPerWarp + g;  // this thread's rows: n0, n0 + 8
  const int tok0 = blockIdx.x * (8 * NT);

  const T* w = static_cast<const T*>(a.w);
  const bool w0_ok = n0 < a.N, w1_ok = n0 + 8 < a.N;
  const T* w0 = w + static_cast<int64_t>(w0_ok ? n0 : 0) * a.stride_w;
  const T* w1 = w + static_cast<int64_t>(w1_ok ? n0 + 8 : 0) * a.stride_w;

  // Row gather in the prologue: one base pointer per token this thread feeds (token g of each group).
  const T* x = static_cast<const T*>(a.x);
  const T* x_row[NT];
  bool x_ok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tok = tok0 + 8 * j + g;
    const int64_t r = tok < a.M ? source_row(a, tok) : -1;
    x_ok[j] = r >= 0 && r < a.R;
    x_row[j] = x + (x_ok[j] ? r : 0) * a.stride_x;
  }

  float acc[NT][4];
  float ss_x[NT], ss_in[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    ss_x[j] = ss_in[j] = 0.f;
  }
  // One warp per (token tile, split) records the sums of squares the reducer needs for the scales.
  const bool track = kNorm && blockIdx.y == 0 && warp == 0;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  // Register double buffer: the weight loads of the next iteration are issued before the MMAs of
  // this one, so 2 * kUnroll * 2 16-byte loads per thread can be in flight.
  uint4 wa[kUnroll], wb[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int k = k_lo + u * kSlab + 8 * t;
    const bool k_in = k < k_hi;  // k_hi - k is a multiple of 8: the 8-run is all in or all out
    wa[u] = load_weight16(w0 + k, k_in && w0_ok);
    wb[u] = load_weight16(w1 + k, k_in && w1_ok);
  }
  for (int kb = k_lo; kb < k_hi; kb += kSlab * kUnroll) {
    uint4 na[kUnroll], nb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = kb + kSlab * kUnroll + u * kSlab + 8 * t;
      const bool k_in = k < k_hi;
      na[u] = load_weight16(w0 + k, k_in && w0_ok);
      nb[u] = load_weight16(w1 + k, k_in && w1_ok);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = kb + u * kSlab + 8 * t;
      const bool k_in = k < k_hi;
      float g_in[8], g_all[8];
      if constexpr (kNorm) {
        float g_chunk[8];
        load_norm_weights8<T>(k_in ? a.in_w : nullptr, k, g_in);
        load_norm_weights8<T>(k_in ? a.chunk_w : nullptr, k, g_chunk);
#pragma unroll
        for (int i = 0; i < 8; ++i) g_all[i] = g_in[i] * g_chunk[i];
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        uint4 xv = (k_in && x_ok[j]) ? __ldg(reinterpret_cast<const uint4*>(x_row[j] + k)) : zero;
        if constexpr (kNorm) {
          uint32_t words[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            float2 f = P::to_float2(words[p]);
            if (track) {
              const float ux = f.x * g_in[2 * p], uy = f.y * g_in[2 * p + 1];
              ss_x[j] += f.x * f.x + f.y * f.y;
              ss_in[j] += ux * ux + uy * uy;
            }
            f.x *= g_all[2 * p];
            f.y *= g_all[2 * p + 1];
            words[p] = P::from_float2(f);
          }
          xv = make_uint4(words[0], words[1], words[2], words[3]);
        }
        P::mma(acc[j], wa[u].x, wb[u].x, wa[u].y, wb[u].y, xv.x, xv.y);
        P::mma(acc[j], wa[u].z, wb[u].z, wa[u].w, wb[u].w, xv.z, xv.w);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      wa[u] = na[u];
      wb[u] = nb[u];
    }
  }

  // acc[j][e]: weight row n0 + 8*(e/2), token tok0 + 8j + 2t + (e%2).
  if (a.partial != nullptr) {
    float* part = a.partial + static_cast<int64_t>(s) * a.M * a.N;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = tok0 + 8 * j + 2 * t + (e & 1);
        const int n = n0 + 8 * (e >> 1);
        if (tok < a.M && n < a.N) part[static_cast<int64_t>(tok) * a.N + n] = acc[j][e];
      }
    }
    if (track) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        float sx = ss_x[j], si = ss_in[j];
        sx += __shfl_xor_sync(0xffffffffu, sx, 1);
        si += __shfl_xor_sync(0xffffffffu, si, 1);
        sx += __shfl_xor_sync(0xffffffffu, sx, 2);
        si += __shfl_xor_sync(0xffffffffu, si, 2);
        const int tok = tok0 + 8 * j + g;
        if (t == 0 && tok < a.M) {
          float* q = a.sumsq + (static_cast<int64_t>(s) * a.M + tok) * 2;
          q[0] = sx;
          q[1] = si;
        }
      }
    }
  } else {
    T* out = static_cast<T*>(a.out);
    const T* bias = static_cast<const T*>(a.bias);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = tok0 + 8 * j + 2 * t + (e & 1);
        const int n = n0 + 8 * (e >> 1);
        if (tok < a.M && n < a.N) {
          const int64_t r = source_row(a, tok);
          float v = acc[j][e] + (bias != nullptr ? to_float(bias[n]) : 0.f);
          if (r < 0 || r >= a.R) v = nan_f32();
          out[static_cast<int64_t>(tok) * a.stride_out + n] = from_float<T>(v);
        }
      }
    }
  }
}

// out[m, n] = sum_{s = 0..S-1, in this order} scale[m, chunk(s)] * partial[s][m][n] + bias[n].
template <typename T, bool kVec4>
__global__ void __launch_bounds__(kReduceThreads) fc_reduce_kernel(const FcArgs a) {
  __shared__ float split_scale[kMaxSplits];
  const int m = blockIdx.x;
  if (threadIdx.x == 0) {
    float row_scale = 1.f;
    if (a.sumsq != nullptr && a.in_w != nullptr) {
      float total = 0.f;
      for (int s = 0; s < a.S; ++s) total += a.sumsq[(static_cast<int64_t>(s) * a.M + m) * 2];
      row_scale = rsqrtf(total / a.KH + a.eps);
    }
    for (int c = 0; c < a.NC; ++c) {
      float scale = row_scale;
      if (a.sumsq != nullptr && a.chunk_w != nullptr) {
        float q = 0.f;
        for (int s = c * a.splits_per_chunk; s < (c + 1) * a.splits_per_chunk; ++s)
          q += a.sumsq[(static_cast<int64_t>(s) * a.M + m) * 2 + 1];
        scale = row_scale * rsqrtf(row_scale * row_scale * (q / a.CH) + a.eps);
      }
      for (int s = c * a.splits_per_chunk; s < (c + 1) * a.splits_per_chunk; ++s) split_scale[s] = scale;
    }
  }
  __syncthreads();
  const int n = (blockIdx.y * kReduceThreads + threadIdx.x) * 4;
  if (n >= a.N) return;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  for (int s = 0; s < a.S; ++s) {
    const float* part = a.partial + (static_cast<int64_t>(s) * a.M + m) * a.N + n;
    const float sc = split_scale[s];
    if constexpr (kVec4) {
      const float4 p = *reinterpret_cast<const float4*>(part);
      v[0] += sc * p.x;
      v[1] += sc * p.y;
      v[2] += sc * p.z;
      v[3] += sc * p.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (n + e < a.N) v[e] += sc * part[e];
      }
    }
  }
  const int64_t r = source_row(a, m);
  const bool valid = r >= 0 && r < a.R;
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(m) * a.stride_out;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    if (n + e < a.N) {
      const float o = v[e] + (bias != nullptr ? to_float(bias[n + e]) : 0.f);
      out[n + e] = from_float<T>(valid ? o : nan_f32());
    }
  }
}

// ---- prepared input for the cuBLAS path ------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Block-wide sum (kPrepareThreads threads), same fixed order in every thread; callable repeatedly.
__device__ __forceinline__ float block_sum(float v) {
  constexpr int kWarpsPerBlock = kPrepareThreads / 32;
  __shared__ float warp_partials[kWarpsPerBlock];
  v = warp_sum(v);
  __syncthreads();  // the previous call's readers are done with warp_partials
  if ((threadIdx.x & 31) == 0) warp_partials[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kWarpsPerBlock; ++i) total += warp_partials[i];
  return total;
}

template <typename T, int VEC>
__device__ __forceinline__ void load_floats(const T* p, float (&f)[VEC]) {
  if constexpr (VEC == 1) {
    f[0] = to_float(*p);
  } else {
    Vec16<T> v;
    v.raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = to_float(v.elem[i]);
  }
}

// prep[m, :] = norm(x[rows[m]]) in the dtype (NaN row when rows[m] is out of range). One block per row.
template <typename T, int VEC>
__global__ void __launch_bounds__(kPrepareThreads) fc_prepare_kernel(const FcArgs a, T* prep, int64_t stride_prep) {
  const int m = blockIdx.x;
  const int64_t r = source_row(a, m);
  const bool valid = r >= 0 && r < a.R;
  const T* xr = static_cast<const T*>(a.x) + (valid ? r : 0) * a.stride_x;
  const T* in_w = static_cast<const T*>(a.in_w);
  const T* chunk_w = static_cast<const T*>(a.chunk_w);
  T* dst = prep + static_cast<int64_t>(m) * stride_prep;
  constexpr int kStep = kPrepareThreads * VEC;
  float row_scale = 1.f;
  if (in_w != nullptr) {
    float sq = 0.f;
    for (int k = threadIdx.x * VEC; valid && k < a.KH; k += kStep) {
      float f[VEC];
      load_floats<T, VEC>(xr + k, f);
#pragma unroll
      for (int i = 0; i < VEC; ++i) sq += f[i] * f[i];
    }
    row_scale = rsqrtf(block_sum(sq) / a.KH + a.eps);
  }
  for (int c = 0; c < a.NC; ++c) {
    const int base = c * a.CH;
    float scale = row_scale;
    if (chunk_w != nullptr) {
      float sq = 0.f;
      for (int k = base + threadIdx.x * VEC; valid && k < base + a.CH; k += kStep) {
        float f[VEC], gi[VEC];
        load_floats<T, VEC>(xr + k, f);
        if (in_w != nullptr) {
          load_floats<T, VEC>(in_w + k, gi);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) gi[i] = 1.f;
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float u = f[i] * gi[i];
          sq += u * u;
        }
      }
      scale = row_scale * rsqrtf(row_scale * row_scale * (block_sum(sq) / a.CH) + a.eps);
    }
    for (int k = base + threadIdx.x * VEC; k < base + a.CH; k += kStep) {
      float f[VEC];
      if (valid) {
        load_floats<T, VEC>(xr + k, f);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) f[i] = nan_f32();
      }
      float gi[VEC], gc[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) gi[i] = gc[i] = 1.f;
      if (in_w != nullptr) load_floats<T, VEC>(in_w + k, gi);
      if (chunk_w != nullptr) load_floats<T, VEC>(chunk_w + k, gc);
      if constexpr (VEC == 1) {
        dst[k] = from_float<T>(f[0] * scale * gi[0] * gc[0]);
      } else {
        Vec16<T> o;
#pragma unroll
        for (int i = 0; i < VEC; ++i) o.elem[i] = from_float<T>(f[i] * scale * gi[i] * gc[i]);
        *reinterpret_cast<uint4*>(dst + k) = o.raw;
      }
    }
  }
}

// ---- host: the scratch cache (policy: see the header comment) ----------------------------------------
enum class Scratch : int { kSplitK = 0, kPrepared, kRows, kBias, kInputNorm, kCount };
constexpr int kScratchKinds = static_cast<int>(Scratch::kCount);
constexpr int64_t kScratchGranule = 512;  // bytes, the caching allocator's unit

struct DeviceScratch {
  std::mutex mu;
  at::Tensor buf[kScratchKinds];      // uint8 [capacity], undefined until first use
  bool captured[kScratchKinds] = {};  // handed out while a CUDA graph was being captured
  std::vector<at::Tensor> retired;    // replaced buffers a captured graph may still replay into
};

DeviceScratch& device_scratch(c10::DeviceIndex index) {
  // Never destroyed: releasing CUDA memory from a static destructor can run after the CUDA runtime
  // has shut down at process exit.
  static const int count = std::max<int>(1, c10::cuda::device_count());
  static DeviceScratch* const all = new DeviceScratch[count];
  TORCH_CHECK(index >= 0 && index < count, "eagle3::draft_fc (cuda): device index ", int(index), " out of range");
  return all[index];
}

// At least `bytes` bytes of this device's `kind` scratch (uint8). The returned tensor holds a
// reference, so it stays valid for this call even if another thread grows the slot meanwhile.
at::Tensor scratch(const at::Device& device, Scratch kind, int64_t bytes) {
  DeviceScratch& d = device_scratch(device.index());
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  const int k = static_cast<int>(kind);
  const std::lock_guard<std::mutex> lock(d.mu);
  at::Tensor& buf = d.buf[k];
  if (!buf.defined() || buf.numel() < bytes) {
    int64_t size = buf.defined() ? std::max(bytes, buf.numel() + buf.numel() / 4) : bytes;
    size = std::max(kScratchGranule, (size + kScratchGranule - 1) / kScratchGranule * kScratchGranule);
    at::Tensor fresh = at::empty({size}, at::TensorOptions().dtype(at::kByte).device(device));
    if (buf.defined()) {
      if (d.captured[k] || capturing) {
        d.retired.push_back(buf);
      } else {
        buf.record_stream(at::cuda::getCurrentCUDAStream(device.index()));
      }
    }
    buf = std::move(fresh);
    d.captured[k] = false;
  }
  if (capturing) d.captured[k] = true;
  return buf;
}

// `numel` elements of `dtype` at the start of the `kind` scratch.
at::Tensor scratch_view(const at::Device& device, Scratch kind, int64_t numel, at::ScalarType dtype) {
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  return scratch(device, kind, bytes).narrow(0, 0, bytes).view(dtype);
}

// ---- host ------------------------------------------------------------------------------------------
int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

bool aligned16(const std::optional<at::Tensor>& t) { return !t.has_value() || is_aligned16(t->data_ptr()); }

template <typename T, int NT>
void launch_skinny_nt(const FcArgs& a, dim3 grid, bool norm, cudaStream_t stream) {
  if (norm) {
    fc_skinny_kernel<T, NT, true><<<grid, kThreads, 0, stream>>>(a);
  } else {
    fc_skinny_kernel<T, NT, false><<<grid, kThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void run_skinny(FcArgs a, const at::Tensor& x, int num_sms, cudaStream_t stream) {
  const bool norm = a.in_w != nullptr || a.chunk_w != nullptr;
  const int groups = ceil_div(std::min(a.M, 8 * kMaxTokenGroups), 8);
  const int nt = groups <= 1 ? 1 : groups <= 2 ? 2 : groups <= 4 ? 4 : 8;
  const int token_tiles = ceil_div(a.M, 8 * nt);
  const int weight_tiles = ceil_div(a.N, kRowsPerBlock);
  // Splits: enough blocks for kBlocksPerSm per SM, each split a multiple of kSlab*kUnroll inside
  // one chunk and at least 4 of those long, at most 16 per chunk and kMaxSplits in all.
  const int step = kSlab * kUnroll;
  const int64_t tiles = static_cast<int64_t>(token_tiles) * weight_tiles * a.NC;
  int per_chunk = static_cast<int>(std::min<int64_t>(16, (static_cast<int64_t>(kBlocksPerSm) * num_sms + tiles - 1) / tiles));
  per_chunk = std::max(1, std::min({per_chunk, a.CH / (4 * step), kMaxSplits / a.NC}));
  a.split_len = ceil_div(ceil_div(a.CH, per_chunk), step) * step;
  a.splits_per_chunk = ceil_div(a.CH, a.split_len);
  a.S = a.NC * a.splits_per_chunk;
  TORCH_CHECK(a.S <= kMaxSplits, "eagle3::draft_fc (cuda): ", a.S, " splits exceed the reducer's ", kMaxSplits);

  at::Tensor workspace;  // keeps the scratch buffer referenced until the launches are queued
  if (a.S > 1 || norm) {
    const int64_t partial = static_cast<int64_t>(a.S) * a.M * a.N;
    const int64_t sums = norm ? static_cast<int64_t>(a.S) * a.M * 2 : 0;
    workspace = scratch_view(x.device(), Scratch::kSplitK, partial + sums, at::kFloat);
    a.partial = workspace.data_ptr<float>();
    a.sumsq = norm ? a.partial + partial : nullptr;
  }
  const dim3 grid(token_tiles, weight_tiles, a.S);
  switch (nt) {
    case 1: launch_skinny_nt<T, 1>(a, grid, norm, stream); break;
    case 2: launch_skinny_nt<T, 2>(a, grid, norm, stream); break;
    case 4: launch_skinny_nt<T, 4>(a, grid, norm, stream); break;
    default: launch_skinny_nt<T, 8>(a, grid, norm, stream); break;
  }
  if (a.partial != nullptr) {
    const dim3 rgrid(a.M, ceil_div(a.N, kReduceThreads * 4));
    if (a.N % 4 == 0) {
      fc_reduce_kernel<T, true><<<rgrid, kReduceThreads, 0, stream>>>(a);
    } else {
      fc_reduce_kernel<T, false><<<rgrid, kReduceThreads, 0, stream>>>(a);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename T>
at::Tensor prepare_input(const FcArgs& a, const at::Tensor& x, cudaStream_t stream) {
  constexpr int VEC = Vec16<T>::kElems;
  at::Tensor prep =
      scratch_view(x.device(), Scratch::kPrepared, static_cast<int64_t>(a.M) * a.KH, x.scalar_type()).view({a.M, a.KH});
  const bool vec = a.KH % VEC == 0 && a.CH % VEC == 0 && a.stride_x % VEC == 0 && is_aligned16(a.x) &&
                   (a.in_w == nullptr || is_aligned16(a.in_w)) && (a.chunk_w == nullptr || is_aligned16(a.chunk_w));
  T* dst = reinterpret_cast<T*>(prep.data_ptr());
  if (vec) {
    fc_prepare_kernel<T, VEC><<<a.M, kPrepareThreads, 0, stream>>>(a, dst, prep.stride(0));
  } else {
    fc_prepare_kernel<T, 1><<<a.M, kPrepareThreads, 0, stream>>>(a, dst, prep.stride(0));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return prep;
}

template <typename T>
void draft_fc_typed(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& chunk_norm_weight,
                    const std::optional<at::Tensor>& input_norm_weight, double eps, at::Tensor& out) {
  FcArgs a{};
  a.x = x.data_ptr();
  a.stride_x = x.stride(0);
  a.w = weight.data_ptr();
  a.stride_w = weight.stride(0);
  a.rows = rows.has_value() ? rows->data_ptr() : nullptr;
  a.rows_are_int64 = rows.has_value() && rows->scalar_type() == at::kLong;
  a.in_w = input_norm_weight.has_value() ? input_norm_weight->data_ptr() : nullptr;
  a.chunk_w = chunk_norm_weight.has_value() ? chunk_norm_weight->data_ptr() : nullptr;
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.stride_out = out.stride(0);
  a.R = x.size(0);
  a.M = static_cast<int>(out.size(0));
  a.N = static_cast<int>(weight.size(0));
  a.KH = static_cast<int>(x.size(1));
  a.NC = chunk_norm_weight.has_value() ? static_cast<int>(chunk_norm_weight->size(0)) : 1;
  a.CH = chunk_norm_weight.has_value() ? static_cast<int>(chunk_norm_weight->size(1)) : a.KH;
  a.eps = static_cast<float>(eps);

  const auto* props = at::cuda::getCurrentDeviceProperties();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if constexpr (!std::is_same_v<T, float>) {
    // 16-byte fragments: rows, chunk boundaries and norm weights must allow 8-element vectors.
    const bool aligned = a.CH % 8 == 0 && a.stride_x % 8 == 0 && a.stride_w % 8 == 0 && is_aligned16(a.x) &&
                         is_aligned16(a.w) && aligned16(chunk_norm_weight) && aligned16(input_norm_weight) &&
                         (!input_norm_weight.has_value() || input_norm_weight->stride(0) == 1);
    // fp16: the skinny kernel rounds the *unnormalized* x * input_norm_weight * chunk_norm_weight to the
    // dtype before the MMA (the RMS scale is applied in the reducer); that product can exceed 65504
    // where norm(x) cannot. bf16 has the range; fp16 with norms takes the prepare + cuBLAS path.
    const bool fp16_norm = std::is_same_v<T, c10::Half> && (a.in_w != nullptr || a.chunk_w != nullptr);
    if (aligned && !fp16_norm && a.KH > 0 && a.NC <= kMaxSplits && a.M <= skinny_max_m(props->major)) {
      run_skinny<T>(a, x, props->multiProcessorCount, stream);
      return;
    }
  }
  const at::Tensor input = (rows.has_value() || chunk_norm_weight.has_value() || input_norm_weight.has_value())
                               ? prepare_input<T>(a, x, stream)
                               : x;
  if (bias.has_value()) {
    at::addmm_out(out, *bias, input, weight.t());
  } else {
    at::mm_out(out, input, weight.t());
  }
}

}  // namespace

void draft_fc_out(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& chunk_norm_weight,
                  const std::optional<at::Tensor>& input_norm_weight, double eps, at::Tensor& out) {
  TORCH_CHECK(x.is_cuda() && weight.is_cuda() && out.is_cuda(), "eagle3::draft_fc (cuda): tensors must be on CUDA");
  // eagle3_ops/validation.py checks all of this with clear messages first; these guard direct callers
  // of eagle3_ops._C against out-of-bounds reads.
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2 && weight.size(1) == x.size(1) &&
                  out.size(1) == weight.size(0) && (rows.has_value() || out.size(0) == x.size(0)),
              "eagle3::draft_fc (cuda): shapes: x [R, KH], weight [N, KH], out [M, N] (M = R without rows)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type() &&
                  weight.device() == x.device() && out.device() == x.device(),
              "eagle3::draft_fc (cuda): one dtype, one device");
  TORCH_CHECK(!rows.has_value() || (rows->device() == x.device() && rows->dim() == 1 && rows->numel() == out.size(0) &&
                                    (rows->scalar_type() == at::kInt || rows->scalar_type() == at::kLong)),
              "eagle3::draft_fc (cuda): rows must be int32/int64 [M] on x's device");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == weight.size(0) && bias->scalar_type() == x.scalar_type() &&
                                    bias->device() == x.device()),
              "eagle3::draft_fc (cuda): bias must be [N]");
  TORCH_CHECK(!input_norm_weight.has_value() ||
                  (input_norm_weight->numel() == x.size(1) && input_norm_weight->scalar_type() == x.scalar_type() &&
                   input_norm_weight->device() == x.device()),
              "eagle3::draft_fc (cuda): input_norm_weight must be [KH]");
  TORCH_CHECK(!chunk_norm_weight.has_value() ||
                  (chunk_norm_weight->dim() == 2 && chunk_norm_weight->numel() == x.size(1) &&
                   chunk_norm_weight->size(1) > 0 && chunk_norm_weight->scalar_type() == x.scalar_type() &&
                   chunk_norm_weight->device() == x.device()),
              "eagle3::draft_fc (cuda): chunk_norm_weight must be [K, H], K*H = KH");
  TORCH_CHECK((x.size(1) <= 1 || x.stride(1) == 1) && (weight.size(1) <= 1 || weight.stride(1) == 1) &&
                  (out.size(1) <= 1 || out.stride(1) == 1),
              "eagle3::draft_fc (cuda): last dims must be contiguous");
  TORCH_CHECK(!chunk_norm_weight.has_value() || chunk_norm_weight->is_contiguous(),
              "eagle3::draft_fc (cuda): chunk_norm_weight must be contiguous");
  TORCH_CHECK(x.size(1) <= INT32_MAX && weight.size(0) <= INT32_MAX && out.size(0) <= INT32_MAX,
              "eagle3::draft_fc (cuda): sizes must fit int32");
  if (out.size(0) == 0 || out.size(1) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(x.device());
  // The kernels index the 1-D tensors with stride 1; validation allows strided views of them. The
  // rare strided view is copied into scratch (one copy kernel, no allocation once warm).
  const auto unit_stride = [](const std::optional<at::Tensor>& t, Scratch kind) -> std::optional<at::Tensor> {
    if (!t.has_value() || t->is_contiguous()) return t;
    at::Tensor dst = scratch_view(t->device(), kind, t->numel(), t->scalar_type());
    dst.copy_(*t);
    return dst;
  };
  const std::optional<at::Tensor> bias_c = unit_stride(bias, Scratch::kBias);
  const std::optional<at::Tensor> rows_c = unit_stride(rows, Scratch::kRows);
  const std::optional<at::Tensor> input_norm_c = unit_stride(input_norm_weight, Scratch::kInputNorm);
  switch (x.scalar_type()) {
    case at::kBFloat16:
      draft_fc_typed<c10::BFloat16>(x, weight, bias_c, rows_c, chunk_norm_weight, input_norm_c, eps, out);
      break;
    case at::kHalf:
      draft_fc_typed<c10::Half>(x, weight, bias_c, rows_c, chunk_norm_weight, input_norm_c, eps, out);
      break;
    case at::kFloat:
      draft_fc_typed<float>(x, weight, bias_c, rows_c, chunk_norm_weight, input_norm_c, eps, out);
      break;
    default:
      TORCH_CHECK(false, "eagle3::draft_fc (cuda): unsupported dtype ", x.scalar_type());
  }
}

}  // namespace eagle3
