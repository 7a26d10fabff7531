// W4A16 matmul for the drafter's few rows (a 16-token block), on the tensor cores, from a pre-shuffled layout.
//
// y[M, N] = x[M, K] W^T with W[n, k] = (q[n, k] - z[g, n]) * s[g, n], g = k / group, x and y bf16, M <= 32.
//
// Layout (int4_cuda.py packs it once at load): for each tile of 8 outputs x 128 inputs, 32 lanes x 16 bytes,
// lane l's 16 bytes holding exactly the 32 codes that lane needs as the B operand of eight m16n8k16 MMAs
// (the k16 steps of the tile), so one coalesced 16-byte piece per lane feeds eight MMAs with no shuffles. A warp
// owns a pair of tiles (16 outputs): the pair's two tiles of one 128-wide chunk are adjacent (1 KB) and its
// chunks follow each other, so each warp streams through one contiguous stretch of memory.
// Word i of a lane covers k16 steps 2i and 2i+1; nibble s of it is the code of output 8*tile + lane/4 at
// k = 16*(2i + (s&3)/2) + 2*(lane%4) + 8*(s&1) + s/4, so that (word >> 4s) & 0x000F000F puts the two codes of
// one B register (k, k+1) in the two bf16 halves.
//
// Dequantization is exact and cheap: 0x4300 | q is the bf16 128 + q, minus the bf16 128 + z gives q - z
// exactly; the MMAs sum x (q - z) over each group in fp32 and the group's partial is scaled by s in fp32. So
// no weight is rounded (the dequantized bf16 path rounds (q - z) s to bf16): the result differs from the
// fp32 dequantized matmul only by fp32 summation order and the bf16 output.
//
// Pipeline: a block's chunks flow through S slots of shared memory by cp.async, S - 1 chunks in flight while one
// is multiplied (x of the chunk copied once by the whole block, each warp's codes, zeros and scales by the warp),
// so the bytes in flight per SM do not cost registers; one barrier per chunk hands slots over.
//
// Split-K: blocks along K write fp32 partials to a workspace and count themselves in on the output tile's
// counter; the last to arrive adds the partials in split order and writes bf16, so every run gives the same
// bits, then resets the counter for the next launch.

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace {

constexpr int WARPS = 8;  // warps per block, each on its own T output tiles over the block's K range

__device__ __forceinline__ uint32_t code_pair(uint32_t w) {
  // nibbles 0 and 4 of w as two bf16 of value 128 + code: (w & 0x000F000F) | 0x43004300 in one lop3
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "n"(0x000F000F), "n"(0x43004300));
  return r;
}

