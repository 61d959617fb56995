// Backward of one ring step given the FINAL lse and delta = rowsum(dout * out) (flash-attention's trick: with the
// final statistics every block's gradient is exact on its own and the blocks' gradients simply add up).
//
// Tiling (FlashAttention-2 style, one kernel): a CTA of 4 warps owns 64 keys of one q head (16 keys per warp) and
// walks the query tiles that can see them (BQ rows each). Per query tile, on tensor cores with fp32 accumulate:
//   S^T = K Q^T,  P^T = exp2(S^T * scale * log2 e - lse * log2 e),  dP^T = V dO^T,  dS^T = P^T (dP^T - delta)
//   dV += P^T dO,  dK += dS^T Q   (registers, for the CTA's 64 keys)
//   dQ += dS K * scale            (dS^T goes through shared memory; fp32 atomics into the caller's dq)
// At the end dK * scale and dV are added atomically into the caller's fp32 dk/dv of the kv head (the q heads of one
// GQA group add into the same kv head; K/V are read per kv head, never repeated). P and dS are rounded to the input
// dtype before their products, as in flash attention; every sum is fp32.
#include <cmath>

#include "common.cuh"
#include "ring_attn.h"

namespace msp_ops {
namespace {

constexpr int kBK = 64;  // keys per CTA
constexpr int kThreads = 128;
constexpr int kPad = 8;

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  int64_t q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, do_sb, do_sh, do_ss;
  const float* lse;
  int64_t lse_sb, lse_sh;
  const float* delta;
  int64_t dl_sb, dl_sh;
  float* dq;
  int64_t dq_sb, dq_sh, dq_ss;
  float* dk;
  int64_t dk_sb, dk_sh, dk_ss;
  float* dv;
  int64_t dv_sb, dv_sh, dv_ss;
  int h, group, n_q, n_k, causal, causal_offset;
  float scale, scale_log2;
};

// x += (a, b) at an 8-byte aligned fp32 pair
__device__ __forceinline__ void atomic_add2(float* x, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(x), make_float2(a, b));
#else
  atomicAdd(x, a);
  atomicAdd(x + 1, b);
#endif
}

template <int BQ>
__device__ __forceinline__ void load_row_stats(float* s_lse2, float* s_delta, const float* lse, const float* delta,
                                               int q0, int n_q, int tid) {
  for (int i = tid; i < BQ; i += kThreads) {
    const int q = q0 + i;
    float l2 = INFINITY;  // rows past the block and rows that saw no key at all: probability 0
    float dl = 0.f;
    if (q < n_q) {
      const float lv = lse[q];
      if (lv != -INFINITY) l2 = lv * dev::kLog2e;
      dl = delta[q];
    }
    s_lse2[i] = l2;
    s_delta[i] = dl;
  }
}

