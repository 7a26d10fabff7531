// How fast can a block-per-128-outputs int4 GEMM at 16 rows pull its bytes in? (issue #16, development probe)
//
// Loads only, no MMAs: each kernel streams an int4 weight of N x K (K/2 bytes a row, plus 384 bytes of zeros and
// scales per 128 outputs and 128-input chunk) and 16 rows of bf16 x, over the same grid as the shipped kernel
// (N / 128 block columns, `split` blocks along K), and folds what it loaded into one word a thread so that
// nothing is dead. Two ways in:
//   cpasync: the shipped kernel's loads (every thread 16-byte cp.async pieces into S slots, one block barrier a
//            chunk, x copied by the block, each warp its 1 KB of codes and its zeros and scales);
//   bulk:    a producer warp issues one bulk copy (the copy engine, cp.async.bulk) of the block's CPB chunks of
//            codes, zeros and scales (contiguous in this layout) and x's 16 rows, completing on the stage's
//            mbarrier; eight consumer warps wait on it and release the stage on an "empty" mbarrier: no block
//            barrier, few issued instructions per byte.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>

namespace {

constexpr int CONSUMERS = 8;
constexpr int CHUNK_BYTES = 8192 + 384;  // a block's 128 outputs x 128 inputs of codes, then zeros and scales
constexpr int X_CHUNK = 16 * 256;        // 16 rows x 128 inputs of bf16

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void copy_async(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
}

template <int S>
__global__ void __launch_bounds__(256, 4) cpasync_kernel(const unsigned char* __restrict__ w,
                                                         const unsigned char* __restrict__ x, int K, int chunks,
                                                         uint32_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int SLOT = X_CHUNK + CHUNK_BYTES;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int KT = K >> 7;
  const int kt0 = blockIdx.y * chunks, kt1 = min(kt0 + chunks, KT);
  const unsigned char* col = w + (int64_t)blockIdx.x * KT * CHUNK_BYTES;
  auto fetch = [&](int k, int slot) {
    unsigned char* s = smem + slot * SLOT;
    const int r = threadIdx.x >> 4, piece = threadIdx.x & 15;
    copy_async(s + r * 256 + 16 * piece, x + (int64_t)r * K * 2 + k * 256 + 16 * piece);
    const unsigned char* c = col + (int64_t)k * CHUNK_BYTES;
    copy_async(s + X_CHUNK + warp * 1024 + 16 * lane, c + warp * 1024 + 16 * lane);
    copy_async(s + X_CHUNK + warp * 1024 + 512 + 16 * lane, c + warp * 1024 + 512 + 16 * lane);
    if (lane < 3) copy_async(s + X_CHUNK + 8192 + warp * 48 + 16 * lane, c + 8192 + warp * 48 + 16 * lane);
  };
  int fk = kt0;
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (fk < kt1) fetch(fk, s);
    asm volatile("cp.async.commit_group;" ::: "memory");
    ++fk;
  }
  uint32_t acc = 0;
  int slot = 0, fslot = S - 1;
  for (int k = kt0; k < kt1; ++k) {
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 2) : "memory");
    __syncthreads();
    if (fk < kt1) fetch(fk, fslot);
    asm volatile("cp.async.commit_group;" ::: "memory");
    ++fk;
    fslot = fslot == S - 1 ? 0 : fslot + 1;
    const unsigned char* s = smem + slot * SLOT;
    const uint4 a = *reinterpret_cast<const uint4*>(s + X_CHUNK + warp * 1024 + 16 * lane);
    const uint4 b = *reinterpret_cast<const uint4*>(s + X_CHUNK + warp * 1024 + 512 + 16 * lane);
    const uint4 xv = *reinterpret_cast<const uint4*>(s + 16 * (threadIdx.x & 255));
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ xv.x ^ xv.w;
    slot = slot == S - 1 ? 0 : slot + 1;
  }
  out[((int64_t)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(
          smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, int bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem)),
               "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// S stages of CPB chunks each; warp 8 produces, warps 0-7 consume
template <int S, int CPB>
__global__ void __launch_bounds__(288, 1) bulk_kernel(const unsigned char* __restrict__ w,
                                                      const unsigned char* __restrict__ x, int K, int chunks,
                                                      uint32_t* __restrict__ out) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int STAGE = CPB * (X_CHUNK + CHUNK_BYTES);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * STAGE);
  uint64_t* empty = full + S;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int KT = K >> 7;
  const int kt0 = blockIdx.y * chunks, kt1 = min(kt0 + chunks, KT);
  const int stages = (kt1 - kt0 + CPB - 1) / CPB;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == CONSUMERS) {  // producer
    const unsigned char* col = w + (int64_t)blockIdx.x * KT * CHUNK_BYTES;
    for (int t = 0; t < stages; ++t) {
      const int s = t % S;
      if (t >= S) mbar_wait(empty + s, ((t / S) - 1) & 1);
      const int k = kt0 + t * CPB, n = min(CPB, kt1 - k);
      unsigned char* st = smem + s * STAGE;
      if (lane == 0) mbar_expect(full + s, n * (CHUNK_BYTES + X_CHUNK));
      __syncwarp();
      if (lane == 0) bulk_copy(st, col + (int64_t)k * CHUNK_BYTES, n * CHUNK_BYTES, full + s);
      else if (lane <= 16)  // x row lane-1 of these chunks, after the codes
        bulk_copy(st + CPB * CHUNK_BYTES + (lane - 1) * CPB * 256, x + (int64_t)(lane - 1) * K * 2 + k * 256,
                  n * 256, full + s);
    }
    return;
  }
  uint32_t acc = 0;
  for (int t = 0; t < stages; ++t) {
    const int s = t % S;
    mbar_wait(full + s, (t / S) & 1);
    const unsigned char* st = smem + s * STAGE;
    const int n = min(CPB, kt1 - kt0 - t * CPB);
    for (int c = 0; c < n; ++c) {
      const uint4 a = *reinterpret_cast<const uint4*>(st + c * CHUNK_BYTES + warp * 1024 + 16 * lane);
      const uint4 b = *reinterpret_cast<const uint4*>(st + c * CHUNK_BYTES + warp * 1024 + 512 + 16 * lane);
      const uint4 xv = *reinterpret_cast<const uint4*>(st + CPB * CHUNK_BYTES + (threadIdx.x >> 4) * CPB * 256 +
                                                       c * 256 + 16 * (threadIdx.x & 15));
      acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ xv.x ^ xv.w;
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + s);
  }
  out[((int64_t)blockIdx.y * gridDim.x + blockIdx.x) * 256 + threadIdx.x] = acc;
}