__device__ __forceinline__ uint32_t minus_zero(uint32_t v, uint32_t neg_zero) {
  // (128 + q) * 1 + -(128 + z): q - z, exact in bf16
  uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(neg_zero));
  return r;
}

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&a)[4], const void* smem) {
  // the four 8x8 tiles of a 16x16 bf16 A operand, each lane giving one row's address
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void copy_async(void* smem, const void* gmem, bool valid) {
  // 16 bytes global -> shared without a register round trip; zeros where !valid (nothing read)
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(addr), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ uint32_t word_of(const uint4& w, int i) {
  return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;  // i is a compile-time constant after unrolling
}

constexpr int T = 2;  // output tiles of 8 per warp (a pair: the layout interleaves them by chunk)

// One chunk (128 inputs) of a warp's two output tiles, in registers: the codes, and the raw zero and scale of
// each group the chunk touches (NG of them).
template <int NG>
struct Chunk {
  uint4 w[T];
  uint32_t z[T][NG];  // zero of output 8 * tile + lane / 4 (ZR: the two zeros of the scales' outputs, low byte first)
  uint32_t s[T][NG];  // fp16 scales of outputs 8 * tile + 2 * (lane % 4) + {0, 1}
};

// One chunk's slot in shared memory: x (16 * MT rows of the chunk's 128 inputs), then for each warp its pair's
// codes (1 KB) and the zeros (16 bytes) and fp16 scales (32 bytes) of the pair's outputs in each group it touches.
template <int NG, int MT>
struct Slot {
  static constexpr int ROW = 136;  // elements a row: +16 bytes so that ldmatrix's eight rows land in distinct banks
  static constexpr int X_BYTES = 16 * MT * ROW * 2;
  static constexpr int WARP_BYTES = 1024 + 48 * NG;
  static constexpr int BYTES = X_BYTES + WARPS * WARP_BYTES;
};

template <int N>
__device__ __forceinline__ void wait_group() {  // all but the newest N committed groups of copies have landed
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// The copies of a block's chunks into their slots, in order, all asynchronous: x by the whole block (16 * MT
// rows of 16 pieces of 16 bytes: MT pieces a thread), each warp its own codes (two pieces a lane, which only
// that lane reads back) and its pair's zeros and scales (lanes 0..NG-1 a group's 16 zeros each, then two lanes
// per group for its 16 scales). A thread keeps 32-bit byte offsets of its pieces at chunk 0 and adds chunk k's
// distance to the kernel's base pointers, so that few registers hold the copies' state (with 64-bit pointers
// the compiler re-derived them from the thread index at every chunk).
template <int GK, int MT>
struct Fetcher {
  static constexpr int NG = GK < 8 ? 8 / GK : 1;
  using S = Slot<NG, MT>;
  uint32_t x_src[MT];  // byte offsets from x (row clamped to M - 1: rows past M are copied as zeros)
  int x_dst[MT];
  bool x_row[MT];
  uint32_t w_src;  // byte offset from qw of the lane's codes in chunk 0
  int w_dst;       // the codes' place in the slot; zeros and scales follow 1 KB on
  uint32_t zs_src, zs_group;  // byte offset from zeros or scales of group 0; bytes per group
  bool zs_lane, zero_lane;
  int group_chunks;

  __device__ __forceinline__ Fetcher(int64_t sx, int M, int p, int N, int KT, int group_chunks_, int warp, int lane)
      : group_chunks(group_chunks_) {
#pragma unroll
    for (int u = 0; u < MT; ++u) {
      const int c = threadIdx.x + u * WARPS * 32, r = c >> 4, piece = c & 15;
      x_src[u] = (uint32_t)(min(r, M - 1) * sx * 2 + 16 * piece);
      x_dst[u] = r * S::ROW * 2 + piece * 16;
      x_row[u] = r < M;
    }
    w_src = (uint32_t)(((int64_t)p * KT * 64 + lane) * 16);
    w_dst = S::X_BYTES + warp * S::WARP_BYTES + 16 * lane;
    zero_lane = lane < NG;
    zs_lane = lane < 3 * NG;
    const int g = zero_lane ? lane : (lane - NG) >> 1;
    zs_src = zero_lane ? g * N + 16 * p : 2 * (g * N + 16 * p + 8 * ((lane - NG) & 1));
    zs_group = zero_lane ? N : 2 * N;
  }

  __device__ __forceinline__ void copy(unsigned char* slot, int k, const __nv_bfloat16* x, const uint4* qw,
                                       const uint8_t* zeros, const __half* scales) {
#pragma unroll
    for (int u = 0; u < MT; ++u)
      copy_async(slot + x_dst[u], reinterpret_cast<const unsigned char*>(x) + x_src[u] + 256 * k, x_row[u]);
    const unsigned char* w = reinterpret_cast<const unsigned char*>(qw) + w_src + ((uint32_t)k << 10);
    copy_async(slot + w_dst, w, true);
    copy_async(slot + w_dst + 512, w + 512, true);
    if (zs_lane) {
      const uint32_t g0 = GK == 16 ? (uint32_t)k / group_chunks : (uint32_t)k * NG;
      const unsigned char* base = zero_lane ? zeros : reinterpret_cast<const unsigned char*>(scales);
      copy_async(slot + w_dst + 1024, base + zs_src + g0 * zs_group, true);
    }
  }
};

// The lane's part of a warp's chunk, from the warp's part of the slot.
template <int NG, bool ZR>
__device__ __forceinline__ void read_chunk(Chunk<NG>& c, const unsigned char* mine, int lane) {
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int i = 0; i < T; ++i) {
    c.w[i] = *reinterpret_cast<const uint4*>(mine + 512 * i + 16 * lane);
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      c.z[i][g] = ZR ? *reinterpret_cast<const uint16_t*>(mine + 1024 + 16 * g + 8 * i + 2 * tig)
                     : mine[1024 + 16 * g + 8 * i + gid];
      c.s[i][g] = *reinterpret_cast<const uint32_t*>(mine + 1024 + 16 * NG + 32 * g + 2 * (8 * i + 2 * tig));
    }
  }
}

// GK: k16 steps per group (2 for group 32, 4 for 64, 8 for 128, 16 for any multiple of 256: groups of whole
// chunks); MT: 16-row tiles of x (1 or 2). ZR (a development variant): the zero comes off after the MMAs instead
// of from every code: the MMAs sum x (128 + q), one more MMA a k16 step sums x (times ones), and a group's
// partial is s (sum x (128 + q) - (128 + z) sum x). Two fewer instructions a code register for one MMA a step
// shared by the warp's tiles; the price is an fp32 difference of two sums ~128x the result's terms (relative
// error ~2^-16 of the group's sum of |x|, far under the bf16 output's rounding), so it is not bit-equal.
template <int GK, int MT, bool ZR = false>
struct Tile {
  static constexpr int NG = GK < 8 ? 8 / GK : 1;  // groups a chunk touches
  float acc[MT][T][4];
  float part[MT][T][4];
  float rows[MT][4];  // ZR: the rows' sums of x over the group so far (rows of the accumulator's layout)

  // multiply one chunk: xs is its x in shared memory (rows `row` elements apart); group_end_chunk: whether a
  // group ends with this chunk (GK >= 8)
  __device__ __forceinline__ void multiply(const Chunk<NG>& c, const __nv_bfloat16* xs, int row,
                                           bool group_end_chunk, int lane) {
    uint32_t neg_zero[T];
    float2 scale[T], zero[T];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j % (GK < 8 ? GK : 8) == 0) {  // a new group starts (or a new chunk of a long group)
#pragma unroll
        for (int i = 0; i < T; ++i) {
          const uint32_t zv = c.z[i][j / (GK < 8 ? GK : 8)];
          if (ZR)
            zero[i] = make_float2(128.f + (float)(zv & 0xFF), 128.f + (float)(zv >> 8));
          else
            neg_zero[i] = (0xC300u | zv) * 0x00010001u;  // bf16 -(128 + z), both halves
          const uint32_t sv = c.s[i][j / (GK < 8 ? GK : 8)];
          scale[i] = __half22float2(*reinterpret_cast<const __half2*>(&sv));
        }
      }
      uint32_t a[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {  // lanes 0-15: rows 0-15 at column 0 of the step, lanes 16-31 at column 8
        ldmatrix_x4(a[m], xs + (16 * m + (lane & 15)) * row + 16 * j + 8 * (lane >> 4));
        if (ZR) mma(rows[m], a[m], 0x3F803F80u, 0x3F803F80u);  // x times ones: every column holds the row's sum
      }
#pragma unroll
      for (int i = 0; i < T; ++i) {
        const uint32_t bits = word_of(c.w[i], j >> 1) >> (8 * (j & 1));
        const uint32_t b0 = ZR ? code_pair(bits) : minus_zero(code_pair(bits), neg_zero[i]);
        const uint32_t b1 = ZR ? code_pair(bits >> 4) : minus_zero(code_pair(bits >> 4), neg_zero[i]);
#pragma unroll
        for (int m = 0; m < MT; ++m) mma(part[m][i], a[m], b0, b1);
      }
      if (GK < 8 ? (j % GK == GK - 1) : (j == 7 && group_end_chunk)) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
          for (int i = 0; i < T; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float sum = ZR ? fmaf(-(e & 1 ? zero[i].y : zero[i].x), rows[m][e], part[m][i][e]) : part[m][i][e];
              acc[m][i][e] = fmaf(sum, e & 1 ? scale[i].y : scale[i].x, acc[m][i][e]);
              part[m][i][e] = 0.f;
            }
          if (ZR)
#pragma unroll
            for (int e = 0; e < 4; ++e) rows[m][e] = 0.f;
        }
      }
    }
  }
};

