// SPDX-License-Identifier: MIT
// Element-wise kernels: dtype conversions (single and multi-tensor), the
// non-finite check, the device-side step counters, the fp32 vector ops and
// the Muon family's fused momentum and update passes on typed buffers.
// The arithmetic is written as in the host backend, operation for operation;
// with -fmad=false (CMakeLists.txt) both give the same bits.
#include <cfloat>

#include "kernels/common.cuh"

namespace dion::kernels {

namespace {

template <dion_dtype_t DT>
__global__ void load_kernel(float* dst, const void* src, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) dst[i] = load_elem(src, DT, i);
}

// dst <- src over n elements, each converted from sdt to ddt as load_elem and
// store_elem convert it: chunks of eight elements per thread (16- or 32-byte
// accesses) where both are 16-byte aligned, element by element otherwise and
// past the last whole chunk; `op` maps each value on its way (the identity
// by default; dst may be src).
struct SameValue {
  __device__ __forceinline__ float operator()(float v) const { return v; }
};
template <class Op = SameValue>
__device__ __forceinline__ void convert_span(void* dst, dion_dtype_t ddt, const void* src, dion_dtype_t sdt,
                                             int64_t n, Op op = Op()) {
  int64_t i0 = 0;
  if (aligned16(src) && aligned16(dst)) {
    const int64_t n8 = n / 8;
    for (int64_t j = global_thread(); j < n8; j += grid_threads()) {
      float v[8];
      load8(src, sdt, j, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = op(v[k]);
      store8(dst, ddt, j, v);
    }
    i0 = n8 * 8;
  }
  for (int64_t i = i0 + global_thread(); i < n; i += grid_threads())
    store_elem(dst, ddt, i, op(load_elem(src, sdt, i)));
}

// dst (bf16 or fp16) <- src rounded, by chunks where aligned. (Element by
// element, the rounding of P for Dion's bf16 products ran at about half the
// copy bandwidth.)
template <dion_dtype_t DT>
__global__ void store_kernel(void* dst, const float* src, int64_t n) {
  convert_span(dst, DT, src, DION_DTYPE_FP32, n);
}

// hi = bf16(src), lo = bf16(src - hi) (Backend::split_bf16), eight elements
// per thread where all three are 16-byte aligned.
__global__ void split_bf16_kernel(uint16_t* hi, uint16_t* lo, const float* src, int64_t n) {
  int64_t i0 = 0;
  if (aligned16(src) && aligned16(hi) && aligned16(lo)) {
    const int64_t n8 = n / 8;
    for (int64_t j = global_thread(); j < n8; j += grid_threads()) {
      float v[8], r[8];
      load8(src, DION_DTYPE_FP32, j, v);
      uint32_t h[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        h[k] = half2_bits(v[2 * k], v[2 * k + 1], DION_DTYPE_BF16);
        r[2 * k] = v[2 * k] - __uint_as_float(h[k] << 16);
        r[2 * k + 1] = v[2 * k + 1] - __uint_as_float(h[k] & 0xffff0000u);
      }
      reinterpret_cast<uint4*>(hi)[j] = make_uint4(h[0], h[1], h[2], h[3]);
      store8(lo, DION_DTYPE_BF16, j, r);
    }
    i0 = n8 * 8;
  }
  for (int64_t i = i0 + global_thread(); i < n; i += grid_threads()) {
    const uint16_t h = float_to_bf16(src[i]);
    hi[i] = h;
    lo[i] = float_to_bf16(src[i] - bf16_to_float(h));
  }
}

// The typed loads and stores of whole batches move every element of the
// batch's tensors once: 8 elements per thread with 16-byte accesses when the
// tensor and its row of the fp32 buffer are both 16-byte aligned (the usual
// case: cudaMalloc'd tensors, n a multiple of 4), else element by element.
// DT: the buffer's dtype (fp32, or bf16 for load_multi_bf16, each element
// rounded as store(BF16) rounds it).
template <dion_dtype_t DT>
__global__ void load_multi_kernel(void* dst, const TensorEntry* list, int64_t count, int f, int64_t n) {
  constexpr int64_t dsize = DT == DION_DTYPE_FP32 ? 4 : 2;
  for (int64_t t = blockIdx.y; t < count; t += gridDim.y)
    convert_span(static_cast<char*>(dst) + t * n * dsize, DT, list[t].ptr[f],
                 static_cast<dion_dtype_t>(list[t].dtype[f]), n);
}

// src holds count x n elements of dtype sdt (fp32, or bf16 for store_multi_bf16).
__global__ void store_multi_kernel(const TensorEntry* list, int64_t count, int f, const void* src, dion_dtype_t sdt,
                                   int64_t n, const int32_t* skip) {
  if (skip && *skip) return;
  const int64_t ssize = sdt == DION_DTYPE_FP32 ? 4 : 2;
  for (int64_t t = blockIdx.y; t < count; t += gridDim.y)
    convert_span(list[t].ptr[f], static_cast<dion_dtype_t>(list[t].dtype[f]),
                 static_cast<const char*>(src) + t * n * ssize, sdt, n);
}

// Field f of each tensor x <- a x (Backend::scale_multi): convert_span in
// place, each value multiplied on its way.
struct ScaleBy {
  float a;
  __device__ __forceinline__ float operator()(float v) const { return a * v; }
};
__global__ void scale_multi_kernel(const TensorEntry* list, int64_t count, int f, int64_t n, float a,
                                   const int32_t* skip) {
  if (skip && *skip) return;
  for (int64_t t = blockIdx.y; t < count; t += gridDim.y) {
    const dion_dtype_t dt = static_cast<dion_dtype_t>(list[t].dtype[f]);
    convert_span(list[t].ptr[f], dt, list[t].ptr[f], dt, n, ScaleBy{a});
  }
}

// NaN/Inf test on the stored bits: the exponent is all ones.
__device__ __forceinline__ bool nonfinite_elem(const void* p, dion_dtype_t dt, int64_t i) {
  switch (dt) {
    case DION_DTYPE_BF16: return (static_cast<const uint16_t*>(p)[i] & 0x7f80u) == 0x7f80u;
    case DION_DTYPE_FP16: return (static_cast<const uint16_t*>(p)[i] & 0x7c00u) == 0x7c00u;
    default: return (float_bits(static_cast<const float*>(p)[i]) & 0x7f800000u) == 0x7f800000u;
  }
}

// The NaN/Inf test of four words (eight 16-bit values or four fp32 values)
// at once: the exponent field of every lane is compared with all ones.
__device__ __forceinline__ bool nonfinite_vec(uint4 v, dion_dtype_t dt) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool bad = false;
  if (dt == DION_DTYPE_FP32) {
#pragma unroll
    for (int j = 0; j < 4; ++j) bad |= (w[j] & 0x7f800000u) == 0x7f800000u;
  } else {
    const uint32_t e = dt == DION_DTYPE_BF16 ? 0x7f80u : 0x7c00u;
#pragma unroll
    for (int j = 0; j < 4; ++j) bad |= ((w[j] & e) == e) | (((w[j] >> 16) & e) == e);
  }
  return bad;
}

// A read of every gradient, so it runs at copy bandwidth: 16-byte loads over
// the aligned body of each tensor (cudaMalloc'd and framework buffers are),
// element loads for a misaligned head and the tail.
__global__ void check_nonfinite_kernel(const TensorEntry* list, int64_t count, int f, int32_t* flag) {
  for (int64_t t = blockIdx.y; t < count; t += gridDim.y) {
    const void* src = list[t].ptr[f];
    if (!src) continue;  // uniform over the block
    const dion_dtype_t dt = static_cast<dion_dtype_t>(list[t].dtype[f]);
    const int64_t n = list[t].n;
    const int64_t esz = dt == DION_DTYPE_FP32 ? 4 : 2;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(src);
    // elements before the first 16-byte boundary (the address is element-aligned)
    const int64_t lead = static_cast<int64_t>(((16 - (addr & 15)) & 15) / esz);
    const int64_t head = lead < n ? lead : n;
    const int64_t per_vec = 16 / esz;
    const int64_t nvec = (n - head) / per_vec;
    const uint4* body = reinterpret_cast<const uint4*>(static_cast<const char*>(src) + head * esz);
    int bad = 0;
    for (int64_t i = global_thread(); i < nvec; i += grid_threads()) bad |= nonfinite_vec(__ldcs(body + i), dt);
    const int64_t rest0 = head + nvec * per_vec;
    for (int64_t i = global_thread(); i < head + (n - rest0); i += grid_threads())
      bad |= nonfinite_elem(src, dt, i < head ? i : rest0 + (i - head));
    // Every writer stores the same value, so the result does not depend on order.
    if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
  }
}

__global__ void advance_step_kernel(GroupScalars* gs, const StepStatus* status) {
  if (!status->skip) ++gs->step;
}

__global__ void merge_skip_kernel(StepStatus* status) { status->skip |= status->skip_mesh; }

__global__ void count_skip_kernel(StepStatus* status) {
  if (status->skip) ++status->skipped_steps;
}

__global__ void axpby_kernel(float a, const float* x, float b, float* y, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) y[i] = a * y[i] + b * x[i];
}

