// Fused merge of a block's (out, lse) into a running fp32 (acc_out, acc_lse): one pass, fp32 math, in place. For
// the backends that return a block's (out, lse) (torch's flash / efficient kernels, head dims the step kernel does
// not cover); replaces kernels.merge's logaddexp + two exps + mul_ + addcmul_ (five launches, three passes over
// the [b, h, s, d] accumulator) with one launch and one pass.
#include <cmath>

#include "common.cuh"
#include "ring_attn.h"

namespace msp_ops {
namespace {

constexpr int kThreads = 128;

struct MergeParams {
  float* acc;
  int64_t a_sb, a_sh, a_ss;
  const float* acc_lse;
  int64_t al_sb, al_sh;
  const void* out;
  int64_t o_sb, o_sh, o_ss;
  const float* lse;
  int64_t l_sb, l_sh;
  float* new_lse;
  int64_t nl_sb, nl_sh;
  int h, n_q, d;
  int64_t rows;
};

// one warp per row: every lane reads both lse before lane 0 writes new_lse (which may alias acc_lse)
template <typename TO>
__global__ void __launch_bounds__(kThreads) merge_kernel(const MergeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= p.rows) return;
  const int i = static_cast<int>(row % p.n_q);
  const int64_t bh = row / p.n_q;
  const int64_t bi = bh / p.h, hi = bh % p.h;
  const float la = p.acc_lse[bi * p.al_sb + hi * p.al_sh + i];
  const float lb = p.lse[bi * p.l_sb + hi * p.l_sh + i];
  const float hi_l = fmaxf(la, lb), lo_l = fminf(la, lb);
  float new_lse, wa, wb;
  if (hi_l == -INFINITY) {  // nothing visible in either: stays empty (0, -inf), no NaN
    new_lse = -INFINITY;
    wa = wb = 0.f;
  } else {
    const float e = expf(lo_l - hi_l);  // in [0, 1]
    new_lse = hi_l + log1pf(e);
    const float w_hi = 1.f / (1.f + e), w_lo = e / (1.f + e);
    const bool a_is_hi = la >= lb;
    wa = a_is_hi ? w_hi : w_lo;
    wb = a_is_hi ? w_lo : w_hi;
  }
  __syncwarp();
  float* a = p.acc + bi * p.a_sb + hi * p.a_sh + i * p.a_ss;
  const TO* o = static_cast<const TO*>(p.out) + bi * p.o_sb + hi * p.o_sh + i * p.o_ss;
  for (int c = lane; c < p.d; c += 32) a[c] = a[c] * wa + dev::to_float<TO>(o[c]) * wb;
  if (lane == 0) p.new_lse[bi * p.nl_sb + hi * p.nl_sh + i] = new_lse;
}

}  // namespace

cudaError_t merge(DType out_dtype, const Shape& shape, Strided acc_out, Strided acc_lse, Strided out, Strided lse,
                  Strided new_lse, cudaStream_t stream) {
  MergeParams p;
  p.acc = static_cast<float*>(acc_out.ptr);
  p.a_sb = acc_out.sb, p.a_sh = acc_out.sh, p.a_ss = acc_out.ss;
  p.acc_lse = static_cast<const float*>(acc_lse.ptr);
  p.al_sb = acc_lse.sb, p.al_sh = acc_lse.sh;
  p.out = out.ptr;
  p.o_sb = out.sb, p.o_sh = out.sh, p.o_ss = out.ss;
  p.lse = static_cast<const float*>(lse.ptr);
  p.l_sb = lse.sb, p.l_sh = lse.sh;
  p.new_lse = static_cast<float*>(new_lse.ptr);
  p.nl_sb = new_lse.sb, p.nl_sh = new_lse.sh;
  return launch_rowwise(out_dtype, shape, p, kThreads, [&](auto t, dim3 grid) {
    merge_kernel<decltype(t)><<<grid, kThreads, 0, stream>>>(p);
  });
}

}  // namespace msp_ops