template <typename T, int D, int BQ>
__global__ void __launch_bounds__(kThreads) bwd_step_kernel(const BwdParams p) {
  using dev::Mma;
  constexpr int LDS = D + kPad;
  constexpr int LDS_DS = BQ + kPad;
  constexpr int NT_Q = BQ / 8;  // n-tiles of S^T / dP^T (queries)
  constexpr int NT_D = D / 8;   // n-tiles of dK / dV (head dim)
  constexpr int WQ = BQ / 16;   // dQ phase: warps along the query rows ...
  constexpr int WD = 4 / WQ;    // ... and along the head dim
  constexpr int DW = D / WD;    // head-dim columns per warp in the dQ phase
  static_assert(WQ * WD == 4 && DW % 16 == 0, "dQ phase must split over 4 warps");
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kBK * LDS;
  T* sQ = sV + kBK * LDS;
  T* sdO = sQ + BQ * LDS;
  T* sdS = sdO + BQ * LDS;  // dS^T [keys][queries]
  float* s_lse2 = reinterpret_cast<float*>(sdS + kBK * LDS_DS);
  float* s_delta = s_lse2 + BQ;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int n0 = blockIdx.x * kBK;
  const int bi = blockIdx.y / p.h, hi = blockIdx.y % p.h, kvh = hi / p.group;

  // causal: query i sees key j iff j <= i + offset, so the first key of the tile is seen from row n0 - offset on
  const int q_first = p.causal ? max(0, n0 - p.causal_offset) : 0;
  if (q_first >= p.n_q) return;  // no query sees this key tile: nothing to add
  const int qt_begin = q_first / BQ, qt_end = (p.n_q + BQ - 1) / BQ;

  const T* qg = static_cast<const T*>(p.q) + bi * p.q_sb + hi * p.q_sh;
  const T* kg = static_cast<const T*>(p.k) + bi * p.k_sb + kvh * p.k_sh;
  const T* vg = static_cast<const T*>(p.v) + bi * p.v_sb + kvh * p.v_sh;
  const T* dog = static_cast<const T*>(p.dout) + bi * p.do_sb + hi * p.do_sh;
  const float* lseg = p.lse + bi * p.lse_sb + hi * p.lse_sh;
  const float* dlg = p.delta + bi * p.dl_sb + hi * p.dl_sh;
  float* dqg = p.dq + bi * p.dq_sb + hi * p.dq_sh;
  float* dkg = p.dk + bi * p.dk_sb + kvh * p.dk_sh;
  float* dvg = p.dv + bi * p.dv_sb + kvh * p.dv_sh;

  dev::load_tile_async<T, kBK, D, LDS, kThreads>(sK, kg, p.k_ss, n0, p.n_k, tid);
  dev::load_tile_async<T, kBK, D, LDS, kThreads>(sV, vg, p.v_ss, n0, p.n_k, tid);
  dev::load_tile_async<T, BQ, D, LDS, kThreads>(sQ, qg, p.q_ss, qt_begin * BQ, p.n_q, tid);
  dev::load_tile_async<T, BQ, D, LDS, kThreads>(sdO, dog, p.do_ss, qt_begin * BQ, p.n_q, tid);
  dev::cp_async_commit();
  load_row_stats<BQ>(s_lse2, s_delta, lseg, dlg, qt_begin * BQ, p.n_q, tid);

  const int kw = warp * 16;  // this warp's keys inside the tile (rows of S^T)
  const int key0 = n0 + kw + g, key1 = key0 + 8;
  float dk[NT_D][4], dv[NT_D][4];
#pragma unroll
  for (int nt = 0; nt < NT_D; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.f;
  }

  for (int qt = qt_begin; qt < qt_end; ++qt) {
    const int q0 = qt * BQ;
    dev::cp_async_wait_all();
    __syncthreads();  // Q / dO tile and row stats in place; every warp is done with the previous dS^T

    // S^T = K Q^T and dP^T = V dO^T: 16 keys x BQ queries per warp
    float st[NT_Q][4], dpt[NT_Q][4];
#pragma unroll
    for (int nt = 0; nt < NT_Q; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t ka[4], va[4];
      const int arow = kw + (lane & 15), acol = ks * 16 + (lane >> 4) * 8;
      dev::ldmatrix_x4(ka[0], ka[1], ka[2], ka[3], dev::smem_addr(sK + arow * LDS + acol));
      dev::ldmatrix_x4(va[0], va[1], va[2], va[3], dev::smem_addr(sV + arow * LDS + acol));
#pragma unroll
      for (int np = 0; np < BQ / 16; ++np) {
        uint32_t b0, b1, b2, b3;
        const int brow = np * 16 + (lane & 7) + (lane >> 4) * 8;
        const int bcol = ks * 16 + ((lane >> 3) & 1) * 8;
        dev::ldmatrix_x4(b0, b1, b2, b3, dev::smem_addr(sQ + brow * LDS + bcol));
        Mma<T>::run(st[2 * np], ka, b0, b1);
        Mma<T>::run(st[2 * np + 1], ka, b2, b3);
        dev::ldmatrix_x4(b0, b1, b2, b3, dev::smem_addr(sdO + brow * LDS + bcol));
        Mma<T>::run(dpt[2 * np], va, b0, b1);
        Mma<T>::run(dpt[2 * np + 1], va, b2, b3);
      }
    }

    // P^T and dS^T (without the softmax scale, applied to dK and dQ at the end)
    const bool need_mask = (n0 + kBK > p.n_k) || (p.causal && n0 + kBK - 1 > q0 + p.causal_offset);
#pragma unroll
    for (int nt = 0; nt < NT_Q; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = nt * 8 + 2 * t4 + (e & 1);
        float pv = dev::ex2(st[nt][e] * p.scale_log2 - s_lse2[qi]);
        if (need_mask) {
          const int key = (e < 2) ? key0 : key1;
          if (key >= p.n_k || (p.causal && key > q0 + qi + p.causal_offset)) pv = 0.f;
        }
        st[nt][e] = pv;
        dpt[nt][e] = pv * (dpt[nt][e] - s_delta[qi]);
      }
    }

    // dV += P^T dO, dK += dS^T Q
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      uint32_t pa[4], da[4];
      pa[0] = Mma<T>::pack(st[2 * kk][0], st[2 * kk][1]);
      pa[1] = Mma<T>::pack(st[2 * kk][2], st[2 * kk][3]);
      pa[2] = Mma<T>::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]);
      pa[3] = Mma<T>::pack(st[2 * kk + 1][2], st[2 * kk + 1][3]);
      da[0] = Mma<T>::pack(dpt[2 * kk][0], dpt[2 * kk][1]);
      da[1] = Mma<T>::pack(dpt[2 * kk][2], dpt[2 * kk][3]);
      da[2] = Mma<T>::pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
      da[3] = Mma<T>::pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b0, b1, b2, b3;
        const int brow = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int bcol = dp * 16 + (lane >> 4) * 8;
        dev::ldmatrix_x4_trans(b0, b1, b2, b3, dev::smem_addr(sdO + brow * LDS + bcol));
        Mma<T>::run(dv[2 * dp], pa, b0, b1);
        Mma<T>::run(dv[2 * dp + 1], pa, b2, b3);
        dev::ldmatrix_x4_trans(b0, b1, b2, b3, dev::smem_addr(sQ + brow * LDS + bcol));
        Mma<T>::run(dk[2 * dp], da, b0, b1);
        Mma<T>::run(dk[2 * dp + 1], da, b2, b3);
      }
    }

    // dS^T to shared memory for dQ (all 64 keys of the tile contribute to every query row)