__global__ void lincomb_kernel(float a, const float* x, float b, const float* y, float* z, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) z[i] = a * x[i] + b * y[i];
}

__global__ void nan_to_num_kernel(float* x, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const float v = x[i];
    if (isnan(v))
      x[i] = 0.0f;
    else if (isinf(v))
      x[i] = v > 0.0f ? FLT_MAX : -FLT_MAX;
  }
}

// One element of apply_update, shared by the fp32 kernel and the typed
// (multi-tensor) one so that both give the same bits.
struct Update {
  float lwd, decay, lr_adj;
  bool cautious;
  // lr and wd live on the device so a captured graph sees their updates.
  __device__ Update(const GroupScalars* gs, float lr_mult, bool cautious_) : cautious(cautious_) {
    const float lr = static_cast<float>(gs->lr), wd = static_cast<float>(gs->weight_decay);
    lwd = lr * wd;
    decay = 1.0f - lwd;
    lr_adj = lr * lr_mult;
  }
  __device__ __forceinline__ float operator()(float xi, float ui) const {
    if (cautious)
      xi = (xi * ui >= 0.0f) ? xi - lwd * xi : xi;
    else
      xi *= decay;
    return xi - lr_adj * ui;
  }
};

__global__ void apply_update_kernel(float* x, const float* u, int64_t n, const GroupScalars* gs, float lr_mult,
                                    bool cautious) {
  const Update op(gs, lr_mult, cautious);
  for (int64_t i = global_thread(); i < n; i += grid_threads()) x[i] = op(x[i], u[i]);
}