// The block's results: bf16 straight to y (one block along K), else fp32 partials to the workspace and the last
// block of the column adds them up in split order. DISCARD (a development variant): the last block then drops the
// dead partials from L2, so that they are not written back to DRAM when evicted (a step writes ~54 MB of them
// against the 557 MB of codes it reads). The two store loops are written out on purpose: one helper
// taking the store as a lambda gave the same bits 2 % slower at 16 rows on the H200 (an A/B of the two builds).
template <int MT, bool DISCARD>
__device__ __forceinline__ void finish(const float (&acc)[MT][T][4], __nv_bfloat16* __restrict__ out,
                                       float* __restrict__ ws, int* __restrict__ counters, int M, int N, int tile0,
                                       bool live, int lane) {
  const int gid = lane >> 2, tig = lane & 3;
  const int split = gridDim.y;
  if (split == 1) {
#pragma unroll
    for (int i = 0; i < T; ++i) {
      if (!live) continue;
      const int n = (tile0 + i) * 8 + 2 * tig;
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = 16 * m + gid + 8 * h;
          if (row < M)
            *reinterpret_cast<__nv_bfloat162*>(out + (int64_t)row * N + n) =
                __floats2bfloat162_rn(acc[m][i][2 * h], acc[m][i][2 * h + 1]);
        }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < T; ++i) {
    if (!live) continue;
    const int n = (tile0 + i) * 8 + 2 * tig;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 16 * m + gid + 8 * h;
        if (row < M)
          *reinterpret_cast<float2*>(ws + ((int64_t)blockIdx.y * M + row) * N + n) =
              make_float2(acc[m][i][2 * h], acc[m][i][2 * h + 1]);
      }
  }
  // count in: the barrier orders every thread's partials before thread 0's arrival, whose release (at GPU scope)
  // publishes them and whose acquire, in the last block, makes the others' partials visible to it (then its
  // barrier to all its threads): no full fences
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0) {
    int before;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(before) : "l"(counters + blockIdx.x) : "memory");
    last = before == split - 1;
  }
  __syncthreads();
  if (!last) return;
  // the last block adds up the column's partials (M rows x its 128 outputs) in split order, four outputs a
  // thread at a time and eight splits' loads in flight: few round trips to L2 whatever the fragment layout
  const int n0 = blockIdx.x * WARPS * 16, quads = min(WARPS * 16, N - n0) >> 2;
  for (int e = threadIdx.x; e < M * quads; e += WARPS * 32) {
    const int row = e / quads, n = n0 + 4 * (e - row * quads);
    const float* src = ws + (int64_t)row * N + n;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < split; s0 += 8) {
      float4 p[8];
#pragma unroll
      for (int u = 0; u < 8; ++u)
        p[u] = s0 + u < split ? __ldcg(reinterpret_cast<const float4*>(src + (int64_t)(s0 + u) * M * N))
                              : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        sum.x += p[u].x;
        sum.y += p[u].y;
        sum.z += p[u].z;
        sum.w += p[u].w;
      }
    }
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + (int64_t)row * N + n);
    dst[0] = __floats2bfloat162_rn(sum.x, sum.y);
    dst[1] = __floats2bfloat162_rn(sum.z, sum.w);
  }
  if (DISCARD && N % 128 == 0) {  // whole 128-byte lines only
    __syncthreads();               // after every thread's loads of them
    for (int l = threadIdx.x; l < split * M * 4; l += WARPS * 32)
      asm volatile("discard.global.L2 [%0], 128;" ::"l"(ws + (int64_t)(l >> 2) * N + n0 + 32 * (l & 3)) : "memory");
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch
}

