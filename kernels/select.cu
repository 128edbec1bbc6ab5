// SPDX-License-Identifier: MIT
// Dion2's slice selection: top-k of score vectors, gather / scale / add of
// the selected rows or columns, and the fused passes on typed buffers that
// store the selected slices of the momentum and update the parameters.
//
// topk: one block per vector. A radix select over the scores' bits (4 passes
// of 8 bits, counting with integer shared-memory atomics) finds the k-th
// largest key T and how many elements equal to T are taken; one ordered pass
// then emits every element above T and the first (lowest-index) elements equal
// to T, in ascending index order, through block-wide prefix sums. The result
// is the host's (partial_sort with ties to the lower index, then sorted).
#include <cub/block/block_scan.cuh>

#include "core/error.hpp"
#include "kernels/common.cuh"

namespace dion::kernels {

namespace {

constexpr int kTopkThreads = 512;

// A key whose unsigned order is the float order (-0 and +0 equal, like the
// host's comparison; NaN above +inf).
__device__ __forceinline__ uint32_t order_key(float x) {
  if (x == 0.0f) x = 0.0f;
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kTopkThreads) topk_kernel(const float* scores, int64_t batch, int64_t n, int64_t k,
                                                            int32_t* idx) {
  using Scan = cub::BlockScan<int, kTopkThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ uint32_t sh_prefix;
  __shared__ int sh_remaining;
  const int tid = threadIdx.x;
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x) {
    const float* s = scores + b * n;
    int32_t* out = idx + b * k;
    if (k >= n) {  // everything is selected
      for (int64_t i = tid; i < n; i += blockDim.x) out[i] = static_cast<int32_t>(i);
      continue;
    }
    // Radix select, most significant digit first: after the pass at `shift`,
    // `prefix` holds the top bits of T and `remaining` the number of elements
    // with that prefix still to take.
    uint32_t prefix = 0, mask = 0;
    int remaining = static_cast<int>(k);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int d = tid; d < 256; d += blockDim.x) hist[d] = 0;
      __syncthreads();
      for (int64_t i = tid; i < n; i += blockDim.x) {
        const uint32_t key = order_key(s[i]);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1);
      }
      __syncthreads();
      if (tid == 0) {
        int cum = 0, d = 255;
        for (; d > 0; --d) {
          if (cum + hist[d] >= remaining) break;
          cum += hist[d];
        }
        sh_prefix = prefix | (static_cast<uint32_t>(d) << shift);
        sh_remaining = remaining - cum;
      }
      __syncthreads();
      prefix = sh_prefix;
      remaining = sh_remaining;
      mask |= 0xffu << shift;
    }
    // Ordered pass: running counts of keys equal to T seen and of indices written.
    const uint32_t T = prefix;
    int eq_seen = 0, written = 0;
    for (int64_t base = 0; base < n; base += blockDim.x) {
      const int64_t i = base + tid;
      const uint32_t key = i < n ? order_key(s[i]) : 0u;
      const int eq = (i < n && key == T) ? 1 : 0;
      int eq_before, eq_total;
      Scan(scan_tmp).ExclusiveSum(eq, eq_before, eq_total);
      __syncthreads();
      const int sel = (i < n && (key > T || (eq && eq_seen + eq_before < remaining))) ? 1 : 0;
      int pos, sel_total;
      Scan(scan_tmp).ExclusiveSum(sel, pos, sel_total);
      __syncthreads();
      if (sel) out[written + pos] = static_cast<int32_t>(i);
      eq_seen += eq_total;
      written += sel_total;
      if (written >= k) break;  // uniform: every thread holds the same totals
    }
    __syncthreads();  // hist and scan_tmp are reused by the next vector
  }
}

// Row/column addressing of slice s of matrix b (axis kRows: rows idx[s]).
struct Gather {
  ConstMatBatch m;
  MatBatch out;
  const int32_t* idx;
  int64_t k;
  bool rows;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    const int32_t* ix = idx + b * k;
    const float* p = mat_at(m, b);
    mat_at(out, b)[i * out.ld + j] = rows ? p[ix[i] * m.ld + j] : p[i * m.ld + ix[j]];
  }
};