// ---- fused passes over typed buffers (Backend::momentum_multi, apply_update_multi) ----
// Laid out as load_multi / store_multi: grid.y walks the tensors, x their
// elements, 8 per thread with 16-byte accesses where every buffer of the
// tensor is 16-byte aligned, element by element otherwise. Each element goes
// through the fp32 operations of the calls they replace, in their order.

// axpby(mu, g, g_scale, m), then lincomb(mu, m, g_scale, g, u) or u = m.
struct Momentum {
  float mu, g_scale;
  bool nesterov;
  __device__ __forceinline__ float operator()(float& m, float g) const {
    m = mu * m + g_scale * g;
    return nesterov ? mu * m + g_scale * g : m;
  }
};

// Whether v, written in dtype dt, is nonzero: NaN counts, -0 does not (as
// nonzero_flags reads the written buffer).
__device__ __forceinline__ bool written_nonzero(float v, dion_dtype_t dt) { return round_to(dt, v) != 0.0f; }

// SUMS (u not null; Backend::momentum_multi_sums): also
// sumsq[t * gridDim.x + blockIdx.x] = the sum of the squares of the values
// block x wrote to tensor t's u (as written: rounded to u's dtype), each
// thread's in its order, then block_sum's fixed tree: the same on every run.
// A kernel of its own so the plain pass keeps its registers.
template <bool SUMS>
__global__ void momentum_multi_kernel(const TensorEntry* list, int64_t count, int64_t n, Momentum op, bool store_state,
                                      void* u, dion_dtype_t udt, const int32_t* skip, int32_t* nonzero,
                                      double* sumsq) {
  [[maybe_unused]] __shared__ double sh[SUMS ? 33 : 1];
  const int64_t usize = udt == DION_DTYPE_FP32 ? 4 : 2;
  const bool write = store_state && !(skip && *skip);  // uniform over the grid
  for (int64_t t = blockIdx.y; t < count; t += gridDim.y) {
    [[maybe_unused]] double ss = 0.0;
    bool any = false;  // an element of u != 0 (NaN counts as nonzero, -0 as zero)
    void* pm = list[t].ptr[kState0];
    const void* pg = list[t].ptr[kGrad];
    const dion_dtype_t dm = static_cast<dion_dtype_t>(list[t].dtype[kState0]);
    const dion_dtype_t dg = static_cast<dion_dtype_t>(list[t].dtype[kGrad]);
    // u null: M is the output (stored), its flags as written.
    void* ut = u ? static_cast<char*>(u) + t * n * usize : nullptr;
    int64_t i0 = 0;
    if (aligned16(pm) && aligned16(pg) && aligned16(ut)) {
      const int64_t n8 = n / 8;
      for (int64_t j = global_thread(); j < n8; j += grid_threads()) {
        float m[8], g[8], o[8];
        const Raw8 rm = load_raw8(pm, dm, j), rg = load_raw8(pg, dg, j);
        cvt8(rm, dm, m);
        cvt8(rg, dg, g);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          o[k] = op(m[k], g[k]);
          any = any || (ut ? written_nonzero(o[k], udt) : written_nonzero(m[k], dm));
          if constexpr (SUMS) {
            const double r = round_to(udt, o[k]);
            ss += r * r;
          }
        }
        if (write) store8(pm, dm, j, m);
        if (ut) store8(ut, udt, j, o);
      }
      i0 = n8 * 8;
    }
    for (int64_t i = i0 + global_thread(); i < n; i += grid_threads()) {
      float m = load_elem(pm, dm, i);
      const float o = op(m, load_elem(pg, dg, i));
      if (ut) store_elem(ut, udt, i, o);
      any = any || (ut ? written_nonzero(o, udt) : written_nonzero(m, dm));
      if constexpr (SUMS) {
        const double r = round_to(udt, o);
        ss += r * r;
      }
      if (write) store_elem(pm, dm, i, m);
    }
    // Every thread of the block reaches this for every t (the loop bounds
    // are uniform over the block); one writer per block, all write 1.
    if (nonzero && __syncthreads_or(any) && threadIdx.x == 0) nonzero[t] = 1;
    if constexpr (SUMS) {
      const double tot = block_sum(ss, sh);
      if (threadIdx.x == 0) sumsq[t * gridDim.x + blockIdx.x] = tot;
    }
  }
}

