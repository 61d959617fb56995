// Forward of one ring step (one local q block against one received k/v block), updating the fp32 running state
// (acc, m, l) in place, and the finalize kernel that turns the state into (out, lse). See ring_attn.h for the
// layout and the state's definition.
//
// Tiling (FlashAttention-2 style): a CTA of 4 warps owns 64 query rows of one head (16 rows per warp) and walks the
// visible keys in tiles of 64. Q, K and V tiles sit in shared memory (rows padded by 16 bytes: conflict-free
// ldmatrix), Q fragments stay in registers, S = Q K^T and O += P V run on tensor cores (mma.sync m16n8k16, fp32
// accumulate), the online softmax runs on S in registers in log2 units. The next K tile is copied (cp.async) while
// P V runs, the V tile while Q K^T runs. Causal tiles above the diagonal are never visited; a tile that no row of
// the CTA can see leaves the state untouched.
#include <cmath>

#include "common.cuh"
#include "ring_attn.h"

namespace msp_ops {
namespace {

constexpr int kBM = 64;  // query rows per CTA
constexpr int kBN = 64;  // keys per tile
constexpr int kThreads = 128;
constexpr int kPad = 8;  // 16 bytes of padding per shared-memory row

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss;
  float* acc;
  int64_t a_sb, a_sh, a_ss;
  float* m;
  int64_t m_sb, m_sh;
  float* l;
  int64_t l_sb, l_sh;
  int h, group;  // group = h / h_kv
  int n_q, n_k;  // rows and keys of the computed part
  int causal, causal_offset;  // causal: key j visible to row i iff j <= i + causal_offset
  float scale_log2;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) fwd_step_kernel(const FwdParams p) {
  using dev::Mma;
  constexpr int LDS = D + kPad;
  constexpr int KSTEPS = D / 16;  // k-steps of S = Q K^T
  constexpr int NT_S = kBN / 8;   // 8-wide n-tiles of S (keys)
  constexpr int NT_O = D / 8;     // 8-wide n-tiles of O (head dim)
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kBM * LDS;
  T* sV = sK + kBN * LDS;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int m0 = blockIdx.x * kBM;
  const int bi = blockIdx.y / p.h, hi = blockIdx.y % p.h, kvh = hi / p.group;

  const int last_row = min(m0 + kBM, p.n_q) - 1;
  int n_end = p.n_k;
  if (p.causal) n_end = min(n_end, last_row + 1 + p.causal_offset);
  if (n_end <= 0) return;  // no row of this tile sees any key of the block: the state stays as it is
  const int n_tiles = (n_end + kBN - 1) / kBN;

  const T* qg = static_cast<const T*>(p.q) + bi * p.q_sb + hi * p.q_sh;
  const T* kg = static_cast<const T*>(p.k) + bi * p.k_sb + kvh * p.k_sh;
  const T* vg = static_cast<const T*>(p.v) + bi * p.v_sb + kvh * p.v_sh;
  float* accg = p.acc + bi * p.a_sb + hi * p.a_sh;
  float* mg = p.m + bi * p.m_sb + hi * p.m_sh;
  float* lg = p.l + bi * p.l_sb + hi * p.l_sh;

  dev::load_tile_async<T, kBM, D, LDS, kThreads>(sQ, qg, p.q_ss, m0, p.n_q, tid);
  dev::load_tile_async<T, kBN, D, LDS, kThreads>(sK, kg, p.k_ss, 0, p.n_k, tid);
  dev::cp_async_commit();

  // running state of this thread's two rows (g and g + 8 of the warp's 16); l is kept as a per-thread partial sum
  // (the quad's four partials add up to the row's l) and reduced once at the end
  const int r0 = m0 + warp * 16 + g, r1 = r0 + 8;
  const bool ok0 = r0 < p.n_q, ok1 = r1 < p.n_q;
  float o[NT_O][4];
#pragma unroll
  for (int nt = 0; nt < NT_O; ++nt) {
    const int c = nt * 8 + 2 * t4;
    const float2 a = ok0 ? *reinterpret_cast<const float2*>(accg + r0 * p.a_ss + c) : make_float2(0.f, 0.f);
    const float2 b = ok1 ? *reinterpret_cast<const float2*>(accg + r1 * p.a_ss + c) : make_float2(0.f, 0.f);
    o[nt][0] = a.x;
    o[nt][1] = a.y;
    o[nt][2] = b.x;
    o[nt][3] = b.y;
  }
  float m_run[2] = {ok0 ? mg[r0] : -INFINITY, ok1 ? mg[r1] : -INFINITY};
  float l_part[2] = {(ok0 && t4 == 0) ? lg[r0] : 0.f, (ok1 && t4 == 0) ? lg[r1] : 0.f};

  uint32_t qf[KSTEPS][4];
  for (int t = 0; t < n_tiles; ++t) {
    const int n0 = t * kBN;
    dev::cp_async_wait_all();
    __syncthreads();  // K tile t (and Q) landed; every warp is done with V tile t-1
    if (t == 0) {
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        dev::ldmatrix_x4(qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3],
                         dev::smem_addr(sQ + (warp * 16 + (lane & 15)) * LDS + ks * 16 + (lane >> 4) * 8));
      }
    }
    dev::load_tile_async<T, kBN, D, LDS, kThreads>(sV, vg, p.v_ss, n0, p.n_k, tid);
    dev::cp_async_commit();

