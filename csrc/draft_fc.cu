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
//   * fc_skinny_kernel<T, NT>: swap-AB mma.sync m16n8k16 (an sm_80+ instruction: the same code serves
//     sm_90a and sm_120a). A block is 4 warps; warp w owns 16 weight rows (64 per block), all warps
//     share one token tile of 8*NT tokens and one k range (a split). The k range is streamed through a
//     kStages-deep shared-memory ring of 64-wide k steps filled by cp.async (LDGSTS): every thread
//     copies the 16-byte weight vectors it will itself use (L2 evict-first policy, 256-byte L2
//     prefetch, no L1), and the block copies the step's x tile once (L2 evict-last) for all four warps.
//     While one step is multiplied, the next kStages - 1 steps are in flight, across the loop's
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
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
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
// M), kStep, kMinSplitSteps, kMaxSplits, kStages(NT) and kPiece to plan its split request, and keeps
// each kernel's register count and shared memory (SKINNY_REGISTERS, skinny_shared_bytes; checked
// against the built cubins by tests/test_build.py); keep them in step.
constexpr int kThreads = 128;        // 4 warps
constexpr int kRowsPerWarp = 16;     // the MMA's M side: weight rows
constexpr int kRowsPerBlock = 64;
constexpr int kSlab = 32;            // k covered by one thread group (4 threads x 8 elements) per MMA pair
constexpr int kSlabsPerStep = 2;     // a ring step: 64 k
constexpr int kStep = kSlab * kSlabsPerStep;
constexpr int kMinSplitSteps = 8;    // a split is at least 512 k: the ring's fill is a small part of it
constexpr int kMaxTokenGroups = 8;   // token tile <= 64 tokens (8 groups of 8)
constexpr int kMaxSplits = 64;
constexpr int kReduceThreads = 256;
constexpr int kPrepareThreads = 256;
constexpr int kPieceThreads = 128;   // pre-pass: one 16-byte vector per thread
constexpr int kPiece = kPieceThreads * 8;
// Ring depth: kStages steps resident, kStages - 1 in flight while one is multiplied. Every variant
// stays within the 48 KB of static shared memory (no opt-in attribute): 4 stages up to NT = 4,
// 3 at NT = 8 (its x tile is 8 KB per step).
template <int NT>
constexpr int kStages = NT == 8 ? 3 : 4;
constexpr int kWeightChunksPerStep = kRowsPerBlock * (kStep / 8);  // 16-byte chunks of a step's weight tile
template <int NT>
constexpr int kXChunksPerStep = 8 * NT * (kStep / 8);  // 16-byte chunks of a step's x tile
template <int NT>
constexpr int kSkinnySharedBytes = kStages<NT> * (kWeightChunksPerStep + kXChunksPerStep<NT>) * 16;
static_assert(kSkinnySharedBytes<1> <= 48 * 1024 && kSkinnySharedBytes<2> <= 48 * 1024 &&
                  kSkinnySharedBytes<4> <= 48 * 1024 && kSkinnySharedBytes<8> <= 48 * 1024,
              "the skinny ring must fit the 48 KB of static shared memory");