__global__ void apply_update_multi_kernel(const TensorEntry* list, int64_t count, int64_t n, const void* u,
                                          dion_dtype_t du, const GroupScalars* gs, float lr_mult, bool cautious,
                                          const int32_t* skip) {
  if (skip && *skip) return;
  const Update op(gs, lr_mult, cautious);
  const int64_t usize = du == DION_DTYPE_FP32 ? 4 : 2;
  for (int64_t t = blockIdx.y; t < count; t += gridDim.y) {
    void* px = list[t].ptr[kParam];
    const dion_dtype_t dx = static_cast<dion_dtype_t>(list[t].dtype[kParam]);
    const void* ut = static_cast<const char*>(u) + t * n * usize;
    int64_t i0 = 0;
    if (aligned16(px) && aligned16(ut)) {
      const int64_t n8 = n / 8;
      for (int64_t j = global_thread(); j < n8; j += grid_threads()) {
        float x[8], v[8];
        const Raw8 rx = load_raw8(px, dx, j), ru = load_raw8(ut, du, j);
        cvt8(rx, dx, x);
        cvt8(ru, du, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] = op(x[k], v[k]);
        store8(px, dx, j, x);
      }
      i0 = n8 * 8;
    }
    for (int64_t i = i0 + global_thread(); i < n; i += grid_threads())
      store_elem(px, dx, i, op(load_elem(px, dx, i), load_elem(ut, du, i)));
  }
}

