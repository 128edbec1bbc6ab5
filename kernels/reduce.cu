// SPDX-License-Identifier: MIT
// Reductions over matrices: Frobenius and column normalisation, slice L1
// norms, Dion's all-zero fix-up and NorMuon's neuron-wise normalisation.
//
// All sums are in double (as on the host) and deterministic: a matrix is cut
// into a fixed number of chunks (a function of its shape and the device), each
// block writes the partial sum of its chunk to scratch, and a second kernel
// adds the partials in index order. No float atomics, so every run gives the
// same bits; the host sums sequentially, so the two agree to double rounding
// of the sums (far below fp32 resolution of the results).
#include <cfloat>

#include <type_traits>

#include "kernels/common.cuh"

namespace dion::kernels {

namespace {

// ---- flat chunks: a matrix's rows*cols elements in `nchunks` equal ranges ----

int64_t flat_chunks(const Ctx& c, int64_t rows, int64_t cols, int64_t batch) {
  const int64_t elems = rows * cols;
  // At least ~8K elements per block (32 per thread), and enough blocks over
  // the whole batch to fill the device a few times.
  const int64_t by_size = std::max<int64_t>(1, ceil_div(elems, 8192));
  const int64_t by_fill = std::max<int64_t>(1, ceil_div(static_cast<int64_t>(c.sms) * 8, std::max<int64_t>(batch, 1)));
  return std::min<int64_t>({by_size, std::max<int64_t>(by_fill, ceil_div(elems, 65536)), 1024});
}

dim3 flat_grid(int64_t nchunks, int64_t batch) {
  return dim3(static_cast<unsigned>(nchunks), static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(batch, 1), 65535)));
}

__global__ void frob_partial_kernel(MatBatch m, int64_t nchunks, double* partial) {
  __shared__ double sh[33];
  const int64_t elems = m.rows * m.cols, chunk = ceil_div(elems, nchunks);
  const int64_t e0 = blockIdx.x * chunk, e1 = min(e0 + chunk, elems);
  for (int64_t b = blockIdx.y; b < m.batch; b += gridDim.y) {
    const float* p = mat_at(m, b);
    double s = 0.0;
    if (m.ld == m.cols && aligned16(p)) {
      // Dense: the chunk is p[e0, e1); its 16-byte-aligned middle in float4s.
      const int64_t a0 = min(e1, (e0 + 3) & ~int64_t(3)), a1 = max(a0, e1 & ~int64_t(3));
      for (int64_t i = e0 + threadIdx.x; i < a0; i += blockDim.x) s += static_cast<double>(p[i]) * p[i];
      for (int64_t i = a1 + threadIdx.x; i < e1; i += blockDim.x) s += static_cast<double>(p[i]) * p[i];
      const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll 4
      for (int64_t j = a0 / 4 + threadIdx.x; j < a1 / 4; j += blockDim.x) {
        const float4 v = q[j];
        const double x = v.x, y = v.y, z = v.z, w = v.w;
        s += x * x + y * y + z * z + w * w;
      }
    } else if (e0 + threadIdx.x < e1) {
      for (FlatWalk w(e0 + threadIdx.x, blockDim.x, m.cols); w.e < e1; w.next(blockDim.x, m.cols)) {
        const double v = p[w.offset(m.ld)];
        s += v * v;
      }
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) partial[b * nchunks + blockIdx.x] = s;
  }
}

__global__ void frob_scale_kernel(MatBatch m, int64_t nchunks, const double* partial, float factor, float eps) {
  __shared__ double sh[33];
  const int64_t elems = m.rows * m.cols, chunk = ceil_div(elems, nchunks);
  const int64_t e0 = blockIdx.x * chunk, e1 = min(e0 + chunk, elems);
  for (int64_t b = blockIdx.y; b < m.batch; b += gridDim.y) {
    const float inv = frob_inv(partial, b, nchunks, factor, eps, sh);
    float* p = mat_at(m, b);
    if (e0 + threadIdx.x < e1)
      for (FlatWalk w(e0 + threadIdx.x, blockDim.x, m.cols); w.e < e1; w.next(blockDim.x, m.cols))
        p[w.offset(m.ld)] *= inv;
  }
}

// Backend::frob_scale_bf16: m[b] (bf16) <- bf16(sc (m[b] + diag I)), sc =
// inv or inv^2 (power), inv = frob_inv of the given partial sums. For the
// s x s matrices of the bf16 iteration's first step: dense rows of a
// multiple of 8 in 16-byte chunks (x walks rows four at a time, threads the
// chunks of a row; chunk c of row r holds the diagonal element when r / 8
// == c), anything else element by element.
__global__ void frob_scale_bf16_kernel(MatBatch m, int64_t nparts, const double* parts, float factor, float eps,
                                       int power, float diag) {
  __shared__ double sh[33];
  uint16_t* base = reinterpret_cast<uint16_t*>(m.p);
  const int64_t elems = m.rows * m.cols;
  for (int64_t b = blockIdx.y; b < m.batch; b += gridDim.y) {
    const float inv = frob_inv(parts, b, nparts, factor, eps, sh);
    const float sc = power == 2 ? inv * inv : inv;
    uint16_t* p = base + b * m.stride;
    if (m.ld == m.cols && m.cols % 8 == 0 && aligned16(p)) {
      // Four rows' chunks loaded before any is stored (in place), by rows
      // and chunks: no division by the row length per chunk.
      const int64_t cpr = m.cols / 8;
      for (int64_t r0 = 4 * static_cast<int64_t>(blockIdx.x); r0 < m.rows; r0 += 4 * static_cast<int64_t>(gridDim.x))
        for (int64_t c = threadIdx.x; c < cpr; c += blockDim.x) {
          float v[4][8];
#pragma unroll
          for (int u = 0; u < 4; ++u)
            if (r0 + u < m.rows) load8(p + (r0 + u) * m.cols, DION_DTYPE_BF16, c, v[u]);
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int64_t r = r0 + u;
            if (r >= m.rows) continue;
            if (r / 8 == c) v[u][r % 8] += diag;
#pragma unroll
            for (int k = 0; k < 8; ++k) v[u][k] *= sc;
            store8(p + r * m.cols, DION_DTYPE_BF16, c, v[u]);
          }
        }
      continue;
    }
    for (int64_t i = global_thread(); i < elems; i += grid_threads()) {
      const int64_t r = i / m.cols, c = i - r * m.cols;
      uint16_t* e = p + r * m.ld + c;
      float v = bf16_to_float(*e);
      if (r == c) v += diag;
      *e = float_to_bf16(v * sc);
    }
  }
}

