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
// chunks): up to three kernels, each chained to the previous one by programmatic dependent launch
// (PDL, sm_90+), docs/kernels.md §7:
//   * fc_norm_prepass_kernel (only with norm weights): grid (M, pieces of 1024 elements), every
//     piece lies in one chunk. Each block writes the sums of x^2 and (x*input_norm_weight)^2 of its
//     piece (fixed-order block sum) into the workspace and, unless the weight is folded, x*g
//     (g = input_norm_weight*chunk_norm_weight, rounded to the dtype as stock rounds its normalized
//     input) for the gathered rows: the norm statistics and the gains are computed once per call,
//     by every SM in parallel, and the skinny kernel below runs the same hot loop with or without
//     norms (it reads x*g instead of x[rows]).
//   * fc_skinny_kernel<T, NT, RB, ST>: swap-AB mma.sync m16n8k16 (an sm_80+ instruction: the same code
//     serves sm_90a and sm_120a). A block is RB / 16 warps (4 for 64 rows, 8 for 128; the shapes built
//     are draft_fc_launch.h's kSkinnyShapes); warp w owns 16 weight rows, all warps share one token
//     tile of 8*NT tokens and one k range (a split). The k range is streamed through an ST-deep
//     shared-memory ring of 64-wide k steps filled by cp.async (LDGSTS): the block's threads copy
//     the step's weight tile (L2 evict-first policy, 256-byte L2 prefetch, no L1) and its x tile once
//     (L2 evict-last) for all warps: per weight byte, a 128-row block copies half the x bytes a 64-row
//     one does. While one step is multiplied, the next ST - 1 steps are in flight, across the loop's
//     back-edge (tests/test_build.py reads this from the SASS). The weight loads of the first steps
//     are issued before griddepcontrol.wait, so they overlap the pre-pass.
//     Thread (g = lane/4, t = lane%4) uses W[row g][k+8t, k+8t+8), W[row g+8][same] and x[token
//     g][same]. The k order inside one MMA is free as long as A and B agree, so these 16-byte vectors
//     ARE the fragments of two m16n8k16 MMAs (k slots {2t, 2t+1, 2t+8, 2t+9} <- k+8t..k+8t+3, then
//     k+8t+4..k+8t+7): one 16-byte shared load per fragment, no shuffles. It writes fp32 partials
//     [S][M][N] into the workspace, or out directly with one split and no norm.
//   * fc_reduce_kernel: out = sum over splits s = 0..S-1 in this order of scale[chunk(s)] *
//     partial[s] + bias; with norms one warp first forms the per-chunk RMS scales of its row from
//     the pre-pass's piece sums (fixed-order warp tree), linearity (docs/kernels.md §5).
//   The weight, when folded (norm_folded: prepared once as W[n, k] * g[k] by
//   eagle3_ops.fold_norm_weights), makes the pre-pass write only the statistics; the skinny kernel
//   then reads x[rows] itself. fp16 with unfolded norms never comes here (cuda_backend sends it to
//   cuBLAS): x * g is rounded to the dtype before the RMS scale, and that product can exceed 65504
//   where norm(x) cannot; fp16 folds only without input_norm_weight (eagle3_ops/validation.py
//   FOLDED_FP16_INPUT_NORM).
//   PDL: the pre-pass triggers at its start, the skinny kernel after its main loop; each dependent
//   waits at griddepcontrol.wait for the whole previous grid to finish and its writes to be visible
//   before reading them, so the launches overlap and the result is the same bits as plain launches.
// 2 cublas (any dtype or layout): fc_prepare_kernel writes norm(x[rows]) in the dtype into the
// workspace, then cuBLAS (at::addmm) multiplies; with no gather and no norm cuBLAS reads x directly.
// (1, tiled, is a Triton kernel only.)
//
// Splits: the `splits` argument is the number of splits per chunk asked for (cuda_backend derives
// it from a model of the bytes each resident block keeps in flight, docs/kernels.md §7.5); it is
// clamped here to the launch contract: every split a whole number of kStep-wide steps, at least
// kMinSplitSteps of them, and at most kMaxSplits splits in all (cuda_backend.skinny_split_shape
// mirrors this clamp).
//
// Memory: nothing is allocated here. The split-K partials, the pre-pass's piece sums and x*g
// (skinny) or the prepared input (cublas) are carved from the caller's uint8 `workspace`, 256-byte
// aligned regions in that order (eagle3_ops.workspace.Carver's rule; docs/kernels.md §9);
// eagle3_cuda::draft_fc_workspace_bytes gives the size for exactly these arguments, and a smaller
// workspace is an error. cuBLAS's own workspace is PyTorch's. Strided 1-D views (rows, bias,
// input_norm_weight) are copied to unit stride by the caller (cuda_backend, also into the
// workspace); this op requires stride 1.
//
// Deterministic: every sum has a fixed order, no atomics; the bits depend on the split count (so on
// M's token tile and the device's SM count, through the planner), not on timing. Row indices
// outside [0, R) are never dereferenced; those output rows are NaN. No host sync, current stream:
// CUDA-graph safe.
//
// This file holds the kernels and their launches (no ATen: see common.h); draft_fc_op.cpp the op's
// tensor-facing half (checks, the skinny plan and workspace layout, the cuBLAS path, device guard,
// stream, dtype dispatch); draft_fc_launch.h the launch shape and arguments both share.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>
#include <utility>