// apply_update_multi_kernel on u' = float(u * scale * rescale), the product
// in double in that order (neuron_normalize's): tensor t is one rows x cols
// matrix, its neuron s (row i, or column j) scaled by scales[t * N + s], the
// matrix by scales[count * N + t]. 16-byte chunks where cols % 8 == 0 (a
// chunk lies in one row) and both buffers are aligned.
__global__ void apply_update_neuron_multi_kernel(const TensorEntry* list, int64_t count, int64_t rows, int64_t cols,
                                                 const void* u, dion_dtype_t du, const double* scales,
                                                 bool rows_are_neurons, const GroupScalars* gs, float lr_mult,
                                                 bool cautious, const int32_t* skip) {
  if (skip && *skip) return;
  const Update op(gs, lr_mult, cautious);
  const int64_t usize = du == DION_DTYPE_FP32 ? 4 : 2, n = rows * cols, N = rows_are_neurons ? rows : cols;
  for (int64_t t = blockIdx.y; t < count; t += gridDim.y) {
    void* px = list[t].ptr[kParam];
    const dion_dtype_t dx = static_cast<dion_dtype_t>(list[t].dtype[kParam]);
    const void* ut = static_cast<const char*>(u) + t * n * usize;
    const double* sc = scales + t * N;
    const double rs = scales[count * N + t];
    int64_t i0 = 0;
    if (cols % 8 == 0 && aligned16(px) && aligned16(ut)) {
      const int64_t n8 = n / 8;
      for (int64_t j = global_thread(); j < n8; j += grid_threads()) {
        const int64_t i = 8 * j / cols, c0 = 8 * j - i * cols;
        float x[8], v[8];
        const Raw8 rx = load_raw8(px, dx, j), ru = load_raw8(ut, du, j);
        cvt8(rx, dx, x);
        cvt8(ru, du, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          v[k] = static_cast<float>(v[k] * sc[rows_are_neurons ? i : c0 + k] * rs);
          x[k] = op(x[k], v[k]);
        }
        store8(px, dx, j, x);
      }
      i0 = n8 * 8;
    }
    for (int64_t e = i0 + global_thread(); e < n; e += grid_threads()) {
      const int64_t i = e / cols, c = e - i * cols;
      const float v = static_cast<float>(load_elem(ut, du, e) * sc[rows_are_neurons ? i : c] * rs);
      store_elem(px, dx, e, op(load_elem(px, dx, e), v));
    }
  }
}

__device__ __forceinline__ const void* pointer_of(const PtrSource& s, const TensorEntry* list, int64_t i) {
  return s.field >= 0 ? list[i].ptr[s.field] : static_cast<const char*>(s.base) + i * s.stride;
}