// The scaling pass of frob_normalize writing bf16(x * inv) to a dense bf16
// batch instead of x * inv in place: one read of x and a 2-byte write, where
// frob_normalize and a store took two reads, a 4-byte write and a 2-byte one.
// grid.y walks the matrices, x the 8-element chunks of each (16-byte
// accesses when the matrix is dense and both sides are aligned).
__global__ void frob_bf16_kernel(ConstMatBatch m, int64_t nchunks, const double* partial, float factor, float eps,
                                 uint16_t* out) {
  __shared__ double sh[33];
  const int64_t elems = m.rows * m.cols;
  for (int64_t b = blockIdx.y; b < m.batch; b += gridDim.y) {
    const float inv = frob_inv(partial, b, nchunks, factor, eps, sh);
    const float* p = mat_at(m, b);
    uint16_t* o = out + b * elems;
    int64_t i0 = 0;
    if (m.ld == m.cols && aligned16(p) && aligned16(o)) {
      const int64_t n8 = elems / 8;
      for (int64_t j = global_thread(); j < n8; j += grid_threads()) {
        float v[8];
        load8(p, DION_DTYPE_FP32, j, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] *= inv;
        store8(o, DION_DTYPE_BF16, j, v);
      }
      i0 = n8 * 8;
    }
    for (int64_t i = i0 + global_thread(); i < elems; i += grid_threads()) {
      const int64_t r = i / m.cols;
      float v = p[r * m.ld + (i - r * m.cols)];
      v *= inv;
      o[i] = float_to_bf16(v);
    }
  }
}

__global__ void nonzero_kernel(ConstMatBatch m, int64_t nchunks, int32_t* flags) {
  const int64_t elems = m.rows * m.cols, chunk = ceil_div(elems, nchunks);
  const int64_t e0 = blockIdx.x * chunk, e1 = min(e0 + chunk, elems);
  for (int64_t b = blockIdx.y; b < m.batch; b += gridDim.y) {
    const float* p = mat_at(m, b);
    int any = 0;
    if (e0 + threadIdx.x < e1)
      for (FlatWalk w(e0 + threadIdx.x, blockDim.x, m.cols); w.e < e1; w.next(blockDim.x, m.cols))
        any |= p[w.offset(m.ld)] != 0.0f;  // NaN counts as nonzero, -0 as zero
    if (__syncthreads_or(any) && threadIdx.x == 0) flags[b] = 1;  // same value from every writer
  }
}

struct ZeroWhereFlag {
  MatBatch p;
  const int32_t* nonzero;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    if (!nonzero[b]) mat_at(p, b)[i * p.ld + j] = 0.0f;
  }
};

struct CopyWhereFlag {
  MatBatch r;
  ConstMatBatch q;
  const int32_t* nonzero;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    if (!nonzero[b]) mat_at(r, b)[i * r.ld + j] = mat_at(q, b)[i * q.ld + j];
  }
};

// ---- column sums: tiles of 32 columns x a chunk of rows ----

enum SumOp { kSquares = 0, kAbs = 1 };

struct ColPlan {
  int64_t tiles, nr;  // column tiles of 32, row chunks
};

// Columns in tiles of 32 W (W consecutive columns per thread); enough row
// chunks for `waves` blocks per SM. The wide tiles' kernels hold 4 blocks per
// SM (64 registers a thread): 16 makes about four full rounds of them, so
// the last, partly filled round is a small share (8 was ~2.2 rounds, the
// third 18 % full: a quarter of the kernel's time at a fraction of the
// bandwidth, measured on an H100).
template <int W = 1>
ColPlan col_plan(const Ctx& c, int64_t rows, int64_t cols, int64_t batch) {
  constexpr int64_t waves = W == 1 ? 4 : 16;
  ColPlan p;
  p.tiles = std::max<int64_t>(1, ceil_div(cols, static_cast<int64_t>(kTileX) * W));
  const int64_t bz = std::min<int64_t>(std::max<int64_t>(batch, 1), 65535);
  const int64_t fill = ceil_div(static_cast<int64_t>(c.sms) * waves, p.tiles * bz);
  p.nr = std::min<int64_t>({std::max<int64_t>(fill, 1), std::max<int64_t>(1, ceil_div(rows, 64)), 65535});
  return p;
}

dim3 col_grid(const ColPlan& p, int64_t batch) {
  return dim3(static_cast<unsigned>(p.tiles), static_cast<unsigned>(p.nr),
              static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(batch, 1), 65535)));
}