#pragma unroll
    for (int nt = 0; nt < NT_Q; ++nt) {
      const int c = nt * 8 + 2 * t4;
      *reinterpret_cast<uint32_t*>(sdS + (kw + g) * LDS_DS + c) = Mma<T>::pack(dpt[nt][0], dpt[nt][1]);
      *reinterpret_cast<uint32_t*>(sdS + (kw + g + 8) * LDS_DS + c) = Mma<T>::pack(dpt[nt][2], dpt[nt][3]);
    }
    __syncthreads();  // dS^T complete; every warp is done with sQ, sdO and the row stats of this tile

    if (qt + 1 < qt_end) {  // next query tile streams in while dQ is computed
      dev::load_tile_async<T, BQ, D, LDS, kThreads>(sQ, qg, p.q_ss, q0 + BQ, p.n_q, tid);
      dev::load_tile_async<T, BQ, D, LDS, kThreads>(sdO, dog, p.do_ss, q0 + BQ, p.n_q, tid);
      dev::cp_async_commit();
      load_row_stats<BQ>(s_lse2, s_delta, lseg, dlg, q0 + BQ, p.n_q, tid);
    }

    // dQ[BQ x D] += dS[BQ x 64] K[64 x D] * scale; warp (wq, wd) owns rows wq*16.. and columns wd*DW..
    {
      const int wq = warp % WQ, wd = warp / WQ;
      float dqa[DW / 8][4];
#pragma unroll
      for (int nt = 0; nt < DW / 8; ++nt) dqa[nt][0] = dqa[nt][1] = dqa[nt][2] = dqa[nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        uint32_t a[4];
        const int arow = kk * 16 + (lane & 7) + (lane >> 4) * 8;  // keys (rows of dS^T)
        const int acol = wq * 16 + ((lane >> 3) & 1) * 8;        // queries
        dev::ldmatrix_x4_trans(a[0], a[1], a[2], a[3], dev::smem_addr(sdS + arow * LDS_DS + acol));
#pragma unroll
        for (int dp = 0; dp < DW / 16; ++dp) {
          uint32_t b0, b1, b2, b3;
          const int brow = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          const int bcol = wd * DW + dp * 16 + (lane >> 4) * 8;
          dev::ldmatrix_x4_trans(b0, b1, b2, b3, dev::smem_addr(sK + brow * LDS + bcol));
          Mma<T>::run(dqa[2 * dp], a, b0, b1);
          Mma<T>::run(dqa[2 * dp + 1], a, b2, b3);
        }
      }
      const int row0 = q0 + wq * 16 + g, row1 = row0 + 8;
#pragma unroll
      for (int nt = 0; nt < DW / 8; ++nt) {
        const int c = wd * DW + nt * 8 + 2 * t4;
        if (row0 < p.n_q) atomic_add2(dqg + row0 * p.dq_ss + c, dqa[nt][0] * p.scale, dqa[nt][1] * p.scale);
        if (row1 < p.n_q) atomic_add2(dqg + row1 * p.dq_ss + c, dqa[nt][2] * p.scale, dqa[nt][3] * p.scale);
      }
    }
  }