// S: slots per block; blocks per SM as many as their slots fit and the registers allow (4 blocks: 64 registers a
// thread, for 16 rows; 3: 85, for 32)
template <int GK, int MT, int S>
constexpr int min_blocks() {
  constexpr int b = (220 * 1024) / (S * Slot<GK < 8 ? 8 / GK : 1, MT>::BYTES), most = MT == 1 ? 4 : 3;
  return b > most ? most : b < 1 ? 1 : b;
}

template <int GK, int MT, int S, bool ZR, bool DISCARD>
__global__ void __launch_bounds__(WARPS * 32, (min_blocks<GK, MT, S>())) w4a16_kernel(
    const __nv_bfloat16* __restrict__ x, int64_t sx, const uint4* __restrict__ qw, const __half* __restrict__ scales,
    const uint8_t* __restrict__ zeros, __nv_bfloat16* __restrict__ out, float* __restrict__ ws,
    int* __restrict__ counters, int M, int N, int K, int group, int chunks) {
  using TileT = Tile<GK, MT, ZR>;
  constexpr int NG = TileT::NG;
  using SlotT = Slot<NG, MT>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int NP = N >> 4, KT = K >> 7;
  const int pair = blockIdx.x * WARPS + warp;
  const bool live = pair < NP;
  const int p = min(pair, NP - 1);  // a warp past the last output reads the last pair and stores nothing
  const int tile0 = 2 * p;
  const int kt0 = blockIdx.y * chunks;
  const int kt1 = min(kt0 + chunks, KT);
  const int group_chunks = group >> 7;  // GK >= 8 only
  TileT tile;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) tile.acc[m][i][e] = tile.part[m][i][e] = tile.rows[m][e] = 0.f;

  // the copies run S - 1 chunks ahead of the multiplications; every step commits one group of copies (empty
  // past the block's range) so that "all but the newest S - 2 groups" is always the chunk about to be used
  Fetcher<GK, MT> fetcher(sx, M, p, N, KT, group_chunks, warp, lane);
  int fk = kt0, fslot = 0;
  auto fetch_next = [&]() {
    if (fk < kt1) fetcher.copy(smem + fslot * SlotT::BYTES, fk, x, qw, zeros, scales);
    commit();
    ++fk;
    fslot = fslot == S - 1 ? 0 : fslot + 1;
  };
