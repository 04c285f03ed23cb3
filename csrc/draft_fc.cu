// draft_fc: out[M, N] = linear(norm(x[rows]), weight, bias)  (docs/design.md §5.4; the exact
// math is eagle3_ops/reference.py draft_fc_ref: input norm over the K*H row, then one RMSNorm per
// H-wide chunk). x [R, KH], weight [N, KH], KH = K*H. Rounding: the skinny path accumulates in fp32
// and rounds once at the end; the cuBLAS path rounds the prepared input norm(x[rows]) to the dtype
// once, then follows torch.backends.cuda.matmul's flags (reduced-precision reductions / TF32 if the
// application enables them).
//
// Bytes / FLOPs: the weight (N*KH elements: 308 MB in bf16 at H=7168, K=3) is read once, x rows
// M*KH, out M*N; FLOPs = 2*M*N*KH. Up to M ~ 130-280 (device dependent, docs/kernels.md §4)
// the weight read is the floor: ~72 us on H200, ~172 us on sm_120 at H=7168.
//
// The torch op eagle3_cuda::draft_fc (csrc/bindings.cpp) takes the path and the split count as
// arguments: eagle3_ops/cuda_backend.py decides them (the crossover table is eagle3_ops/plans.py;
// the skinny kernel's launch contract below is checked there first, and only re-checked here as
// memory safety; docs/design.md §9, docs/kernels.md §7). Paths, numbered as eagle3_ops.plans.PATHS:
//
// 0 skinny (bf16/fp16, 16-byte-aligned rows, chunk width a multiple of 8, at most kMaxSplits
// chunks): fc_skinny_kernel, swap-AB mma.sync m16n8k16 (an sm_80+ instruction: the same code serves
// sm_90a and sm_120a; nothing is staged in shared memory, so sm_120's 99 KB per block does not
// constrain it). A block is 4 warps; warp w owns 16 weight rows (64 per block), all warps share one
// token tile of 8*NT tokens and one k range (a split), so the gathered x rows come from L1 for all
// four warps while each weight element is loaded exactly once, 16 bytes per load, without L1
// allocation and L2 evict-first (the weight is read once per call), kUnroll 32-wide k slabs
// (8 loads = 128 B per thread) in flight before the MMAs.
// Thread (g = lane/4, t = lane%4) loads W[row g][k+8t, k+8t+8), W[row g+8][same] and x[token
// g][same]. The k order inside one MMA is free as long as A and B agree, so these 16-byte vectors
// ARE the fragments of two m16n8k16 MMAs (k slots {2t, 2t+1, 2t+8, 2t+9} <- k+8t..k+8t+3, then
// k+8t+4..k+8t+7): no shuffles, no shared memory (docs/kernels.md §7.1). Grid (token tiles, weight
// tiles of 64 rows, S splits); every split lies inside one H-wide chunk. The skinny kernel writes
// fp32 partials [S][M][N], plus (with norms) per split and token the sums of x^2 and
// (x*input_norm_weight)^2 taken from the x fragments it loads anyway, into the workspace;
// fc_reduce_kernel sums the splits in the fixed order s = 0..S-1, multiplying each split's partial
// by its chunk's RMS scale (linearity, docs/kernels.md §5: no K-wide pre-pass at all), adds bias
// and writes out. The norm weights g = input_norm_weight * chunk_norm_weight multiply the x
// fragments on the fly (rounded back to the dtype, as the stock path rounds its normalized input).
// With one split and no norm the skinny kernel writes out directly. fp16 with norms never comes
// here (cuda_backend sends it to cuBLAS): x * g is rounded to the dtype before the RMS scale, and
// that product can exceed 65504 where norm(x) cannot.
// Folded norm weights (norm_folded: the weight was prepared once as W[n, k] * g[k],
// eagle3_ops.fold_norm_weights): the hot loop is the plain one (no per-element x * g, no repack,
// no sums in it), and the blocks of weight tile 0 take the RMS statistics of their (token tile,
// split) in a separate pass over x at the end of the kernel (8*NT rows of one split: kilobytes, in
// cache from the main loop, against 64 weight rows of the split per block). x is never multiplied
// here; fp16 folds only without input_norm_weight (eagle3_ops/validation.py FOLDED_FP16_INPUT_NORM:
// the cuBLAS path's prepared x * scales could overflow without g).
// The reducer is launched with programmatic dependent launch (PDL, sm_90+): it is scheduled while
// the skinny grid drains (the skinny blocks trigger after their main loop) and waits at
// griddepcontrol.wait for the whole skinny grid to finish and its writes to be visible, so the
// second launch's latency overlaps the first kernel's tail; the result is the same bits.
// 2 cublas (any dtype or layout): fc_prepare_kernel writes norm(x[rows]) in the dtype into the
// workspace, then cuBLAS (at::addmm) multiplies; with no gather and no norm cuBLAS reads x directly.
// (1, tiled, is a Triton kernel only.)
//
// Splits: the `splits` argument is the number of splits per chunk asked for (cuda_backend derives
// it from the SM count and the kernel variant's occupancy, eagle3_cuda::skinny_occupancy, so that
// the grid fills whole waves of resident blocks); it is clamped here to the launch contract: every
// split a whole number of kSlab*kUnroll steps, at least 4 of them, and at most kMaxSplits splits in
// all (docs/kernels.md §7.5; cuda_backend.skinny_split_shape mirrors this clamp).
//
// Memory: nothing is allocated here. The split-K partials and sums of squares (skinny) or the
// prepared input (cublas) are carved from the caller's uint8 `workspace`, 256-byte aligned regions
// in that order (eagle3_ops.workspace.Carver's rule; docs/kernels.md §9); eagle3_cuda::draft_fc_workspace_bytes gives
// the size for exactly these arguments, and a smaller workspace is an error. cuBLAS's own workspace
// is PyTorch's. Strided 1-D views (rows, bias, input_norm_weight) are copied to unit stride by the
// caller (cuda_backend, also into the workspace); this op requires stride 1.
//
// Deterministic: every sum has a fixed order, no atomics. Row indices outside [0, R) are never
// dereferenced; those output rows are NaN. No host sync, current stream: CUDA-graph safe.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "common.cuh"
#include "ops.h"