// Element sources of the sum kernels: src.at(b) is matrix b's accessor,
// (i, j) -> its element as a float. An fp32 batch, or Dion2's momentum M + G
// read from the typed buffers (momentum_multi's axpby with mu = g_scale = 1,
// the same fp32 operations: no FMA contraction in these kernels).
struct MatSrc {
  ConstMatBatch m;
  struct At {
    const float* p;
    int64_t ld;
    __device__ __forceinline__ float operator()(int64_t i, int64_t j) const { return p[i * ld + j]; }
    // Elements (i, j0 .. j0 + 7), 0 past the last column (the chunked sums'
    // accessor; element loads: the fp32 batches it serves are small).
    __device__ __forceinline__ void get8(int64_t i, int64_t j0, int64_t cols, float (&v)[8]) const {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = j0 + k < cols ? p[i * ld + j0 + k] : 0.0f;
    }
  };
  __device__ __forceinline__ At at(int64_t b) const { return At{mat_at(m, b), m.ld}; }
};

struct MomentumSrc {
  const TensorEntry* list;
  int64_t per, rows, cols;
  int32_t* nonfinite;  // nullable: set to 1 where a gradient element is NaN or Inf (check_nonfinite's flag)
  struct At {
    const void *pm, *pg;
    dion_dtype_t dm, dg;
    int64_t base, cols;
    bool vec;  // both buffers 16-byte aligned and cols % 8 == 0: chunks are 16-byte loads
    int32_t* nonfinite;
    __device__ __forceinline__ float operator()(int64_t i, int64_t j) const {
      const float mu = 1.0f, g_scale = 1.0f;
      const int64_t o = base + i * cols + j;
      const float g = load_elem(pg, dg, o);
      if (nonfinite && !isfinite(g)) *nonfinite = 1;
      return mu * load_elem(pm, dm, o) + g_scale * g;
    }
    // Elements (i, j0 .. j0 + 7) (j0 % 8 == 0), 0 past the last column: two
    // 16-byte loads (32 for fp32) where vec, the same values as operator().
    __device__ __forceinline__ void get8(int64_t i, int64_t j0, int64_t, float (&v)[8]) const {
      if (vec) {
        const float mu = 1.0f, g_scale = 1.0f;
        const int64_t c = (base + i * cols + j0) / 8;
        float m[8], g[8];
        const Raw8 rm = load_raw8(pm, dm, c), rg = load_raw8(pg, dg, c);
        cvt8(rm, dm, m);
        cvt8(rg, dg, g);
        bool bad = false;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          bad = bad || !isfinite(g[k]);
          v[k] = mu * m[k] + g_scale * g[k];
        }
        if (nonfinite && bad) *nonfinite = 1;
        return;
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = j0 + k < cols ? (*this)(i, j0 + k) : 0.0f;
    }
  };
  __device__ __forceinline__ At at(int64_t b) const {
    const TensorEntry& e = list[b / per];
    const void *pm = e.ptr[kState0], *pg = e.ptr[kGrad];
    return At{pm,
              pg,
              static_cast<dion_dtype_t>(e.dtype[kState0]),
              static_cast<dion_dtype_t>(e.dtype[kGrad]),
              (b % per) * rows * cols,
              cols,
              cols % 8 == 0 && aligned16(pm) && aligned16(pg),
              nonfinite};
  }
};

// Elements (i, j0 .. j0 + W - 1) of a source accessor: W = 1 reads the one
// element (j0 < cols), W = 8 eight (At::get8: 16-byte loads where the source
// allows them, 0 past the last column). Every element is read exactly once
// (FixupSrc writes as it reads).
template <int W, class At>
__device__ __forceinline__ void get_chunk(const At& p, int64_t i, int64_t j0, int64_t cols, float (&v)[W]) {
  if constexpr (W == 1)
    v[0] = p(i, j0);
  else
    p.get8(i, j0, cols, v);
}

// Sources whose accessor writes as it reads (FixupSrc) have rows4: four
// rows' elements (i, i + step, ..., j) loaded before any is written, which
// the compiler may not do itself across the writes (the loads would wait
// one by one on the stores they may alias).
template <class A, class = void>
struct has_rows4 : std::false_type {};
template <class A>
struct has_rows4<A, std::void_t<decltype(&A::rows4)>> : std::true_type {};

// partial[(b * nr + chunk) * cols + j] = sum over the chunk's rows of op(m[i, j]):
// tiles of 32 W columns (thread x of row stride y reads columns W x .. W x + W -
// 1 of its rows), the block's kTileY row strides summed in shared memory in
// order. W = 1 is the column kernel of col_sums; W = 8 (slice_l1_of) reads
// Dion2's M + G at close to the copy bandwidth (the one-element-per-thread
// tiles reached about 40 % of it on bf16 buffers).
template <int OP, int W, class Src>
__global__ void col_partial_kernel(Src src, int64_t batch, int64_t rows, int64_t cols, int64_t nr, double* partial) {
  __shared__ double sh[kTileY][kTileX * W + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j0 = (blockIdx.x * static_cast<int64_t>(kTileX) + tx) * W;
  const int64_t chunk = ceil_div(rows, nr), r0 = blockIdx.y * chunk, r1 = min(r0 + chunk, rows);
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const auto p = src.at(b);
    double s[W] = {};
    int64_t i4 = r0 + ty;  // the rows done four at a time (rows4), in the same order
    if constexpr (W == 1 && has_rows4<std::remove_cv_t<decltype(p)>>::value) {
      if (j0 < cols)
        for (; i4 + 3 * kTileY < r1; i4 += 4 * kTileY) {
          float v[4];
          p.rows4(i4, kTileY, j0, v);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const double d = v[k];
            s[0] += OP == kSquares ? d * d : fabs(d);
          }
        }
    }
    if (j0 < cols) {
#pragma unroll 4
      for (int64_t i = i4; i < r1; i += kTileY) {
        float v[W];
        get_chunk<W>(p, i, j0, cols, v);
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const double d = v[k];
          s[k] += OP == kSquares ? d * d : fabs(d);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < W; ++k) sh[ty][tx * W + k] = s[k];
    __syncthreads();
    const int t = ty * kTileX + tx;  // the tile's column t (W = 1: the threads of row stride 0)
    const int64_t j = blockIdx.x * static_cast<int64_t>(kTileX) * W + t;
    if (t < kTileX * W && j < cols) {
      double tot = 0.0;
      for (int y = 0; y < kTileY; ++y) tot += sh[y][t];
      partial[(b * nr + blockIdx.y) * cols + j] = tot;
    }
    __syncthreads();
  }
}