#include "common.cuh"
#include "draft_fc_launch.h"


namespace eagle3 {
namespace {

// The ring of fc_skinny_kernel<T, NT, RB, ST>: ST steps resident, ST - 1 in flight while one is
// multiplied (draft_fc_launch.h lists the shapes built). Rings within the 48 KB of static shared
// memory are static arrays; larger ones (the 128-row blocks) are dynamic shared memory, which the
// launch opts in to (cudaFuncAttributeMaxDynamicSharedMemorySize).
template <int NT, int RB, int ST>
constexpr int kSkinnyShared = skinny_shared_bytes(SkinnyShape{NT, RB, ST});
template <int NT, int RB, int ST>
constexpr bool kDynamicRing = kSkinnyShared<NT, RB, ST> > kStaticSharedLimit;


__device__ __forceinline__ int64_t source_row(const FcArgs& a, int m) {
  if (a.rows == nullptr) return m;
  return a.rows_are_int64 ? static_cast<const int64_t*>(a.rows)[m]
                          : static_cast<int64_t>(static_cast<const int32_t*>(a.rows)[m]);
}

__device__ __forceinline__ float nan_f32() { return __int_as_float(0x7fc00000); }

// PDL (sm_90+; compiled out below): let the next kernel in the stream be scheduled now / wait until
// the previous grid has completed and its writes are visible (a no-op without the launch attribute).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

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

// L2 eviction policies (createpolicy, sm_80+; ptxas folds a constant policy into the access's memory
// descriptor, no per-load cost). The weight is read exactly once per call: evict first, so its lines
// are the first to leave L2 and do not push out x, the partials or the target model's working set.
// The x rows are re-read by every weight tile of the grid: evict last.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One 16-byte weight vector, global -> shared, asynchronously (cp.async.cg: L2 only, no L1
// allocation), with the evict-first policy as a cache hint and a 256-byte L2 prefetch (the thread
// group reads 256 contiguous bytes of a row per slab pair). !pred: nothing is read and the 16 bytes
// are zero-filled (tails of k ranges and of the weight rows). tests/test_build.py checks the hint and
// the pipeline depth in the SASS.
__device__ __forceinline__ void copy_weight16(uint32_t dst, const void* src, bool pred, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(pred ? 16 : 0), "l"(policy)
               : "memory");
}

// One 16-byte x vector, global -> shared (evict-last hint; zero-filled when !pred: rows out of range,
// tokens past M, k past the split are never read).
__device__ __forceinline__ void copy_x16(uint32_t dst, const void* src, bool pred, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(pred ? 16 : 0), "l"(policy)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
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

// ---- norm pre-pass ---------------------------------------------------------------------------------
// Grid (M, P = NC * pieces_per_chunk), kPieceThreads threads: block (m, p) covers kPiece elements of
// chunk p / pieces_per_chunk of row rows[m], one 16-byte vector per thread. It writes
// stats[m][p] = (sum x^2, sum (x*in_w)^2) of its piece (warp xor trees, then the warps in order:
// fixed order) and, with kWriteGained, xg[m][k] = x*g rounded to the dtype (zeros for a row out of
// range: its output row is NaN anyway, the reducer writes it). Every block is independent: all SMs
// share the pass, and M, P and the SM count do not change any sum's order.
template <typename T, bool kWriteGained>
__global__ void __launch_bounds__(kPieceThreads) fc_norm_prepass_kernel(const FcArgs a, T* xg) {
  pdl_launch_dependents();  // the skinny grid may start streaming its weight now
  using P = Pair<T>;
  const int m = blockIdx.x, p = blockIdx.y;
  const int c = p / a.pieces_per_chunk;
  const int k = c * a.CH + (p - c * a.pieces_per_chunk) * kPiece + threadIdx.x * 8;
  const bool in = k < (c + 1) * a.CH;  // the chunk's last piece may be partial (CH % 8 == 0)
  const int64_t r = source_row(a, m);
  const bool valid = r >= 0 && r < a.R;
  float sx = 0.f, si = 0.f;
  if (in) {
    const uint4 xv = valid ? __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + r * a.stride_x + k))
                           : make_uint4(0u, 0u, 0u, 0u);
    float g_in[8];
    load_norm_weights8<T>(a.in_w, k, g_in);
    float g_chunk[8];
    if constexpr (kWriteGained) load_norm_weights8<T>(a.chunk_w, k, g_chunk);
    uint32_t words[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = P::to_float2(words[q]);
      const float ux = f.x * g_in[2 * q], uy = f.y * g_in[2 * q + 1];
      sx += f.x * f.x + f.y * f.y;
      si += ux * ux + uy * uy;
      if constexpr (kWriteGained) {
        words[q] = P::from_float2(make_float2(f.x * (g_in[2 * q] * g_chunk[2 * q]),
                                              f.y * (g_in[2 * q + 1] * g_chunk[2 * q + 1])));
      }
    }
    if constexpr (kWriteGained) {
      *reinterpret_cast<uint4*>(xg + static_cast<int64_t>(m) * a.KH + k) = make_uint4(words[0], words[1], words[2],
                                                                                      words[3]);
    }
  }
  sx = warp_sum(sx);
  si = warp_sum(si);
  __shared__ float warp_sums[kPieceThreads / 32][2];
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    warp_sums[warp][0] = sx;
    warp_sums[warp][1] = si;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float tx = 0.f, ti = 0.f;
#pragma unroll
    for (int w = 0; w < kPieceThreads / 32; ++w) {
      tx += warp_sums[w][0];
      ti += warp_sums[w][1];
    }
    float* q = a.stats + (static_cast<int64_t>(m) * gridDim.y + p) * 2;
    q[0] = tx;
    q[1] = ti;
  }
}

