// Torch binding of the fused ring-attention kernels: argument checks, the current stream and device, and the
// translation of tensors into (pointer, strides). The kernels themselves live in the .cu files, which include only
// CUDA headers (so CI compile-checks them with nvcc alone). Layouts and the running state: ring_attn.h.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <initializer_list>

#include "ring_attn.h"

namespace {

using msp_ops::DType;
using msp_ops::Mode;
using msp_ops::Shape;
using msp_ops::Strided;

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, name, ": dtype ", t.scalar_type(), " is not supported (float32, float16, bfloat16)");
  }
  return DType::kFloat32;
}

DType half_dtype(const at::Tensor& t, const char* name) {
  const DType dt = dtype_of(t, name);
  TORCH_CHECK(dt != DType::kFloat32, name, " must be float16 or bfloat16, got ", t.scalar_type());
  return dt;
}

bool stride_ok(const at::Tensor& t, int dim, int64_t multiple) {
  return t.size(dim) <= 1 || t.stride(dim) % multiple == 0;  // a size-1 dim's stride is never used
}

// align: bytes the base pointer must be aligned to; vec: elements every outer stride must be a multiple of
Strided strided(const at::Tensor& t, const char* name, int dims, at::Device device, int64_t align = 1,
                int64_t vec = 1) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.dim() == dims, name, " must be ", dims, "-d (", dims == 4 ? "[b, h, s, d]" : "[b, h, s]",
              "), got shape ", t.sizes());
  TORCH_CHECK(t.stride(dims - 1) == 1 || t.size(dims - 1) <= 1, name,
              " must have a contiguous last dimension, got strides ", t.strides());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0, name, " must be ", align,
              "-byte aligned (pass a contiguous tensor)");
  for (int i = 0; i < dims - 1; ++i) {
    TORCH_CHECK(stride_ok(t, i, vec), name, ": stride ", t.stride(i), " of dim ", i, " must be a multiple of ",
                vec, " elements (pass a contiguous tensor)");
  }
  return Strided{t.data_ptr(), t.stride(0), t.stride(1), dims == 4 ? t.stride(2) : 1};
}

void check_fp32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef want) {
  TORCH_CHECK(t.sizes() == want, name, " must have shape ", want, ", got ", t.sizes());
}

Mode mode_of(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 3, "mode must be 0 (full), 1 (causal), 2 (kv first half) or 3 (q second half), "
              "got ", mode);
  return static_cast<Mode>(mode);
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "msparallel_ds ops: ", what, " failed: ", cudaGetErrorString(err));
}

// q [b, h, s_q, d], k/v [b, h_kv, s_k, d]: the shared shape checks of the forward and backward steps
Shape qkv_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-d [b, h, s, d]");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "q ", q.sizes(), " and k ", k.sizes(),
              " must share batch and head dim");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "q heads (", q.size(1), ") must be a multiple of kv heads (",
              k.size(1), ")");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v dtypes differ: ",
              q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(msp_ops::head_dim_supported(static_cast<int>(q.size(3))), "head dim ", q.size(3),
              " has no fused kernel (64 or 128)");
  return Shape{static_cast<int>(q.size(0)), static_cast<int>(q.size(1)), static_cast<int>(k.size(1)),
               static_cast<int>(q.size(2)), static_cast<int>(k.size(2)), static_cast<int>(q.size(3))};
}

