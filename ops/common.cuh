// Device helpers shared by the ring-attention kernels: tensor-core MMA (mma.sync m16n8k16, sm_80+), ldmatrix,
// cp.async, fragment packing and exp2. CUDA headers only.
//
// Fragment layouts of mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), with g = lane / 4 and
// t = lane % 4:
//   A (16 x 16, row major)  a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
//   B (16 x 8, "col")       b0: (k = 2t..2t+1, n = g)  b1: (k = 2t+8.., n = g)
//   C (16 x 8, fp32)        c0, c1: (g, 2t..2t+1)     c2, c3: (g+8, 2t..2t+1)
// ldmatrix.x4: lane L gives the shared address of row L % 8 of 8x8 matrix L / 8 and receives, for matrix i,
// register i = elements (row L/4, cols 2(L%4)..+1); with .trans it receives (rows 2(L%4)..+1, col L/4) instead.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ring_attn.h"

namespace msp_ops {
namespace dev {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; valid = false zero-fills the destination without reading the source.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                                  uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// exp2 on the special-function unit; ex2(-inf) = +0.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  // c += a * b, fp32 accumulate
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // two floats -> one register, the first in the low half (the lower column index)
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <>
struct Mma<__half> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Copy a ROWS x D tile of 16-bit elements (rows row0.. of a matrix with n_rows rows and row stride `ld` elements)
// into shared memory with row stride LDS elements; rows >= n_rows are zero-filled (never left stale: a stale NaN
// times a zero probability is still NaN). All NTHREADS threads take part; the caller commits and waits.
template <typename T, int ROWS, int D, int LDS, int NTHREADS>
__device__ __forceinline__ void load_tile_async(T* s, const T* g, int64_t ld, int row0, int n_rows, int tid) {
  constexpr int kChunksPerRow = D / 8;  // 8 x 16 bit = 16 bytes
  constexpr int kChunks = ROWS * kChunksPerRow;
  static_assert(kChunks % NTHREADS == 0, "tile must split evenly over the threads");
#pragma unroll
  for (int i = 0; i < kChunks / NTHREADS; ++i) {
    const int c = tid + i * NTHREADS;
    const int r = c / kChunksPerRow;
    const int ch = c % kChunksPerRow;
    const int gr = row0 + r;
    const bool valid = gr < n_rows;
    const T* src = g + static_cast<int64_t>(valid ? gr : 0) * ld + ch * 8;
    cp_async_16(smem_addr(s + r * LDS + ch * 8), src, valid);
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

}  // namespace dev

// Host side: launches a row-wise kernel (one warp per (b, h, query) row: merge, finalize, backward preprocess).
// Fills the params' row fields from `shape`, sizes the grid, and instantiates the kernel for `dtype` through
// launch(T{}, grid) with T = float, __half or __nv_bfloat16; invalid when the rows need more blocks than a grid holds.
template <typename Params, typename Launch>
inline cudaError_t launch_rowwise(DType dtype, const Shape& shape, Params& p, int threads, Launch&& launch) {
  p.h = shape.h;
  p.n_q = shape.s_q;
  p.d = shape.d;
  p.rows = static_cast<int64_t>(shape.b) * shape.h * shape.s_q;
  if (p.rows == 0) return cudaSuccess;
  const int64_t blocks = (p.rows + threads / 32 - 1) / (threads / 32);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (dtype) {
    case DType::kFloat32: launch(float{}, grid); break;
    case DType::kFloat16: launch(__half{}, grid); break;
    case DType::kBFloat16: launch(__nv_bfloat16{}, grid); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// Host side, shared by the forward and backward launchers: checks a step's arguments and resolves its mask mode
// into the rows and keys it covers (full block, causal diagonal, the zigzag halves).
struct StepRange {
  int q_begin = 0, n_q = 0, n_k = 0, causal = 0, offset = 0;
};

inline cudaError_t step_range(DType dtype, const Shape& shape, Mode mode, StepRange* r) {
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  if (!head_dim_supported(shape.d) || shape.h_kv <= 0 || shape.h % shape.h_kv != 0) return cudaErrorInvalidValue;
  if (static_cast<int64_t>(shape.b) * shape.h > 65535) return cudaErrorInvalidValue;  // grid.y
  int q_begin = 0, n_q = shape.s_q, n_k = shape.s_k, causal = 0, offset = 0;
  switch (mode) {
    case Mode::kFull: break;
    case Mode::kCausal:
      causal = 1;
      offset = shape.s_k - shape.s_q;
      break;
    case Mode::kKvFirstHalf:
      if (shape.s_k % 2) return cudaErrorInvalidValue;
      n_k = shape.s_k / 2;
      break;
    case Mode::kQSecondHalf:
      if (shape.s_q % 2) return cudaErrorInvalidValue;
      q_begin = shape.s_q / 2;
      n_q = shape.s_q - q_begin;
      break;
    default: return cudaErrorInvalidValue;
  }
  *r = StepRange{q_begin, n_q, n_k, causal, offset};
  return cudaSuccess;
}
}  // namespace msp_ops
