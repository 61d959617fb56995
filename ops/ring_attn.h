// Host API of the fused ring-attention kernels (msparallel_ds/ops). Plain C++ and CUDA runtime types only: this
// header is included by the .cu files (compiled by nvcc without torch) and by binding.cpp (the only torch file).
//
// Layout, for every tensor the kernels touch ("rows" = sequence positions):
//   q, out, dout, acc, dq      [b, h,    s_q, d]   element (bi, hi, i, c) at ptr[bi*sb + hi*sh + i*ss + c]
//   k, v, dk, dv               [b, h_kv, s_k, d]   same, with the kv head kvh = hi / (h / h_kv) (GQA, no repeat)
//   m, l, lse, delta           [b, h,    s_q]      element (bi, hi, i) at ptr[bi*sb + hi*sh + i]
// Strides are in elements and may be anything (views such as kv[0][:, :, :half] or q[:, :, half:] are fine) as long as
// the last dimension is contiguous. 16-bit tensors read with 16-byte vector copies need 16-byte aligned base pointers
// and strides that are multiples of 8 elements; fp32 state read with 8-byte vectors needs 8-byte alignment and even
// strides. binding.cpp checks all of it; the Python wrappers make a tensor contiguous when it does not hold.
//
// Running state of the forward (all fp32, owned by the caller, updated in place by fwd_step):
//   acc  sum_j exp2(s2_ij - m_i) * v_j   (unnormalised output)
//   m    running row max of s2_ij = (q_i . k_j) * scale * log2(e)   (log2 units; -inf before any visible key)
//   l    sum_j exp2(s2_ij - m_i)                                     (0 before any visible key)
// Start from acc = 0, m = -inf, l = 0. finalize: out = acc / l, lse = (m + log2 l) * ln 2 (natural log, what
// torch's flash kernels return); rows that never saw a key get out = 0, lse = -inf.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace msp_ops {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Which part of a (q block, k/v block) pair is computed. Causal is bottom-right aligned: key j is visible to query
// i iff j <= i + (s_k - s_q) (square blocks: the usual diagonal). The half modes are the zigzag ring's skipped
// blocks (ring.py): from an earlier rank only the first half of its keys is in the past; from a later rank only the
// second half of the local queries sees anything. Rows / keys outside the computed part are not touched.
enum class Mode : int { kFull = 0, kCausal = 1, kKvFirstHalf = 2, kQSecondHalf = 3 };

struct Strided {  // a [b, h, s, d] or [b, h, s] tensor; ss unused for the 3-d ones (unit stride on s)
  void* ptr;
  int64_t sb, sh, ss;
};

struct Shape {
  int b, h, h_kv, s_q, s_k, d;
};

// Head dims with a tensor-core kernel; anything else is refused (the Python side falls back to torch's kernels).
bool head_dim_supported(int d);

// One ring step: fold the k/v block into the running (acc, m, l) of the q block, in place. q/k/v in dtype
// (fp16 or bf16); acc fp32 [b, h, s_q, d]; m, l fp32 [b, h, s_q] (m and l share strides).
cudaError_t fwd_step(DType dtype, const Shape& shape, Mode mode, float scale, Strided q, Strided k, Strided v,
                     Strided acc, Strided m, Strided l, cudaStream_t stream);

// out[b, h, s_q, d] (out_dtype: fp32, fp16 or bf16) and lse[b, h, s_q] fp32 from the running state.
cudaError_t finalize(DType out_dtype, const Shape& shape, Strided acc, Strided m, Strided l, Strided out,
                     Strided lse, cudaStream_t stream);

// delta[b, h, s_q] fp32 = rowsum(dout * out), both in dtype (fp16 / bf16). Computed once per backward.
cudaError_t bwd_preprocess(DType dtype, const Shape& shape, Strided out, Strided dout, Strided delta,
                           cudaStream_t stream);

// Gradients of one block given the FINAL lse and delta: dq += (fp32, in place, atomics), dk += and dv += (fp32,
// in place, atomics: the q heads of one kv head add into it). Same modes as fwd_step.
cudaError_t bwd_step(DType dtype, const Shape& shape, Mode mode, float scale, Strided q, Strided k, Strided v,
                     Strided dout, Strided lse, Strided delta, Strided dq, Strided dk, Strided dv,
                     cudaStream_t stream);

// Fold a block's (out, lse) into the running (acc_out, acc_lse) in one pass, fp32 math:
//   new_lse = logaddexp(acc_lse, lse); acc_out = acc_out * exp(acc_lse - new_lse) + out * exp(lse - new_lse)
// acc_out fp32 updated in place; new_lse may alias acc_lse; out in out_dtype (fp32, fp16, bf16); any head dim.
// Rows where both lse are -inf get acc_out = 0 and new_lse = -inf (what kernels.merge does).
cudaError_t merge(DType out_dtype, const Shape& shape, Strided acc_out, Strided acc_lse, Strided out, Strided lse,
                  Strided new_lse, cudaStream_t stream);

}  // namespace msp_ops