namespace eagle3 {
namespace {

// ---- launch shape ----------------------------------------------------------------------------------
// eagle3_ops/cuda_backend.py mirrors kThreads, kRowsPerBlock, the token tile (8 * NT tokens, NT from
// M), kSlab * kUnroll and kMaxSplits to plan its split request, and keeps each variant's register
// count (SKINNY_REGISTERS, checked against the built cubins by tests/test_build.py); keep them in step.
constexpr int kThreads = 128;       // 4 warps
constexpr int kRowsPerWarp = 16;    // the MMA's M side: weight rows
constexpr int kRowsPerBlock = 64;
constexpr int kSlab = 32;           // k covered by one thread group (4 threads x 8 elements) per step
constexpr int kUnroll = 4;          // slabs loaded before the MMAs that use them
constexpr int kMaxTokenGroups = 8;  // token tile <= 64 tokens (8 groups of 8)
constexpr int kMaxSplits = 64;
constexpr int kReduceThreads = 256;
constexpr int kPrepareThreads = 256;
// Workspace regions start on this boundary (eagle3_ops.workspace.ALIGN: the Python side carves the
// same way, and the float4 / 16-byte vector accesses need 16).
constexpr int64_t kWorkspaceAlign = 256;
// Path numbers: the index in eagle3_ops.plans.PATHS ("skinny", "tiled", "cublas").
constexpr int64_t kPathSkinny = 0;
constexpr int64_t kPathCublas = 2;
// fc_skinny_kernel variants (eagle3_cuda::skinny_occupancy's `variant`, cuda_backend.SKINNY_VARIANTS):
constexpr int kPlain = 0;   // no norm
constexpr int kNormed = 1;  // norm weights multiply x in the hot loop; one warp per block sums squares
constexpr int kFolded = 2;  // the weight carries the norm weights; sums of squares in a separate pass


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
  bool folded;     // the weight carries g = in_w * chunk_w (in_w still feeds the chunk statistic)
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

// L2 eviction policy for the weight stream: evict first (the weight is read exactly once per call,
// so its lines should be the first to leave L2 and not push out x, the partials or the target
// model's working set). createpolicy is sm_80+; ptxas folds the constant policy into the load's
// memory descriptor (no per-load cost).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// One 16-byte weight load, streamed: read-only path, no L1 allocation (L1 is for the shared x rows),
// L2 evict-first (the policy above, as a cache hint), 256-byte L2 prefetch (the thread group reads
// 256 contiguous bytes of each row per iteration). Inline asm volatile keeps all kUnroll*2 loads of
// an iteration issued before the MMAs that consume them (plain loads were interleaved with the MMAs
// by the compiler, ~2 in flight). Zero when !pred (tails of k ranges and of the weight rows:
// nothing is read). tests/test_build.py checks the hint in the PTX and the SASS.
__device__ __forceinline__ uint4 load_weight16(const void* p, bool pred, uint64_t policy) {
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
      " mov.b32 %3, 0;\n @p ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %6;\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"(static_cast<int>(pred)), "l"(policy));
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

// Folded variant: sums of x^2 and (x * input_norm_weight)^2 over [k_lo, k_hi) of every token of the
// tile, one warp per token, 16-byte loads; written to sumsq[s][tok] for the reducer's scales.
template <typename T, int NT>
__device__ __forceinline__ void record_sums_of_squares(const FcArgs& a, int s, int k_lo, int k_hi, int tok0) {
  using P = Pair<T>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const T* x = static_cast<const T*>(a.x);
  // Not unrolled: this pass is off the hot loop and must not raise the kernel's register count.
#pragma unroll 1
  for (int j = warp; j < 8 * NT; j += kThreads / 32) {
    const int tok = tok0 + j;
    if (tok >= a.M) break;  // uniform per warp
    const int64_t r = source_row(a, tok);
    const bool ok = r >= 0 && r < a.R;  // out-of-range rows are never read (their outputs are NaN)
    const T* xr = x + (ok ? r : 0) * a.stride_x;
    float sx = 0.f, si = 0.f;
#pragma unroll 1
    for (int k = k_lo + 8 * lane; ok && k < k_hi; k += 8 * 32) {
      const uint4 xv = __ldg(reinterpret_cast<const uint4*>(xr + k));
      float g_in[8];
      load_norm_weights8<T>(a.in_w, k, g_in);
      const uint32_t words[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const float2 f = P::to_float2(words[p]);
        const float ux = f.x * g_in[2 * p], uy = f.y * g_in[2 * p + 1];
        sx += f.x * f.x + f.y * f.y;
        si += ux * ux + uy * uy;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      sx += __shfl_xor_sync(0xffffffffu, sx, off);
      si += __shfl_xor_sync(0xffffffffu, si, off);
    }
    if (lane == 0) {
      float* q = a.sumsq + (static_cast<int64_t>(s) * a.M + tok) * 2;
      q[0] = sx;
      q[1] = si;
    }
  }
}

template <typename T, int NT, int kVariant>
__global__ void __launch_bounds__(kThreads) fc_skinny_kernel(const FcArgs a) {
  constexpr bool kNorm = kVariant == kNormed;  // x * g in the hot loop
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
  const uint64_t w_policy = l2_evict_first_policy();

  // Register double buffer: the weight loads of the next iteration are issued before the MMAs of
  // this one, so 2 * kUnroll * 2 16-byte loads per thread can be in flight.
  uint4 wa[kUnroll], wb[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int k = k_lo + u * kSlab + 8 * t;
    const bool k_in = k < k_hi;  // k_hi - k is a multiple of 8: the 8-run is all in or all out
    wa[u] = load_weight16(w0 + k, k_in && w0_ok, w_policy);
    wb[u] = load_weight16(w1 + k, k_in && w1_ok, w_policy);
  }
  for (int kb = k_lo; kb < k_hi; kb += kSlab * kUnroll) {
    uint4 na[kUnroll], nb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = kb + kSlab * kUnroll + u * kSlab + 8 * t;
      const bool k_in = k < k_hi;
      na[u] = load_weight16(w0 + k, k_in && w0_ok, w_policy);
      nb[u] = load_weight16(w1 + k, k_in && w1_ok, w_policy);
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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // PDL: the reducer may be scheduled now; it waits (griddepcontrol.wait) for this whole grid.
  // (Also a compiler barrier: nothing below is hoisted into the main loop.)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

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
  if constexpr (kVariant == kFolded) {
    // Last, when nothing of the main loop is live any more (placed before the main loop, ptxas kept
    // the first weight loads in flight across it; after the loop, the accumulators: up to 200
    // registers at NT = 8 instead of the plain variant's 148 on sm_90a). The x rows are in cache.
    if (blockIdx.y == 0) record_sums_of_squares<T, NT>(a, s, k_lo, k_hi, tok0);
  }
}

// out[m, n] = sum_{s = 0..S-1, in this order} scale[m, chunk(s)] * partial[s][m][n] + bias[n].
template <typename T, bool kVec4>
__global__ void __launch_bounds__(kReduceThreads) fc_reduce_kernel(const FcArgs a) {
  __shared__ float split_scale[kMaxSplits];
  const int m = blockIdx.x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // PDL: block until the skinny grid has completed and its partials / sums are visible (a no-op
  // when launched without the attribute).
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
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
  // the gains multiplied into the prepared row: none when the weight carries them (folded)
  const T* gain_in = a.folded ? nullptr : in_w;
  const T* gain_chunk = a.folded ? nullptr : chunk_w;
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
    row_scale = rsqrtf(block_sum<kPrepareThreads / 32>(sq) / a.KH + a.eps);
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
      scale = row_scale * rsqrtf(row_scale * row_scale * (block_sum<kPrepareThreads / 32>(sq) / a.CH) + a.eps);
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
      if (gain_in != nullptr) load_floats<T, VEC>(gain_in + k, gi);
      if (gain_chunk != nullptr) load_floats<T, VEC>(gain_chunk + k, gc);
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

// ---- host ------------------------------------------------------------------------------------------
int64_t align_up(int64_t bytes) { return ceil_div(bytes, kWorkspaceAlign) * kWorkspaceAlign; }

// The skinny launch for one problem: token tile, grid and splits (see the header comment).
struct SkinnyPlan {
  int nt;            // token groups of 8 per tile: 1, 2, 4 or 8
  int token_tiles;   // grid.x
  int weight_tiles;  // grid.y
  int splits_per_chunk, split_len, S;  // grid.z = S = NC * splits_per_chunk
};

SkinnyPlan skinny_plan(int64_t M, int64_t N, int CH, int NC, int64_t splits) {
  TORCH_CHECK(CH > 0 && NC > 0, "eagle3_cuda::draft_fc: the skinny path needs K*H > 0");
  TORCH_CHECK(splits >= 1, "eagle3_cuda::draft_fc: the skinny path needs splits >= 1, got ", splits);
  SkinnyPlan p{};
  const int groups = static_cast<int>(ceil_div(std::min<int64_t>(M, 8 * kMaxTokenGroups), 8));
  p.nt = groups <= 1 ? 1 : groups <= 2 ? 2 : groups <= 4 ? 4 : 8;
  p.token_tiles = static_cast<int>(ceil_div(M, 8 * p.nt));
  p.weight_tiles = static_cast<int>(ceil_div(N, kRowsPerBlock));
  // Each split a multiple of kSlab*kUnroll inside one chunk and at least 4 of those long, at most
  // kMaxSplits in all.
  const int step = kSlab * kUnroll;
  const int asked = static_cast<int>(std::min<int64_t>(splits, INT_MAX));
  const int per_chunk = std::max(1, std::min({asked, CH / (4 * step), kMaxSplits / NC}));
  p.split_len = static_cast<int>(ceil_div(ceil_div(CH, per_chunk), step) * step);
  p.splits_per_chunk = static_cast<int>(ceil_div(CH, p.split_len));
  p.S = NC * p.splits_per_chunk;
  TORCH_CHECK(p.S <= kMaxSplits, "eagle3_cuda::draft_fc: ", p.S, " splits exceed the reducer's ", kMaxSplits,
              " (more than ", kMaxSplits, " chunks: use the cublas path)");
  return p;
}

// Workspace regions of the skinny path: fp32 partials [S][M][N], then (with norms) fp32 sums of
// squares [S][M][2]; none with one split and no norm (the kernel writes out directly).
struct SkinnyRegions {
  int64_t partial_bytes, sums_bytes;
  int64_t total() const { return partial_bytes + sums_bytes; }
};

SkinnyRegions skinny_regions(const SkinnyPlan& p, int64_t M, int64_t N, bool norm) {
  if (p.S == 1 && !norm) return {0, 0};
  const int64_t partial = align_up(static_cast<int64_t>(p.S) * M * N * static_cast<int64_t>(sizeof(float)));
  const int64_t sums = norm ? align_up(static_cast<int64_t>(p.S) * M * 2 * static_cast<int64_t>(sizeof(float))) : 0;
  return {partial, sums};
}

// (chunk width, chunk count): (H, K) with chunk norm, else (KH, 1).
std::pair<int64_t, int64_t> chunks(int64_t KH, int64_t K, bool chunk_norm) {
  if (!chunk_norm) return {KH, 1};
  TORCH_CHECK(K >= 1 && KH % K == 0 && KH / K > 0, "eagle3_cuda::draft_fc: chunk_norm needs K >= 1 chunks of ",
              "equal, non-zero width (K*H = KH), got KH=", KH, ", K=", K);
  return {KH / K, K};
}

int64_t workspace_bytes(int64_t M, int64_t N, int64_t KH, int64_t K, bool chunk_norm, bool input_norm, int64_t path,
                        int64_t splits, at::ScalarType dtype) {
  TORCH_CHECK(M >= 0 && N >= 0 && KH >= 0, "eagle3_cuda::draft_fc_workspace_bytes: negative size");
  TORCH_CHECK(M <= INT32_MAX && N <= INT32_MAX && KH <= INT32_MAX,
              "eagle3_cuda::draft_fc_workspace_bytes: sizes must fit int32");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "eagle3_cuda::draft_fc_workspace_bytes: unsupported dtype ", dtype);
  if (M == 0 || N == 0) return 0;
  if (path == kPathSkinny) {
    TORCH_CHECK(dtype != at::kFloat, "eagle3_cuda::draft_fc: the skinny path takes bf16/fp16 only");
    const auto [CH, NC] = chunks(KH, K, chunk_norm);
    const SkinnyPlan p = skinny_plan(M, N, static_cast<int>(CH), static_cast<int>(NC), splits);
    return skinny_regions(p, M, N, chunk_norm || input_norm).total();
  }
  TORCH_CHECK(path == kPathCublas, "eagle3_cuda::draft_fc: path must be 0 (skinny) or 2 (cublas), got ", path,
              " (1, tiled, is a Triton kernel only)");
  // The prepared input norm(x[rows]) [M, KH] in the dtype. (A call with no gather and no norm has
  // nothing to prepare and needs none of it; the caller knows, see draft_fc below.)
  return align_up(M * KH * static_cast<int64_t>(c10::elementSize(dtype)));
}

template <typename T, int NT>
void launch_skinny_nt(const FcArgs& a, dim3 grid, int variant, cudaStream_t stream) {
  if (variant == kFolded) {
    fc_skinny_kernel<T, NT, kFolded><<<grid, kThreads, 0, stream>>>(a);
  } else if (variant == kNormed) {
    fc_skinny_kernel<T, NT, kNormed><<<grid, kThreads, 0, stream>>>(a);
  } else {
    fc_skinny_kernel<T, NT, kPlain><<<grid, kThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The split-K reducer as a programmatic dependent launch of the skinny grid (see the header).
template <typename T, bool kVec4>
void launch_reduce(const FcArgs& a, dim3 grid, cudaStream_t stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kReduceThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, fc_reduce_kernel<T, kVec4>, a));
}

template <typename T>
void run_skinny(FcArgs a, const SkinnyPlan& p, uint8_t* workspace, cudaStream_t stream) {
  const bool norm = a.in_w != nullptr || a.chunk_w != nullptr;
  const int variant = !norm ? kPlain : a.folded ? kFolded : kNormed;
  a.split_len = p.split_len;
  a.splits_per_chunk = p.splits_per_chunk;
  a.S = p.S;
  const SkinnyRegions regions = skinny_regions(p, a.M, a.N, norm);
  if (regions.total() > 0) {
    a.partial = reinterpret_cast<float*>(workspace);
    a.sumsq = norm ? reinterpret_cast<float*>(workspace + regions.partial_bytes) : nullptr;
  }
  const dim3 grid(p.token_tiles, p.weight_tiles, a.S);
  switch (p.nt) {
    case 1: launch_skinny_nt<T, 1>(a, grid, variant, stream); break;
    case 2: launch_skinny_nt<T, 2>(a, grid, variant, stream); break;
    case 4: launch_skinny_nt<T, 4>(a, grid, variant, stream); break;
    default: launch_skinny_nt<T, 8>(a, grid, variant, stream); break;
  }
  if (a.partial != nullptr) {
    const dim3 rgrid(a.M, static_cast<unsigned>(ceil_div(a.N, kReduceThreads * 4)));
    if (a.N % 4 == 0) {
      launch_reduce<T, true>(a, rgrid, stream);
    } else {
      launch_reduce<T, false>(a, rgrid, stream);
    }
  }
}

// norm(x[rows]) [M, KH] in the dtype, written into the workspace's first region.
template <typename T>
at::Tensor prepare_input(const FcArgs& a, const at::Tensor& workspace, at::ScalarType dtype, cudaStream_t stream) {
  constexpr int VEC = Vec16<T>::kElems;
  const int64_t bytes = static_cast<int64_t>(a.M) * a.KH * static_cast<int64_t>(sizeof(T));
  at::Tensor prep = workspace.narrow(0, 0, bytes).view(dtype).view({a.M, a.KH});
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

bool aligned16(const std::optional<at::Tensor>& t) { return !t.has_value() || is_aligned16(t->data_ptr()); }

template <typename T>
void draft_fc_typed(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& chunk_norm_weight,
                    const std::optional<at::Tensor>& input_norm_weight, double eps, at::Tensor& out,
                    const std::optional<at::Tensor>& workspace, int64_t path, int64_t splits,
                    bool norm_folded) {
  FcArgs a{};
  a.folded = norm_folded;
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

  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (path == kPathSkinny) {
    if constexpr (!std::is_same_v<T, float>) {
      // The launch contract of the 16-byte fragments (cuda_backend checks it before choosing this
      // path; here it guards direct callers against misaligned loads).
      TORCH_CHECK(a.KH > 0 && a.CH % 8 == 0 && a.stride_x % 8 == 0 && a.stride_w % 8 == 0 && is_aligned16(a.x) &&
                      is_aligned16(a.w) && aligned16(chunk_norm_weight) && aligned16(input_norm_weight),
                  "eagle3_cuda::draft_fc: the skinny path needs K*H > 0, a chunk width and row strides that are ",
                  "multiples of 8 and 16-byte aligned x, weight and norm weights; use the cublas path");
      const SkinnyPlan p = skinny_plan(a.M, a.N, a.CH, a.NC, splits);
      run_skinny<T>(a, p, workspace.has_value() ? static_cast<uint8_t*>(workspace->data_ptr()) : nullptr, stream);
      return;
    }
    TORCH_CHECK(false, "eagle3_cuda::draft_fc: the skinny path takes bf16/fp16 only");
  }
  at::Tensor input = x;
  if (rows.has_value() || chunk_norm_weight.has_value() || input_norm_weight.has_value()) {
    // K*H = 0: nothing to prepare (and no workspace): an empty [M, 0] view; out = bias.
    input = a.KH > 0 ? prepare_input<T>(a, *workspace, x.scalar_type(), stream) : x.as_strided({a.M, 0}, {0, 1});
  }
  if (bias.has_value()) {
    at::addmm_out(out, *bias, input, weight.t());
  } else {
    at::mm_out(out, input, weight.t());
  }
}

bool unit_stride(const std::optional<at::Tensor>& t) {
  return !t.has_value() || t->numel() <= 1 || t->stride(0) == 1;
}

template <typename T, int NT>
const void* skinny_variant(int64_t variant) {
  switch (variant) {
    case kPlain: return reinterpret_cast<const void*>(&fc_skinny_kernel<T, NT, kPlain>);
    case kNormed: return reinterpret_cast<const void*>(&fc_skinny_kernel<T, NT, kNormed>);
    case kFolded: return reinterpret_cast<const void*>(&fc_skinny_kernel<T, NT, kFolded>);
    default: TORCH_CHECK(false, "eagle3_cuda::skinny_occupancy: variant must be 0 (plain), 1 (norm) or 2 (folded), ",
                         "got ", variant);
  }
  return nullptr;
}

template <typename T>
const void* skinny_kernel_for(int64_t nt, int64_t variant) {
  switch (nt) {
    case 1: return skinny_variant<T, 1>(variant);
    case 2: return skinny_variant<T, 2>(variant);
    case 4: return skinny_variant<T, 4>(variant);
    case 8: return skinny_variant<T, 8>(variant);
    default: TORCH_CHECK(false, "eagle3_cuda::skinny_occupancy: nt must be 1, 2, 4 or 8, got ", nt);
  }
  return nullptr;
}

}  // namespace

int64_t skinny_occupancy(int64_t nt, int64_t variant, at::ScalarType dtype) {
  const void* kernel = nullptr;
  switch (dtype) {
    case at::kBFloat16: kernel = skinny_kernel_for<c10::BFloat16>(nt, variant); break;
    case at::kHalf: kernel = skinny_kernel_for<c10::Half>(nt, variant); break;
    default: TORCH_CHECK(false, "eagle3_cuda::skinny_occupancy: the skinny kernel takes bf16/fp16 only, got ", dtype);
  }
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
  return blocks;
}

int64_t draft_fc_workspace_bytes(int64_t M, int64_t N, int64_t KH, int64_t K, bool chunk_norm, bool input_norm,
                                 int64_t path, int64_t splits, at::ScalarType dtype) {
  return workspace_bytes(M, N, KH, K, chunk_norm, input_norm, path, splits, dtype);
}

void draft_fc(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
              const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& chunk_norm_weight,
              const std::optional<at::Tensor>& input_norm_weight, double eps, at::Tensor& out,
              const std::optional<at::Tensor>& workspace, int64_t path, int64_t splits, bool norm_folded) {
  const char* op = "eagle3_cuda::draft_fc: ";
  // eagle3_ops/validation.py checks all of this with clear messages first; these guard direct
  // callers of the op against out-of-bounds accesses.
  TORCH_CHECK(x.is_cuda() && weight.is_cuda() && out.is_cuda(), op, "tensors must be on CUDA");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2 && weight.size(1) == x.size(1) &&
                  out.size(1) == weight.size(0) && (rows.has_value() || out.size(0) == x.size(0)),
              op, "shapes: x [R, KH], weight [N, KH], out [M, N] (M = R without rows)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type() &&
                  weight.device() == x.device() && out.device() == x.device(),
              op, "one dtype, one device");
  TORCH_CHECK(!rows.has_value() || (rows->device() == x.device() && rows->dim() == 1 && rows->numel() == out.size(0) &&
                                    (rows->scalar_type() == at::kInt || rows->scalar_type() == at::kLong)),
              op, "rows must be int32/int64 [M] on x's device");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == weight.size(0) &&
                                    bias->scalar_type() == x.scalar_type() && bias->device() == x.device()),
              op, "bias must be [N]");
  TORCH_CHECK(!input_norm_weight.has_value() ||
                  (input_norm_weight->dim() == 1 && input_norm_weight->numel() == x.size(1) &&
                   input_norm_weight->scalar_type() == x.scalar_type() && input_norm_weight->device() == x.device()),
              op, "input_norm_weight must be [KH]");
  TORCH_CHECK(!chunk_norm_weight.has_value() ||
                  (chunk_norm_weight->dim() == 2 && chunk_norm_weight->numel() == x.size(1) &&
                   chunk_norm_weight->size(1) > 0 && chunk_norm_weight->scalar_type() == x.scalar_type() &&
                   chunk_norm_weight->device() == x.device()),
              op, "chunk_norm_weight must be [K, H], K*H = KH");
  TORCH_CHECK((x.size(1) <= 1 || x.stride(1) == 1) && (weight.size(1) <= 1 || weight.stride(1) == 1) &&
                  (out.size(1) <= 1 || out.stride(1) == 1),
              op, "last dims must be contiguous");
  TORCH_CHECK(!chunk_norm_weight.has_value() || chunk_norm_weight->is_contiguous(), op,
              "chunk_norm_weight must be contiguous");
  TORCH_CHECK(unit_stride(rows) && unit_stride(bias) && unit_stride(input_norm_weight), op,
              "rows, bias and input_norm_weight must have stride 1 (copy strided views first)");
  TORCH_CHECK(x.size(1) <= INT32_MAX && weight.size(0) <= INT32_MAX && out.size(0) <= INT32_MAX, op,
              "sizes must fit int32");
  TORCH_CHECK(path == kPathSkinny || path == kPathCublas, op, "path must be 0 (skinny) or 2 (cublas), got ", path);
  TORCH_CHECK(!norm_folded || chunk_norm_weight.has_value() || input_norm_weight.has_value(), op,
              "norm_folded needs the norm weights (their shapes and input_norm_weight's values give the scales)");
  if (out.size(0) == 0 || out.size(1) == 0) return;
  const bool prepares = rows.has_value() || chunk_norm_weight.has_value() || input_norm_weight.has_value();
  const int64_t K = chunk_norm_weight.has_value() ? chunk_norm_weight->size(0) : 1;
  const int64_t need = (path == kPathCublas && !prepares)
                           ? 0
                           : workspace_bytes(out.size(0), weight.size(0), x.size(1), K, chunk_norm_weight.has_value(),
                                             input_norm_weight.has_value(), path, splits, x.scalar_type());
  if (need > 0) {
    TORCH_CHECK(workspace.has_value(), op, "this call needs a workspace of ", need,
                " bytes (eagle3_cuda::draft_fc_workspace_bytes), got none");
    TORCH_CHECK(workspace->device() == x.device() && workspace->scalar_type() == at::kByte && workspace->dim() == 1 &&
                    (workspace->numel() <= 1 || workspace->stride(0) == 1),
                op, "workspace must be a 1-D uint8 tensor with stride 1 on x's device");
    TORCH_CHECK(workspace->numel() >= need, op, "workspace has ", workspace->numel(), " bytes, this call needs ", need,
                " (eagle3_cuda::draft_fc_workspace_bytes)");
    TORCH_CHECK(is_aligned16(workspace->data_ptr()), op, "workspace must be 16-byte aligned");
  }
  const at::cuda::OptionalCUDAGuard guard(x.device());
  switch (x.scalar_type()) {
    case at::kBFloat16:
      draft_fc_typed<c10::BFloat16>(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace,
                                    path, splits, norm_folded);
      break;
    case at::kHalf:
      draft_fc_typed<c10::Half>(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace, path,
                                splits, norm_folded);
      break;
    case at::kFloat:
      draft_fc_typed<float>(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace, path,
                            splits, norm_folded);
      break;
    default:
      TORCH_CHECK(false, op, "unsupported dtype ", x.scalar_type());
  }
}

}  // namespace eagle3
