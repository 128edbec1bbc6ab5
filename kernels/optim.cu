// SPDX-License-Identifier: MIT
// Multi-tensor AdamW and Lion on typed buffers: grid.y walks the tensors of
// the table, x their elements. Every value is loaded in its own dtype,
// updated in fp32 exactly as the host backend does, and stored back rounded
// to nearest even. Hyperparameters and the step count are read from the
// group's GroupScalars on the device, so a captured graph picks up changes;
// a set skip flag (a gradient held NaN/Inf) makes the kernels write nothing.
#include "kernels/common.cuh"

namespace dion::kernels {

namespace {

__global__ void adamw_kernel(const TensorEntry* list, int64_t count, const GroupScalars* gs, float eps, bool cautious,
                             const int32_t* skip) {
  if (skip && *skip) return;
  const float lr = static_cast<float>(gs->lr), wd = static_cast<float>(gs->weight_decay);
  const float b1 = static_cast<float>(gs->beta1), b2 = static_cast<float>(gs->beta2);
  // Bias corrections in double from the step count, then used as float.
  const double t = static_cast<double>(gs->step);
  const float bc1 = static_cast<float>(1.0 - pow(gs->beta1, t));
  const float bc2 = static_cast<float>(1.0 - pow(gs->beta2, t));
  const float step = lr / bc1, sbc2 = sqrtf(bc2), lwd = lr * wd;
  for (int64_t e = blockIdx.y; e < count; e += gridDim.y) {
    const TensorEntry& te = list[e];
    const dion_dtype_t dx = static_cast<dion_dtype_t>(te.dtype[kParam]), dg = static_cast<dion_dtype_t>(te.dtype[kGrad]);
    const dion_dtype_t dm = static_cast<dion_dtype_t>(te.dtype[kState0]);
    const dion_dtype_t dv = static_cast<dion_dtype_t>(te.dtype[kState1]);
    void *px = te.ptr[kParam], *pm = te.ptr[kState0], *pv = te.ptr[kState1];
    const void* pg = te.ptr[kGrad];
    const int64_t n = te.n;
    int64_t i0 = 0;
    // All-fp32 tensors with 16-byte aligned buffers: four elements per
    // thread with vector loads (the kernel is bound by memory bandwidth).
    // The arithmetic is the scalar path's, element by element.
    if (dx == DION_DTYPE_FP32 && dg == DION_DTYPE_FP32 && dm == DION_DTYPE_FP32 && dv == DION_DTYPE_FP32 &&
        ((reinterpret_cast<uintptr_t>(px) | reinterpret_cast<uintptr_t>(pg) | reinterpret_cast<uintptr_t>(pm) |
          reinterpret_cast<uintptr_t>(pv)) & 15) == 0) {
      const int64_t n4 = n / 4;
      float4* x4 = static_cast<float4*>(px);
      float4* m4 = static_cast<float4*>(pm);
      float4* v4 = static_cast<float4*>(pv);
      const float4* g4 = static_cast<const float4*>(pg);
      for (int64_t j = global_thread(); j < n4; j += grid_threads()) {
        float4 g = g4[j], m = m4[j], v = v4[j], x = x4[j];
        float* gp = &g.x;
        float* mp = &m.x;
        float* vp = &v.x;
        float* xp = &x.x;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float mi = mp[k] + (1.0f - b1) * (gp[k] - mp[k]);
          const float vi = b2 * vp[k] + (1.0f - b2) * gp[k] * gp[k];
          const float xo = xp[k];
          float xi;
          if (cautious)
            xi = (mi * xo >= 0.0f) ? xo - lwd * xo : xo;
          else
            xi = xo * (1.0f - lwd);
          mp[k] = mi;
          vp[k] = vi;
          xp[k] = xi - step * mi / (sqrtf(vi) / sbc2 + eps);
        }
        m4[j] = m;
        v4[j] = v;
        x4[j] = x;
      }
      i0 = n4 * 4;
    }
    for (int64_t i = i0 + global_thread(); i < n; i += grid_threads()) {
      const float g = load_elem(pg, dg, i);
      const float m0 = load_elem(pm, dm, i), v0 = load_elem(pv, dv, i);
      const float xo = load_elem(px, dx, i);
      const float mi = m0 + (1.0f - b1) * (g - m0);
      const float vi = b2 * v0 + (1.0f - b2) * g * g;
      store_elem(pm, dm, i, mi);
      store_elem(pv, dv, i, vi);
      float xi;
      if (cautious)
        xi = (mi * xo >= 0.0f) ? xo - lwd * xo : xo;
      else
        xi = xo * (1.0f - lwd);
      store_elem(px, dx, i, xi - step * mi / (sqrtf(vi) / sbc2 + eps));
    }
  }
}

__global__ void lion_kernel(const TensorEntry* list, int64_t count, const GroupScalars* gs, bool cautious,
                            const int32_t* skip) {
  if (skip && *skip) return;
  const float lr = static_cast<float>(gs->lr), wd = static_cast<float>(gs->weight_decay);
  const float b1 = static_cast<float>(gs->beta1), b2 = static_cast<float>(gs->beta2);
  const float lwd = lr * wd;
  for (int64_t e = blockIdx.y; e < count; e += gridDim.y) {
    const TensorEntry& te = list[e];
    const dion_dtype_t dx = static_cast<dion_dtype_t>(te.dtype[kParam]), dg = static_cast<dion_dtype_t>(te.dtype[kGrad]);
    const dion_dtype_t dm = static_cast<dion_dtype_t>(te.dtype[kState0]);
    void *px = te.ptr[kParam], *pm = te.ptr[kState0];
    const void* pg = te.ptr[kGrad];
    const int64_t n = te.n;
    for (int64_t i = global_thread(); i < n; i += grid_threads()) {
      const float g = load_elem(pg, dg, i), m0 = load_elem(pm, dm, i);
      const float c = b1 * m0 + (1.0f - b1) * g;
      const float u = static_cast<float>((c > 0.0f) - (c < 0.0f));
      store_elem(pm, dm, i, b2 * m0 + (1.0f - b2) * g);
      float xi = load_elem(px, dx, i);
      if (cautious)
        xi = (xi * u >= 0.0f) ? xi - lwd * xi : xi;
      else
        xi *= 1.0f - lwd;
      store_elem(px, dx, i, xi - lr * u);
    }
  }
}

}  // namespace

void adamw(const Ctx& c, const TensorEntry* list, int64_t count, int64_t max_n, const GroupScalars* gs, float eps,
           bool cautious, const int32_t* skip) {
  if (count <= 0 || max_n <= 0) return;
  adamw_kernel<<<grid_multi(c, count, max_n), kThreads, 0, c.stream>>>(list, count, gs, eps, cautious, skip);
  cuda::check_launch("adamw kernel");
}

void lion(const Ctx& c, const TensorEntry* list, int64_t count, int64_t max_n, const GroupScalars* gs, bool cautious,
          const int32_t* skip) {
  if (count <= 0 || max_n <= 0) return;
  lion_kernel<<<grid_multi(c, count, max_n), kThreads, 0, c.stream>>>(list, count, gs, cautious, skip);
  cuda::check_launch("lion kernel");
}

}  // namespace dion::kernels