struct ScaleSlices {
  MatBatch m;
  const int32_t* idx;
  int64_t k;
  bool rows;
  float s;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    const int32_t* ix = idx + b * k;
    float* p = mat_at(m, b);
    p[rows ? ix[i] * m.ld + j : i * m.ld + ix[j]] *= s;
  }
};

struct AddSlices {
  MatBatch m;
  ConstMatBatch u;
  const int32_t* idx;
  int64_t k;
  bool rows;
  const GroupScalars* gs;
  float mult;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    // alpha from the device-side lr, so a captured graph follows lr changes.
    const float alpha = gs ? static_cast<float>(mult * gs->lr) : mult;
    const int32_t* ix = idx + b * k;
    float* p = mat_at(m, b);
    p[rows ? ix[i] * m.ld + j : i * m.ld + ix[j]] += alpha * mat_at(u, b)[i * u.ld + j];
  }
};

// ---- Dion2's fused passes over typed buffers ----

// store_multi of the selected slices only: matrix b of m belongs to tensor
// b / per, where it is the (b % per)-th dense rows x cols matrix.
struct StoreSlices {
  const TensorEntry* list;
  int f;
  ConstMatBatch m;
  const int32_t* idx;
  int64_t k, per;
  bool rows;
  const int32_t* skip;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    if (skip && *skip) return;
    const int32_t* ix = idx + b * k;
    const int64_t r = rows ? ix[i] : i, c = rows ? j : ix[j];
    const TensorEntry& e = list[b / per];
    store_elem(e.ptr[f], static_cast<dion_dtype_t>(e.dtype[f]), (b % per) * m.rows * m.cols + r * m.cols + c,
               mat_at(m, b)[r * m.ld + c]);
  }
};

// pos[b * N + idx[b * k + s]] = s: the inverse of each matrix's index list
// (pos is -1 elsewhere), so the whole-matrix pass finds an element's slice
// of u with one lookup.
struct FillPos {
  const int32_t* idx;
  int64_t k, N;
  int32_t* pos;
  __device__ void operator()(int64_t b, int64_t, int64_t s) const {
    pos[b * N + idx[b * k + s]] = static_cast<int32_t>(s);
  }
};

// Where element e of a tensor's walk lies: matrix q of the tensor, row r,
// column c (the element paths').
struct MatPos {
  int64_t q, r, c;
  __device__ MatPos(int64_t e, int64_t rows, int64_t cols) {
    const int64_t msize = rows * cols;
    q = e / msize;
    const int64_t rem = e - q * msize;
    r = rem / cols;
    c = rem - r * cols;
  }
};

// The vector paths' walk over a tensor's rows in chunks of eight elements
// (cols % 8 == 0): matrix q, row r, chunk c (columns 8c .. 8c + 7), and j,
// the chunk's index in the tensor (its elements 8j .. 8j + 7). A thread
// divides once, at its first chunk, and then steps by the grid's thread
// count; a chunk never straddles two rows, so the selected-slice lookups are
// per chunk (a row's) or one 32-byte load (eight columns').
struct ChunkWalk {
  int64_t j, q, r, c, dr, dc;
  __device__ ChunkWalk(int64_t start, int64_t step, int64_t rows, int64_t cpr) : j(start) {
    const int64_t R = start / cpr;
    c = start - R * cpr;
    q = R / rows;
    r = R - q * rows;
    dr = step / cpr;
    dc = step - dr * cpr;
  }
  __device__ __forceinline__ void next(int64_t step, int64_t rows, int64_t cpr) {
    j += step;
    c += dc;
    r += dr;
    if (c >= cpr) {
      c -= cpr;
      ++r;
    }
    while (r >= rows) {
      r -= rows;
      ++q;
    }
  }
};

// The selected-slice positions of columns c0 .. c0 + 7 (pos 16-byte aligned
// there: c0 and N are multiples of 8 on the vector paths).
__device__ __forceinline__ void positions8(const int32_t* p, int32_t (&s)[8]) {
  const int4 a = reinterpret_cast<const int4*>(p)[0], b = reinterpret_cast<const int4*>(p)[1];
  s[0] = a.x, s[1] = a.y, s[2] = a.z, s[3] = a.w, s[4] = b.x, s[5] = b.y, s[6] = b.z, s[7] = b.w;
}