__device__ __forceinline__ double col_total(const double* partial, int64_t b, int64_t nr, int64_t cols, int64_t j) {
  double s = 0.0;
  for (int64_t c = 0; c < nr; ++c) s += partial[(b * nr + c) * cols + j];
  return s;
}

// m(i, j) *= 1 / (sqrt(sumsq[b * cols + j]) + eps), each thread's column
// scale computed once, in double (m left as it was unless write_m); then the
// copies (rb, list: nullable):
// col_normalize's scale and Backend::col_scale_store.
__global__ void col_scale_store_kernel(MatBatch m, int64_t nr, const double* sumsq, float eps, uint16_t* rb,
                                       const TensorEntry* list, int f, const int32_t* skip, bool write_m) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j = blockIdx.x * static_cast<int64_t>(kTileX) + tx;
  const int64_t chunk = ceil_div(m.rows, nr), r0 = blockIdx.y * chunk, r1 = min(r0 + chunk, m.rows);
  if (j >= m.cols) return;
  const bool store = list && !(skip && *skip);
  for (int64_t b = blockIdx.z; b < m.batch; b += gridDim.z) {
    const double inv = 1.0 / (sqrt(sumsq[b * m.cols + j]) + eps);
    float* p = mat_at(m, b);
    uint16_t* o = rb ? rb + b * m.rows * m.cols : nullptr;
    void* dst = store ? list[b].ptr[f] : nullptr;
    const dion_dtype_t dt = store ? static_cast<dion_dtype_t>(list[b].dtype[f]) : DION_DTYPE_FP32;
    // Four rows' loads before their stores (which they might alias), then one at a time.
    int64_t i = r0 + ty;
    for (; i + 3 * kTileY < r1; i += 4 * kTileY) {
      float x[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) x[k] = p[(i + k * kTileY) * m.ld + j];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t row = i + k * kTileY;
        const float v = static_cast<float>(x[k] * inv);
        if (write_m) p[row * m.ld + j] = v;
        if (o) o[row * m.cols + j] = float_to_bf16(v);
        if (dst) store_elem(dst, dt, row * m.cols + j, v);
      }
    }
    for (; i < r1; i += kTileY) {
      const float v = static_cast<float>(p[i * m.ld + j] * inv);
      if (write_m) p[i * m.ld + j] = v;
      if (o) o[i * m.cols + j] = float_to_bf16(v);
      if (dst) store_elem(dst, dt, i * m.cols + j, v);
    }
  }
}

// out[b * cols + j] = total of column j (as T).
template <class T>
__global__ void col_finish_kernel(int64_t batch, int64_t cols, int64_t nr, const double* partial, T* out) {
  for (int64_t e = global_thread(); e < batch * cols; e += grid_threads()) {
    const int64_t b = e / cols, j = e % cols;
    out[e] = static_cast<T>(col_total(partial, b, nr, cols, j));
  }
}

// ---- row sums: one warp per row ----

template <int OP, int W, class T, class Src>
__global__ void row_sum_kernel(Src src, int64_t batch, int64_t rows, int64_t cols, T* out) {
  const int lane = threadIdx.x;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const auto p = src.at(b);
    for (int64_t i = blockIdx.x * static_cast<int64_t>(kTileY) + threadIdx.y; i < rows;
         i += static_cast<int64_t>(gridDim.x) * kTileY) {
      double s = 0.0;
#pragma unroll 4
      for (int64_t j0 = lane * W; j0 < cols; j0 += kTileX * W) {
        float v[W];
        get_chunk<W>(p, i, j0, cols, v);
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const double d = v[k];
          s += OP == kSquares ? d * d : fabs(d);
        }
      }
      s = warp_sum(s);
      if (lane == 0) out[b * rows + i] = static_cast<T>(s);
    }
  }
}

// Row totals of op(src) into out (batch x rows): one warp per row, lane l
// reading chunks l, l + 32, ... of W columns.
template <int OP, class T, int W = 1, class Src = MatSrc>
void row_sums(const Ctx& c, Src src, int64_t batch, int64_t rows, int64_t cols, T* out, const char* name) {
  const int64_t gy = std::min<int64_t>(batch, 65535);
  const int64_t gx = std::min<int64_t>(ceil_div(rows, kTileY), std::max<int64_t>(1, ceil_div(c.sms * 32, gy)));
  row_sum_kernel<OP, W, T><<<dim3(static_cast<unsigned>(std::max<int64_t>(gx, 1)), static_cast<unsigned>(gy)),
                             dim3(kTileX, kTileY), 0, c.stream>>>(src, batch, rows, cols, out);
  cuda::check_launch(name);
}
template <int OP, class T>
void row_sums(const Ctx& c, ConstMatBatch m, T* out, const char* name) {
  row_sums<OP, T>(c, MatSrc{m}, m.batch, m.rows, m.cols, out, name);
}

// Column totals of op(m) into out (batch x cols), through `partial`
// (col_partial_bytes<W>).
template <int OP, class T, int W = 1, class Src>
void col_sums(const Ctx& c, Src src, int64_t batch, int64_t rows, int64_t cols, T* out, double* partial,
              const char* name) {
  const ColPlan plan = col_plan<W>(c, rows, cols, batch);
  col_partial_kernel<OP, W><<<col_grid(plan, batch), dim3(kTileX, kTileY), 0, c.stream>>>(src, batch, rows, cols,
                                                                                          plan.nr, partial);
  cuda::check_launch(name);
  col_finish_kernel<T><<<blocks_1d(c, batch * cols), kThreads, 0, c.stream>>>(batch, cols, plan.nr, partial, out);
  cuda::check_launch(name);
}
template <int OP, class T>
void col_sums(const Ctx& c, ConstMatBatch m, T* out, double* partial, const char* name) {
  col_sums<OP, T>(c, MatSrc{m}, m.batch, m.rows, m.cols, out, partial, name);
}