// ---- the skinny kernel -----------------------------------------------------------------------------
// See the header. Shared memory: a ring of ST steps, each the step's weight tile [RB rows][64 k]
// and x tile [8*NT tokens][64 k], rows of 8 16-byte chunks with chunk c of row r stored at
// c ^ (r & 7): the 8 rows an ldmatrix phase reads (and the 8 chunks a quarter warp's cp.async
// writes) fall in 8 different bank groups.
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <typename T, int NT, int RB, int ST>
__global__ void __launch_bounds__(skinny_threads(RB)) fc_skinny_kernel(const FcArgs a) {
  static_assert(NT >= 1 && NT <= kMaxTokenGroups, "token tile of 8..64 tokens");
  static_assert(RB % kRowsPerWarp == 0 && ST >= 3, "warps of 16 rows; at least two steps in flight");
  constexpr int S = ST;
  constexpr int kThreads = skinny_threads(RB);
  constexpr int kChunks = kStep / 8;                                 // 16-byte chunks per row and step
  constexpr int kWeightStage = RB * kChunks;                         // a step's weight tile [RB][64]
  constexpr int kXStage = 8 * NT * kChunks;                          // a step's x tile [8 NT][64]
  constexpr int kWeightPerThread = kWeightStage / kThreads;          // 4
  constexpr int kXPerThread = (kXStage + kThreads - 1) / kThreads;   // 1 (NT <= 2, RB = 64), 2, 4
  static_assert(kWeightStage % kThreads == 0 && kThreads % kChunks == 0, "copy assignment");
  static_assert(kSkinnyShared<NT, RB, ST> == S * (kWeightStage + kXStage) * 16, "the launch's ring size");
  uint4* ring_w;  // [S][kWeightStage]
  uint4* ring_x;  // [S][kXStage]
  if constexpr (kDynamicRing<NT, RB, ST>) {
    extern __shared__ uint4 dynamic_ring[];  // kSkinnyShared bytes, the launch's dynamic shared memory
    ring_w = dynamic_ring;
    ring_x = dynamic_ring + S * kWeightStage;
  } else {
    __shared__ uint4 static_ring_w[S * kWeightStage];
    __shared__ uint4 static_ring_x[S * kXStage];
    ring_w = static_ring_w;
    ring_x = static_ring_x;
  }
  using P = Pair<T>;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int s = blockIdx.z;
  const int chunk = s / a.splits_per_chunk;
  const int k_lo = chunk * a.CH + (s - chunk * a.splits_per_chunk) * a.split_len;
  const int k_hi = min(k_lo + a.split_len, (chunk + 1) * a.CH);
  const int steps = (k_hi - k_lo + kStep - 1) / kStep;
  const int tok0 = blockIdx.x * (8 * NT);
  const int n_blk = blockIdx.y * RB;
  // Copies: thread tid moves chunk c = tid % 8 (k + 8c) of weight rows tid / 8 + (kThreads / 8) i and
  // of x tokens tid / 8 + (kThreads / 8) i; the row gather happens here, once, as one base pointer per
  // token.
  const int c_copy = tid % kChunks;
  const T* w = static_cast<const T*>(a.w);
  const T* w_src[kWeightPerThread];
  bool w_ok[kWeightPerThread];
  uint32_t w_dst[kWeightPerThread];
#pragma unroll
  for (int i = 0; i < kWeightPerThread; ++i) {
    const int row = tid / kChunks + (kThreads / kChunks) * i;
    w_ok[i] = n_blk + row < a.N;
    w_src[i] = w + static_cast<int64_t>(w_ok[i] ? n_blk + row : 0) * a.stride_w + 8 * c_copy;
    w_dst[i] = shared_address(ring_w + row * kChunks + (c_copy ^ (row & 7)));
  }
  const uint64_t w_policy = l2_evict_first_policy();
  auto copy_weight_step = [&](int i) {
    const int k = k_lo + i * kStep;
    const bool k_in = k + 8 * c_copy < k_hi;  // k_hi - k is a multiple of 8: a chunk is all in or all out
#pragma unroll
    for (int q = 0; q < kWeightPerThread; ++q) {
      copy_weight16(w_dst[q] + (i % S) * (kWeightStage * 16), w_src[q] + (k_in ? k : 0), k_in && w_ok[q], w_policy);
    }
  };
  // The weight of the first S - 1 steps streams before the wait for the pre-pass (it does not read
  // what the pre-pass writes).
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < steps) copy_weight_step(i);
  }
  pdl_wait();

  const T* x = static_cast<const T*>(a.x);
  const uint64_t x_policy = l2_evict_last_policy();
  const T* x_src[kXPerThread];
  bool x_ok[kXPerThread];
  uint32_t x_dst[kXPerThread];