// gemm_pointers: out[j * count + i] from source j; coef as documented there.
__global__ void gemm_pointers_kernel(const TensorEntry* list, int64_t count, PtrSource s0, PtrSource s1, PtrSource s2,
                                     const void** out, const GroupScalars* gs, float mult, const int32_t* skip,
                                     float* coef) {
  for (int64_t i = global_thread(); i < count; i += grid_threads()) {
    out[i] = pointer_of(s0, list, i);
    out[count + i] = pointer_of(s1, list, i);
    out[2 * count + i] = pointer_of(s2, list, i);
  }
  if (coef && global_thread() == 0) {
    const bool s = skip && *skip;
    if (gs) {
      const Update op(gs, mult, false);
      coef[0] = s ? 0.0f : -op.lr_adj;
      coef[1] = s ? 1.0f : op.decay;
    } else {
      coef[0] = s ? 0.0f : mult;
      coef[1] = 1.0f;
    }
  }
}

__global__ void decay_kernel(float* x, int64_t n, const GroupScalars* gs) {
  const float decay = static_cast<float>(1.0 - gs->lr * gs->weight_decay);  // as the host: in double
  for (int64_t i = global_thread(); i < n; i += grid_threads()) x[i] *= decay;
}

struct ScaleMatrix {
  MatBatch m;
  float beta;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    float* p = mat_at(m, b) + i * m.ld + j;
    *p = beta == 0.0f ? 0.0f : beta * *p;  // beta == 0 clears NaN too, as BLAS does
  }
};

}  // namespace

void load(const Ctx& c, float* dst, const void* src, dion_dtype_t dt, int64_t n) {
  if (n <= 0) return;
  if (dt == DION_DTYPE_FP32) {
    cuda::check(cudaMemcpyAsync(dst, src, sizeof(float) * static_cast<size_t>(n), cudaMemcpyDefault, c.stream),
                "cudaMemcpyAsync (load)");
    return;
  }
  if (dt == DION_DTYPE_BF16)
    load_kernel<DION_DTYPE_BF16><<<blocks_1d(c, n), kThreads, 0, c.stream>>>(dst, src, n);
  else
    load_kernel<DION_DTYPE_FP16><<<blocks_1d(c, n), kThreads, 0, c.stream>>>(dst, src, n);
  cuda::check_launch("load kernel");
}

void store(const Ctx& c, void* dst, dion_dtype_t dt, const float* src, int64_t n) {
  if (n <= 0) return;
  if (dt == DION_DTYPE_FP32) {
    cuda::check(cudaMemcpyAsync(dst, src, sizeof(float) * static_cast<size_t>(n), cudaMemcpyDefault, c.stream),
                "cudaMemcpyAsync (store)");
    return;
  }
  const unsigned blocks = blocks_1d(c, (n + 7) / 8);
  if (dt == DION_DTYPE_BF16)
    store_kernel<DION_DTYPE_BF16><<<blocks, kThreads, 0, c.stream>>>(dst, src, n);
  else
    store_kernel<DION_DTYPE_FP16><<<blocks, kThreads, 0, c.stream>>>(dst, src, n);
  cuda::check_launch("store kernel");
}

void split_bf16(const Ctx& c, void* hi, void* lo, const float* src, int64_t n) {
  if (n <= 0) return;
  split_bf16_kernel<<<blocks_1d(c, (n + 7) / 8), kThreads, 0, c.stream>>>(static_cast<uint16_t*>(hi),
                                                                          static_cast<uint16_t*>(lo), src, n);
  cuda::check_launch("split_bf16 kernel");
}

void load_multi(const Ctx& c, float* dst, const TensorEntry* list, int64_t count, Field f, int64_t n) {
  if (count <= 0 || n <= 0) return;
  load_multi_kernel<DION_DTYPE_FP32><<<grid_multi(c, count, n), kThreads, 0, c.stream>>>(dst, list, count, f, n);
  cuda::check_launch("load_multi kernel");
}