template <int W = 1>
size_t col_partial_bytes(const Ctx& c, int64_t rows, int64_t cols, int64_t batch) {
  const ColPlan plan = col_plan<W>(c, rows, cols, batch);
  return sizeof(double) * static_cast<size_t>(batch * plan.nr * cols);
}

// ---- NorMuon ----

// Per matrix: the variance lerp of every neuron, its scale, and the rescale
// that keeps the Frobenius norm (host backend: the same expressions).
__global__ void neuron_stats_kernel(int64_t batch, int64_t N, int64_t len, const double* ss, float* v,
                                    int64_t v_per_matrix, float beta2, const int32_t* selected, double* scale,
                                    double* rescale) {
  __shared__ double sh[33];
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x) {
    double f2 = 0.0, g2 = 0.0;
    for (int64_t s = threadIdx.x; s < N; s += blockDim.x) {
      const double sq = ss[b * N + s];
      f2 += sq;
      const int64_t vi = b * v_per_matrix + (selected ? selected[b * N + s] : s);
      const float mean = static_cast<float>(sq / static_cast<double>(len));
      float vv = v[vi];
      vv = vv + (1.0f - beta2) * (mean - vv);
      v[vi] = vv;
      const double sc = 1.0 / (sqrt(static_cast<double>(vv)) + 1e-8);
      scale[b * N + s] = sc;
      g2 += sq * sc * sc;
    }
    f2 = block_sum(f2, sh);
    g2 = block_sum(g2, sh);
    if (threadIdx.x == 0) rescale[b] = sqrt(f2) / fmax(sqrt(g2), 1e-8);
  }
}

struct NeuronScale {
  MatBatch u;
  bool rows_are_neurons;
  int64_t N;
  const double* scale;
  const double* rescale;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    float* p = mat_at(u, b) + i * u.ld + j;
    *p = static_cast<float>(*p * scale[b * N + (rows_are_neurons ? i : j)] * rescale[b]);
  }
};

// Dense bf16 matrices (batch stride rows * cols) as a row/column sums source.
struct Bf16Src {
  const uint16_t* p;
  int64_t rows, cols;
  bool vec;  // 16-byte aligned and cols % 8 == 0: get8 is one 16-byte load
  struct At {
    const uint16_t* p;
    int64_t cols;
    bool vec;
    __device__ __forceinline__ float operator()(int64_t i, int64_t j) const { return bf16_to_float(p[i * cols + j]); }
    __device__ __forceinline__ void get8(int64_t i, int64_t j0, int64_t ncols, float (&v)[8]) const {
      if (vec) {
        load8(p + i * cols, DION_DTYPE_BF16, j0 / 8, v);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = j0 + k < ncols ? bf16_to_float(p[i * cols + j0 + k]) : 0.0f;
      }
    }
  };
  __device__ __forceinline__ At at(int64_t b) const { return At{p + b * rows * cols, cols, vec}; }
};

}  // namespace

size_t frob_normalize_scratch(const Ctx& c, const MatBatch& m) {
  return sizeof(double) * static_cast<size_t>(m.batch * flat_chunks(c, m.rows, m.cols, m.batch));
}

void frob_normalize(const Ctx& c, MatBatch m, float factor, float eps, void* scratch) {
  if (m.batch <= 0 || m.rows <= 0 || m.cols <= 0) return;
  const int64_t nch = flat_chunks(c, m.rows, m.cols, m.batch);
  double* partial = static_cast<double*>(scratch);
  frob_partial_kernel<<<flat_grid(nch, m.batch), kThreads, 0, c.stream>>>(m, nch, partial);
  cuda::check_launch("frob_normalize partial-sum kernel");
  frob_scale_kernel<<<flat_grid(nch, m.batch), kThreads, 0, c.stream>>>(m, nch, partial, factor, eps);
  cuda::check_launch("frob_normalize scale kernel");
}

void frob_normalize_bf16(const Ctx& c, ConstMatBatch m, float factor, float eps, void* out, void* scratch) {
  if (m.batch <= 0 || m.rows <= 0 || m.cols <= 0) return;
  // The partial sums exactly as frob_normalize takes them (same chunks).
  const int64_t nch = flat_chunks(c, m.rows, m.cols, m.batch);
  double* partial = static_cast<double*>(scratch);
  const MatBatch mm{const_cast<float*>(m.p), m.rows, m.cols, m.ld, m.stride, m.batch};  // read only
  frob_partial_kernel<<<flat_grid(nch, m.batch), kThreads, 0, c.stream>>>(mm, nch, partial);
  cuda::check_launch("frob_normalize_bf16 partial-sum kernel");
  frob_bf16_kernel<<<grid_multi(c, m.batch, ceil_div(m.rows * m.cols, 8)), kThreads, 0, c.stream>>>(
      m, nch, partial, factor, eps, static_cast<uint16_t*>(out));
  cuda::check_launch("frob_normalize_bf16 scale kernel");
}

void frob_normalize_bf16_parts(const Ctx& c, ConstMatBatch m, const double* parts, int64_t nparts, float factor,
                               float eps, void* out) {
  if (m.batch <= 0 || m.rows <= 0 || m.cols <= 0) return;
  frob_bf16_kernel<<<grid_multi(c, m.batch, ceil_div(m.rows * m.cols, 8)), kThreads, 0, c.stream>>>(
      m, nparts, parts, factor, eps, static_cast<uint16_t*>(out));
  cuda::check_launch("frob_normalize_bf16_parts kernel");
}