template <typename Kernel>
void launch(Kernel kernel, int threads, int smem, const at::Tensor& w, const at::Tensor& x, int64_t N,
            int64_t split, at::Tensor& out) {
  const int K = x.size(1), KT = K / 128;
  TORCH_CHECK(N % 128 == 0 && K % 128 == 0 && x.size(0) == 16, "N, K multiples of 128, x 16 rows");
  TORCH_CHECK(w.numel() >= (N / 128) * KT * CHUNK_BYTES, "w too small");
  const int chunks = (KT + split - 1) / split;
  const dim3 grid(N / 128, (KT + chunks - 1) / chunks);
  TORCH_CHECK(out.numel() >= (int64_t)grid.x * grid.y * 256, "out too small");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, threads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      w.data_ptr<uint8_t>(), reinterpret_cast<const unsigned char*>(x.data_ptr()), K, chunks,
      reinterpret_cast<uint32_t*>(out.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void cpasync(const at::Tensor& w, const at::Tensor& x, int64_t N, int64_t split, at::Tensor& out, int64_t S) {
  constexpr int SLOT = X_CHUNK + CHUNK_BYTES;
  if (S == 3) launch(cpasync_kernel<3>, 256, 3 * SLOT, w, x, N, split, out);
  else if (S == 4) launch(cpasync_kernel<4>, 256, 4 * SLOT, w, x, N, split, out);
  else TORCH_CHECK(false, "S: 3 or 4");
}

void bulk(const at::Tensor& w, const at::Tensor& x, int64_t N, int64_t split, at::Tensor& out, int64_t S,
          int64_t cpb) {
  constexpr int ONE = X_CHUNK + CHUNK_BYTES;
#define BULK(s, c)                                                                                   \
  if (S == s && cpb == c) return launch(bulk_kernel<s, c>, 288, s * c * ONE + 2 * s * 8, w, x, N, split, out);
  BULK(2, 1) BULK(3, 1) BULK(4, 1) BULK(6, 1) BULK(8, 1) BULK(2, 2) BULK(3, 2) BULK(4, 2) BULK(2, 4) BULK(3, 4)
#undef BULK
  TORCH_CHECK(false, "no instance for S=", S, " CPB=", cpb);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpasync", &cpasync);
  m.def("bulk", &bulk);
}