// decay (x *= 1 - lr wd, the factor computed in double as decay_kernel
// does), then add_slices' x += alpha * u on the selected slices, in fp32.
// Scaled (rows only): u's row s of matrix b is first normalised to
// float(u * sc[b k + s] * sc[nb k + b]) (neuron_scales' scales, in double).
template <bool Scaled>
struct DecayAdd {
  float d, alpha;
  int64_t per, N;
  bool rows;
  const int32_t* pos;  // null: nothing selected
  ConstMatBatch u;
  bool ubf16;  // u's elements are bf16 (widened exactly)
  const double* sc;  // Scaled: the scales; k slices per matrix, nb matrices
  int64_t k, nb;
  __device__ __forceinline__ float u_at(int64_t b, int64_t off) const {
    const int64_t i = b * u.stride + off;
    return ubf16 ? bf16_to_float(reinterpret_cast<const uint16_t*>(u.p)[i]) : u.p[i];
  }
  __device__ __forceinline__ float operator()(float x, int64_t t, const MatPos& p) const {
    x *= d;
    if (pos) {
      const int64_t b = t * per + p.q;
      const int32_t s = pos[b * N + (rows ? p.r : p.c)];
      if (s >= 0) {
        float v = u_at(b, rows ? s * u.ld + p.c : p.r * u.ld + s);
        if constexpr (Scaled) v = static_cast<float>(v * sc[b * k + s] * sc[nb * k + b]);
        x += alpha * v;
      }
    }
    return x;
  }
  // The chunk (q, r, columns c0 .. c0 + 7) of tensor t in two halves, so
  // that a walk can load u's elements with the chunk's own, before it
  // computes: fetch puts u's value of each selected element in v and returns
  // which are selected (bit e: element c0 + e); apply does the decay and the
  // additions.
  __device__ __forceinline__ uint32_t fetch(float (&v)[8], int64_t t, int64_t q, int64_t r, int64_t c0) const {
    if (!pos) return 0;
    const int64_t b = t * per + q;
    const int32_t* pb = pos + b * N;
    uint32_t sel = 0;
    if (rows) {
      const int32_t s = pb[r];
      if (s >= 0) {
        const int64_t i = b * u.stride + s * u.ld + c0;
        const void* p = ubf16 ? static_cast<const void*>(reinterpret_cast<const uint16_t*>(u.p) + i)
                              : static_cast<const void*>(u.p + i);
        if (aligned16(p)) {
          load8(p, ubf16 ? DION_DTYPE_BF16 : DION_DTYPE_FP32, 0, v);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = u_at(b, s * u.ld + c0 + e);
        }
        if constexpr (Scaled) {
          const double a = sc[b * k + s], rs = sc[nb * k + b];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = static_cast<float>(v[e] * a * rs);
        }
        sel = 0xffu;
      }
      return sel;
    }
    int32_t s[8];
    positions8(pb + c0, s);
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (s[e] >= 0) {
        v[e] = u_at(b, r * u.ld + s[e]);
        sel |= 1u << e;
      }
    return sel;
  }
  __device__ __forceinline__ void apply(float (&x)[8], const float (&v)[8], uint32_t sel) const {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      x[e] *= d;
      if (sel & (1u << e)) x[e] += alpha * v[e];
    }
  }
};