#pragma unroll
  for (int s = 0; s < S - 1; ++s) fetch_next();
  int slot = 0;
  int group_left = GK == 16 ? group_chunks - kt0 % group_chunks : 1;  // chunks until the current group ends
  for (int k = kt0; k < kt1; ++k) {
    wait_group<S - 2>();
    __syncthreads();  // chunk k landed for every thread, and every warp is done with chunk k - 1's slot
    fetch_next();     // chunk k + S - 1, into chunk k - 1's slot
    const unsigned char* sl = smem + slot * SlotT::BYTES;
    Chunk<NG> c;
    read_chunk<NG, ZR>(c, sl + SlotT::X_BYTES + warp * SlotT::WARP_BYTES, lane);
    bool group_end = true;
    if (GK == 16) {
      group_end = --group_left == 0 || k + 1 == kt1;
      if (group_left == 0) group_left = group_chunks;
    }
    tile.multiply(c, reinterpret_cast<const __nv_bfloat16*>(sl), SlotT::ROW, group_end, lane);
    slot = slot == S - 1 ? 0 : slot + 1;
  }

  finish<MT, DISCARD>(tile.acc, out, ws, counters, M, N, tile0, live, lane);
}

// The bf16 weight [N, K] from the packed codes, each element bf16((q - z) * s) computed in fp32 (the
// dequantized path's weight): for inputs of many rows, where a bf16 GEMM is compute-bound.
__global__ void dequant_kernel(const uint4* __restrict__ qw, const __half* __restrict__ scales,
                               const uint8_t* __restrict__ zeros, __nv_bfloat16* __restrict__ w, int N, int K,
                               int group) {
  const int KT = K >> 7;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (int64_t)(N >> 3) * KT * 32) return;
  // memory order: pair, chunk, tile of the pair, lane
  const int lane = idx & 31, kt = (idx >> 6) % KT;
  const int64_t nt = 2 * ((idx >> 6) / KT) + ((idx >> 5) & 1);
  const int n = nt * 8 + (lane >> 2), tig = lane & 3;
  const uint4 v = qw[idx];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = word_of(v, i);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int k = (kt << 7) + 16 * (2 * i + ((s & 3) >> 1)) + 2 * tig + 8 * (s & 1) + (s >> 2);
      const int64_t gn = (int64_t)(k / group) * N + n;
      const float q = (float)((word >> (4 * s)) & 0xF);
      w[(int64_t)n * K + k] = __float2bfloat16_rn(__half2float(scales[gn]) * (q - (float)zeros[gn]));
    }
  }
}