void frob_scale_bf16(const Ctx& c, MatBatch m, const double* parts, int64_t nparts, float factor, float eps, int power,
                     float diag) {
  if (m.batch <= 0 || m.rows <= 0 || m.cols <= 0) return;
  frob_scale_bf16_kernel<<<grid_multi(c, m.batch, ceil_div(m.rows * m.cols, 8)), kThreads, 0, c.stream>>>(
      m, nparts, parts, factor, eps, power, diag);
  cuda::check_launch("frob_scale_bf16 kernel");
}

// The column totals (batch * cols doubles), then col_sums' partial sums.
size_t col_normalize_scratch(const Ctx& c, const MatBatch& m) {
  return sizeof(double) * static_cast<size_t>(m.batch * m.cols) + col_partial_bytes(c, m.rows, m.cols, m.batch);
}

// col_sums' totals of squares, then col_scale_store_kernel's scale (no copies).
void col_normalize(const Ctx& c, MatBatch m, float eps, void* scratch) {
  if (m.batch <= 0 || m.rows <= 0 || m.cols <= 0) return;
  double* totals = static_cast<double*>(scratch);
  col_sums<kSquares, double>(c, ConstMatBatch(m), totals, totals + m.batch * m.cols, "col_normalize sum kernel");
  const ColPlan plan = col_plan(c, m.rows, m.cols, m.batch);
  col_scale_store_kernel<<<col_grid(plan, m.batch), dim3(kTileX, kTileY), 0, c.stream>>>(
      m, plan.nr, totals, eps, nullptr, nullptr, 0, nullptr, true);
  cuda::check_launch("col_normalize scale kernel");
}

size_t slice_l1_scratch(const Ctx& c, const ConstMatBatch& m, Axis axis) {
  return axis == kRows ? 0 : col_partial_bytes<8>(c, m.rows, m.cols, m.batch);
}

namespace {
// Per-slice L1 norms of the elements src gives (slice_l1's and
// momentum_l1_multi's): rows by warps, columns through `partial`.
template <class Src>
void slice_l1_of(const Ctx& c, Src src, int64_t batch, int64_t rows, int64_t cols, Axis axis, float* out,
                 double* partial, const char* name) {
  const int64_t N = axis == kRows ? rows : cols;
  if (batch <= 0 || N <= 0) return;
  if (rows <= 0 || cols <= 0) {  // empty slices: all norms are 0
    cuda::check(cudaMemsetAsync(out, 0, sizeof(float) * static_cast<size_t>(batch * N), c.stream), name);
    return;
  }
  // Eight columns per thread (16-byte loads of M and G for momentum_l1_multi).
  if (axis == kRows)
    row_sums<kAbs, float, 8>(c, src, batch, rows, cols, out, name);
  else
    col_sums<kAbs, float, 8>(c, src, batch, rows, cols, out, partial, name);
}
}  // namespace

void slice_l1(const Ctx& c, ConstMatBatch m, Axis axis, float* out, void* scratch) {
  slice_l1_of(c, MatSrc{m}, m.batch, m.rows, m.cols, axis, out, static_cast<double*>(scratch), "slice_l1 kernel");
}

namespace {

// nan_to_num's value of v (NaN -> 0, +-inf -> +-FLT_MAX).
__device__ __forceinline__ float finite_or_clamped(float v) {
  if (isnan(v)) return 0.0f;
  if (isinf(v)) return v > 0.0f ? FLT_MAX : -FLT_MAX;
  return v;
}
// Writes v over old only where the bits differ (the sequence's kernels
// write only there too: nan_to_num where not finite, the fix-up where
// flagged), so a clean P or R is read, not rewritten.
__device__ __forceinline__ bool put_if_changed(float* x, float old, float v) {
  if (__float_as_uint(v) == __float_as_uint(old)) return false;
  *x = v;
  return true;
}

// Backend::finish_p: grid.y walks the matrices (dense, `per` elements each),
// read as float4s where aligned. pb holds bf16(p) on entry, so an element is
// written (to p and pb) only where the fix-up changes it: a clean P is only
// read; with `all`, pb receives every element's bf16 copy.
// p's element i fixed up (v0 as read): written where it changed; returns it.
__device__ __forceinline__ float finish_p_fix(float* x, int64_t i, float v0, bool keep, bool* changed) {
  const float v = keep ? finite_or_clamped(v0) : 0.0f;
  *changed = put_if_changed(x + i, v0, v);
  return v;
}
__device__ __forceinline__ void finish_p_at(float* x, uint16_t* o, int64_t i, float v0, bool keep, bool all) {
  bool changed;
  const float v = finish_p_fix(x, i, v0, keep, &changed);
  if (o && (changed || all)) o[i] = float_to_bf16(v);
}

__global__ void finish_p_kernel(float* p, int64_t batch, int64_t per, const int32_t* flags, uint16_t* pb, bool all) {
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const bool keep = flags[b] != 0;
    float* x = p + b * per;
    uint16_t* o = pb ? pb + b * per : nullptr;
    int64_t i0 = 0;
    if (aligned16(x)) {
      const int64_t n4 = per / 4;
      // Every element's copy (all) into an 8-byte aligned pb: the four bf16
      // values of a float4 in one store instead of four 2-byte ones.
      const bool packed = o && all && (reinterpret_cast<uintptr_t>(o) & 7) == 0;
      for (int64_t j = global_thread(); j < n4; j += grid_threads()) {
        const float4 v = reinterpret_cast<const float4*>(x)[j];
        if (packed) {
          const float v0[4] = {v.x, v.y, v.z, v.w};
          float w[4];
          bool changed;
#pragma unroll
          for (int k = 0; k < 4; ++k) w[k] = finish_p_fix(x, 4 * j + k, v0[k], keep, &changed);
          reinterpret_cast<uint2*>(o)[j] =
              make_uint2(half2_bits(w[0], w[1], DION_DTYPE_BF16), half2_bits(w[2], w[3], DION_DTYPE_BF16));
        } else {
          finish_p_at(x, o, 4 * j, v.x, keep, all);
          finish_p_at(x, o, 4 * j + 1, v.y, keep, all);
          finish_p_at(x, o, 4 * j + 2, v.z, keep, all);
          finish_p_at(x, o, 4 * j + 3, v.w, keep, all);
        }
      }
      i0 = 4 * n4;
    }
    for (int64_t i = i0 + global_thread(); i < per; i += grid_threads()) finish_p_at(x, o, i, x[i], keep, all);
  }
}