// Workspace regions start on this boundary (eagle3_ops.workspace.ALIGN: the Python side carves the
// same way, and the float4 / 16-byte vector accesses need 16).
constexpr int64_t kWorkspaceAlign = 256;
// Path numbers: the index in eagle3_ops.plans.PATHS ("skinny", "tiled", "cublas").
constexpr int64_t kPathSkinny = 0;
constexpr int64_t kPathCublas = 2;


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
  float* stats;    // [M][P][2] fp32 (sum x^2, sum (x*in_w)^2 per pre-pass piece), or nullptr: no norm
  bool folded;     // the weight carries g = in_w * chunk_w (in_w still feeds the chunk statistic)
  int64_t R;
  int M, N, KH;
  int CH, NC;  // chunk width and count: (H, K) with chunk norm, else (KH, 1)
  int pieces_per_chunk;  // pre-pass pieces of kPiece elements per chunk; P = NC * pieces_per_chunk
  int splits_per_chunk, split_len, S;
  float eps;
};

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
// See the header. Shared memory: a ring of kStages steps, each the step's weight tile [64 rows][64 k]
// and x tile [8*NT tokens][64 k], rows of 8 16-byte chunks with chunk c of row r stored at
// c ^ (r & 7): the 8 rows an ldmatrix phase reads (and the 8 chunks a quarter warp's cp.async
// writes) fall in 8 different bank groups.
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <typename T, int NT>
__global__ void __launch_bounds__(kThreads) fc_skinny_kernel(const FcArgs a) {
  static_assert(NT >= 1 && NT <= kMaxTokenGroups, "token tile of 8..64 tokens");
  constexpr int S = kStages<NT>;
  constexpr int kChunks = kStep / 8;                                 // 16-byte chunks per row and step
  constexpr int kWeightStage = kWeightChunksPerStep;
  constexpr int kXStage = kXChunksPerStep<NT>;
  constexpr int kWeightPerThread = kWeightStage / kThreads;          // 4
  constexpr int kXPerThread = (kXStage + kThreads - 1) / kThreads;   // 1 (NT <= 2), 2, 4
  static_assert(kWeightStage % kThreads == 0 && kThreads % kChunks == 0, "copy assignment");
  __shared__ uint4 ring_w[S * kWeightStage];
  __shared__ uint4 ring_x[S * kXStage];
  using P = Pair<T>;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int s = blockIdx.z;
  const int chunk = s / a.splits_per_chunk;
  const int k_lo = chunk * a.CH + (s - chunk * a.splits_per_chunk) * a.split_len;
  const int k_hi = min(k_lo + a.split_len, (chunk + 1) * a.CH);
  const int steps = (k_hi - k_lo + kStep - 1) / kStep;
  const int tok0 = blockIdx.x * (8 * NT);
  const int n_blk = blockIdx.y * kRowsPerBlock;
  // Copies: thread tid moves chunk c = tid % 8 (k + 8c) of weight rows tid / 8 + 16 i and of x tokens
  // tid / 8 + 16 i; the row gather happens here, once, as one base pointer per token.
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


// ---- host ------------------------------------------------------------------------------------------
int64_t align_up(int64_t bytes) { return ceil_div(bytes, kWorkspaceAlign) * kWorkspaceAlign; }

// The skinny launch for one problem: token tile, grid and splits (see the header comment).
struct SkinnyPlan {
  int nt;            // token groups of 8 per tile: 1, 2, 4 or 8
  int token_tiles;   // grid.x
  int weight_tiles;  // grid.y
  int splits_per_chunk, split_len, S;  // grid.z = S = NC * splits_per_chunk
  int pieces_per_chunk;  // the norm pre-pass's grid.y = NC * pieces_per_chunk
};

SkinnyPlan skinny_plan(int64_t M, int64_t N, int CH, int NC, int64_t splits) {
  TORCH_CHECK(CH > 0 && NC > 0, "eagle3_cuda::draft_fc: the skinny path needs K*H > 0");
  TORCH_CHECK(splits >= 1, "eagle3_cuda::draft_fc: the skinny path needs splits >= 1, got ", splits);
  SkinnyPlan p{};
  const int groups = static_cast<int>(ceil_div(std::min<int64_t>(M, 8 * kMaxTokenGroups), 8));
  p.nt = groups <= 1 ? 1 : groups <= 2 ? 2 : groups <= 4 ? 4 : 8;
  p.token_tiles = static_cast<int>(ceil_div(M, 8 * p.nt));
  p.weight_tiles = static_cast<int>(ceil_div(N, kRowsPerBlock));
  // Each split a whole number of kStep steps inside one chunk, at least kMinSplitSteps of them
  // (unless the chunk is narrower), at most kMaxSplits splits in all.
  const int asked = static_cast<int>(std::min<int64_t>(splits, INT_MAX));
  const int per_chunk = std::max(1, std::min({asked, CH / (kMinSplitSteps * kStep), kMaxSplits / NC}));
  p.split_len = static_cast<int>(ceil_div(ceil_div(CH, per_chunk), kStep) * kStep);
  p.splits_per_chunk = static_cast<int>(ceil_div(CH, p.split_len));
  p.S = NC * p.splits_per_chunk;
  TORCH_CHECK(p.S <= kMaxSplits, "eagle3_cuda::draft_fc: ", p.S, " splits exceed the reducer's ", kMaxSplits,
              " (more than ", kMaxSplits, " chunks: use the cublas path)");
  p.pieces_per_chunk = static_cast<int>(ceil_div(CH, kPiece));
  return p;
}

// Workspace regions of the skinny path, in this order: fp32 partials [S][M][N] (none with one split
// and no norm: the kernel writes out directly); with norms the pre-pass's fp32 piece sums [M][P][2];
// with unfolded norms x*g [M][KH] in the dtype.
struct SkinnyRegions {
  int64_t partial_bytes, stats_bytes, gained_bytes;
  int64_t total() const { return partial_bytes + stats_bytes + gained_bytes; }
};

SkinnyRegions skinny_regions(const SkinnyPlan& p, int64_t M, int64_t N, int64_t KH, bool norm, bool folded,
                             int64_t elem_bytes) {
  SkinnyRegions r{0, 0, 0};
  if (p.S > 1 || norm) r.partial_bytes = align_up(static_cast<int64_t>(p.S) * M * N * static_cast<int64_t>(sizeof(float)));
  if (norm) {
    const int64_t pieces = static_cast<int64_t>(p.S / p.splits_per_chunk) * p.pieces_per_chunk;  // NC * ppc
    r.stats_bytes = align_up(M * pieces * 2 * static_cast<int64_t>(sizeof(float)));
    if (!folded) r.gained_bytes = align_up(M * KH * elem_bytes);
  }
  return r;
}

// (chunk width, chunk count): (H, K) with chunk norm, else (KH, 1).
std::pair<int64_t, int64_t> chunks(int64_t KH, int64_t K, bool chunk_norm) {
  if (!chunk_norm) return {KH, 1};
  TORCH_CHECK(K >= 1 && KH % K == 0 && KH / K > 0, "eagle3_cuda::draft_fc: chunk_norm needs K >= 1 chunks of ",
              "equal, non-zero width (K*H = KH), got KH=", KH, ", K=", K);
  return {KH / K, K};
}

int64_t workspace_bytes(int64_t M, int64_t N, int64_t KH, int64_t K, bool chunk_norm, bool input_norm, int64_t path,
                        int64_t splits, at::ScalarType dtype, bool norm_folded) {
  TORCH_CHECK(M >= 0 && N >= 0 && KH >= 0, "eagle3_cuda::draft_fc_workspace_bytes: negative size");
  TORCH_CHECK(M <= INT32_MAX && N <= INT32_MAX && KH <= INT32_MAX,
              "eagle3_cuda::draft_fc_workspace_bytes: sizes must fit int32");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "eagle3_cuda::draft_fc_workspace_bytes: unsupported dtype ", dtype);
  if (M == 0 || N == 0) return 0;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  if (path == kPathSkinny) {
    TORCH_CHECK(dtype != at::kFloat, "eagle3_cuda::draft_fc: the skinny path takes bf16/fp16 only");
    const auto [CH, NC] = chunks(KH, K, chunk_norm);
    const SkinnyPlan p = skinny_plan(M, N, static_cast<int>(CH), static_cast<int>(NC), splits);
    return skinny_regions(p, M, N, KH, chunk_norm || input_norm, norm_folded, elem).total();
  }
  TORCH_CHECK(path == kPathCublas, "eagle3_cuda::draft_fc: path must be 0 (skinny) or 2 (cublas), got ", path,
              " (1, tiled, is a Triton kernel only)");
  // The prepared input norm(x[rows]) [M, KH] in the dtype. (A call with no gather and no norm has
  // nothing to prepare and needs none of it; the caller knows, see draft_fc below.)
  return align_up(M * KH * elem);
}