    // S = Q K^T for the warp's 16 rows x 64 keys
    float s[NT_S][4];
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
      for (int np = 0; np < NT_S / 2; ++np) {
        uint32_t b0, b1, b2, b3;
        const int key = np * 16 + (lane & 7) + (lane >> 4) * 8;
        const int col = ks * 16 + ((lane >> 3) & 1) * 8;
        dev::ldmatrix_x4(b0, b1, b2, b3, dev::smem_addr(sK + key * LDS + col));
        Mma<T>::run(s[2 * np], qf[ks], b0, b1);
        Mma<T>::run(s[2 * np + 1], qf[ks], b2, b3);
      }
    }

    // scale to log2 units; mask keys past the block and (causal) above the diagonal
    const bool need_mask = (n0 + kBN > p.n_k) || (p.causal && n0 + kBN - 1 > m0 + p.causal_offset);
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * p.scale_log2;
        if (need_mask) {
          const int key = n0 + nt * 8 + 2 * t4 + (e & 1);
          const int row = (e < 2) ? r0 : r1;
          if (key >= p.n_k || (p.causal && key > row + p.causal_offset)) x = -INFINITY;
        }
        s[nt][e] = x;
      }
    }

    // online softmax: new max, rescale the old state, probabilities in place of the scores
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < NT_S; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = dev::quad_max(mx);
      const float m_new = fmaxf(m_run[r], mx);
      const float m_use = (m_new == -INFINITY) ? 0.f : m_new;  // nothing visible yet: exp2(-inf - 0) = 0
      const float alpha = dev::ex2(m_run[r] - m_use);
      m_run[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT_S; ++nt) {
        s[nt][2 * r] = dev::ex2(s[nt][2 * r] - m_use);
        s[nt][2 * r + 1] = dev::ex2(s[nt][2 * r + 1] - m_use);
        sum += s[nt][2 * r] + s[nt][2 * r + 1];
      }
      l_part[r] = l_part[r] * alpha + sum;
#pragma unroll
      for (int nt = 0; nt < NT_O; ++nt) {
        o[nt][2 * r] *= alpha;
        o[nt][2 * r + 1] *= alpha;
      }
    }

    // P as A fragments (16 rows x 64 keys = 4 k-steps)
    uint32_t pa[kBN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      pa[kk][0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }

    dev::cp_async_wait_all();
    __syncthreads();  // V tile t landed; every warp is done reading K tile t
    if (t + 1 < n_tiles) {
      dev::load_tile_async<T, kBN, D, LDS, kThreads>(sK, kg, p.k_ss, n0 + kBN, p.n_k, tid);
      dev::cp_async_commit();
    }

    // O += P V
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b0, b1, b2, b3;
        const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = dp * 16 + (lane >> 4) * 8;
        dev::ldmatrix_x4_trans(b0, b1, b2, b3, dev::smem_addr(sV + key * LDS + col));
        Mma<T>::run(o[2 * dp], pa[kk], b0, b1);
        Mma<T>::run(o[2 * dp + 1], pa[kk], b2, b3);
      }
    }
  }

  const float l0 = dev::quad_sum(l_part[0]);
  const float l1 = dev::quad_sum(l_part[1]);
  if (t4 == 0) {
    if (ok0) {
      mg[r0] = m_run[0];
      lg[r0] = l0;
    }
    if (ok1) {
      mg[r1] = m_run[1];
      lg[r1] = l1;
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT_O; ++nt) {
    const int c = nt * 8 + 2 * t4;
    if (ok0) *reinterpret_cast<float2*>(accg + r0 * p.a_ss + c) = make_float2(o[nt][0], o[nt][1]);
    if (ok1) *reinterpret_cast<float2*>(accg + r1 * p.a_ss + c) = make_float2(o[nt][2], o[nt][3]);
  }
}

struct FinalizeParams {
  const float* acc;
  int64_t a_sb, a_sh, a_ss;
  const float* m;
  int64_t m_sb, m_sh;
  const float* l;
  int64_t l_sb, l_sh;
  void* out;
  int64_t o_sb, o_sh, o_ss;
  float* lse;
  int64_t lse_sb, lse_sh;
  int h, n_q, d;
  int64_t rows;  // b * h * n_q
};