// Backend::finish_r's source for col_sums<kSquares>: each element of r
// fixed up (nan_to_num, or q's where the matrix is flagged) and, since the
// column-sum kernels read every element exactly once, written back where it
// changed and to the bf16 copy on the way. The sums are then those of the
// fixed-up r, in col_normalize's tiles, chunks and order.
// q: the batch q, or (ql non-null) field qf of ql[b], dense rows x cols in
// its dtype.
struct FixupSrc {
  MatBatch r;
  const int32_t* flags;
  ConstMatBatch q;
  const TensorEntry* ql;
  int qf;
  uint16_t* rb;
  struct At {
    float* p;
    const float* qp;
    const void* qs;  // the field's elements (ql), else null
    dion_dtype_t qdt;
    uint16_t* o;
    int64_t ld, qld, cols;
    bool keep;
    __device__ __forceinline__ float qv(int64_t i, int64_t j) const {
      return qs ? load_elem(qs, qdt, i * cols + j) : qp[i * qld + j];
    }
    __device__ __forceinline__ float operator()(int64_t i, int64_t j) const {
      const float v0 = p[i * ld + j], v = keep ? finite_or_clamped(v0) : qv(i, j);
      put_if_changed(p + i * ld + j, v0, v);
      if (o) o[i * cols + j] = float_to_bf16(v);
      return v;
    }
    // Rows i, i + step, i + 2 step, i + 3 step of column j: the same values
    // and writes as four calls, the loads first.
    __device__ __forceinline__ void rows4(int64_t i, int64_t step, int64_t j, float (&v)[4]) const {
      float v0[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) v0[k] = p[(i + k * step) * ld + j];
      if (keep) {
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = finite_or_clamped(v0[k]);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = qv(i + k * step, j);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t row = i + k * step;
        put_if_changed(p + row * ld + j, v0[k], v[k]);
        if (o) o[row * cols + j] = float_to_bf16(v[k]);
      }
    }
  };
  __device__ __forceinline__ At at(int64_t b) const {
    const bool keep = flags[b] != 0;
    const void* qs = ql && !keep ? ql[b].ptr[qf] : nullptr;
    const dion_dtype_t qdt = qs ? static_cast<dion_dtype_t>(ql[b].dtype[qf]) : DION_DTYPE_FP32;
    return At{mat_at(r, b), ql ? nullptr : mat_at(q, b), qs, qdt, rb ? rb + b * r.rows * r.cols : nullptr, r.ld,
              q.ld, r.cols, keep};
  }
};
static_assert(has_rows4<FixupSrc::At>::value && !has_rows4<MatSrc::At>::value, "rows4 detection");

}  // namespace

void finish_p(const Ctx& c, MatBatch p, const int32_t* flags, void* pb, bool pb_all) {
  const int64_t per = p.rows * p.cols;
  if (p.batch <= 0 || per <= 0) return;
  finish_p_kernel<<<grid_multi(c, p.batch, ceil_div(per, 4)), kThreads, 0, c.stream>>>(p.p, p.batch, per, flags,
                                                                         static_cast<uint16_t*>(pb), pb_all);
  cuda::check_launch("finish_p kernel");
}

size_t finish_r_scratch(const Ctx& c, const ConstMatBatch& r) { return col_partial_bytes(c, r.rows, r.cols, r.batch); }

void finish_r(const Ctx& c, MatBatch r, const int32_t* flags, ConstMatBatch q, const TensorEntry* qlist, Field qf,
              void* rb, double* sumsq, void* scratch) {
  if (r.batch <= 0 || r.cols <= 0) return;
  if (r.rows <= 0) {  // empty columns: their sums are 0
    cuda::check(cudaMemsetAsync(sumsq, 0, sizeof(double) * static_cast<size_t>(r.batch * r.cols), c.stream),
                "cudaMemsetAsync (finish_r)");
    return;
  }
  const FixupSrc src{r, flags, q, qlist, static_cast<int>(qf), static_cast<uint16_t*>(rb)};
  col_sums<kSquares, double>(c, src, r.batch, r.rows, r.cols, sumsq, static_cast<double*>(scratch), "finish_r kernel");
}

void col_scale_store(const Ctx& c, MatBatch r, const double* sumsq, float eps, void* rb, const TensorEntry* list,
                     Field f, const int32_t* skip, bool write_r) {
  if (r.batch <= 0 || r.rows <= 0 || r.cols <= 0) return;
  const ColPlan plan = col_plan(c, r.rows, r.cols, r.batch);
  col_scale_store_kernel<<<col_grid(plan, r.batch), dim3(kTileX, kTileY), 0, c.stream>>>(
      r, plan.nr, sumsq, eps, static_cast<uint16_t*>(rb), list, static_cast<int>(f), skip, write_r);
  cuda::check_launch("col_scale_store kernel");
}