#pragma unroll
  for (int nt = 0; nt < NT_D; ++nt) {
    const int c = nt * 8 + 2 * t4;
    if (key0 < p.n_k) {
      atomic_add2(dkg + key0 * p.dk_ss + c, dk[nt][0] * p.scale, dk[nt][1] * p.scale);
      atomic_add2(dvg + key0 * p.dv_ss + c, dv[nt][0], dv[nt][1]);
    }
    if (key1 < p.n_k) {
      atomic_add2(dkg + key1 * p.dk_ss + c, dk[nt][2] * p.scale, dk[nt][3] * p.scale);
      atomic_add2(dvg + key1 * p.dv_ss + c, dv[nt][2], dv[nt][3]);
    }
  }
}

struct PreParams {
  const void* out;
  int64_t o_sb, o_sh, o_ss;
  const void* dout;
  int64_t do_sb, do_sh, do_ss;
  float* delta;
  int64_t dl_sb, dl_sh;
  int h, n_q, d;
  int64_t rows;
};

// delta = rowsum(dout * out) in fp32, one warp per row
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_preprocess_kernel(const PreParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= p.rows) return;
  const int i = static_cast<int>(row % p.n_q);
  const int64_t bh = row / p.n_q;
  const int64_t bi = bh / p.h, hi = bh % p.h;
  const T* o = static_cast<const T*>(p.out) + bi * p.o_sb + hi * p.o_sh + i * p.o_ss;
  const T* d = static_cast<const T*>(p.dout) + bi * p.do_sb + hi * p.do_sh + i * p.do_ss;
  float acc = 0.f;
  for (int c = lane; c < p.d; c += 32) acc += dev::to_float<T>(o[c]) * dev::to_float<T>(d[c]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) p.delta[bi * p.dl_sb + hi * p.dl_sh + i] = acc;
}