// one warp per row
template <typename TO>
__global__ void __launch_bounds__(kThreads) finalize_kernel(const FinalizeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= p.rows) return;
  const int i = static_cast<int>(row % p.n_q);
  const int64_t bh = row / p.n_q;
  const int64_t bi = bh / p.h, hi = bh % p.h;
  const float mv = p.m[bi * p.m_sb + hi * p.m_sh + i];
  const float lv = p.l[bi * p.l_sb + hi * p.l_sh + i];
  const float inv = lv > 0.f ? 1.f / lv : 0.f;
  const float* a = p.acc + bi * p.a_sb + hi * p.a_sh + i * p.a_ss;
  TO* o = static_cast<TO*>(p.out) + bi * p.o_sb + hi * p.o_sh + i * p.o_ss;
  for (int c = lane; c < p.d; c += 32) o[c] = dev::from_float<TO>(a[c] * inv);
  if (lane == 0) p.lse[bi * p.lse_sb + hi * p.lse_sh + i] = lv > 0.f ? (mv + log2f(lv)) * dev::kLn2 : -INFINITY;
}

template <typename T, int D>
cudaError_t launch_fwd(const FwdParams& p, int b, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(kBM + 2 * kBN) * (D + kPad) * sizeof(T);
  cudaError_t err = cudaFuncSetAttribute(fwd_step_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid((p.n_q + kBM - 1) / kBM, b * p.h);
  fwd_step_kernel<T, D><<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_fwd_dim(const FwdParams& p, int b, int d, cudaStream_t stream) {
  switch (d) {
    case 64: return launch_fwd<T, 64>(p, b, stream);
    case 128: return launch_fwd<T, 128>(p, b, stream);
    default: return cudaErrorInvalidValue;
  }
}

inline const char* offset_ptr(const void* p, int64_t elements, int elem_size) {
  return static_cast<const char*>(p) + elements * elem_size;
}

}  // namespace

bool head_dim_supported(int d) { return d == 64 || d == 128; }

cudaError_t fwd_step(DType dtype, const Shape& shape, Mode mode, float scale, Strided q, Strided k, Strided v,
                     Strided acc, Strided m, Strided l, cudaStream_t stream) {
  StepRange range;
  if (cudaError_t err = step_range(dtype, shape, mode, &range); err != cudaSuccess) return err;
  const int q_begin = range.q_begin, n_q = range.n_q, n_k = range.n_k, causal = range.causal, offset = range.offset;
  if (shape.b <= 0 || n_q <= 0 || n_k <= 0) return cudaSuccess;  // nothing to compute
  FwdParams p;
  p.q = offset_ptr(q.ptr, q_begin * q.ss, 2);
  p.k = k.ptr;
  p.v = v.ptr;
  p.q_sb = q.sb, p.q_sh = q.sh, p.q_ss = q.ss;
  p.k_sb = k.sb, p.k_sh = k.sh, p.k_ss = k.ss;
  p.v_sb = v.sb, p.v_sh = v.sh, p.v_ss = v.ss;
  p.acc = static_cast<float*>(acc.ptr) + q_begin * acc.ss;
  p.a_sb = acc.sb, p.a_sh = acc.sh, p.a_ss = acc.ss;
  p.m = static_cast<float*>(m.ptr) + q_begin;
  p.m_sb = m.sb, p.m_sh = m.sh;
  p.l = static_cast<float*>(l.ptr) + q_begin;
  p.l_sb = l.sb, p.l_sh = l.sh;
  p.h = shape.h;
  p.group = shape.h / shape.h_kv;
  p.n_q = n_q;
  p.n_k = n_k;
  p.causal = causal;
  p.causal_offset = offset;
  p.scale_log2 = scale * dev::kLog2e;
  return dtype == DType::kBFloat16 ? dispatch_fwd_dim<__nv_bfloat16>(p, shape.b, shape.d, stream)
                                   : dispatch_fwd_dim<__half>(p, shape.b, shape.d, stream);
}

cudaError_t finalize(DType out_dtype, const Shape& shape, Strided acc, Strided m, Strided l, Strided out,
                     Strided lse, cudaStream_t stream) {
  FinalizeParams p;
  p.acc = static_cast<const float*>(acc.ptr);
  p.a_sb = acc.sb, p.a_sh = acc.sh, p.a_ss = acc.ss;
  p.m = static_cast<const float*>(m.ptr);
  p.m_sb = m.sb, p.m_sh = m.sh;
  p.l = static_cast<const float*>(l.ptr);
  p.l_sb = l.sb, p.l_sh = l.sh;
  p.out = out.ptr;
  p.o_sb = out.sb, p.o_sh = out.sh, p.o_ss = out.ss;
  p.lse = static_cast<float*>(lse.ptr);
  p.lse_sb = lse.sb, p.lse_sh = lse.sh;
  return launch_rowwise(out_dtype, shape, p, kThreads, [&](auto t, dim3 grid) {
    finalize_kernel<decltype(t)><<<grid, kThreads, 0, stream>>>(p);
  });
}

}  // namespace msp_ops