// Bounded to 5 resident blocks per SM (at most 48 registers, 52 and 56
// unbounded, 4 blocks), and the selection pass below to 6 (40, was 48 for
// a bf16 S): neither spills, and on an H200 gpt-1.3b Dion2 bf16 ran 9.70 ->
// 9.52 ms per step and NorDion2 19.44 -> 19.16 (docs/benchmarks.md, tenth
// session). These passes wait on memory: more warps keep more bytes in flight.
template <bool Scaled>
__global__ void __launch_bounds__(kThreads, 5)
    decay_add_slices_multi_kernel(const TensorEntry* list, int64_t count, int64_t rows, int64_t cols,
                                  DecayAdd<Scaled> op, const GroupScalars* gs, float mult, const int32_t* skip) {
  if (skip && *skip) return;
  // From the device-side lr and wd, so a captured graph follows their changes.
  op.d = static_cast<float>(1.0 - gs->lr * gs->weight_decay);
  op.alpha = static_cast<float>(mult * gs->lr);
  const int64_t n = op.per * rows * cols;
  for (int64_t t = blockIdx.y; t < count; t += gridDim.y) {
    void* px = list[t].ptr[kParam];
    const dion_dtype_t dx = static_cast<dion_dtype_t>(list[t].dtype[kParam]);
    if (cols % 8 == 0 && aligned16(px)) {
      // u's elements are loaded with the chunk's own (fetch, after the
      // chunk's load and before its conversion), before the decay waits
      // for either.
      for (ChunkWalk w(global_thread(), grid_threads(), rows, cols / 8); w.q < op.per;
           w.next(grid_threads(), rows, cols / 8)) {
        float x[8], v[8];
        const Raw8 rx = load_raw8(px, dx, w.j);
        const uint32_t sel = op.fetch(v, t, w.q, w.r, 8 * w.c);
        cvt8(rx, dx, x);
        op.apply(x, v, sel);
        store8(px, dx, w.j, x);
      }
      continue;
    }
    for (int64_t i = global_thread(); i < n; i += grid_threads())
      store_elem(px, dx, i, op(load_elem(px, dx, i), t, MatPos(i, rows, cols)));
  }
}

// Dion2's selection pass (Backend::select_momentum_multi): m = M + G (the
// fp32 operations of momentum_multi with mu = g_scale = 1); an element of a
// selected slice s goes to out and is scaled by decay (scale_slices' x *= s);
// M <- the result unless skipped. OB16: out's elements are bf16 (the value
// rounded once; ld and stride count bf16 elements), a kernel of its own so
// the fp32 one keeps its registers.
template <bool OB16>
struct SelectMomentum {
  int64_t per, N;
  bool rows;
  const int32_t* pos;
  MatBatch out;
  float decay;
  // out[b](off) = v; ss += the square of what was stored (in double: the
  // sums of squares select_momentum_multi hands to the bf16 iteration).
  __device__ __forceinline__ void put(int64_t b, int64_t off, float v, double& ss) const {
    if constexpr (OB16) {
      const uint16_t h = float_to_bf16(v);
      reinterpret_cast<uint16_t*>(out.p)[b * out.stride + off] = h;
      const double r = bf16_to_float(h);
      ss += r * r;
    } else {
      out.p[b * out.stride + off] = v;
      ss += static_cast<double>(v) * v;
    }
  }
  __device__ __forceinline__ float operator()(float m, float g, int64_t t, const MatPos& p, double& ss) const {
    const float mu = 1.0f, g_scale = 1.0f;
    float v = mu * m + g_scale * g;
    const int64_t b = t * per + p.q;
    const int32_t s = pos[b * N + (rows ? p.r : p.c)];
    if (s >= 0) {
      put(b, rows ? s * out.ld + p.c : p.r * out.ld + s, v, ss);
      v *= decay;
    }
    return v;
  }
  // The same for the chunk (q, r, columns c0 .. c0 + 7) of tensor t: m <- the results.
  __device__ __forceinline__ void chunk(float (&m)[8], const float (&g)[8], int64_t t, int64_t q, int64_t r,
                                        int64_t c0, double& ss) const {
    const float mu = 1.0f, g_scale = 1.0f;
    const int64_t b = t * per + q;
    const int32_t* pb = pos + b * N;
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = mu * m[k] + g_scale * g[k];
    if (rows) {
      const int32_t sr = pb[r];
      if (sr >= 0) {
        const int64_t off = b * out.stride + sr * out.ld + c0;
        if constexpr (OB16) {
          uint16_t* dst = reinterpret_cast<uint16_t*>(out.p) + off;
          if (aligned16(dst)) {
            store8(dst, DION_DTYPE_BF16, 0, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              const double x = bf16_to_float(float_to_bf16(v[k]));
              ss += x * x;
            }
          } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) put(b, sr * out.ld + c0 + k, v[k], ss);
          }
        } else {
          float* dst = out.p + off;
          if (aligned16(dst)) {
            reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
            reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
          } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) dst[k] = v[k];
          }
#pragma unroll
          for (int k = 0; k < 8; ++k) ss += static_cast<double>(v[k]) * v[k];
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] *= decay;
      }
    } else {
      int32_t s[8];
      positions8(pb + c0, s);
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (s[k] >= 0) {
          put(b, r * out.ld + s[k], v[k], ss);
          v[k] *= decay;
        }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) m[k] = v[k];
  }
};