template <typename T, int D, int BQ>
cudaError_t launch_bwd(const BwdParams& p, int b, cudaStream_t stream) {
  const size_t smem = (static_cast<size_t>(2 * kBK + 2 * BQ) * (D + kPad) + static_cast<size_t>(kBK) * (BQ + kPad)) *
                          sizeof(T) +
                      2 * BQ * sizeof(float);
  cudaError_t err = cudaFuncSetAttribute(bwd_step_kernel<T, D, BQ>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid((p.n_k + kBK - 1) / kBK, b * p.h);
  bwd_step_kernel<T, D, BQ><<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// query tile: 64 rows for d = 64; 32 for d = 128 (keeps dK, dV, S^T and dP^T in registers without spilling)
template <typename T>
cudaError_t dispatch_bwd_dim(const BwdParams& p, int b, int d, cudaStream_t stream) {
  switch (d) {
    case 64: return launch_bwd<T, 64, 64>(p, b, stream);
    case 128: return launch_bwd<T, 128, 32>(p, b, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t bwd_preprocess(DType dtype, const Shape& shape, Strided out, Strided dout, Strided delta,
                           cudaStream_t stream) {
  PreParams p;
  p.out = out.ptr;
  p.o_sb = out.sb, p.o_sh = out.sh, p.o_ss = out.ss;
  p.dout = dout.ptr;
  p.do_sb = dout.sb, p.do_sh = dout.sh, p.do_ss = dout.ss;
  p.delta = static_cast<float*>(delta.ptr);
  p.dl_sb = delta.sb, p.dl_sh = delta.sh;
  return launch_rowwise(dtype, shape, p, kThreads, [&](auto t, dim3 grid) {
    bwd_preprocess_kernel<decltype(t)><<<grid, kThreads, 0, stream>>>(p);
  });
}

cudaError_t bwd_step(DType dtype, const Shape& shape, Mode mode, float scale, Strided q, Strided k, Strided v,
                     Strided dout, Strided lse, Strided delta, Strided dq, Strided dk, Strided dv,
                     cudaStream_t stream) {
  StepRange range;
  if (cudaError_t err = step_range(dtype, shape, mode, &range); err != cudaSuccess) return err;
  const int q_begin = range.q_begin, n_q = range.n_q, n_k = range.n_k, causal = range.causal, offset = range.offset;
  if (shape.b <= 0 || n_q <= 0 || n_k <= 0) return cudaSuccess;
  BwdParams p;
  p.q = static_cast<const char*>(q.ptr) + q_begin * q.ss * 2;
  p.k = k.ptr;
  p.v = v.ptr;
  p.dout = static_cast<const char*>(dout.ptr) + q_begin * dout.ss * 2;
  p.q_sb = q.sb, p.q_sh = q.sh, p.q_ss = q.ss;
  p.k_sb = k.sb, p.k_sh = k.sh, p.k_ss = k.ss;
  p.v_sb = v.sb, p.v_sh = v.sh, p.v_ss = v.ss;
  p.do_sb = dout.sb, p.do_sh = dout.sh, p.do_ss = dout.ss;
  p.lse = static_cast<const float*>(lse.ptr) + q_begin;
  p.lse_sb = lse.sb, p.lse_sh = lse.sh;
  p.delta = static_cast<const float*>(delta.ptr) + q_begin;
  p.dl_sb = delta.sb, p.dl_sh = delta.sh;
  p.dq = static_cast<float*>(dq.ptr) + q_begin * dq.ss;
  p.dq_sb = dq.sb, p.dq_sh = dq.sh, p.dq_ss = dq.ss;
  p.dk = static_cast<float*>(dk.ptr);
  p.dk_sb = dk.sb, p.dk_sh = dk.sh, p.dk_ss = dk.ss;
  p.dv = static_cast<float*>(dv.ptr);
  p.dv_sb = dv.sb, p.dv_sh = dv.sh, p.dv_ss = dv.ss;
  p.h = shape.h;
  p.group = shape.h / shape.h_kv;
  p.n_q = n_q;
  p.n_k = n_k;
  p.causal = causal;
  p.causal_offset = offset;
  p.scale = scale;
  p.scale_log2 = scale * dev::kLog2e;
  return dtype == DType::kBFloat16 ? dispatch_bwd_dim<__nv_bfloat16>(p, shape.b, shape.d, stream)
                                   : dispatch_bwd_dim<__half>(p, shape.b, shape.d, stream);
}

}  // namespace msp_ops