// cudaLaunchKernelEx, with the programmatic-stream-serialization attribute (PDL) when `pdl`: the
// kernel may be scheduled before the previous one in the stream has finished and waits for it at
// griddepcontrol.wait.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, int threads, bool pdl, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <typename T>
void launch_skinny(const FcArgs& a, int nt, dim3 grid, bool pdl, cudaStream_t stream) {
  switch (nt) {
    case 1: launch(fc_skinny_kernel<T, 1>, grid, kThreads, pdl, stream, a); break;
    case 2: launch(fc_skinny_kernel<T, 2>, grid, kThreads, pdl, stream, a); break;
    case 4: launch(fc_skinny_kernel<T, 4>, grid, kThreads, pdl, stream, a); break;
    default: launch(fc_skinny_kernel<T, 8>, grid, kThreads, pdl, stream, a); break;
  }
}

// pre-pass (with norms) -> skinny -> reducer (with partials), each a PDL dependent of the previous.
template <typename T>
void run_skinny(FcArgs a, const SkinnyPlan& p, uint8_t* workspace, cudaStream_t stream) {
  const bool norm = a.in_w != nullptr || a.chunk_w != nullptr;
  a.split_len = p.split_len;
  a.splits_per_chunk = p.splits_per_chunk;
  a.S = p.S;
  a.pieces_per_chunk = p.pieces_per_chunk;
  const SkinnyRegions regions = skinny_regions(p, a.M, a.N, a.KH, norm, a.folded, sizeof(T));
  if (regions.partial_bytes > 0) a.partial = reinterpret_cast<float*>(workspace);
  FcArgs sk = a;  // what the skinny kernel reads
  if (norm) {
    a.stats = reinterpret_cast<float*>(workspace + regions.partial_bytes);
    T* gained = a.folded ? nullptr : reinterpret_cast<T*>(workspace + regions.partial_bytes + regions.stats_bytes);
    const dim3 pgrid(a.M, static_cast<unsigned>(a.NC * p.pieces_per_chunk));
    if (gained != nullptr) {
      launch(fc_norm_prepass_kernel<T, true>, pgrid, kPieceThreads, false, stream, a, gained);
      // the skinny kernel multiplies x*g, gathered already: row m of a [M, KH] matrix
      sk.x = gained;
      sk.stride_x = a.KH;
      sk.rows = nullptr;
      sk.R = a.M;
    } else {
      launch(fc_norm_prepass_kernel<T, false>, pgrid, kPieceThreads, false, stream, a, static_cast<T*>(nullptr));
    }
  }
  launch_skinny<T>(sk, p.nt, dim3(p.token_tiles, p.weight_tiles, a.S), norm, stream);
  if (a.partial != nullptr) {
    const dim3 rgrid(a.M, static_cast<unsigned>(ceil_div(a.N, kReduceThreads * 4)));
    if (a.N % 4 == 0) {
      launch(fc_reduce_kernel<T, true>, rgrid, kReduceThreads, true, stream, a);
    } else {
      launch(fc_reduce_kernel<T, false>, rgrid, kReduceThreads, true, stream, a);
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

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
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

template <typename T>
const void* skinny_kernel_for(int64_t nt) {
  switch (nt) {
    case 1: return reinterpret_cast<const void*>(&fc_skinny_kernel<T, 1>);
    case 2: return reinterpret_cast<const void*>(&fc_skinny_kernel<T, 2>);
    case 4: return reinterpret_cast<const void*>(&fc_skinny_kernel<T, 4>);
    case 8: return reinterpret_cast<const void*>(&fc_skinny_kernel<T, 8>);
    default: TORCH_CHECK(false, "eagle3_cuda::skinny_occupancy: nt must be 1, 2, 4 or 8, got ", nt);
  }
  return nullptr;
}

}  // namespace

int64_t skinny_occupancy(int64_t nt, at::ScalarType dtype) {
  const void* kernel = nullptr;
  switch (dtype) {
    case at::kBFloat16: kernel = skinny_kernel_for<c10::BFloat16>(nt); break;
    case at::kHalf: kernel = skinny_kernel_for<c10::Half>(nt); break;
    default: TORCH_CHECK(false, "eagle3_cuda::skinny_occupancy: the skinny kernel takes bf16/fp16 only, got ", dtype);
  }
  int blocks = 0;
  // static shared memory only (the ring): the runtime counts it from the function itself
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
  return blocks;
}

int64_t draft_fc_workspace_bytes(int64_t M, int64_t N, int64_t KH, int64_t K, bool chunk_norm, bool input_norm,
                                 int64_t path, int64_t splits, at::ScalarType dtype, bool norm_folded) {
  return workspace_bytes(M, N, KH, K, chunk_norm, input_norm, path, splits, dtype, norm_folded);
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
                                             input_norm_weight.has_value(), path, splits, x.scalar_type(),
                                             norm_folded);
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
  const c10::cuda::OptionalCUDAGuard guard(x.device());
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