void fwd_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& acc, at::Tensor& m,
              at::Tensor& l, int64_t mode, double scale) {
  const Shape s = qkv_shape(q, k, v);
  const DType dt = half_dtype(q, "q");
  const at::Device dev = q.device();
  check_fp32(acc, "acc");
  check_fp32(m, "m");
  check_fp32(l, "l");
  check_shape(acc, "acc", q.sizes());
  check_shape(m, "m", {s.b, s.h, s.s_q});
  check_shape(l, "l", {s.b, s.h, s.s_q});
  TORCH_CHECK(m.strides() == l.strides(), "m and l must have the same strides");
  const Strided sq = strided(q, "q", 4, dev, 16, 8), sk = strided(k, "k", 4, dev, 16, 8),
                sv = strided(v, "v", 4, dev, 16, 8), sacc = strided(acc, "acc", 4, dev, 8, 2),
                sm = strided(m, "m", 3, dev), sl = strided(l, "l", 3, dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_cuda(msp_ops::fwd_step(dt, s, mode_of(mode), static_cast<float>(scale), sq, sk, sv, sacc, sm, sl,
                               c10::cuda::getCurrentCUDAStream()),
             "fwd_step");
}

void finalize(const at::Tensor& acc, const at::Tensor& m, const at::Tensor& l, at::Tensor& out, at::Tensor& lse) {
  const at::Device dev = acc.device();
  check_fp32(acc, "acc");
  check_fp32(m, "m");
  check_fp32(l, "l");
  check_fp32(lse, "lse");
  TORCH_CHECK(acc.dim() == 4, "acc must be 4-d [b, h, s, d]");
  const Shape s{static_cast<int>(acc.size(0)), static_cast<int>(acc.size(1)), 1, static_cast<int>(acc.size(2)), 0,
                static_cast<int>(acc.size(3))};
  check_shape(out, "out", acc.sizes());
  check_shape(m, "m", {s.b, s.h, s.s_q});
  check_shape(l, "l", {s.b, s.h, s.s_q});
  check_shape(lse, "lse", {s.b, s.h, s.s_q});
  const Strided sa = strided(acc, "acc", 4, dev), sm = strided(m, "m", 3, dev), sl = strided(l, "l", 3, dev),
                so = strided(out, "out", 4, dev), slse = strided(lse, "lse", 3, dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_cuda(msp_ops::finalize(dtype_of(out, "out"), s, sa, sm, sl, so, slse, c10::cuda::getCurrentCUDAStream()),
             "finalize");
}

void bwd_preprocess(const at::Tensor& out, const at::Tensor& dout, at::Tensor& delta) {
  const at::Device dev = out.device();
  TORCH_CHECK(out.dim() == 4, "out must be 4-d [b, h, s, d]");
  check_shape(dout, "dout", out.sizes());
  TORCH_CHECK(out.scalar_type() == dout.scalar_type(), "out and dout dtypes differ: ", out.scalar_type(), ", ",
              dout.scalar_type());
  check_fp32(delta, "delta");
  const Shape s{static_cast<int>(out.size(0)), static_cast<int>(out.size(1)), 1, static_cast<int>(out.size(2)), 0,
                static_cast<int>(out.size(3))};
  check_shape(delta, "delta", {s.b, s.h, s.s_q});
  const Strided so = strided(out, "out", 4, dev), sd = strided(dout, "dout", 4, dev),
                sdl = strided(delta, "delta", 3, dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_cuda(msp_ops::bwd_preprocess(dtype_of(out, "out"), s, so, sd, sdl, c10::cuda::getCurrentCUDAStream()),
             "bwd_preprocess");
}

void bwd_step(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
              int64_t mode, double scale) {
  const Shape s = qkv_shape(q, k, v);
  const DType dt = half_dtype(q, "q");
  const at::Device dev = q.device();
  TORCH_CHECK(dout.scalar_type() == q.scalar_type(), "dout must have q's dtype ", q.scalar_type(), ", got ",
              dout.scalar_type());
  check_shape(dout, "dout", q.sizes());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&lse, &delta, &dq, &dk, &dv}) check_fp32(*t, "lse, delta, dq, dk and dv");
  check_shape(lse, "lse", {s.b, s.h, s.s_q});
  check_shape(delta, "delta", {s.b, s.h, s.s_q});
  check_shape(dq, "dq", q.sizes());
  check_shape(dk, "dk", k.sizes());
  check_shape(dv, "dv", k.sizes());
  const Strided sq = strided(q, "q", 4, dev, 16, 8), sk = strided(k, "k", 4, dev, 16, 8),
                sv = strided(v, "v", 4, dev, 16, 8), sdo = strided(dout, "dout", 4, dev, 16, 8),
                slse = strided(lse, "lse", 3, dev), sdl = strided(delta, "delta", 3, dev),
                sdq = strided(dq, "dq", 4, dev, 8, 2), sdk = strided(dk, "dk", 4, dev, 8, 2),
                sdv = strided(dv, "dv", 4, dev, 8, 2);
  const c10::cuda::CUDAGuard guard(dev);
  check_cuda(msp_ops::bwd_step(dt, s, mode_of(mode), static_cast<float>(scale), sq, sk, sv, sdo, slse, sdl, sdq, sdk,
                               sdv, c10::cuda::getCurrentCUDAStream()),
             "bwd_step");
}

void merge(at::Tensor& acc_out, const at::Tensor& acc_lse, const at::Tensor& out, const at::Tensor& lse,
           at::Tensor& new_lse) {
  const at::Device dev = acc_out.device();
  check_fp32(acc_out, "acc_out");
  check_fp32(acc_lse, "acc_lse");
  check_fp32(lse, "lse");
  check_fp32(new_lse, "new_lse");
  TORCH_CHECK(acc_out.dim() == 4, "acc_out must be 4-d [b, h, s, d]");
  const Shape s{static_cast<int>(acc_out.size(0)), static_cast<int>(acc_out.size(1)), 1,
                static_cast<int>(acc_out.size(2)), 0, static_cast<int>(acc_out.size(3))};
  check_shape(out, "out", acc_out.sizes());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&acc_lse, &lse, &new_lse}) check_shape(*t, "acc_lse, lse and new_lse", {s.b, s.h, s.s_q});
  const Strided sa = strided(acc_out, "acc_out", 4, dev), sal = strided(acc_lse, "acc_lse", 3, dev),
                so = strided(out, "out", 4, dev), sl = strided(lse, "lse", 3, dev),
                snl = strided(new_lse, "new_lse", 3, dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_cuda(msp_ops::merge(dtype_of(out, "out"), s, sa, sal, so, sl, snl, c10::cuda::getCurrentCUDAStream()),
             "merge");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "msparallel_ds fused ring-attention kernels (CUDA, sm_80+); layouts in ops/ring_attn.h";
  mod.def("fwd_step", &fwd_step, "fold one k/v block into the fp32 running (acc, m, l) in place", py::arg("q"),
          py::arg("k"), py::arg("v"), py::arg("acc"), py::arg("m"), py::arg("l"), py::arg("mode"), py::arg("scale"));
  mod.def("finalize", &finalize, "out = acc / l, lse = (m + log2 l) ln 2", py::arg("acc"), py::arg("m"),
          py::arg("l"), py::arg("out"), py::arg("lse"));
  mod.def("bwd_preprocess", &bwd_preprocess, "delta = rowsum(dout * out) in fp32", py::arg("out"), py::arg("dout"),
          py::arg("delta"));
  mod.def("bwd_step", &bwd_step, "dq, dk, dv += one block's gradients (fp32, in place)", py::arg("dout"),
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lse"), py::arg("delta"), py::arg("dq"), py::arg("dk"),
          py::arg("dv"), py::arg("mode"), py::arg("scale"));
  mod.def("merge", &merge, "fold (out, lse) into fp32 (acc_out, acc_lse) in one pass", py::arg("acc_out"),
          py::arg("acc_lse"), py::arg("out"), py::arg("lse"), py::arg("new_lse"));
  mod.def("head_dim_supported", [](int64_t d) { return msp_ops::head_dim_supported(static_cast<int>(d)); },
          py::arg("d"));
}
