// SPDX-License-Identifier: MIT
// The host (CPU) backend: BLAS/LAPACK (Fortran symbols of any implementation:
// OpenBLAS, reference BLAS/LAPACK) for the dense linear algebra, plain loops
// for the element-wise work. fp32 throughout; the element-wise reductions
// accumulate in double.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "../../core/backend.hpp"
#include "../../core/error.hpp"

extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void sgeqrf_(const int* m, const int* n, float* a, const int* lda, float* tau, float* work, const int* lwork,
             int* info);
void sorgqr_(const int* m, const int* n, const int* k, float* a, const int* lda, const float* tau, float* work,
             const int* lwork, int* info);
void spotrf_(const char* uplo, const int* n, float* a, const int* lda, int* info);
void strsm_(const char* side, const char* uplo, const char* ta, const char* diag, const int* m, const int* n,
            const float* alpha, const float* a, const int* lda, float* b, const int* ldb);
}

namespace dion {

namespace {

int to_int(int64_t v, const char* what) {
  DION_REQUIRE(v >= 0 && v <= 0x7fffffff, DION_ERROR_NOT_SUPPORTED,
               "host backend: %s = %lld exceeds the 32-bit BLAS/LAPACK interface", what, static_cast<long long>(v));
  return static_cast<int>(v);
}

// Scratch that grows and is reused, so steady-state steps do not allocate.
struct Scratch {
  std::vector<float> a, tau, work, prod, slices, neuron;
};
thread_local Scratch g_scratch;

float* grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

inline float* at(const MatBatch& m, int64_t b) { return m.p + b * m.stride; }
inline const float* at(const ConstMatBatch& m, int64_t b) { return m.p + b * m.stride; }

// The bf16 matrices of m (ld and stride count elements) widened exactly into
// buf, dense: the fp32 operands of the host's gemm_bf16 and gemm_bf16_f32.
ConstMatBatch widen_bf16(const ConstMatBatch& m, std::vector<float>& buf) {
  buf.resize(static_cast<size_t>(m.rows * m.cols * m.batch));
  const uint16_t* p = reinterpret_cast<const uint16_t*>(m.p);
  for (int64_t q = 0; q < m.batch; ++q)
    for (int64_t i = 0; i < m.rows; ++i)
      for (int64_t j = 0; j < m.cols; ++j)
        buf[static_cast<size_t>((q * m.rows + i) * m.cols + j)] = bf16_to_float(p[q * m.stride + i * m.ld + j]);
  return ConstMatBatch(buf.data(), m.rows, m.cols, m.cols, m.stride ? m.rows * m.cols : 0, m.batch);
}

class HostBackend final : public Backend {
 public:
  bool host_memory() const override { return true; }
  void set_stream(void*) override {}
  void* alloc(size_t bytes) override {
    if (bytes == 0) bytes = 1;
    void* p = std::aligned_alloc(64, (bytes + 63) & ~size_t(63));
    if (!p) fail(DION_ERROR_OUT_OF_MEMORY, "host backend: cannot allocate %zu bytes", bytes);
    return p;
  }
  void release(void* p) override { std::free(p); }
  void zero(void* p, size_t bytes) override { std::memset(p, 0, bytes); }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (dst != src && bytes) std::memmove(dst, src, bytes);
  }
  void copy2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) override {
    if (!width) return;
    for (size_t i = 0; i < height; ++i)
      std::memmove(static_cast<char*>(dst) + i * dpitch, static_cast<const char*>(src) + i * spitch, width);
  }
  void copy_sync(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void poke_flag(int32_t* flag, int32_t value) override { *flag = value; }
  void synchronize() override {}

  void load(float* dst, const void* src, dion_dtype_t dt, int64_t n) override {
    if (dt == DION_DTYPE_FP32) {
      copy(dst, src, sizeof(float) * static_cast<size_t>(n));
      return;
    }
    for (int64_t i = 0; i < n; ++i) dst[i] = load_elem(src, dt, i);
  }
  void store(void* dst, dion_dtype_t dt, const float* src, int64_t n) override {
    if (dt == DION_DTYPE_FP32) {
      copy(dst, src, sizeof(float) * static_cast<size_t>(n));
      return;
    }
    for (int64_t i = 0; i < n; ++i) store_elem(dst, dt, i, src[i]);
  }
  void split_bf16(void* hi, void* lo, const float* src, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = float_to_bf16(src[i]);
      static_cast<uint16_t*>(hi)[i] = h;
      static_cast<uint16_t*>(lo)[i] = float_to_bf16(src[i] - bf16_to_float(h));
    }
  }
  void load_multi(float* dst, const TensorEntry* list, int64_t count, Field f, int64_t n) override {
    for (int64_t i = 0; i < count; ++i)
      load(dst + i * n, list[i].ptr[f], static_cast<dion_dtype_t>(list[i].dtype[f]), n);
  }
  void load_multi_bf16(void* dst, const TensorEntry* list, int64_t count, Field f, int64_t n) override {
    std::vector<float>& x = fscratch_;
    x.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < count; ++i) {
      load(x.data(), list[i].ptr[f], static_cast<dion_dtype_t>(list[i].dtype[f]), n);
      store(static_cast<uint16_t*>(dst) + i * n, DION_DTYPE_BF16, x.data(), n);
    }
  }
  void store_multi(const TensorEntry* list, int64_t count, Field f, const float* src, int64_t n,
                   const int32_t* skip) override {
    if (skip && *skip) return;
    for (int64_t i = 0; i < count; ++i)
      store(list[i].ptr[f], static_cast<dion_dtype_t>(list[i].dtype[f]), src + i * n, n);
  }
  void store_multi_bf16(const TensorEntry* list, int64_t count, Field f, const void* src, int64_t n,
                        const int32_t* skip) override {
    if (skip && *skip) return;
    for (int64_t i = 0; i < count; ++i) {
      const auto dt = static_cast<dion_dtype_t>(list[i].dtype[f]);
      for (int64_t j = 0; j < n; ++j) store_elem(list[i].ptr[f], dt, j, load_elem(src, DION_DTYPE_BF16, i * n + j));
    }
  }
  void scale_multi(const TensorEntry* list, int64_t count, Field f, int64_t n, float a,
                   const int32_t* skip) override {
    if (skip && *skip) return;
    for (int64_t i = 0; i < count; ++i) {
      const auto dt = static_cast<dion_dtype_t>(list[i].dtype[f]);
      for (int64_t j = 0; j < n; ++j) store_elem(list[i].ptr[f], dt, j, a * load_elem(list[i].ptr[f], dt, j));
    }
  }
  void check_nonfinite(const TensorEntry* list, int64_t count, int64_t, Field f, int32_t* flag) override {
    for (int64_t t = 0; t < count; ++t) {
      const void* p = list[t].ptr[f];
      const auto dt = static_cast<dion_dtype_t>(list[t].dtype[f]);
      for (int64_t i = 0; i < list[t].n; ++i)
        if (!std::isfinite(load_elem(p, dt, i))) {
          *flag = 1;
          return;
        }
    }
  }
  void advance_step(GroupScalars* gs, const StepStatus* st) override {
    if (!st->skip) ++gs->step;
  }
  void merge_skip(StepStatus* st) override { st->skip |= st->skip_mesh; }
  void count_skip(StepStatus* st) override {
    if (st->skip) ++st->skipped_steps;
  }

  void randn_bf16(void* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                  int64_t global_cols, const PhiloxKey& key, const TensorEntry* tensors, const int64_t* step,
                  float scale) override {
    float* f = grow(g_scratch.prod, static_cast<size_t>(batch * rows * cols));
    randn(f, batch, rows, cols, row0, col0, global_cols, key, tensors, step, scale);
    store(out, DION_DTYPE_BF16, f, batch * rows * cols);
  }
  void randn(float* out, int64_t batch, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t global_cols,
             const PhiloxKey& key, const TensorEntry* tensors, const int64_t* step, float scale) override {
    for (int64_t b = 0; b < batch; ++b) {
      PhiloxKey k = key;
      if (tensors) k.tensor = tensors[b].tensor_id;
      if (step) k.step = static_cast<uint64_t>(*step);
      float* o = out + b * rows * cols;
      // Row i is the global elements [s, s + cols): the Philox blocks that
      // cover them, each drawn once (philox_normal4).
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t s = (row0 + i) * global_cols + col0, e = s + cols;
        for (int64_t g = s >> 2; 4 * g < e; ++g) {
          float z[4];
          philox_normal4(k, static_cast<uint64_t>(g), z);
          for (int64_t q = std::max<int64_t>(4 * g, s); q < std::min<int64_t>(4 * g + 4, e); ++q)
            o[i * cols + q - s] = scale * z[q - 4 * g];
        }
      }
    }
  }

  void gemm(bool ta, bool tb, float alpha, ConstMatBatch a, ConstMatBatch b, float beta, MatBatch c,
            dion_matmul_precision_t) override {
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
    const int64_t m = c.rows, n = c.cols, k = ta ? a.rows : a.cols;
    DION_REQUIRE((ta ? a.cols : a.rows) == m && (tb ? b.cols : b.rows) == k && (tb ? b.rows : b.cols) == n,
                 DION_ERROR_INTERNAL, "host gemm: shape mismatch");
    if (m == 0 || n == 0) return;
    const int M = to_int(m, "gemm m"), N = to_int(n, "gemm n"), K = to_int(k, "gemm k");
    const int lda = to_int(std::max<int64_t>(a.ld, 1), "lda"), ldb = to_int(std::max<int64_t>(b.ld, 1), "ldb"),
              ldc = to_int(std::max<int64_t>(c.ld, 1), "ldc");
    const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
    for (int64_t i = 0; i < c.batch; ++i) {
      if (K == 0) {
        float* cp = at(c, i);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t s = 0; s < n; ++s) cp[r * c.ld + s] = beta == 0.0f ? 0.0f : beta * cp[r * c.ld + s];
        continue;
      }
      sgemm_(&opb, &opa, &N, &M, &K, &alpha, at(b, i), &ldb, at(a, i), &lda, &beta, at(c, i), &ldc);
    }
  }

  void gemm_bf16(bool ta, bool tb, float alpha, ConstMatBatch a, ConstMatBatch b, float beta, MatBatch c) override {
    // Widen to fp32 (exact), multiply in fp32, round C to bf16.
    std::vector<float> fa, fb, fc;
    ConstMatBatch wa = widen_bf16(a, fa), wb = widen_bf16(b, fb);
    widen_bf16(c, fc);  // C's old values, for beta
    MatBatch out{fc.data(), c.rows, c.cols, c.cols, c.rows * c.cols, c.batch};
    gemm(ta, tb, alpha, wa, wb, beta, out, DION_MATMUL_FP32);
    uint16_t* cp = reinterpret_cast<uint16_t*>(c.p);
    for (int64_t q = 0; q < c.batch; ++q)
      for (int64_t i = 0; i < c.rows; ++i)
        for (int64_t j = 0; j < c.cols; ++j)
          cp[q * c.stride + i * c.ld + j] = float_to_bf16(fc[static_cast<size_t>((q * c.rows + i) * c.cols + j)]);
  }

  void gemm_bf16_out(bool ta, bool tb, float alpha, ConstMatBatch a, ConstMatBatch b, float beta, ConstMatBatch c,
                     MatBatch d) override {
    DION_REQUIRE(c.rows == d.rows && c.cols == d.cols && c.batch == d.batch && c.ld == c.cols &&
                     d.ld == d.cols && c.stride == c.rows * c.cols && d.stride == d.rows * d.cols,
                 DION_ERROR_INTERNAL, "host gemm_bf16_out: c and d must be dense, of one shape");
    std::memcpy(d.p, c.p, sizeof(uint16_t) * static_cast<size_t>(d.batch * d.stride));
    gemm_bf16(ta, tb, alpha, a, b, beta, d);
  }
  void gemm_bf16_f32(bool ta, bool tb, float alpha, ConstMatBatch a, ConstMatBatch b, float beta,
                     MatBatch c) override {
    // Widen A and B to fp32 (exact) and multiply in fp32 into C.
    std::vector<float> fa, fb;
    gemm(ta, tb, alpha, widen_bf16(a, fa), widen_bf16(b, fb), beta, c, DION_MATMUL_FP32);
  }
  void add_diag_bf16(MatBatch m, float v) override {
    uint16_t* p = reinterpret_cast<uint16_t*>(m.p);
    const int64_t n = std::min(m.rows, m.cols);
    for (int64_t q = 0; q < m.batch; ++q)
      for (int64_t i = 0; i < n; ++i) {
        uint16_t& e = p[q * m.stride + i * m.ld + i];
        e = float_to_bf16(bf16_to_float(e) + v);
      }
  }

  void ns_shift_bf16(MatBatch a, MatBatch b, float coef, float diag, const FrobScale* scale, void* a3) override {
    uint16_t *pa = reinterpret_cast<uint16_t*>(a.p), *pb = reinterpret_cast<uint16_t*>(b.p),
             *p3 = static_cast<uint16_t*>(a3);
    const int64_t n = a.rows;
    for (int64_t q = 0; q < a.batch; ++q) {
      float s2 = 1.0f, s3 = 1.0f, sc = 1.0f;
      if (scale) {
        const float inv = inv_of_parts(scale->parts, q, scale->nparts, scale->factor, scale->eps);
        s2 = inv * inv;
        s3 = s2 * inv;
        sc = inv;
      }
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) {
          uint16_t& e = pa[q * a.stride + i * a.ld + j];
          float x = bf16_to_float(e);
          if (scale) {
            p3[(q * n + i) * n + j] = float_to_bf16(x * s3);
            e = float_to_bf16(x * s2);
            x = bf16_to_float(e);
          }
          float t = coef * x;
          if (i == j) t += diag;
          pb[q * b.stride + i * b.ld + j] = float_to_bf16(t * sc);
        }
    }
  }

  // Copies row-major (p x r, ld) into a column-major p x r buffer.
  static float* to_colmajor(const float* src, int64_t p, int64_t r, int64_t ld, std::vector<float>& buf) {
    float* a = grow(buf, static_cast<size_t>(p * r));
    for (int64_t i = 0; i < p; ++i)
      for (int64_t j = 0; j < r; ++j) a[i + j * p] = src[i * ld + j];
    return a;
  }

  void geqrf(float* a, int p, int r) {
    int info = 0, lwork = -1;
    float* tau = grow(g_scratch.tau, static_cast<size_t>(std::max(1, r)));
    float wq = 0;
    sgeqrf_(&p, &r, a, &p, tau, &wq, &lwork, &info);
    lwork = std::max(1, static_cast<int>(wq));
    float* work = grow(g_scratch.work, static_cast<size_t>(lwork));
    sgeqrf_(&p, &r, a, &p, tau, work, &lwork, &info);
    DION_REQUIRE(info == 0, DION_ERROR_INTERNAL, "host backend: sgeqrf failed (info %d)", info);
  }

  void qr_q(MatBatch m) override {
    const int p = to_int(m.rows, "qr rows"), r = to_int(m.cols, "qr cols");
    if (p == 0 || r == 0) return;
    DION_REQUIRE(p >= r, DION_ERROR_INTERNAL, "host qr_q: needs rows >= cols");
    for (int64_t b = 0; b < m.batch; ++b) {
      float* a = to_colmajor(at(m, b), p, r, m.ld, g_scratch.a);
      geqrf(a, p, r);
      int info = 0, lwork = -1;
      float wq = 0;
      sorgqr_(&p, &r, &r, a, &p, g_scratch.tau.data(), &wq, &lwork, &info);
      lwork = std::max(1, static_cast<int>(wq));
      float* work = grow(g_scratch.work, static_cast<size_t>(lwork));
      sorgqr_(&p, &r, &r, a, &p, g_scratch.tau.data(), work, &lwork, &info);
      DION_REQUIRE(info == 0, DION_ERROR_INTERNAL, "host backend: sorgqr failed (info %d)", info);
      float* out = at(m, b);
      for (int64_t i = 0; i < p; ++i)
        for (int64_t j = 0; j < r; ++j) out[i * m.ld + j] = a[i + j * p];
    }
  }

  void qr_r(MatBatch m, MatBatch r_out) override {
    const int p = to_int(m.rows, "qr rows"), r = to_int(m.cols, "qr cols");
    DION_REQUIRE(p >= r && r_out.rows == r && r_out.cols == r, DION_ERROR_INTERNAL, "host qr_r: bad shapes");
    if (r == 0) return;  // as the CUDA backend's (sgeqrf refuses lda = 0)
    for (int64_t b = 0; b < m.batch; ++b) {
      float* a = to_colmajor(at(m, b), p, r, m.ld, g_scratch.a);
      geqrf(a, p, r);
      float* out = at(r_out, b);
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < r; ++j) out[i * r_out.ld + j] = j >= i ? a[i + j * p] : 0.0f;
    }
  }

  void cholesky_upper(MatBatch m, int32_t* info) override {
    const int n = to_int(m.rows, "cholesky n");
    const int ld = to_int(m.ld, "cholesky ld");
    for (int64_t b = 0; b < m.batch; ++b) {
      float* a = at(m, b);
      int st = 0;
      // Row-major upper U with A = U^T U is column-major lower L = U^T with A = L L^T.
      const char lo = 'L';
      if (n > 0) spotrf_(&lo, &n, a, &ld, &st);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < i; ++j) a[i * m.ld + j] = 0.0f;
      // A factor with a non-finite or tiny pivot is a failure too.
      if (st == 0)
        for (int64_t i = 0; i < n; ++i)
          if (!std::isfinite(a[i * m.ld + i]) || !(a[i * m.ld + i] > 0.0f)) st = static_cast<int>(i) + 1;
      info[b] = st;
    }
  }

  using Backend::trsm_right_upper;
  void trsm_right_upper(ConstMatBatch u, ConstMatBatch in, MatBatch bm,
                        dion_matmul_precision_t /*precision: fp32 here*/) override {
    if (in.p != bm.p) copy_mats(in, bm);
    // B U^{-1} (row-major) is, column-major, solving U^T X^T = B^T; U's buffer
    // read column-major is U^T (lower).
    const int n = to_int(u.rows, "trsm n"), rows = to_int(bm.rows, "trsm rows");
    const int ldu = to_int(u.ld, "trsm ldu"), ldb = to_int(bm.ld, "trsm ldb");
    if (n == 0 || rows == 0) return;
    const float one = 1.0f;
    const char side = 'L', uplo = 'L', tr = 'N', diag = 'N';
    for (int64_t b = 0; b < bm.batch; ++b)
      strsm_(&side, &uplo, &tr, &diag, &n, &rows, &one, at(u, u.stride ? b : 0), &ldu, at(bm, b), &ldb);
  }

  void orth_fallback(MatBatch p, ConstMatBatch p0, const int32_t* info) override {
    for (int64_t b = 0; b < p.batch; ++b) {
      if (info[b] == 0) continue;
      MatBatch one{at(p, b), p.rows, p.cols, p.ld, 0, 1};
      const float* src = at(p0, b);
      for (int64_t i = 0; i < p.rows; ++i)
        std::memcpy(one.p + i * p.ld, src + i * p0.ld, sizeof(float) * static_cast<size_t>(p.cols));
      qr_q(one);
    }
  }

  void axpby(float a, const float* x, float b, float* y, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) y[i] = a * y[i] + b * x[i];
  }
  void lincomb(float a, const float* x, float b, const float* y, float* z, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) z[i] = a * x[i] + b * y[i];
  }
  void nan_to_num(float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(x[i])) x[i] = 0.0f;
      else if (std::isinf(x[i])) x[i] = x[i] > 0 ? FLT_MAX : -FLT_MAX;
    }
  }
  void zero_fixup(ConstMatBatch m, MatBatch p, MatBatch r, ConstMatBatch q) override {
    for (int64_t b = 0; b < m.batch; ++b) {
      const float* mp = at(m, b);
      bool zero = true;
      for (int64_t i = 0; i < m.rows && zero; ++i)
        for (int64_t j = 0; j < m.cols; ++j)
          if (mp[i * m.ld + j] != 0.0f) {
            zero = false;
            break;
          }
      if (!zero) continue;
      float* pp = at(p, b);
      for (int64_t i = 0; i < p.rows; ++i)
        for (int64_t j = 0; j < p.cols; ++j) pp[i * p.ld + j] = 0.0f;
      float* rp = at(r, b);
      const float* qp = at(q, b);
      for (int64_t i = 0; i < r.rows; ++i)
        for (int64_t j = 0; j < r.cols; ++j) rp[i * r.ld + j] = qp[i * q.ld + j];
    }
  }
  void nonzero_flags(ConstMatBatch m, int32_t* flags) override {
    for (int64_t b = 0; b < m.batch; ++b) {
      const float* mp = at(m, b);
      int32_t nz = 0;
      for (int64_t i = 0; i < m.rows && !nz; ++i)
        for (int64_t j = 0; j < m.cols; ++j)
          if (mp[i * m.ld + j] != 0.0f) {
            nz = 1;
            break;
          }
      flags[b] = nz;
    }
  }
  void zero_fixup_flagged(const int32_t* flags, MatBatch p, MatBatch r, ConstMatBatch q) override {
    zero_where_flagged(flags, p);
    copy_where_flagged(flags, r, q);
  }
  // The two halves of the fix-up: p[b] = 0, r[b] = q[b] where flags[b] == 0.
  static void zero_where_flagged(const int32_t* flags, MatBatch p) {
    for (int64_t b = 0; b < p.batch; ++b) {
      if (flags[b]) continue;
      float* pp = at(p, b);
      for (int64_t i = 0; i < p.rows; ++i)
        for (int64_t j = 0; j < p.cols; ++j) pp[i * p.ld + j] = 0.0f;
    }
  }
  static void copy_where_flagged(const int32_t* flags, MatBatch r, ConstMatBatch q) {
    for (int64_t b = 0; b < r.batch; ++b) {
      if (flags[b]) continue;
      float* rp = at(r, b);
      const float* qp = at(q, b);
      for (int64_t i = 0; i < r.rows; ++i)
        for (int64_t j = 0; j < r.cols; ++j) rp[i * r.ld + j] = qp[i * q.ld + j];
    }
  }
  // Column sums of squares in double (out: cols per matrix), and the scale by
  // 1 / (sqrt(sum) + eps) in double: col_normalize's two halves.
  static void col_sums_double(ConstMatBatch m, double* out) {
    for (int64_t b = 0; b < m.batch; ++b) {
      const float* p = at(m, b);
      double* s = out + b * m.cols;
      for (int64_t j = 0; j < m.cols; ++j) s[j] = 0.0;
      for (int64_t i = 0; i < m.rows; ++i)
        for (int64_t j = 0; j < m.cols; ++j) s[j] += static_cast<double>(p[i * m.ld + j]) * p[i * m.ld + j];
    }
  }
  void col_scale_double(MatBatch m, const double* sumsq, float eps) {
    std::vector<double>& inv = col_inv_;
    inv.resize(static_cast<size_t>(m.cols));
    for (int64_t b = 0; b < m.batch; ++b) {
      float* p = at(m, b);
      for (int64_t j = 0; j < m.cols; ++j) inv[j] = 1.0 / (std::sqrt(sumsq[b * m.cols + j]) + eps);
      for (int64_t i = 0; i < m.rows; ++i)
        for (int64_t j = 0; j < m.cols; ++j) p[i * m.ld + j] = static_cast<float>(p[i * m.ld + j] * inv[j]);
    }
  }
  // 1 / (factor ||m[b]||_F + eps), the scale both normalisations apply.
  static double sum_squares(ConstMatBatch m, int64_t b) {
    const float* p = at(m, b);
    double s = 0;
    for (int64_t i = 0; i < m.rows; ++i)
      for (int64_t j = 0; j < m.cols; ++j) s += static_cast<double>(p[i * m.ld + j]) * p[i * m.ld + j];
    return s;
  }
  static float inv_of(double sumsq, float factor, float eps) {
    return static_cast<float>(1.0 / (factor * std::sqrt(sumsq) + eps));
  }
  // inv_of matrix b's total of its nparts partial sums, added in order.
  static float inv_of_parts(const double* parts, int64_t b, int64_t nparts, float factor, float eps) {
    double ss = 0;
    for (int64_t c = 0; c < nparts; ++c) ss += parts[b * nparts + c];
    return inv_of(ss, factor, eps);
  }
  static float frob_inv(ConstMatBatch m, int64_t b, float factor, float eps) {
    return inv_of(sum_squares(m, b), factor, eps);
  }
  void frob_normalize(MatBatch m, float factor, float eps) override {
    for (int64_t b = 0; b < m.batch; ++b) {
      const float inv = frob_inv(m, b, factor, eps);
      float* p = at(m, b);
      for (int64_t i = 0; i < m.rows; ++i)
        for (int64_t j = 0; j < m.cols; ++j) p[i * m.ld + j] *= inv;
    }
  }
  void frob_normalize_bf16(ConstMatBatch m, float factor, float eps, void* out) override {
    frob_bf16(m, nullptr, 0, factor, eps, out);
  }
  void frob_normalize_bf16_parts(ConstMatBatch m, const double* parts, int64_t nparts, float factor, float eps,
                                 void* out) override {
    frob_bf16(m, parts, nparts, factor, eps, out);
  }
  void frob_scale_bf16(MatBatch m, const FrobScale& s, float diag) override {
    uint16_t* base = reinterpret_cast<uint16_t*>(m.p);
    for (int64_t b = 0; b < m.batch; ++b) {
      const float inv = inv_of_parts(s.parts, b, s.nparts, s.factor, s.eps), sc = s.power == 2 ? inv * inv : inv;
      for (int64_t i = 0; i < m.rows; ++i)
        for (int64_t j = 0; j < m.cols; ++j) {
          uint16_t& e = base[b * m.stride + i * m.ld + j];
          float v = bf16_to_float(e);
          if (i == j) v += diag;
          e = float_to_bf16(v * sc);
        }
    }
  }
  // parts null: the norms from m itself.
  static void frob_bf16(ConstMatBatch m, const double* parts, int64_t nparts, float factor, float eps, void* out) {
    uint16_t* o = static_cast<uint16_t*>(out);
    for (int64_t b = 0; b < m.batch; ++b) {
      const float inv = parts ? inv_of_parts(parts, b, nparts, factor, eps) : frob_inv(m, b, factor, eps);
      const float* p = at(m, b);
      for (int64_t i = 0; i < m.rows; ++i)
        for (int64_t j = 0; j < m.cols; ++j) *o++ = float_to_bf16(p[i * m.ld + j] * inv);
    }
  }
  void col_normalize(MatBatch m, float eps) override {
    std::vector<double>& s = col_acc_;
    s.resize(static_cast<size_t>(m.batch * m.cols));
    col_sums_double(m, s.data());
    col_scale_double(m, s.data(), eps);
  }
  void finish_p(MatBatch p, const int32_t* flags, void* pb, bool pb_all) override {
    // Unless pb_all, pb holds bf16(p): only the elements the fix-up changes are rewritten.
    uint16_t* o = static_cast<uint16_t*>(pb);
    const int64_t per = p.rows * p.cols;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t i = b * per; i < (b + 1) * per; ++i) {  // dense: p.stride == per
        float v = flags[b] ? p.p[i] : 0.0f;
        nan_to_num(&v, 1);
        const bool changed = float_bits(v) != float_bits(p.p[i]);
        p.p[i] = v;
        if (o && (changed || pb_all)) o[i] = float_to_bf16(v);
      }
  }
  void finish_r(MatBatch r, const int32_t* flags, ConstMatBatch q, const TensorEntry* qlist, Field qf, void* rb,
                double* sumsq) override {
    nan_to_num(r.p, r.batch * r.rows * r.cols);
    if (qlist) {  // the flagged matrices' q loaded from the field (r dense, as the field)
      for (int64_t b = 0; b < r.batch; ++b)
        if (!flags[b])
          load(at(r, b), qlist[b].ptr[qf], static_cast<dion_dtype_t>(qlist[b].dtype[qf]), r.rows * r.cols);
    } else {
      copy_where_flagged(flags, r, q);
    }
    if (rb) store(rb, DION_DTYPE_BF16, r.p, r.batch * r.rows * r.cols);
    col_sums_double(r, sumsq);
  }
  void col_scale_store(MatBatch r, const double* sumsq, float eps, void* rb, const TensorEntry* list, Field f,
                       const int32_t* skip, bool write_r) override {
    MatBatch s = r;
    if (!write_r) {  // scale a copy (r dense): r is left as it was
      fscratch_.assign(r.p, r.p + r.batch * r.rows * r.cols);
      s.p = fscratch_.data();
    }
    col_scale_double(s, sumsq, eps);
    if (rb) store(rb, DION_DTYPE_BF16, s.p, s.batch * s.rows * s.cols);
    if (list) store_multi(list, s.batch, f, s.p, s.rows * s.cols, skip);
  }
  void slice_l1(ConstMatBatch m, Axis axis, float* out) override {
    const int64_t N = axis == kRows ? m.rows : m.cols;
    for (int64_t b = 0; b < m.batch; ++b) {
      const float* p = at(m, b);
      float* o = out + b * N;
      for (int64_t s = 0; s < N; ++s) o[s] = 0;
      for (int64_t i = 0; i < m.rows; ++i)
        for (int64_t j = 0; j < m.cols; ++j) o[axis == kRows ? i : j] += std::fabs(p[i * m.ld + j]);
    }
  }

  void apply_update(float* x, const float* u, int64_t n, const GroupScalars* gs, float lr_mult,
                    bool cautious) override {
    const float lr = static_cast<float>(gs->lr), wd = static_cast<float>(gs->weight_decay);
    const float decay = 1.0f - lr * wd, lwd = lr * wd, lr_adj = lr * lr_mult;
    for (int64_t i = 0; i < n; ++i) {
      float xi = x[i];
      if (cautious)
        xi = (xi * u[i] >= 0.0f) ? xi - lwd * xi : xi;
      else
        xi *= decay;
      x[i] = xi - lr_adj * u[i];
    }
  }
  void decay(float* x, int64_t n, const GroupScalars* gs) override {
    const float d = static_cast<float>(1.0 - gs->lr * gs->weight_decay);
    for (int64_t i = 0; i < n; ++i) x[i] *= d;
  }
  void adamw(const TensorEntry* list, int64_t count, int64_t, const GroupScalars* gs, float eps, bool cautious,
             const int32_t* skip) override {
    if (skip && *skip) return;
    const double st = static_cast<double>(gs->step);
    const float lr = static_cast<float>(gs->lr), wd = static_cast<float>(gs->weight_decay);
    const float b1 = static_cast<float>(gs->beta1), b2 = static_cast<float>(gs->beta2);
    const float bc1 = static_cast<float>(1.0 - std::pow(gs->beta1, st));
    const float bc2 = static_cast<float>(1.0 - std::pow(gs->beta2, st));
    const float step = lr / bc1, sbc2 = std::sqrt(bc2), lwd = lr * wd;
    for (int64_t t = 0; t < count; ++t) {
      const TensorEntry& e = list[t];
      const auto dx = static_cast<dion_dtype_t>(e.dtype[kParam]), dg = static_cast<dion_dtype_t>(e.dtype[kGrad]),
                 dm = static_cast<dion_dtype_t>(e.dtype[kState0]), dv = static_cast<dion_dtype_t>(e.dtype[kState1]);
      for (int64_t i = 0; i < e.n; ++i) {
        const float xo = load_elem(e.ptr[kParam], dx, i), g = load_elem(e.ptr[kGrad], dg, i);
        const float m0 = load_elem(e.ptr[kState0], dm, i), v0 = load_elem(e.ptr[kState1], dv, i);
        const float mi = m0 + (1.0f - b1) * (g - m0);
        const float vi = b2 * v0 + (1.0f - b2) * g * g;
        float xi;
        if (cautious)
          xi = (mi * xo >= 0.0f) ? xo - lwd * xo : xo;
        else
          xi = xo * (1.0f - lwd);
        store_elem(e.ptr[kParam], dx, i, xi - step * mi / (std::sqrt(vi) / sbc2 + eps));
        store_elem(e.ptr[kState0], dm, i, mi);
        store_elem(e.ptr[kState1], dv, i, vi);
      }
    }
  }
  void lion(const TensorEntry* list, int64_t count, int64_t, const GroupScalars* gs, bool cautious,
            const int32_t* skip) override {
    if (skip && *skip) return;
    const float lr = static_cast<float>(gs->lr), wd = static_cast<float>(gs->weight_decay);
    const float b1 = static_cast<float>(gs->beta1), b2 = static_cast<float>(gs->beta2);
    const float lwd = lr * wd;
    for (int64_t t = 0; t < count; ++t) {
      const TensorEntry& e = list[t];
      const auto dx = static_cast<dion_dtype_t>(e.dtype[kParam]), dg = static_cast<dion_dtype_t>(e.dtype[kGrad]),
                 dm = static_cast<dion_dtype_t>(e.dtype[kState0]);
      for (int64_t i = 0; i < e.n; ++i) {
        const float g = load_elem(e.ptr[kGrad], dg, i), m = load_elem(e.ptr[kState0], dm, i);
        const float c = b1 * m + (1.0f - b1) * g;
        const float u = static_cast<float>((c > 0.0f) - (c < 0.0f));
        store_elem(e.ptr[kState0], dm, i, b2 * m + (1.0f - b2) * g);
        float xi = load_elem(e.ptr[kParam], dx, i);
        if (cautious)
          xi = (xi * u >= 0.0f) ? xi - lwd * xi : xi;
        else
          xi *= 1.0f - lwd;
        store_elem(e.ptr[kParam], dx, i, xi - lr * u);
      }
    }
  }
  void neuron_normalize(MatBatch u, Axis axis, float* v, int64_t v_per_matrix, float beta2,
                        const int32_t* selected) override {
    const int64_t N = axis == kRows ? u.rows : u.cols;    // neurons in u
    const int64_t len = axis == kRows ? u.cols : u.rows;  // elements per neuron
    std::vector<double>& scale = col_acc_;
    scale.resize(static_cast<size_t>(N));
    for (int64_t b = 0; b < u.batch; ++b) {
      float* p = at(u, b);
      auto el = [&](int64_t s, int64_t e) -> float& { return axis == kRows ? p[s * u.ld + e] : p[e * u.ld + s]; };
      const double rescale =
          neuron_stats([&](int64_t s, int64_t e) { return el(s, e); }, N, len, v, b * v_per_matrix,
                       selected ? selected + b * N : nullptr, beta2, scale.data());
      for (int64_t s = 0; s < N; ++s)
        for (int64_t e = 0; e < len; ++e) el(s, e) = static_cast<float>(el(s, e) * scale[s] * rescale);
    }
  }
  void neuron_scales(int64_t batch, int64_t rows, int64_t cols, Axis axis, const void* in_bf16, float* v,
                     int64_t v_per_matrix, float beta2, double* scales) override {
    const uint16_t* in = static_cast<const uint16_t*>(in_bf16);
    const int64_t N = axis == kRows ? rows : cols, len = axis == kRows ? cols : rows;
    for (int64_t b = 0; b < batch; ++b) {
      const uint16_t* p = in + b * rows * cols;
      scales[batch * N + b] = neuron_stats(
          [&](int64_t s, int64_t e) { return bf16_to_float(axis == kRows ? p[s * cols + e] : p[e * cols + s]); }, N,
          len, v, b * v_per_matrix, nullptr, beta2, scales + b * N);
    }
  }
  // One matrix's NorMuon statistics from el(s, e) (element e of neuron s):
  // each neuron's variance lerped into v[v0 + s] (or v0 + sel[s]), its scale
  // into scale[s]; returns the rescale that keeps the Frobenius norm.
  template <class El>
  static double neuron_stats(const El& el, int64_t N, int64_t len, float* v, int64_t v0, const int32_t* sel,
                             float beta2, double* scale) {
    double f2 = 0, g2 = 0;
    for (int64_t s = 0; s < N; ++s) {
      double ss = 0;
      for (int64_t e = 0; e < len; ++e) ss += static_cast<double>(el(s, e)) * el(s, e);
      f2 += ss;
      const int64_t vi = v0 + (sel ? sel[s] : s);
      const float mean = static_cast<float>(ss / static_cast<double>(len));
      v[vi] = v[vi] + (1.0f - beta2) * (mean - v[vi]);
      scale[s] = 1.0 / (std::sqrt(static_cast<double>(v[vi])) + 1e-8);
      g2 += ss * scale[s] * scale[s];
    }
    return std::sqrt(f2) / std::max(std::sqrt(g2), 1e-8);
  }

  void topk(const float* scores, int64_t batch, int64_t n, int64_t k, int32_t* idx) override {
    std::vector<int32_t>& order = order_;
    order.resize(static_cast<size_t>(n));
    for (int64_t b = 0; b < batch; ++b) {
      const float* s = scores + b * n;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [s](int32_t x, int32_t y) { return s[x] > s[y] || (s[x] == s[y] && x < y); });
      std::sort(order.begin(), order.begin() + k);  // ascending indices: deterministic layout
      std::copy(order.begin(), order.begin() + k, idx + b * k);
    }
  }
  void gather_slices(ConstMatBatch m, Axis axis, const int32_t* idx, int64_t k, MatBatch out) override {
    for (int64_t b = 0; b < m.batch; ++b) {
      const float* p = at(m, b);
      float* o = at(out, b);
      const int32_t* ix = idx + b * k;
      if (axis == kRows)
        for (int64_t s = 0; s < k; ++s)
          for (int64_t j = 0; j < m.cols; ++j) o[s * out.ld + j] = p[ix[s] * m.ld + j];
      else
        for (int64_t i = 0; i < m.rows; ++i)
          for (int64_t s = 0; s < k; ++s) o[i * out.ld + s] = p[i * m.ld + ix[s]];
    }
  }
  void scale_slices(MatBatch m, Axis axis, const int32_t* idx, int64_t k, float sc) override {
    for (int64_t b = 0; b < m.batch; ++b) {
      float* p = at(m, b);
      const int32_t* ix = idx + b * k;
      if (axis == kRows)
        for (int64_t s = 0; s < k; ++s)
          for (int64_t j = 0; j < m.cols; ++j) p[ix[s] * m.ld + j] *= sc;
      else
        for (int64_t i = 0; i < m.rows; ++i)
          for (int64_t s = 0; s < k; ++s) p[i * m.ld + ix[s]] *= sc;
    }
  }
  void add_slices(MatBatch m, Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u, const GroupScalars* gs,
                  float mult) override {
    const float alpha = gs ? static_cast<float>(mult * gs->lr) : mult;
    for (int64_t b = 0; b < m.batch; ++b) {
      float* p = at(m, b);
      const float* q = at(u, b);
      const int32_t* ix = idx + b * k;
      if (axis == kRows)
        for (int64_t s = 0; s < k; ++s)
          for (int64_t j = 0; j < m.cols; ++j) p[ix[s] * m.ld + j] += alpha * q[s * u.ld + j];
      else
        for (int64_t i = 0; i < m.rows; ++i)
          for (int64_t s = 0; s < k; ++s) p[i * m.ld + ix[s]] += alpha * q[i * u.ld + s];
    }
  }

  // ---- fused passes over typed buffers: the loops of the calls they replace, merged ----
  void momentum_multi(const TensorEntry* list, int64_t count, int64_t n, float mu, float g_scale, bool nesterov,
                      bool store_state, void* u, dion_dtype_t u_dtype, const int32_t* skip,
                      int32_t* nonzero) override {
    const bool write = store_state && !(skip && *skip);
    for (int64_t t = 0; t < count; ++t) {
      const TensorEntry& e = list[t];
      const auto dm = static_cast<dion_dtype_t>(e.dtype[kState0]), dg = static_cast<dion_dtype_t>(e.dtype[kGrad]);
      bool any = false;
      for (int64_t i = 0; i < n; ++i) {
        const float g = load_elem(e.ptr[kGrad], dg, i);
        const float m = mu * load_elem(e.ptr[kState0], dm, i) + g_scale * g;  // axpby
        if (write) store_elem(e.ptr[kState0], dm, i, m);
        if (u) {
          store_elem(u, u_dtype, t * n + i, nesterov ? mu * m + g_scale * g : m);  // lincomb
          any = any || load_elem(u, u_dtype, t * n + i) != 0.0f;  // NaN counts as nonzero, -0 as zero
        } else {
          any = any || round_to(dm, m) != 0.0f;  // M as written
        }
      }
      if (nonzero && any) nonzero[t] = 1;
    }
  }
  // One sum per tensor, in element order.
  int64_t momentum_parts(int64_t, int64_t) override { return 1; }
  void momentum_multi_sums(const TensorEntry* list, int64_t count, int64_t n, float mu, float g_scale, bool nesterov,
                           void* u, dion_dtype_t u_dtype, const int32_t* skip, double* sumsq) override {
    DION_REQUIRE(u, DION_ERROR_INTERNAL, "host momentum_multi_sums: u is required");
    momentum_multi(list, count, n, mu, g_scale, nesterov, true, u, u_dtype, skip, nullptr);
    for (int64_t t = 0; t < count; ++t) {
      double s = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double v = load_elem(u, u_dtype, t * n + i);
        s += v * v;
      }
      sumsq[t] = s;
    }
  }
  // The field widened into scratch (and a bf16 b widened), then gemm.
  void gemm_field(const TensorEntry* list, int64_t count, Field f, int64_t rows, int64_t cols, dion_dtype_t x_dtype,
                  bool trans_x, ConstMatBatch b, MatBatch c, dion_matmul_precision_t precision, dion_dtype_t c_dtype,
                  int b_field) override {
    const bool c16 = c_dtype == DION_DTYPE_BF16;
    DION_REQUIRE(c_dtype == DION_DTYPE_FP32 ||
                     (c16 && x_dtype == DION_DTYPE_BF16 && c.ld == c.cols && c.stride == c.rows * c.cols),
                 DION_ERROR_INTERNAL, "host gemm_field: bad output dtype");
    DION_REQUIRE(b_field < 0 || x_dtype == DION_DTYPE_FP32, DION_ERROR_INTERNAL,
                 "host gemm_field: B from a field with fp32 X only");
    if (b_field >= 0) {  // B from the fields, loaded as load_multi does
      const int64_t nb = b.rows * b.cols;
      float* bs = grow(bfield_scratch_, static_cast<size_t>(count * nb));
      load_multi(bs, list, count, static_cast<Field>(b_field), nb);
      b = ConstMatBatch(bs, b.rows, b.cols, b.cols, nb, count);
    }
    const int64_t n = rows * cols;
    float* x = grow(g_scratch.prod, static_cast<size_t>(count * n));
    load_multi(x, list, count, f, n);
    const ConstMatBatch X(x, rows, cols, cols, n, count);
    // bf16 output: the fp32 product, then each element rounded into c
    MatBatch cf = c;
    if (c16) cf = MatBatch{grow(fscratch_, static_cast<size_t>(count * c.rows * c.cols)), c.rows, c.cols, c.cols,
                           c.rows * c.cols, count};
    if (x_dtype == DION_DTYPE_BF16)
      gemm(trans_x, false, 1.0f, X, widen_bf16(b, bf16_wide_), 0.0f, cf, DION_MATMUL_FP32);
    else
      gemm(trans_x, false, 1.0f, X, b, 0.0f, cf, precision);
    if (c16) store(c.p, DION_DTYPE_BF16, cf.p, count * c.rows * c.cols);
  }
  // The product in fp32 (A and B widened exactly), then each element's sum.
  void accumulate_lowrank(const TensorEntry* list, int64_t count, ConstMatBatch a, ConstMatBatch b,
                          dion_dtype_t ab_dtype, dion_dtype_t /*x_dtype: each entry's own*/,
                          dion_matmul_precision_t /*fp32 here*/, float alpha, const int32_t* skip) override {
    if (skip && *skip) return;
    const int64_t n = a.rows * b.rows;
    const float* u = lowrank_product(count, a, b, ab_dtype);
    for (int64_t t = 0; t < count; ++t) {
      const auto dm = static_cast<dion_dtype_t>(list[t].dtype[kState0]);
      for (int64_t i = 0; i < n; ++i)
        store_elem(list[t].ptr[kState0], dm, i, alpha * u[t * n + i] + load_elem(list[t].ptr[kState0], dm, i));
    }
  }
  // The product in fp32 (A and B widened exactly), then the update of it.
  void update_lowrank(const TensorEntry* list, int64_t count, ConstMatBatch a, ConstMatBatch b, dion_dtype_t ab_dtype,
                      dion_dtype_t /*x_dtype: each entry's own*/, dion_matmul_precision_t /*fp32 here*/,
                      const GroupScalars* gs, float lr_mult, const int32_t* skip) override {
    if (skip && *skip) return;
    const float* u = lowrank_product(count, a, b, ab_dtype);
    apply_update_multi(list, count, a.rows * b.rows, u, DION_DTYPE_FP32, gs, lr_mult, false, nullptr);
  }
  // A_i B_i^T of each pair into scratch (dense, the products one after the other), in fp32.
  const float* lowrank_product(int64_t count, ConstMatBatch a, ConstMatBatch b, dion_dtype_t ab_dtype) {
    const int64_t rows = a.rows, cols = b.rows, n = rows * cols;
    float* u = grow(g_scratch.prod, static_cast<size_t>(count * n));
    const MatBatch U{u, rows, cols, cols, n, count};
    if (ab_dtype == DION_DTYPE_BF16)
      gemm_bf16_f32(false, true, 1.0f, a, b, 0.0f, U);
    else
      gemm(false, true, 1.0f, a, b, 0.0f, U, DION_MATMUL_FP32);
    return u;
  }
  void apply_update_multi(const TensorEntry* list, int64_t count, int64_t n, const void* u, dion_dtype_t u_dtype,
                          const GroupScalars* gs, float lr_mult, bool cautious, const int32_t* skip) override {
    if (skip && *skip) return;
    float* x = grow(g_scratch.a, static_cast<size_t>(n));
    float* uf = grow(g_scratch.work, static_cast<size_t>(n));
    for (int64_t t = 0; t < count; ++t) {
      const auto dx = static_cast<dion_dtype_t>(list[t].dtype[kParam]);
      load(x, list[t].ptr[kParam], dx, n);
      load(uf, static_cast<const char*>(u) + t * n * static_cast<int64_t>(dtype_size(u_dtype)), u_dtype, n);
      apply_update(x, uf, n, gs, lr_mult, cautious);
      store(list[t].ptr[kParam], dx, x, n);
    }
  }
  void apply_update_neuron_multi(const TensorEntry* list, int64_t count, int64_t rows, int64_t cols, const void* u,
                                 dion_dtype_t u_dtype, const double* scales, Axis axis, const GroupScalars* gs,
                                 float lr_mult, bool cautious, const int32_t* skip) override {
    if (skip && *skip) return;
    const int64_t n = rows * cols, N = axis == kRows ? rows : cols;
    float* uf = grow(g_scratch.neuron, static_cast<size_t>(count * n));
    load(uf, u, u_dtype, count * n);
    for (int64_t t = 0; t < count; ++t)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          float& e = uf[(t * rows + i) * cols + j];
          e = static_cast<float>(e * scales[t * N + (axis == kRows ? i : j)] * scales[count * N + t]);
        }
    apply_update_multi(list, count, n, uf, DION_DTYPE_FP32, gs, lr_mult, cautious, nullptr);
  }
  void store_slices_multi(const TensorEntry* list, int64_t count, Field f, ConstMatBatch m, Axis axis,
                          const int32_t* idx, int64_t k, const int32_t* skip) override {
    if ((skip && *skip) || count <= 0 || k <= 0) return;
    const int64_t per = m.batch / count, msize = m.rows * m.cols;
    for (int64_t b = 0; b < m.batch; ++b) {
      const TensorEntry& e = list[b / per];
      const auto dt = static_cast<dion_dtype_t>(e.dtype[f]);
      const int64_t base = (b % per) * msize;
      const float* p = at(m, b);
      const int32_t* ix = idx + b * k;
      if (axis == kRows)
        for (int64_t s = 0; s < k; ++s)
          for (int64_t j = 0; j < m.cols; ++j) store_elem(e.ptr[f], dt, base + ix[s] * m.cols + j, p[ix[s] * m.ld + j]);
      else
        for (int64_t i = 0; i < m.rows; ++i)
          for (int64_t s = 0; s < k; ++s) store_elem(e.ptr[f], dt, base + i * m.cols + ix[s], p[i * m.ld + ix[s]]);
    }
  }
  // One matrix at a time: m = M + G into scratch, then the calls' loops.
  void momentum_l1_multi(const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols, Axis axis,
                         float* out, int32_t* nonfinite) override {
    const int64_t msize = rows * cols, N = axis == kRows ? rows : cols;
    float* m = grow(g_scratch.a, static_cast<size_t>(msize));
    for (int64_t t = 0; t < count; ++t)
      for (int64_t q = 0; q < per; ++q) {
        momentum_of(list[t], q * msize, msize, m);
        slice_l1(ConstMatBatch(m, rows, cols, cols, msize, 1), axis, out + (t * per + q) * N);
      }
    if (nonfinite) check_nonfinite(list, count, per * msize, kGrad, nonfinite);
  }
  int64_t select_momentum_parts(int64_t, int64_t per, int64_t, int64_t) override { return per == 1 ? 1 : 0; }
  void select_momentum_multi(const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols,
                             Axis axis, const int32_t* idx, int64_t k, float decay, MatBatch out,
                             dion_dtype_t out_dtype, const int32_t* skip, double* sumsq) override {
    DION_REQUIRE(!sumsq || per == 1, DION_ERROR_INTERNAL, "host select_momentum_multi: sums of squares need per == 1");
    DION_REQUIRE(out_dtype == DION_DTYPE_FP32 || out_dtype == DION_DTYPE_BF16, DION_ERROR_INTERNAL,
                 "host select_momentum_multi: out must be fp32 or bf16");
    const bool ob16 = out_dtype == DION_DTYPE_BF16;
    const int64_t msize = rows * cols;
    const bool write = !(skip && *skip);
    float* m = grow(g_scratch.a, static_cast<size_t>(msize));
    // bf16 out: the slices gathered in fp32 here (dense), then rounded into out.
    float* o16 = ob16 ? grow(g_scratch.slices, static_cast<size_t>(out.rows * out.cols)) : nullptr;
    for (int64_t t = 0; t < count; ++t)
      for (int64_t q = 0; q < per; ++q) {
        const int64_t b = t * per + q;
        momentum_of(list[t], q * msize, msize, m);
        const MatBatch mb{m, rows, cols, cols, msize, 1};
        const MatBatch ob = ob16 ? MatBatch{o16, out.rows, out.cols, out.cols, 0, 1}
                                 : MatBatch{at(out, b), out.rows, out.cols, out.ld, out.stride, 1};
        gather_slices(mb, axis, idx + b * k, k, ob);
        if (ob16) {
          uint16_t* dst = reinterpret_cast<uint16_t*>(out.p) + b * out.stride;
          for (int64_t i = 0; i < out.rows; ++i)
            for (int64_t j = 0; j < out.cols; ++j) {
              float& v = o16[i * out.cols + j];
              dst[i * out.ld + j] = float_to_bf16(v);
              v = bf16_to_float(dst[i * out.ld + j]);  // the stored value, for the sums
            }
        }
        // frob_inv's sum over the gathered matrix, in its order.
        if (sumsq) sumsq[b] = sum_squares(ConstMatBatch(ob.p, ob.rows, ob.cols, ob.ld, 0, 1), 0);
        scale_slices(mb, axis, idx + b * k, k, decay);
        if (write) {
          const auto dm = static_cast<dion_dtype_t>(list[t].dtype[kState0]);
          for (int64_t i = 0; i < msize; ++i) store_elem(list[t].ptr[kState0], dm, q * msize + i, m[i]);
        }
      }
  }
  void decay_add_slices_multi(const TensorEntry* list, int64_t count, int64_t per, int64_t rows, int64_t cols,
                              Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u, dion_dtype_t u_dtype,
                              const double* scales, const GroupScalars* gs, float mult,
                              const int32_t* skip) override {
    if (skip && *skip) return;
    DION_REQUIRE(u_dtype == DION_DTYPE_FP32 || u_dtype == DION_DTYPE_BF16, DION_ERROR_INTERNAL,
                 "host decay_add_slices_multi: u must be fp32 or bf16");
    DION_REQUIRE(!scales || axis == kRows, DION_ERROR_INTERNAL,
                 "host decay_add_slices_multi: neuron scales need selected rows");
    if (u_dtype == DION_DTYPE_BF16 && k > 0) u = widen_bf16(u, bf16_wide_);
    if (scales && k > 0) {  // u's rows normalised (apply_update_neuron_multi's formula), dense k x cols
      const int64_t B = count * per;
      float* us = grow(g_scratch.neuron, static_cast<size_t>(B * k * cols));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < k; ++s)
          for (int64_t j = 0; j < cols; ++j)
            us[(b * k + s) * cols + j] =
                static_cast<float>(at(u, b)[s * u.ld + j] * scales[b * k + s] * scales[B * k + b]);
      u = ConstMatBatch(us, k, cols, cols, k * cols, B);
    }
    const int64_t msize = rows * cols;
    float* x = grow(g_scratch.a, static_cast<size_t>(msize));
    for (int64_t t = 0; t < count; ++t) {
      const auto dx = static_cast<dion_dtype_t>(list[t].dtype[kParam]);
      for (int64_t q = 0; q < per; ++q) {
        void* p = static_cast<char*>(list[t].ptr[kParam]) + q * msize * static_cast<int64_t>(dtype_size(dx));
        const int64_t b = t * per + q;
        load(x, p, dx, msize);
        decay(x, msize, gs);
        if (k > 0) {
          ConstMatBatch ub(at(u, b), u.rows, u.cols, u.ld, 0, 1);
          add_slices(MatBatch{x, rows, cols, cols, 0, 1}, axis, idx + b * k, k, ub, gs, mult);
        }
        store(p, dx, x, msize);
      }
    }
  }

 private:
  // m[i] = M + G (momentum_multi's axpby with mu = g_scale = 1) of elements
  // [first, first + n) of tensor e.
  static void momentum_of(const TensorEntry& e, int64_t first, int64_t n, float* m) {
    const auto dm = static_cast<dion_dtype_t>(e.dtype[kState0]), dg = static_cast<dion_dtype_t>(e.dtype[kGrad]);
    const float mu = 1.0f, g_scale = 1.0f;
    for (int64_t i = 0; i < n; ++i)
      m[i] = mu * load_elem(e.ptr[kState0], dm, first + i) + g_scale * load_elem(e.ptr[kGrad], dg, first + i);
  }

  std::vector<double> col_acc_, col_inv_;
  std::vector<float> bf16_wide_, fscratch_, bfield_scratch_;
  std::vector<int32_t> order_;
};

}  // namespace

Backend* make_host_backend() { return new HostBackend(); }

}  // namespace dion