void load_multi_bf16(const Ctx& c, void* dst, const TensorEntry* list, int64_t count, Field f, int64_t n) {
  if (count <= 0 || n <= 0) return;
  load_multi_kernel<DION_DTYPE_BF16><<<grid_multi(c, count, n), kThreads, 0, c.stream>>>(dst, list, count, f, n);
  cuda::check_launch("load_multi_bf16 kernel");
}

namespace {
void store_multi_typed(const Ctx& c, const TensorEntry* list, int64_t count, Field f, const void* src,
                       dion_dtype_t sdt, int64_t n, const int32_t* skip) {
  if (count <= 0 || n <= 0) return;
  store_multi_kernel<<<grid_multi(c, count, n), kThreads, 0, c.stream>>>(list, count, f, src, sdt, n, skip);
  cuda::check_launch("store_multi kernel");
}
}  // namespace

void store_multi(const Ctx& c, const TensorEntry* list, int64_t count, Field f, const float* src, int64_t n,
                 const int32_t* skip) {
  store_multi_typed(c, list, count, f, src, DION_DTYPE_FP32, n, skip);
}

void store_multi_bf16(const Ctx& c, const TensorEntry* list, int64_t count, Field f, const void* src, int64_t n,
                      const int32_t* skip) {
  store_multi_typed(c, list, count, f, src, DION_DTYPE_BF16, n, skip);
}

void scale_multi(const Ctx& c, const TensorEntry* list, int64_t count, Field f, int64_t n, float a,
                 const int32_t* skip) {
  if (count <= 0 || n <= 0) return;
  scale_multi_kernel<<<grid_multi(c, count, (n + 7) / 8), kThreads, 0, c.stream>>>(list, count, f, n, a, skip);
  cuda::check_launch("scale_multi kernel");
}

void check_nonfinite(const Ctx& c, const TensorEntry* list, int64_t count, int64_t max_n, Field f, int32_t* flag) {
  if (count <= 0 || max_n <= 0) return;
  check_nonfinite_kernel<<<grid_multi(c, count, max_n), kThreads, 0, c.stream>>>(list, count, f, flag);
  cuda::check_launch("check_nonfinite kernel");
}

void advance_step(const Ctx& c, GroupScalars* gs, const StepStatus* status) {
  advance_step_kernel<<<1, 1, 0, c.stream>>>(gs, status);
  cuda::check_launch("advance_step kernel");
}

void merge_skip(const Ctx& c, StepStatus* status) {
  merge_skip_kernel<<<1, 1, 0, c.stream>>>(status);
  cuda::check_launch("merge_skip kernel");
}

void count_skip(const Ctx& c, StepStatus* status) {
  count_skip_kernel<<<1, 1, 0, c.stream>>>(status);
  cuda::check_launch("count_skip kernel");
}

void axpby(const Ctx& c, float a, const float* x, float b, float* y, int64_t n) {
  if (n <= 0) return;
  axpby_kernel<<<blocks_1d(c, n), kThreads, 0, c.stream>>>(a, x, b, y, n);
  cuda::check_launch("axpby kernel");
}

void lincomb(const Ctx& c, float a, const float* x, float b, const float* y, float* z, int64_t n) {
  if (n <= 0) return;
  lincomb_kernel<<<blocks_1d(c, n), kThreads, 0, c.stream>>>(a, x, b, y, z, n);
  cuda::check_launch("lincomb kernel");
}

void nan_to_num(const Ctx& c, float* x, int64_t n) {
  if (n <= 0) return;
  nan_to_num_kernel<<<blocks_1d(c, n), kThreads, 0, c.stream>>>(x, n);
  cuda::check_launch("nan_to_num kernel");
}

void apply_update(const Ctx& c, float* x, const float* u, int64_t n, const GroupScalars* gs, float lr_mult,
                  bool cautious) {
  if (n <= 0) return;
  apply_update_kernel<<<blocks_1d(c, n), kThreads, 0, c.stream>>>(x, u, n, gs, lr_mult, cautious);
  cuda::check_launch("apply_update kernel");
}