constexpr int STAGES = 3;  // chunks in a block's slots: two in flight while one is multiplied

// One instance of the kernel: group steps, row tiles, slots, zero through the rows' sums.
template <int GK_, int MT_, int S_, bool ZR = false, bool DISCARD = false>
struct Config {
  static constexpr int GK = GK_, MT = MT_, S = S_;
  static constexpr int SMEM = S * Slot<GK < 8 ? 8 / GK : 1, MT>::BYTES;
  static constexpr auto kernel = w4a16_kernel<GK, MT, S, ZR, DISCARD>;

  static void prepare() {  // allow the kernel its shared memory (more than 48 KB needs asking), once per device
    static uint64_t raised = 0;
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    if (device >= 64 || !(raised >> device & 1)) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
      if (device < 64) raised |= uint64_t{1} << device;
    }
  }
};

// f(Config<...>{}) for the kernel that runs `group` with mt row tiles. variant != 0: development variants of the
// pipeline depth at group 128 and 16 rows (benchmarks/gpu_int4.py cuda:vN): 1: 4 slots, 2: 2 slots, 3: 5 slots
// (3 blocks an SM; at 16 rows the drafter's split-K grids have at most 3 blocks an SM anyway); 4 and 5: the zero
// through the rows' sums (Tile's ZR) with 3 and 4 slots; 6: the shipped kernel that discards the dead partials
// (finish's DISCARD, the same bits).
template <typename F>
void dispatch(int group, int mt, int variant, F&& f) {
  if (mt == 1 && group == 128 && variant) {
    if (variant == 1) f(Config<8, 1, 4>{});
    else if (variant == 3) f(Config<8, 1, 5>{});
    else if (variant == 4) f(Config<8, 1, STAGES, true>{});
    else if (variant == 5) f(Config<8, 1, 4, true>{});
    else if (variant == 6) f(Config<8, 1, STAGES, false, true>{});
    else f(Config<8, 1, 2>{});
    return;
  }
  if (mt == 1) {
    if (group == 32) f(Config<2, 1, STAGES>{});
    else if (group == 64) f(Config<4, 1, STAGES>{});
    else if (group == 128) f(Config<8, 1, STAGES>{});
    else f(Config<16, 1, STAGES>{});
  } else {
    if (group == 32) f(Config<2, 2, STAGES>{});
    else if (group == 64) f(Config<4, 2, STAGES>{});
    else if (group == 128) f(Config<8, 2, STAGES>{});
    else f(Config<16, 2, STAGES>{});
  }
}

void check_operands(const at::Tensor& qw, const at::Tensor& scales, const at::Tensor& zeros, int64_t group) {
  TORCH_CHECK(qw.is_cuda() && qw.scalar_type() == at::kInt && qw.is_contiguous(), "qw: contiguous int32 on CUDA");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.is_contiguous(), "scales: fp16 [G, N]");
  TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.sizes() == scales.sizes() && zeros.is_contiguous(),
              "zeros: uint8 [G, N]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(qw.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(scales.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(zeros.data_ptr()) % 16 == 0,
              "qw, scales and zeros must be 16-byte aligned");
  TORCH_CHECK(group == 32 || group == 64 || (group > 0 && group % 128 == 0), "group must be 32, 64 or a multiple of 128");
}

}  // namespace