// sumsq (per == 1, or null): sumsq[t * gridDim.x + blockIdx.x] = the sum of
// the squares of the elements block x put in tensor t's out matrix: each
// thread's in its chunk order, then block_sum's fixed tree, so the partial
// sums (and frob_normalize_bf16_parts' norm) are the same on every run.
template <bool OB16>
__global__ void __launch_bounds__(kThreads, 6)
    select_momentum_multi_kernel(const TensorEntry* list, int64_t count, int64_t rows, int64_t cols,
                                 SelectMomentum<OB16> op, const int32_t* skip, double* sumsq) {
  __shared__ double sh[33];
  const bool write = !(skip && *skip);  // uniform over the grid
  const int64_t n = op.per * rows * cols;
  for (int64_t t = blockIdx.y; t < count; t += gridDim.y) {
    double ss = 0.0;
    void* pm = list[t].ptr[kState0];
    const void* pg = list[t].ptr[kGrad];
    const dion_dtype_t dm = static_cast<dion_dtype_t>(list[t].dtype[kState0]);
    const dion_dtype_t dg = static_cast<dion_dtype_t>(list[t].dtype[kGrad]);
    if (cols % 8 == 0 && aligned16(pm) && aligned16(pg)) {
      for (ChunkWalk w(global_thread(), grid_threads(), rows, cols / 8); w.q < op.per;
           w.next(grid_threads(), rows, cols / 8)) {
        float m[8], g[8];
        const Raw8 rm = load_raw8(pm, dm, w.j), rg = load_raw8(pg, dg, w.j);
        cvt8(rm, dm, m);
        cvt8(rg, dg, g);
        op.chunk(m, g, t, w.q, w.r, 8 * w.c, ss);
        if (write) store8(pm, dm, w.j, m);
      }
    } else {
      for (int64_t i = global_thread(); i < n; i += grid_threads()) {
        const float v = op(load_elem(pm, dm, i), load_elem(pg, dg, i), t, MatPos(i, rows, cols), ss);
        if (write) store_elem(pm, dm, i, v);
      }
    }
    if (sumsq) {  // uniform over the block: every thread reaches the block sum
      const double tot = block_sum(ss, sh);
      if (threadIdx.x == 0) sumsq[t * gridDim.x + blockIdx.x] = tot;
    }
  }
}

// pos (count * per * N int32): -1 everywhere, then each matrix's selected
// slices' places in its index list.
int32_t* fill_positions(const Ctx& c, int64_t matrices, int64_t N, const int32_t* idx, int64_t k, void* scratch,
                        const char* what) {
  int32_t* pos = static_cast<int32_t*>(scratch);
  cuda::check(cudaMemsetAsync(pos, 0xff, sizeof(int32_t) * static_cast<size_t>(matrices * N), c.stream), what);
  for_each_2d(c, matrices, 1, k, FillPos{idx, k, N, pos}, what);
  return pos;
}

}  // namespace

void topk(const Ctx& c, const float* scores, int64_t batch, int64_t n, int64_t k, int32_t* idx) {
  if (batch <= 0 || n <= 0 || k <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(batch, 1 << 30));
  topk_kernel<<<blocks, kTopkThreads, 0, c.stream>>>(scores, batch, n, k, idx);
  cuda::check_launch("topk kernel");
}

void gather_slices(const Ctx& c, ConstMatBatch m, Axis axis, const int32_t* idx, int64_t k, MatBatch out) {
  const bool rows = axis == kRows;
  for_each_2d(c, m.batch, rows ? k : m.rows, rows ? m.cols : k, Gather{m, out, idx, k, rows}, "gather_slices kernel");
}

void scale_slices(const Ctx& c, MatBatch m, Axis axis, const int32_t* idx, int64_t k, float s) {
  const bool rows = axis == kRows;
  for_each_2d(c, m.batch, rows ? k : m.rows, rows ? m.cols : k, ScaleSlices{m, idx, k, rows, s},
              "scale_slices kernel");
}