#pragma unroll
  for (int i = 0; i < kXPerThread; ++i) {
    const int j = tid / kChunks + (kThreads / kChunks) * i;  // token within the tile
    const int64_t r = (j < 8 * NT && tok0 + j < a.M) ? source_row(a, tok0 + j) : -1;
    x_ok[i] = r >= 0 && r < a.R;  // false too for j >= 8*NT (NT = 1: threads 64..127 copy no x)
    x_src[i] = x + (x_ok[i] ? r : 0) * a.stride_x + 8 * c_copy;
    x_dst[i] = shared_address(ring_x + (j % (8 * NT)) * kChunks + (c_copy ^ (j & 7)));
  }
  auto copy_x_step = [&](int i) {
    const int k = k_lo + i * kStep;
    const bool k_in = k + 8 * c_copy < k_hi;
#pragma unroll
    for (int q = 0; q < kXPerThread; ++q) {
      if (kXPerThread * kThreads == kXStage || tid / kChunks + (kThreads / kChunks) * q < 8 * NT) {
        copy_x16(x_dst[q] + (i % S) * (kXStage * 16), x_src[q] + (k_in ? k : 0), k_in && x_ok[q], x_policy);
      }
    }
  };
  // Group i holds step i's x (and, for i = 0, the weight of steps 0..S-2): waiting for group i
  // waits for all of step i.
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < steps) copy_x_step(i);
    cp_async_commit();
  }

  // ldmatrix addresses (lane l gives row l % 8 of matrix l / 8). Weight, per 16-wide k half h of a
  // 32-wide slab u: matrices (rows 0-7 | 8-15 of this warp's 16, k 0-7 | 8-15) = the A fragment
  // a0..a3 of m16n8k16. x, per slab and token group j: matrices (tokens 8j..8j+7, k 0-7 | 8-15 |
  // 16-23 | 24-31) = the B fragments (b0, b1) of the slab's two MMAs.
  const int m_row = lane & 7, m_idx = lane >> 3;
  const int a_row = warp * kRowsPerWarp + m_row + 8 * (m_idx & 1);
  const uint32_t a_base = shared_address(ring_w + a_row * kChunks);
  const uint32_t b_base = shared_address(ring_x + m_row * kChunks);
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int i = 0; i < steps; ++i) {
    cp_async_wait<S - 2>();  // this thread's copies of step i have landed
    __syncthreads();         // everyone's have, and nobody still reads stage (i - 1) % S
    if (i + S - 1 < steps) {
      copy_weight_step(i + S - 1);
      copy_x_step(i + S - 1);
    }
    cp_async_commit();  // (an empty group past the end keeps the count uniform)
    const uint32_t a_stage = a_base + (i % S) * (kWeightStage * 16);
    const uint32_t b_stage = b_base + (i % S) * (kXStage * 16);
#pragma unroll
    for (int u = 0; u < kSlabsPerStep; ++u) {
      uint32_t a0[4], a1[4];
      ldmatrix_x4(a_stage + (((4 * u + (m_idx >> 1)) ^ m_row) * 16), a0[0], a0[1], a0[2], a0[3]);
      ldmatrix_x4(a_stage + (((4 * u + 2 + (m_idx >> 1)) ^ m_row) * 16), a1[0], a1[1], a1[2], a1[3]);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        uint32_t b[4];
        ldmatrix_x4(b_stage + (j * 8 * kChunks + ((4 * u + m_idx) ^ m_row)) * 16, b[0], b[1], b[2], b[3]);
        P::mma(acc[j], a0[0], a0[1], a0[2], a0[3], b[0], b[1]);
        P::mma(acc[j], a1[0], a1[1], a1[2], a1[3], b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();  // nothing may still write this block's shared memory when it exits
  // PDL: the reducer may be scheduled now; it waits (griddepcontrol.wait) for this whole grid.
  // (Also a compiler barrier: nothing below is hoisted into the main loop.)
  pdl_launch_dependents();

  // acc[j][e]: weight row n_blk + 16*warp + g + 8*(e/2), token tok0 + 8j + 2t + (e%2).
  const int n0 = n_blk + warp * kRowsPerWarp + g;
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

// ---- split-K reducer -------------------------------------------------------------------------------
// out[m, n] = sum_{s = 0..S-1, in this order} scale[m, chunk(s)] * partial[s][m][n] + bias[n].
// With norms warp 0 first forms row m's chunk scales from the pre-pass's piece sums: lane l sums
// pieces l, l + 32, ... in order, then a warp xor tree (fixed order; every block of row m computes
// the same bits).
template <typename T, bool kVec4>
__global__ void __launch_bounds__(kReduceThreads) fc_reduce_kernel(const FcArgs a) {
  __shared__ float chunk_scale[kMaxSplits];
  const int m = blockIdx.x;
  // PDL: block until the skinny grid has completed and its partials are visible (the skinny grid
  // itself waited for the pre-pass, so its sums are visible too).
  pdl_wait();
  if (a.stats != nullptr) {
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int P = a.NC * a.pieces_per_chunk;
      const float* st = a.stats + static_cast<int64_t>(m) * P * 2;
      float row_scale = 1.f;
      if (a.in_w != nullptr) {
        float total = 0.f;
        for (int p = lane; p < P; p += 32) total += st[2 * p];
        row_scale = rsqrtf(warp_sum(total) / a.KH + a.eps);
      }
      for (int c = 0; c < a.NC; ++c) {
        float scale = row_scale;
        if (a.chunk_w != nullptr) {
          float q = 0.f;
          for (int p = c * a.pieces_per_chunk + lane; p < (c + 1) * a.pieces_per_chunk; p += 32) q += st[2 * p + 1];
          scale = row_scale * rsqrtf(row_scale * row_scale * (warp_sum(q) / a.CH) + a.eps);
        }
        if (lane == 0) chunk_scale[c] = scale;
      }
    }
    __syncthreads();
  }
  const int n = (blockIdx.y * kReduceThreads + threadIdx.x) * 4;
  if (n >= a.N) return;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  for (int s = 0; s < a.S; ++s) {
    const float* part = a.partial + (static_cast<int64_t>(s) * a.M + m) * a.N + n;
    const float sc = a.stats != nullptr ? chunk_scale[s / a.splits_per_chunk] : 1.f;
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

// cudaLaunchKernelEx, with the programmatic-stream-serialization attribute (PDL) when `pdl`: the
// kernel may be scheduled before the previous one in the stream has finished and waits for it at
// griddepcontrol.wait.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, int threads, int dynamic_shared, bool pdl, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<size_t>(dynamic_shared);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

using SkinnyKernel = void (*)(const FcArgs);

// fc_skinny_kernel<T, shape> for one of kSkinnyShapes, or nullptr.
template <typename T, int I = 0>
SkinnyKernel skinny_kernel_for(SkinnyShape shape) {
  if constexpr (I == kNumSkinnyShapes) {
    return nullptr;
  } else {
    constexpr SkinnyShape s = kSkinnyShapes[I];
    if (shape.nt == s.nt && shape.rows == s.rows && shape.stages == s.stages) {
      return fc_skinny_kernel<T, s.nt, s.rows, s.stages>;
    }
    return skinny_kernel_for<T, I + 1>(shape);
  }
}

// A ring above the static limit is dynamic shared memory: the kernel must be allowed that much
// (per device; cheap, and not a stream operation, so legal during graph capture). Fails where the
// device's shared memory per block is smaller.
cudaError_t allow_ring(SkinnyKernel kernel, SkinnyShape shape) {
  const int bytes = skinny_shared_bytes(shape);
  if (bytes <= kStaticSharedLimit) return cudaSuccess;
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                              bytes);
}

template <typename T>
cudaError_t launch_skinny(const FcArgs& a, SkinnyShape shape, dim3 grid, bool pdl, cudaStream_t stream) {
  const SkinnyKernel kernel = skinny_kernel_for<T>(shape);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const cudaError_t err = allow_ring(kernel, shape);
  if (err != cudaSuccess) return err;
  const int bytes = skinny_shared_bytes(shape);
  return launch(kernel, grid, skinny_threads(shape.rows), bytes > kStaticSharedLimit ? bytes : 0, pdl, stream, a);
}

}  // namespace

template <typename T>
cudaError_t run_skinny(FcArgs a, const SkinnyPlan& p, const SkinnyRegions& regions, uint8_t* workspace,
                       cudaStream_t stream) {
  const bool norm = a.in_w != nullptr || a.chunk_w != nullptr;
  a.split_len = p.split_len;
  a.splits_per_chunk = p.splits_per_chunk;
  a.S = p.S;
  a.pieces_per_chunk = p.pieces_per_chunk;
  if (regions.partial_bytes > 0) a.partial = reinterpret_cast<float*>(workspace);
  FcArgs sk = a;  // what the skinny kernel reads
  if (norm) {
    a.stats = reinterpret_cast<float*>(workspace + regions.partial_bytes);
    T* gained = a.folded ? nullptr : reinterpret_cast<T*>(workspace + regions.partial_bytes + regions.stats_bytes);
    const dim3 pgrid(a.M, static_cast<unsigned>(a.NC * p.pieces_per_chunk));
    cudaError_t err;
    if (gained != nullptr) {
      err = launch(fc_norm_prepass_kernel<T, true>, pgrid, kPieceThreads, 0, false, stream, a, gained);
      // the skinny kernel multiplies x*g, gathered already: row m of a [M, KH] matrix
      sk.x = gained;
      sk.stride_x = a.KH;
      sk.rows = nullptr;
      sk.R = a.M;
    } else {
      err = launch(fc_norm_prepass_kernel<T, false>, pgrid, kPieceThreads, 0, false, stream, a,
                   static_cast<T*>(nullptr));
    }
    if (err != cudaSuccess) return err;
  }
  const cudaError_t err = launch_skinny<T>(sk, p.shape, dim3(p.token_tiles, p.weight_tiles, a.S), norm, stream);
  if (err != cudaSuccess || a.partial == nullptr) return err;
  const dim3 rgrid(a.M, static_cast<unsigned>(ceil_div(a.N, kReduceThreads * 4)));
  return a.N % 4 == 0 ? launch(fc_reduce_kernel<T, true>, rgrid, kReduceThreads, 0, true, stream, a)
                      : launch(fc_reduce_kernel<T, false>, rgrid, kReduceThreads, 0, true, stream, a);
}

template <typename T>
cudaError_t launch_prepare(const FcArgs& a, void* prep, int64_t prep_stride, cudaStream_t stream) {
  constexpr int VEC = Vec16<T>::kElems;
  const bool vec = a.KH % VEC == 0 && a.CH % VEC == 0 && a.stride_x % VEC == 0 && is_aligned16(a.x) &&
                   (a.in_w == nullptr || is_aligned16(a.in_w)) && (a.chunk_w == nullptr || is_aligned16(a.chunk_w));
  T* dst = static_cast<T*>(prep);
  if (vec) {
    fc_prepare_kernel<T, VEC><<<a.M, kPrepareThreads, 0, stream>>>(a, dst, prep_stride);
  } else {
    fc_prepare_kernel<T, 1><<<a.M, kPrepareThreads, 0, stream>>>(a, dst, prep_stride);
  }
  return cudaGetLastError();
}

cudaError_t max_shared_per_block(int* bytes) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  return err != cudaSuccess ? err : cudaDeviceGetAttribute(bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
}

template <typename T>
cudaError_t skinny_occupancy_blocks(SkinnyShape shape, int* blocks) {
  *blocks = 0;
  const SkinnyKernel kernel = skinny_kernel_for<T>(shape);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  int per_block = 0;
  cudaError_t err = max_shared_per_block(&per_block);
  if (err != cudaSuccess) return err;
  const int bytes = skinny_shared_bytes(shape);
  if (bytes > per_block) return cudaSuccess;  // this device cannot hold the ring: 0 blocks
  err = allow_ring(kernel, shape);
  if (err != cudaSuccess) return err;
  // the static rings are counted from the function itself; a dynamic one is passed
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, skinny_threads(shape.rows),
                                                       bytes > kStaticSharedLimit ? bytes : 0);
}

template cudaError_t run_skinny<c10::BFloat16>(FcArgs, const SkinnyPlan&, const SkinnyRegions&, uint8_t*, cudaStream_t);
template cudaError_t run_skinny<c10::Half>(FcArgs, const SkinnyPlan&, const SkinnyRegions&, uint8_t*, cudaStream_t);
template cudaError_t launch_prepare<c10::BFloat16>(const FcArgs&, void*, int64_t, cudaStream_t);
template cudaError_t launch_prepare<c10::Half>(const FcArgs&, void*, int64_t, cudaStream_t);
template cudaError_t launch_prepare<float>(const FcArgs&, void*, int64_t, cudaStream_t);
template cudaError_t skinny_occupancy_blocks<c10::BFloat16>(SkinnyShape, int*);
template cudaError_t skinny_occupancy_blocks<c10::Half>(SkinnyShape, int*);

}  // namespace eagle3