// x [M, K] bf16 (M <= 32), packed codes, fp16 scales [G, N], uint8 zeros [G, N] -> y [M, N] bf16.
// split: blocks along K (clamped so none is empty).
at::Tensor w4a16_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales, const at::Tensor& zeros,
                    at::Tensor& counters, int64_t group, int64_t split, int64_t variant) {
  check_operands(qw, scales, zeros, group);
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x: bf16 [M, K] with unit column stride on CUDA");
  const int M = x.size(0), K = x.size(1), N = scales.size(1);
  TORCH_CHECK(M >= 1 && M <= 32, "x has ", M, " rows; this kernel takes 1..32");
  TORCH_CHECK(K % 128 == 0 && N % 16 == 0 && K % group == 0, "K must be a multiple of 128 and of the group, N of 16");
  TORCH_CHECK(x.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "x rows must be 16-byte aligned");
  TORCH_CHECK(qw.numel() == (int64_t)N * K / 8 && scales.size(0) == K / group, "operand sizes do not match");
  TORCH_CHECK((int64_t)N * K / 2 < (int64_t{1} << 32) && (int64_t)M * x.stride(0) * 2 < (int64_t{1} << 32),
              "the kernel addresses the weight and x with 32-bit byte offsets: split a larger Linear");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const int KT = K / 128;
  int s = (int)std::max<int64_t>(1, std::min<int64_t>(split, KT));
  const int chunks = (KT + s - 1) / s;
  s = (KT + chunks - 1) / chunks;  // no block without a chunk
  TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == at::kInt, "counters: int32 on CUDA");
  auto out = at::empty({M, N}, x.options());
  at::Tensor ws;
  if (s > 1) ws = at::empty({s, M, N}, x.options().dtype(at::kFloat));
  const int mt = M > 16 ? 2 : 1;
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch((int)group, mt, (int)variant, [&](auto config) {
    using C = decltype(config);
    C::prepare();
    const dim3 grid((N / 16 + WARPS - 1) / WARPS, s);  // a block: 8 warps of 16 outputs
    TORCH_CHECK(counters.numel() >= grid.x, "counters: one per block column (", grid.x, ") needed");
    C::kernel<<<grid, WARPS * 32, C::SMEM, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), x.stride(0), reinterpret_cast<const uint4*>(qw.data_ptr()),
        reinterpret_cast<const __half*>(scales.data_ptr()), zeros.data_ptr<uint8_t>(),
        reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), s > 1 ? ws.data_ptr<float>() : nullptr,
        counters.data_ptr<int>(), M, N, K, (int)group, chunks);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// (outputs per block, blocks resident per SM on the current device) of the kernel for this group and row count
std::tuple<int64_t, int64_t> kernel_shape(int64_t group, int64_t rows, int64_t variant) {
  TORCH_CHECK(rows >= 1 && rows <= 32, "rows must be 1..32");
  int64_t outputs = 0;
  int blocks = 0;
  dispatch((int)group, rows > 16 ? 2 : 1, (int)variant, [&](auto config) {
    using C = decltype(config);
    C::prepare();
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, C::kernel, WARPS * 32, C::SMEM));
    outputs = 16 * WARPS;
  });
  return {outputs, blocks};
}

at::Tensor w4_dequant(const at::Tensor& qw, const at::Tensor& scales, const at::Tensor& zeros, int64_t group) {
  check_operands(qw, scales, zeros, group);
  const int N = scales.size(1), K = scales.size(0) * group;
  TORCH_CHECK(qw.numel() == (int64_t)N * K / 8 && K % 128 == 0 && N % 16 == 0, "operand sizes do not match");
  const c10::cuda::OptionalCUDAGuard guard(qw.device());
  auto w = at::empty({N, K}, qw.options().dtype(at::kBFloat16));
  const int64_t threads = (int64_t)(N / 8) * (K / 128) * 32;
  dequant_kernel<<<(threads + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(qw.data_ptr()), reinterpret_cast<const __half*>(scales.data_ptr()),
      zeros.data_ptr<uint8_t>(), reinterpret_cast<__nv_bfloat16*>(w.data_ptr()), N, K, (int)group);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4a16_mm", &w4a16_mm, "int4 weight x bf16 rows (M <= 32)");
  m.def("kernel_shape", &kernel_shape, "outputs per block and blocks resident per SM");
  m.def("w4_dequant", &w4_dequant, "bf16 weight [N, K] from the packed codes");
}