size_t momentum_l1_multi_scratch(const Ctx& c, int64_t count, int64_t per, int64_t rows, int64_t cols, Axis axis) {
  return axis == kRows ? 0 : col_partial_bytes<8>(c, rows, cols, count * per);
}

void momentum_l1_multi(const Ctx& c, const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols,
                       Axis axis, float* out, void* scratch, int32_t* nonfinite) {
  slice_l1_of(c, MomentumSrc{list, per, rows, cols, nonfinite}, count * per, rows, cols, axis, out,
              static_cast<double*>(scratch), "momentum_l1_multi kernel");
}

size_t zero_fixup_scratch(const Ctx& c, const ConstMatBatch& m) {
  (void)c;
  return sizeof(int32_t) * static_cast<size_t>(std::max<int64_t>(m.batch, 1));
}

void nonzero_flags(const Ctx& c, ConstMatBatch m, int32_t* flags) {
  if (m.batch <= 0) return;
  cuda::check(cudaMemsetAsync(flags, 0, sizeof(int32_t) * static_cast<size_t>(m.batch), c.stream),
              "cudaMemsetAsync (nonzero_flags)");
  if (m.rows > 0 && m.cols > 0) {
    const int64_t nch = flat_chunks(c, m.rows, m.cols, m.batch);
    nonzero_kernel<<<flat_grid(nch, m.batch), kThreads, 0, c.stream>>>(m, nch, flags);
    cuda::check_launch("nonzero_flags kernel");
  }
}

void zero_fixup_flagged(const Ctx& c, const int32_t* flags, MatBatch p, MatBatch r, ConstMatBatch q) {
  for_each_2d(c, p.batch, p.rows, p.cols, ZeroWhereFlag{p, flags}, "zero_fixup kernel (p)");
  for_each_2d(c, r.batch, r.rows, r.cols, CopyWhereFlag{r, q, flags}, "zero_fixup kernel (r)");
}

void zero_fixup(const Ctx& c, ConstMatBatch m, MatBatch p, MatBatch r, ConstMatBatch q, void* scratch) {
  if (m.batch <= 0) return;
  int32_t* nonzero = static_cast<int32_t*>(scratch);
  nonzero_flags(c, m, nonzero);
  p.batch = std::min(p.batch, m.batch);
  r.batch = std::min(r.batch, m.batch);
  zero_fixup_flagged(c, nonzero, p, r, q);
}

size_t neuron_normalize_scratch(const Ctx& c, const MatBatch& u, Axis axis) {
  const int64_t N = axis == kRows ? u.rows : u.cols;
  size_t bytes = sizeof(double) * static_cast<size_t>(2 * u.batch * N + u.batch);
  if (axis == kCols) bytes += col_partial_bytes(c, u.rows, u.cols, u.batch);
  return bytes;
}

namespace {
// The statistics of neuron_normalize and neuron_scales: the sums of squares
// of u's neurons (or of in's, dense bf16 matrices of u's shape, where in is
// not null) into scratch, then v, scale (batch x N) and rescale (batch).
void neuron_stats(const Ctx& c, MatBatch u, Axis axis, float* v, int64_t v_per_matrix, float beta2,
                  const int32_t* selected, void* scratch, const uint16_t* in, double* scale, double* rescale) {
  const int64_t N = axis == kRows ? u.rows : u.cols;    // neurons
  const int64_t len = axis == kRows ? u.cols : u.rows;  // elements per neuron
  double* ss = static_cast<double*>(scratch);
  double* partial = ss + u.batch * N * 2 + u.batch;  // past neuron_normalize's scale and rescale
  if (in) {
    const Bf16Src src{in, u.rows, u.cols, u.cols % 8 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0};
    if (axis == kRows)
      row_sums<kSquares, double, 8>(c, src, u.batch, u.rows, u.cols, ss, "neuron_scales row kernel");
    else
      col_sums<kSquares, double>(c, src, u.batch, u.rows, u.cols, ss, partial, "neuron_scales column kernel");
  } else if (axis == kRows) {
    row_sums<kSquares, double>(c, u, ss, "neuron_normalize row kernel");
  } else {
    col_sums<kSquares, double>(c, u, ss, partial, "neuron_normalize column kernel");
  }
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(u.batch, 65535));
  neuron_stats_kernel<<<blocks, kThreads, 0, c.stream>>>(u.batch, N, len, ss, v, v_per_matrix, beta2, selected, scale,
                                                         rescale);
  cuda::check_launch("neuron_normalize variance kernel");
}
}  // namespace

void neuron_normalize(const Ctx& c, MatBatch u, Axis axis, float* v, int64_t v_per_matrix, float beta2,
                      const int32_t* selected, void* scratch) {
  const int64_t N = axis == kRows ? u.rows : u.cols;
  if (u.batch <= 0 || u.rows <= 0 || u.cols <= 0) return;
  double* scale = static_cast<double*>(scratch) + u.batch * N;
  double* rescale = scale + u.batch * N;
  neuron_stats(c, u, axis, v, v_per_matrix, beta2, selected, scratch, nullptr, scale, rescale);
  for_each_2d(c, u.batch, u.rows, u.cols, NeuronScale{u, axis == kRows, N, scale, rescale},
              "neuron_normalize scale kernel");
}

void neuron_scales(const Ctx& c, int64_t batch, int64_t rows, int64_t cols, Axis axis, const void* in, float* v,
                   int64_t v_per_matrix, float beta2, void* scratch, double* scales) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return;
  const int64_t N = axis == kRows ? rows : cols;
  neuron_stats(c, MatBatch{nullptr, rows, cols, cols, rows * cols, batch}, axis, v, v_per_matrix, beta2, nullptr,
               scratch, static_cast<const uint16_t*>(in), scales, scales + batch * N);
}

}  // namespace dion::kernels