void momentum_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t n, float mu, float g_scale,
                    bool nesterov, bool store_state, void* u, dion_dtype_t u_dtype, const int32_t* skip,
                    int32_t* nonzero) {
  if (count <= 0 || n <= 0) return;
  momentum_multi_kernel<false><<<grid_multi(c, count, (n + 7) / 8), kThreads, 0, c.stream>>>(
      list, count, n, Momentum{mu, g_scale, nesterov}, store_state, u, u_dtype, skip, nonzero, nullptr);
  cuda::check_launch("momentum_multi kernel");
}

// The grid's x blocks each give one partial sum (0 past Backend::select_parts_max(1, n)).
int64_t momentum_parts(const Ctx& c, int64_t count, int64_t n) {
  if (count <= 0 || n <= 0) return 0;
  const int64_t parts = grid_multi(c, count, (n + 7) / 8).x;
  return parts <= Backend::select_parts_max(1, n) ? parts : 0;
}

void momentum_multi_sums(const Ctx& c, const TensorEntry* list, int64_t count, int64_t n, float mu, float g_scale,
                         bool nesterov, void* u, dion_dtype_t u_dtype, const int32_t* skip, double* sumsq) {
  if (count <= 0 || n <= 0) return;
  momentum_multi_kernel<true><<<grid_multi(c, count, (n + 7) / 8), kThreads, 0, c.stream>>>(
      list, count, n, Momentum{mu, g_scale, nesterov}, true, u, u_dtype, skip, nullptr, sumsq);
  cuda::check_launch("momentum_multi (sums) kernel");
}

void gemm_pointers(const Ctx& c, const TensorEntry* list, int64_t count, const PtrSource (&src)[3], const void** out,
                   const GroupScalars* gs, float mult, const int32_t* skip, float* coef) {
  gemm_pointers_kernel<<<blocks_1d(c, std::max<int64_t>(count, 1)), kThreads, 0, c.stream>>>(
      list, count, src[0], src[1], src[2], out, gs, mult, skip, coef);
  cuda::check_launch("gemm_pointers kernel");
}

void apply_update_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t n, const void* u,
                        dion_dtype_t u_dtype, const GroupScalars* gs, float lr_mult, bool cautious,
                        const int32_t* skip) {
  if (count <= 0 || n <= 0) return;
  apply_update_multi_kernel<<<grid_multi(c, count, (n + 7) / 8), kThreads, 0, c.stream>>>(
      list, count, n, u, u_dtype, gs, lr_mult, cautious, skip);
  cuda::check_launch("apply_update_multi kernel");
}

void apply_update_neuron_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t rows, int64_t cols,
                               const void* u, dion_dtype_t u_dtype, const double* scales, bool rows_are_neurons,
                               const GroupScalars* gs, float lr_mult, bool cautious, const int32_t* skip) {
  if (count <= 0 || rows <= 0 || cols <= 0) return;
  apply_update_neuron_multi_kernel<<<grid_multi(c, count, (rows * cols + 7) / 8), kThreads, 0, c.stream>>>(
      list, count, rows, cols, u, u_dtype, scales, rows_are_neurons, gs, lr_mult, cautious, skip);
  cuda::check_launch("apply_update_neuron_multi kernel");
}

void decay(const Ctx& c, float* x, int64_t n, const GroupScalars* gs) {
  if (n <= 0) return;
  decay_kernel<<<blocks_1d(c, n), kThreads, 0, c.stream>>>(x, n, gs);
  cuda::check_launch("decay kernel");
}

void scale_matrix(const Ctx& c, MatBatch m, float beta) {
  for_each_2d(c, m.batch, m.rows, m.cols, ScaleMatrix{m, beta}, "gemm (k = 0) scale kernel");
}

}  // namespace dion::kernels