void add_slices(const Ctx& c, MatBatch m, Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u,
                const GroupScalars* gs, float mult) {
  const bool rows = axis == kRows;
  for_each_2d(c, m.batch, rows ? k : m.rows, rows ? m.cols : k, AddSlices{m, u, idx, k, rows, gs, mult},
              "add_slices kernel");
}

void store_slices_multi(const Ctx& c, const TensorEntry* list, int64_t count, Field f, ConstMatBatch m, Axis axis,
                        const int32_t* idx, int64_t k, const int32_t* skip) {
  if (count <= 0 || k <= 0 || m.batch <= 0) return;
  const bool rows = axis == kRows;
  for_each_2d(c, m.batch, rows ? k : m.rows, rows ? m.cols : k,
              StoreSlices{list, static_cast<int>(f), m, idx, k, m.batch / count, rows, skip},
              "store_slices_multi kernel");
}

size_t decay_add_slices_multi_scratch(int64_t count, int64_t per, int64_t rows, int64_t cols, Axis axis, int64_t k) {
  if (k <= 0) return 0;
  return sizeof(int32_t) * static_cast<size_t>(count * per * (axis == kRows ? rows : cols));
}

void decay_add_slices_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t per, int64_t rows,
                            int64_t cols, Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u, bool u_bf16,
                            const double* scales, const GroupScalars* gs, float mult, const int32_t* skip,
                            void* scratch) {
  const int64_t n = per * rows * cols;
  if (count <= 0 || n <= 0) return;
  const bool by_rows = axis == kRows;
  const int64_t N = by_rows ? rows : cols;
  const int32_t* pos = k > 0 ? fill_positions(c, count * per, N, idx, k, scratch, "decay_add_slices_multi positions")
                            : nullptr;
  const dim3 grid = grid_multi(c, count, (n + 7) / 8);
  if (scales && k > 0)
    decay_add_slices_multi_kernel<true><<<grid, kThreads, 0, c.stream>>>(
        list, count, rows, cols, DecayAdd<true>{0.0f, 0.0f, per, N, by_rows, pos, u, u_bf16, scales, k, count * per},
        gs, mult, skip);
  else
    decay_add_slices_multi_kernel<false><<<grid, kThreads, 0, c.stream>>>(
        list, count, rows, cols, DecayAdd<false>{0.0f, 0.0f, per, N, by_rows, pos, u, u_bf16, nullptr, 0, 0}, gs,
        mult, skip);
  cuda::check_launch("decay_add_slices_multi kernel");
}

// The grid's x blocks each give one partial sum (0 past Backend::select_parts_max).
int64_t select_momentum_parts(const Ctx& c, int64_t count, int64_t per, int64_t rows, int64_t cols) {
  if (per != 1 || count <= 0 || rows * cols <= 0) return 0;
  const int64_t parts = grid_multi(c, count, (rows * cols + 7) / 8).x;
  return parts <= Backend::select_parts_max(rows, cols) ? parts : 0;
}

void select_momentum_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t per, int64_t rows,
                           int64_t cols, Axis axis, const int32_t* idx, int64_t k, float decay, MatBatch out,
                           bool out_bf16, const int32_t* skip, void* scratch, double* sumsq) {
  const int64_t n = per * rows * cols;
  if (count <= 0 || n <= 0 || k <= 0) return;
  const bool by_rows = axis == kRows;
  const int64_t N = by_rows ? rows : cols;
  const int32_t* pos = fill_positions(c, count * per, N, idx, k, scratch, "select_momentum_multi positions");
  const dim3 grid = grid_multi(c, count, (n + 7) / 8);
  DION_REQUIRE(!sumsq || per == 1, DION_ERROR_INTERNAL, "select_momentum_multi: sums of squares need per == 1");
  if (out_bf16)
    select_momentum_multi_kernel<true><<<grid, kThreads, 0, c.stream>>>(
        list, count, rows, cols, SelectMomentum<true>{per, N, by_rows, pos, out, decay}, skip, sumsq);
  else
    select_momentum_multi_kernel<false><<<grid, kThreads, 0, c.stream>>>(
        list, count, rows, cols, SelectMomentum<false>{per, N, by_rows, pos, out, decay}, skip, sumsq);
  cuda::check_launch("select_momentum_multi kernel");
}

}  // namespace dion::kernels
