// SPDX-License-Identifier: MIT
// CUDA backend against host backend: GEMM, QR, Cholesky, triangular solve,
// the Gram-Schmidt fallback; CUDA-graph capture of a sequence of ops; and the
// device-pointer checks.
//
// Tolerances. A GEMM entry is a length-k dot product evaluated in different
// orders by cuBLAS and the host BLAS: each is within k * 2^-24 * S of the
// exact value, S = sum |alpha a_ik b_kj| + |beta c_ij|, so fp32 results are
// compared with an absolute bound of 2 k 2^-24 S_max (rounded up to 1e-5 S_max
// for k <= 40). TF32 and BF16 round the inputs to 10 and 7 mantissa bits
// (relative 2^-11, 2^-8 per input, twice per product): bounds 3e-3 S_max and
// 2e-2 S_max. The factorizations are backward stable with errors ~ n 2^-24 in
// the norms of their inputs; on the well-conditioned inputs used here
// (condition numbers < 100), 1e-4 relative to the largest entry covers both
// libraries' algorithms with margin, while any wrong index or transpose moves
// entries by O(1).
#include <cuda.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <set>
#include <utility>

#include "../reference/ref_linalg.h"
#include "kernels/launch.hpp"
#include "ops_util.h"

namespace dion_ops_test {
namespace {

// The operands of a batched GEMM test, C (m x n) = op(A) op(B) + C: padded
// (ld > cols, gaps between matrices), transposed as ta / tb say, A broadcast
// (stride 0) for bcast 1 and B for bcast 2, filled with gen(); c0 is C's
// initial host copy.
struct GemmOperands {
  bool ta, tb;
  Mat a, b, c;
  std::vector<float> c0;
  // op(A)[bt](i, l) and op(B)[bt](l, j) on the host
  float av(int64_t bt, int64_t i, int64_t l) const {
    return ta ? a.h[bt * a.stride + l * a.ld + i] : a.h[bt * a.stride + i * a.ld + l];
  }
  float bv(int64_t bt, int64_t l, int64_t j) const {
    return tb ? b.h[bt * b.stride + j * b.ld + l] : b.h[bt * b.stride + l * b.ld + j];
  }
};
template <class G>
GemmOperands gemm_operands(bool ta, bool tb, int bcast, int64_t m, int64_t n, int64_t k, int64_t B, G gen) {
  GemmOperands o{ta, tb, ta ? Mat::padded(k, m, B) : Mat::padded(m, k, B),
                 tb ? Mat::padded(n, k, B, 1, 2) : Mat::padded(k, n, B, 1, 2), Mat::padded(m, n, B, 4, 3), {}};
  if (bcast == 1) o.a.stride = 0;
  if (bcast == 2) o.b.stride = 0;
  o.a.fill(gen);
  o.b.fill(gen);
  o.c.fill(gen);
  o.c0 = o.c.h;
  return o;
}

// Scale S_max of a GEMM (see the top).
double gemm_scale(const GemmOperands& o, float alpha, float beta) {
  const Mat& c = o.c;
  const int64_t k = o.ta ? o.a.rows : o.a.cols;
  double s = 0;
  for (int64_t bt = 0; bt < c.batch; ++bt)
    for (int64_t i = 0; i < c.rows; ++i)
      for (int64_t j = 0; j < c.cols; ++j) {
        double t = std::fabs(beta * o.c0[bt * c.stride + i * c.ld + j]);
        for (int64_t l = 0; l < k; ++l) t += std::fabs(static_cast<double>(alpha) * o.av(bt, i, l) * o.bv(bt, l, j));
        s = std::max(s, t);
      }
  return s;
}

// Two shapes: the second's inner dimension is at least 4 times the output's,
// where TF32 products go through cuBLASLt (gemm's long-K rule; ctest's
// ops_linalg_lt_off runs this test with DION_LT_GEMM=0, the cuBLAS call).
TEST_F(OpsTest, GemmAllTransposesAndPrecisions) {
  for (const auto [m, n, k] : {std::array<int64_t, 3>{37, 29, 23}, std::array<int64_t, 3>{20, 12, 160}})
  for (int t = 0; t < 4; ++t)
    for (int bcast = 0; bcast < 3; ++bcast)  // 0: none, 1: A broadcast (stride 0), 2: B broadcast
      for (dion_matmul_precision_t prec : {DION_MATMUL_FP32, DION_MATMUL_TF32, DION_MATMUL_BF16}) {
        const bool ta = t & 1, tb = t & 2;
        SCOPED_TRACE(testing::Message() << m << " x " << n << " x " << k << ", ta " << ta << " tb " << tb
                                        << " broadcast " << bcast << " precision " << prec);
        GemmOperands o = gemm_operands(ta, tb, bcast, m, n, k, 3, [&] { return gauss(); });
        Mat &a = o.a, &b = o.b, &c = o.c;
        const float alpha = 0.7f, beta = 0.3f;
        const double S = gemm_scale(o, alpha, beta);
        cuda->gemm(ta, tb, alpha, a.D(), b.D(), beta, c.D(), prec);
        host->gemm(ta, tb, alpha, a.H(), b.H(), beta, c.H(), DION_MATMUL_FP32);
        const double tol = prec == DION_MATMUL_FP32 ? 1e-5 : prec == DION_MATMUL_TF32 ? 3e-3 : 2e-2;
        EXPECT_TRUE(close(c.h, c.dev(), 0.0, tol * S));
      }
}

// Matmul precision BF16 on fp32 operands (cuBLAS's
// CUBLAS_COMPUTE_32F_FAST_16BF) rounds each operand element to bf16 once and
// accumulates in fp32: against a float64 product of the operands rounded to
// bf16 on the host, the error is at most one rounding of each operand in
// either direction (cuBLAS does not document which), 2 * 2^-8 relative to the
// sum of |terms|, plus the fp32 accumulation's k * 2^-24. Shapes large enough
// for tensor-core GEMMs, padded, transposed and broadcast operands.
float round_bf16(float x) { return dionref::bf16_bits_to_float(dionref::float_to_bf16_bits(x)); }

TEST_F(OpsTest, GemmBf16RoundsEachOperandOnce) {
  const int64_t m = 130, n = 96, k = 200, B = 3;
  for (int t = 0; t < 4; ++t)
    for (int bcast = 0; bcast < 3; ++bcast) {
      const bool ta = t & 1, tb = t & 2;
      SCOPED_TRACE(testing::Message() << "ta " << ta << " tb " << tb << " broadcast " << bcast);
      GemmOperands o = gemm_operands(ta, tb, bcast, m, n, k, B, [&] { return gauss(); });
      Mat& c = o.c;
      const float alpha = 0.7f, beta = 0.3f;
      cuda->gemm(ta, tb, alpha, o.a.D(), o.b.D(), beta, c.D(), DION_MATMUL_BF16);
      const std::vector<float> got = c.dev();
      double worst = 0;
      for (int64_t bt = 0; bt < B; ++bt)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            const size_t e = static_cast<size_t>(bt * c.stride + i * c.ld + j);
            double want = static_cast<double>(beta) * o.c0[e], mag = std::fabs(want);
            for (int64_t l = 0; l < k; ++l) {
              const double term = static_cast<double>(alpha) * round_bf16(o.av(bt, i, l)) * round_bf16(o.bv(bt, l, j));
              want += term;
              mag += std::fabs(term);
            }
            worst = std::max(worst, std::fabs(got[e] - want) / mag);
          }
      // One rounding of either direction of each operand (2 * 2^-8), and the
      // fp32 accumulation of k terms: k * 2^-24 = 1.2e-5 at k = 200.
      EXPECT_LT(worst, 2.0 / 256 + 2e-5);
    }
}

// Dense batches of r x c matrices at p (bf16 or fp32 elements; the views
// count elements) for the bf16 GEMM tests.
ConstMatBatch cm(const void* p, int64_t r, int64_t c, int64_t batch) {
  return ConstMatBatch(static_cast<const float*>(p), r, c, c, r * c, batch);
}
MatBatch mm(void* p, int64_t r, int64_t c, int64_t batch) {
  return MatBatch{static_cast<float*>(p), r, c, c, r * c, batch};
}

// gemm_bf16 (bf16 C) and gemm_bf16_f32 (fp32 C) on bf16 buffers against the
// host backend's products of the widened operands: A and B are exact in
// bf16, so the fp32 results differ only by the accumulation order (k 2^-24 of
// the sum of |terms|: 1e-5 at k = 96 with room), and a bf16 C by one more
// rounding, to nearest on both, of results that may differ by that much: one
// bf16 ulp, at most 2^-7 of the value (the spacing of bf16 is 2^-8 to 2^-7
// of the values it separates). gemm_bf16_out (C read from a buffer of its
// own, through cuBLASLt) the same way, and its C must stay as it was.
TEST_F(OpsTest, GemmOnBf16BuffersMatchesHost) {
  const int64_t m = 70, n = 48, k = 96, B = 2;
  auto bf = [&](size_t count) {
    std::vector<uint16_t> v(count);
    for (auto& x : v) x = float_to_bf16(gauss());
    return v;
  };
  for (int t = 0; t < 4; ++t)
    for (int mode = 0; mode < 3; ++mode) {
      const bool ta = t & 1, tb = t & 2, f32 = mode == 0, out = mode == 2;
      SCOPED_TRACE(testing::Message() << "ta " << ta << " tb " << tb
                                      << (f32 ? " fp32 C" : out ? " bf16 C apart from D" : " bf16 C"));
      const int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
      const std::vector<uint16_t> a = bf(static_cast<size_t>(B * ar * ac)), b = bf(static_cast<size_t>(B * br * bc));
      const std::vector<uint16_t> c0b = bf(static_cast<size_t>(B * m * n));
      std::vector<float> c0(c0b.size());
      for (size_t i = 0; i < c0.size(); ++i) c0[i] = bf16_to_float(c0b[i]);
      const float alpha = 0.7f, beta = 0.5f;
      Dev<uint16_t> da(a), db(b), dcb(c0b);
      Dev<float> dc(c0);
      std::vector<float> hc = c0, got;
      std::vector<uint16_t> hcb = c0b;
      if (f32) {
        host->gemm_bf16_f32(ta, tb, alpha, cm(a.data(), ar, ac, B), cm(b.data(), br, bc, B), beta,
                            MatBatch{hc.data(), m, n, n, m * n, B});
        cuda->gemm_bf16_f32(ta, tb, alpha, cm(da.p(), ar, ac, B), cm(db.p(), br, bc, B), beta,
                            MatBatch{dc.p(), m, n, n, m * n, B});
        got = dc.get();
      } else {
        Dev<uint16_t> dd(std::vector<uint16_t>(c0b.size(), 0x7fc0));  // NaN: every element must be written
        if (out) {
          std::vector<uint16_t> hd(c0b.size());
          host->gemm_bf16_out(ta, tb, alpha, cm(a.data(), ar, ac, B), cm(b.data(), br, bc, B), beta,
                              cm(c0b.data(), m, n, B),
                              MatBatch{reinterpret_cast<float*>(hd.data()), m, n, n, m * n, B});
          hcb = hd;
          cuda->gemm_bf16_out(ta, tb, alpha, cm(da.p(), ar, ac, B), cm(db.p(), br, bc, B), beta,
                              cm(dcb.p(), m, n, B), MatBatch{reinterpret_cast<float*>(dd.p()), m, n, n, m * n, B});
          EXPECT_EQ(dcb.get(), c0b) << "C was written";
        } else {
          host->gemm_bf16(ta, tb, alpha, cm(a.data(), ar, ac, B), cm(b.data(), br, bc, B), beta,
                          MatBatch{reinterpret_cast<float*>(hcb.data()), m, n, n, m * n, B});
          cuda->gemm_bf16(ta, tb, alpha, cm(da.p(), ar, ac, B), cm(db.p(), br, bc, B), beta,
                          MatBatch{reinterpret_cast<float*>(dcb.p()), m, n, n, m * n, B});
        }
        const std::vector<uint16_t> gb = out ? dd.get() : dcb.get();
        got.resize(gb.size());
        for (size_t i = 0; i < gb.size(); ++i) {
          got[i] = bf16_to_float(gb[i]);
          hc[i] = bf16_to_float(hcb[i]);
        }
      }
      EXPECT_EQ(std::count_if(got.begin(), got.end(), [](float x) { return !std::isfinite(x); }), 0)
          << "elements not written";
      double worst = 0;
      for (int64_t q = 0; q < B; ++q)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            const size_t e = static_cast<size_t>((q * m + i) * n + j);
            double mag = std::fabs(beta * c0[e]);
            for (int64_t l = 0; l < k; ++l) {
              const float av = bf16_to_float(a[static_cast<size_t>(q * ar * ac + (ta ? l * ac + i : i * ac + l))]);
              const float bv = bf16_to_float(b[static_cast<size_t>(q * br * bc + (tb ? j * bc + l : l * bc + j))]);
              mag += std::fabs(static_cast<double>(alpha) * av * bv);
            }
            const double tol = 1e-5 * mag + (f32 ? 0.0 : std::ldexp(std::fabs(static_cast<double>(hc[e])), -7));
            worst = std::max(worst, std::fabs(static_cast<double>(got[e]) - hc[e]) / tol);
          }
      EXPECT_LE(worst, 1.0) << "worst error / tolerance";
    }
}

// gemm_bf16_lower and mirror_bf16, the iteration's symmetric products by
// blocks (8 x 8 blocks for n >= 2048 a multiple of 256, 4 x 4 for n >= 1024
// a multiple of 128, else the full product and bs = 0), against the host's gemm_bf16 (and add_diag_bf16) of
// the same bf16 operands, with GemmOnBf16BuffersMatchesHost's bound: 1e-5 of
// the sum of |terms| (here its Cauchy-Schwarz bound |alpha| |row_i| |col_j| +
// |beta c_ij|) for the accumulation order, plus one bf16 ulp (2^-7 of the
// value) for the rounding. Every element must be written (C starts as NaN
// where beta = 0), C must be exactly symmetric where blocks were used, and
// mirror_bf16's copy must hold C's blocks on and below the diagonal and
// nothing else (the rest keeps its sentinel). Cases: the Gram matrix of a
// wide (X X^T) and a tall (X^T X) X, completed with a copy, and c A A + b A
// of a symmetric A, completed with the diagonal shift a; two sizes that take
// the full product.
TEST_F(OpsTest, GemmBf16LowerAndMirrorMatchHost) {
  struct Case {
    int64_t n, l, batch;
    bool tall, square;
    bool blocks;  // whether the CUDA backend forms this one by blocks
  };
  const Case cases[] = {{2048, 256, 1, false, false, true},  {1024, 1536, 2, false, false, true},
                        {1152, 1280, 1, true, false, true},
                        {1024, 1024, 2, false, true, true},  {1152, 1152, 1, false, true, true},
                        {768, 512, 2, false, false, false},  {1000, 1000, 1, false, true, false}};
  const uint16_t kSentinel = 0x7fc1;  // a NaN: the copy's blocks above the diagonal must keep it
  for (const Case& cs : cases) {
    const int64_t n = cs.n, l = cs.square ? cs.n : cs.l, B = cs.batch;
    SCOPED_TRACE(testing::Message() << "n " << n << " l " << l << " batch " << B << (cs.tall ? " tall" : "")
                                    << (cs.square ? " A A" : " Gram"));
    // op(A) is n x l: X (n x l) for the wide Gram and A A, X^T (X: l x n) for the tall Gram.
    const bool ta = cs.tall, tb = cs.square ? false : !cs.tall;
    const int64_t xr = cs.tall ? l : n, xc = cs.tall ? n : l;
    std::vector<uint16_t> x(static_cast<size_t>(B * xr * xc));
    std::vector<uint16_t> c0(static_cast<size_t>(B * n * n), 0x7fc0);  // NaN: every element must be written
    float alpha = 1.0f, beta = 0.0f, shift = 0.0f;
    if (cs.square) {  // a symmetric A = bf16(G G^T / w), G n x w, C = A, as the iteration's B = b A + c A A
      const int64_t w = 64;
      std::vector<double> g(static_cast<size_t>(n * w));
      for (int64_t q = 0; q < B; ++q) {
        for (auto& v : g) v = gauss();
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j <= i; ++j) {
            double s = 0;
            for (int64_t t = 0; t < w; ++t) s += g[static_cast<size_t>(i * w + t)] * g[static_cast<size_t>(j * w + t)];
            const uint16_t v = float_to_bf16(static_cast<float>(s / static_cast<double>(w)));
            x[static_cast<size_t>((q * n + i) * n + j)] = x[static_cast<size_t>((q * n + j) * n + i)] = v;
          }
      }
      c0 = x;
      alpha = 0.5f;
      beta = -2.75f;
      shift = 3.5f;
    } else {
      for (auto& v : x) v = float_to_bf16(gauss());
    }
    Dev<uint16_t> dx(x), dc(c0), dcopy(std::vector<uint16_t>(c0.size(), kSentinel));
    std::vector<uint16_t> hc = c0;
    host->gemm_bf16(ta, tb, alpha, cm(x.data(), xr, xc, B), cm(x.data(), xr, xc, B), beta, mm(hc.data(), n, n, B));
    if (shift != 0.0f) host->add_diag_bf16(mm(hc.data(), n, n, B), shift);
    const int64_t bs =
        cuda->gemm_bf16_lower(ta, tb, alpha, cm(dx.p(), xr, xc, B), cm(dx.p(), xr, xc, B), beta, mm(dc.p(), n, n, B));
    EXPECT_EQ(bs > 0, cs.blocks) << "bs " << bs;
    if (std::getenv("DION_SYM_BLOCKS") == nullptr && bs > 0) EXPECT_EQ(bs, n >= 2048 ? n / 8 : n / 4);
    const MatBatch copy = mm(dcopy.p(), n, n, B);
    if (bs > 0) {
      EXPECT_EQ(n % bs, 0);
      cuda->mirror_bf16(mm(dc.p(), n, n, B), bs, shift, cs.square ? nullptr : &copy, nullptr);
    } else if (shift != 0.0f) {
      cuda->add_diag_bf16(mm(dc.p(), n, n, B), shift);
    }
    const std::vector<uint16_t> got = dc.get(), gotcopy = dcopy.get();
    // |row i of op(A)| = |col i of op(B)| (both are row/column i of X or X^T).
    std::vector<double> norm(static_cast<size_t>(B * n), 0.0);
    for (int64_t q = 0; q < B; ++q)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t t = 0; t < l; ++t) {
          const double v = bf16_to_float(x[static_cast<size_t>(q * xr * xc + (cs.tall ? t * n + i : i * l + t))]);
          norm[static_cast<size_t>(q * n + i)] += v * v;
        }
    double worst = 0;
    int64_t asymmetric = 0, unwritten = 0, bad_copy = 0;
    for (int64_t q = 0; q < B; ++q)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) {
          const size_t e = static_cast<size_t>((q * n + i) * n + j), et = static_cast<size_t>((q * n + j) * n + i);
          if (got[e] != got[et]) ++asymmetric;
          if (bs > 0 && !cs.square && gotcopy[e] != (i / bs >= j / bs ? got[e] : kSentinel)) ++bad_copy;
          const double g = bf16_to_float(got[e]), h = bf16_to_float(hc[e]);
          if (!std::isfinite(g)) {
            ++unwritten;
            continue;
          }
          const double mag =
              std::fabs(alpha) * std::sqrt(norm[static_cast<size_t>(q * n + i)] * norm[static_cast<size_t>(q * n + j)]) +
              (beta != 0.0f ? std::fabs(beta * bf16_to_float(c0[e])) : 0.0) + (i == j ? std::fabs(shift) : 0.0);
          const double tol = 1e-5 * mag + std::ldexp(std::fabs(h), -7);
          worst = std::max(worst, std::fabs(g - h) / tol);
        }
    EXPECT_EQ(unwritten, 0) << "elements left NaN (unwritten) or non-finite";
    // The full product (bs = 0) promises no symmetry.
    if (bs > 0) EXPECT_EQ(asymmetric, 0) << "elements whose transpose differs";
    EXPECT_EQ(bad_copy, 0) << "copy elements other than C's blocks on and below the diagonal, or overwritten above";
    EXPECT_LE(worst, 1.0) << "worst error / tolerance";
  }
}

// mirror_bf16 alone against its contract, element by element, on any
// square bf16 matrices (not products): every element (i, j) below the
// block diagonal (i / bs > j / bs) is written to (j, i), the blocks on the
// diagonal keep their elements but for the diagonal's shift (one bf16
// rounding of x + diag, as add_diag_bf16), the copy receives every element
// on and below the block diagonal as it was before the shift and keeps its
// sentinel elsewhere, and nothing outside the n x n matrices (a row's
// padding) is touched. Exact: the kernel moves bits. Shapes: 4 x 4 blocks
// of 288 (64-column tiles straddle the blocks), of 256 and 512, blocks of
// 32 on n = 160 (a last tile of 32) and on a row pitch of 97 and 163 (rows
// not 16-byte aligned: the kernel's scalar path), batches of 1 to 3.
TEST_F(OpsTest, MirrorBf16MatchesItsContract) {
  struct Case {
    int64_t n, bs, batch, pad;
    bool copy;
    float diag;
  };
  const Case cases[] = {{1152, 288, 2, 0, true, 0.0f}, {1152, 288, 1, 0, false, 3.5f}, {1024, 256, 2, 0, false, -1.25f},
                        {2048, 512, 1, 0, true, 0.0f},  {160, 32, 2, 0, true, 2.0f},     {96, 32, 3, 1, true, 0.0f},
                        {160, 32, 2, 3, false, 0.75f}};
  const uint16_t kSentinel = 0x7fc1;
  for (const Case& cs : cases) {
    const int64_t n = cs.n, bs = cs.bs, B = cs.batch, ld = n + cs.pad, st = n * ld + cs.pad;
    SCOPED_TRACE(testing::Message() << "n " << n << " bs " << bs << " batch " << B << " ld " << ld
                                    << (cs.copy ? " copy" : "") << " diag " << cs.diag);
    std::vector<uint16_t> m(static_cast<size_t>(B * st));
    for (auto& v : m) v = float_to_bf16(gauss());
    std::vector<uint16_t> want = m, want_copy(m.size(), kSentinel);
    for (int64_t q = 0; q < B; ++q)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) {
          const size_t e = static_cast<size_t>(q * st + i * ld + j), et = static_cast<size_t>(q * st + j * ld + i);
          if (i / bs > j / bs) want[et] = m[e];
          if (i / bs >= j / bs) want_copy[e] = m[e];
          if (i == j && cs.diag != 0.0f) want[e] = float_to_bf16(bf16_to_float(m[e]) + cs.diag);
        }
    Dev<uint16_t> dm(m), dcopy(std::vector<uint16_t>(m.size(), kSentinel));
    const MatBatch copy{reinterpret_cast<float*>(dcopy.p()), n, n, ld, st, B};
    cuda->mirror_bf16(MatBatch{reinterpret_cast<float*>(dm.p()), n, n, ld, st, B}, bs, cs.diag,
                      cs.copy ? &copy : nullptr, nullptr);
    const std::vector<uint16_t> got = dm.get(), got_copy = dcopy.get();
    int64_t bad = 0, bad_copy = 0;
    for (size_t e = 0; e < m.size(); ++e) {
      bad += got[e] != want[e];
      bad_copy += got_copy[e] != (cs.copy ? want_copy[e] : kSentinel);
    }
    EXPECT_EQ(bad, 0) << "elements of the matrices (or their padding) that differ from the contract";
    EXPECT_EQ(bad_copy, 0) << "elements of the copy that differ from the contract";
  }
}

// mirror_bf16 with the first step's scale against the two passes it
// replaces, bit for bit: the plain mirror (no shift, no copy), then
// frob_scale_bf16 with the shift (both on the device: the same frob_inv
// over the same partial sums); the copy must then hold the result's elements
// on and below the block diagonal and keep its sentinel elsewhere, and a
// row's padding is left alone. The iteration's two uses (power 2, no shift,
// a copy: A; power 1, the shift a, no copy: B) and the others, on the
// shapes of MirrorBf16MatchesItsContract (blocks straddling 64-column tiles,
// unaligned rows) and 8 x 8 blocks of 256.
TEST_F(OpsTest, MirrorBf16ScaledMatchesFrobScale) {
  struct Case {
    int64_t n, bs, batch, pad;
    bool copy;
    float diag;
    int power;
  };
  const Case cases[] = {{1152, 288, 2, 0, true, 0.0f, 2},  {1152, 288, 1, 0, false, 3.5f, 1},
                        {2048, 256, 2, 0, true, 0.0f, 2},  {2048, 256, 2, 0, false, -2.75f, 1},
                        {1024, 512, 1, 0, true, 1.5f, 1},  {160, 32, 2, 0, false, 2.0f, 2},
                        {96, 32, 3, 1, true, 0.0f, 2},     {160, 32, 2, 3, false, 0.75f, 1}};
  const uint16_t kSentinel = 0x7fc1;
  const int64_t nparts = 37;
  for (const Case& cs : cases) {
    const int64_t n = cs.n, bs = cs.bs, B = cs.batch, ld = n + cs.pad, st = n * ld + cs.pad;
    SCOPED_TRACE(testing::Message() << "n " << n << " bs " << bs << " batch " << B << " ld " << ld
                                    << (cs.copy ? " copy" : "") << " diag " << cs.diag << " power " << cs.power);
    std::vector<uint16_t> m(static_cast<size_t>(B * st));
    for (auto& v : m) v = float_to_bf16(gauss());
    // Partial sums of squares of the order of an n x 3n start's (norms of a few tens).
    std::vector<double> parts(static_cast<size_t>(B * nparts));
    for (auto& v : parts) v = 3.0 * static_cast<double>(n) / nparts * (1.0 + 0.25 * std::fabs(gauss()));
    Dev<double> dparts(parts);
    const float factor = 1.02f, eps = 1e-7f;
    auto mb = [&](uint16_t* p) { return MatBatch{reinterpret_cast<float*>(p), n, n, ld, st, B}; };
    Dev<uint16_t> dref(m), dm(m), dcopy(std::vector<uint16_t>(m.size(), kSentinel));
    cuda->mirror_bf16(mb(dref.p()), bs, 0.0f, nullptr, nullptr);
    const FrobScale sc{dparts.p(), nparts, factor, eps, cs.power};
    cuda->frob_scale_bf16(mb(dref.p()), sc, cs.diag);
    const MatBatch copy = mb(dcopy.p());
    cuda->mirror_bf16(mb(dm.p()), bs, cs.diag, cs.copy ? &copy : nullptr, &sc);
    const std::vector<uint16_t> want = dref.get(), got = dm.get(), got_copy = dcopy.get();
    int64_t bad = 0, bad_copy = 0, changed = 0;
    for (int64_t q = 0; q < B; ++q)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < ld; ++j) {
          const size_t e = static_cast<size_t>(q * st + i * ld + j);
          const bool inside = j < n, lower = inside && i / bs >= j / bs;
          bad += got[e] != (inside ? want[e] : m[e]);
          bad_copy += got_copy[e] != (cs.copy && lower ? want[e] : kSentinel);
          changed += inside && want[e] != m[e];
        }
    for (int64_t q = 0; q < B; ++q)  // each matrix's padding after its last row
      for (int64_t e = q * st + n * ld; e < (q + 1) * st; ++e) bad += got[static_cast<size_t>(e)] != m[static_cast<size_t>(e)];
    EXPECT_EQ(bad, 0) << "elements that differ from the mirror followed by frob_scale_bf16 (or padding touched)";
    EXPECT_EQ(bad_copy, 0) << "elements of the copy that differ from the result's lower blocks, or not left";
    EXPECT_GT(changed, B * n * n / 2) << "the scale should change most elements";
  }
}

TEST_F(OpsTest, GemmBetaZeroAndEmptyK) {
  const int64_t m = 9, n = 11, B = 2;
  // beta = 0 ignores C, NaN included.
  Mat a = Mat::padded(m, 5, B), b = Mat::padded(5, n, B), c = Mat::padded(m, n, B);
  a.fill([&] { return gauss(); });
  b.fill([&] { return gauss(); });
  c.fill([] { return NAN; });
  cuda->gemm(false, false, 1.0f, a.D(), b.D(), 0.0f, c.D(), DION_MATMUL_FP32);
  host->gemm(false, false, 1.0f, a.H(), b.H(), 0.0f, c.H(), DION_MATMUL_FP32);
  EXPECT_TRUE(close(c.h, c.dev(), 1e-5, 1e-5));
  // k = 0: C = beta * C; and with beta = 0, C = 0 even where C held NaN.
  for (float beta : {0.5f, 0.0f}) {
    Mat a0(m, 0, 1, m, B), b0(0, n, n, 0, B), c0 = Mat::padded(m, n, B);
    c0.fill([&] { return gauss(); });
    c0.at(1, 2, 3) = NAN;
    c0.sync();
    cuda->gemm(false, false, 1.0f, a0.D(), b0.D(), beta, c0.D(), DION_MATMUL_FP32);
    host->gemm(false, false, 1.0f, a0.H(), b0.H(), beta, c0.H(), DION_MATMUL_FP32);
    // (close(), not same_bits: the GPU returns the canonical NaN, x86 keeps the payload.)
    EXPECT_TRUE(close(c0.h, c0.dev(), 0.0)) << "beta " << beta;
    // gemm_bf16_f32 (bf16 operands, fp32 C) likewise (the operands' buffers
    // are never read: their fp32 pointers stand in for bf16 ones).
    c0.fill([&] { return gauss(); });
    c0.at(0, 3, 4) = NAN;
    c0.sync();
    cuda->gemm_bf16_f32(false, false, 1.0f, a0.D(), b0.D(), beta, c0.D());
    host->gemm_bf16_f32(false, false, 1.0f, a0.H(), b0.H(), beta, c0.H());
    EXPECT_TRUE(close(c0.h, c0.dev(), 0.0)) << "gemm_bf16_f32, beta " << beta;
  }
}

// Multiplies column j of the host result by the sign that best aligns it with
// the device one (QR factors are unique up to those signs).
std::vector<float> align_columns(const Mat& want, const std::vector<float>& got) {
  std::vector<float> w = want.h;
  for (int64_t b = 0; b < want.batch; ++b)
    for (int64_t j = 0; j < want.cols; ++j) {
      double dot = 0;
      for (int64_t i = 0; i < want.rows; ++i) {
        const size_t e = static_cast<size_t>(b * want.stride + i * want.ld + j);
        dot += static_cast<double>(w[e]) * got[e];
      }
      if (dot < 0)
        for (int64_t i = 0; i < want.rows; ++i) w[static_cast<size_t>(b * want.stride + i * want.ld + j)] *= -1.0f;
    }
  return w;
}

// max |Q^T Q - I| over the batch.
double orthonormality_error(const std::vector<float>& q, const Mat& shape) {
  double worst = 0;
  for (int64_t b = 0; b < shape.batch; ++b)
    for (int64_t x = 0; x < shape.cols; ++x)
      for (int64_t y = 0; y < shape.cols; ++y) {
        double s = 0;
        for (int64_t i = 0; i < shape.rows; ++i)
          s += static_cast<double>(q[b * shape.stride + i * shape.ld + x]) * q[b * shape.stride + i * shape.ld + y];
        worst = std::max(worst, std::fabs(s - (x == y ? 1.0 : 0.0)));
      }
  return worst;
}

// Runs body once on a CUDA backend with its own blocked Cholesky (the
// default up to 2048 x 2048) and once on one with cuSOLVER's potrf(Batched)
// (DION_OWN_CHOLESKY=0): every Cholesky the backend takes, qr_r's fp64 one
// included, goes through one or the other.
// The variable is left as it was (tools/gpu_chol_check.sh times the tests
// after these with it set).
template <class F>
void with_each_cholesky(std::unique_ptr<Backend>& cuda, F&& body) {
  for (const char* own : {"1", "0"}) {
    SCOPED_TRACE(testing::Message() << "DION_OWN_CHOLESKY=" << own);
    ScopedEnv env("DION_OWN_CHOLESKY", own);
    cuda.reset(make_cuda_backend(0));
    body();
  }
  cuda.reset(make_cuda_backend(0));
}

// Adds 3 sqrt(cols) to the diagonal of every matrix of a Gaussian batch (and
// syncs the device copy): its singular values then lie within a factor of
// about 3 of each other, so its QR is well determined.
void shift_diagonal(Mat& a) {
  for (int64_t b = 0; b < a.batch; ++b)
    for (int64_t i = 0; i < std::min(a.rows, a.cols); ++i) a.at(b, i, i) += 3.0f * std::sqrt(static_cast<float>(a.cols));
  a.sync();
}

TEST_F(OpsTest, QrQAndR) {
  with_each_cholesky(cuda, [&] {
    struct Shape {
      int64_t p, r, B;
      // {640, 512, 2}: RCQR's sketch at r = 512, whose fp64 Gram matrix
      // qr_r forms by 4 x 4 blocks (2 x 2, and 16 at r = 16, in
      // ops_linalg_triangle_blocks)
    } shapes[] = {{60, 20, 3}, {16, 16, 2}, {300, 40, 1}, {700, 200, 3}, {1500, 600, 1}, {640, 512, 2}};
    for (const Shape& s : shapes) {
      SCOPED_TRACE(testing::Message() << s.p << " x " << s.r << " batch " << s.B);
      Mat a = Mat::padded(s.p, s.r, s.B);
      a.fill([&] { return gauss(); });
      if (s.p == s.r) shift_diagonal(a);  // a square Gaussian matrix can be badly conditioned
      Mat a2 = Mat::padded(s.p, s.r, s.B);
      a2.h = a.h;
      a2.sync();
      Mat r = Mat::padded(s.r, s.r, s.B, 2, 1);
      r.fill([] { return 5.0f; });
      cuda->qr_r(a2.D(), r.D());
      host->qr_r(a2.H(), r.H());
      // R is unique up to row signs: align rows by the diagonal.
      std::vector<float> rd = r.dev(), rh = r.h;
      for (int64_t b = 0; b < s.B; ++b)
        for (int64_t i = 0; i < s.r; ++i)
          if ((rd[b * r.stride + i * r.ld + i] < 0) != (rh[b * r.stride + i * r.ld + i] < 0))
            for (int64_t j = 0; j < s.r; ++j) rh[b * r.stride + i * r.ld + j] *= -1.0f;
      EXPECT_TRUE(close(rh, rd, 0.0, 1e-4 * max_abs(rh)));
      for (int64_t b = 0; b < s.B; ++b)  // zeros below the diagonal
        for (int64_t i = 1; i < s.r; ++i) EXPECT_EQ(rd[b * r.stride + i * r.ld + i - 1], 0.0f);

      cuda->qr_q(a.D());
      host->qr_q(a.H());
      const std::vector<float> q = a.dev();
      EXPECT_LT(orthonormality_error(q, a), 1e-5);
      EXPECT_TRUE(close(align_columns(a, q), q, 0.0, 1e-4));
    }
  });
}

// qr_q spreads a batch's Householder QRs over up to 8 streams (one cuSOLVER
// handle and workspace each): every matrix is still factored by the same
// calls on the same data, so the Q of a batch of 11 (lanes reused, and a
// last round of 3) has the same bits as with every matrix on the current
// stream (DION_QR_STREAMS=1), on the default stream and on a caller's
// non-blocking one (the lanes fork from and join back to it).
TEST_F(OpsTest, QrQStreamsSameBits) {
  ScopedEnv batched("DION_QR_BATCHED", "0");  // the lanes serve cuSOLVER's path only
  ScopedEnv streams("DION_QR_STREAMS", "1");
  const int64_t p = 300, r = 120, B = 11;
  Mat a = Mat::padded(p, r, B);
  a.fill([&] { return gauss(); });
  std::vector<float> q[3];
  cudaStream_t st = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  for (int v = 0; v < 3; ++v) {
    streams.set(v == 0 ? "1" : "8");
    std::unique_ptr<Backend> be(make_cuda_backend(0));
    if (v == 2) be->set_stream(st);
    Mat x = Mat::padded(p, r, B);
    x.h = a.h;
    x.sync();
    be->qr_q(x.D());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    q[v] = x.dev();
    EXPECT_LT(orthonormality_error(q[v], x), 1e-5) << "variant " << v;
  }
  ASSERT_EQ(cudaStreamDestroy(st), cudaSuccess);
  ASSERT_EQ(q[0].size(), q[1].size());
  EXPECT_EQ(0, std::memcmp(q[0].data(), q[1].data(), q[0].size() * sizeof(float))) << "8 streams against 1";
  EXPECT_EQ(0, std::memcmp(q[0].data(), q[2].data(), q[0].size() * sizeof(float))) << "on a caller's stream";
}

// qr_q's batched Householder QR (kernels/householder.cu, the default where
// a panel of 16 or 32 columns fits in shared memory) against the host's
// LAPACK-convention Householder QR and against cuSOLVER's geqrf / orgqr
// (DION_QR_BATCHED=0): the same reflectors, so the same Q with the same
// column signs, compared without aligning them. The shapes take one and
// several outer blocks of 128 columns, partial panels and outer blocks (200
// = 128 + 2 x 32 + 8), both panel widths (32 up to about 1660 rows on
// Hopper, 16 above), tall and square matrices, padded rows and batches of
// 1 to 3. The inputs are well conditioned (Gaussian, p >= 2.5 r, or square
// with a shifted diagonal: singular values within a factor of about 3), so
// fp32 QRs agree to about n eps cond, and 1e-4 bounds entries of at most 1.
// On Hopper the panels of 256 rows and more (512 at width 16) are factored
// by clusters of 2 to 8 CTAs (kernels::householder_panel_cluster: 700,
// 768, 1800 and 3000 rows here); Q must also agree with the panels one CTA
// per matrix (DION_QR_PANEL_CLUSTER=0), and differ from it somewhere (the
// column sums are added in another order): the clusters ran.
TEST_F(OpsTest, QrQBatchedMatchesHostAndCusolver) {
  std::unique_ptr<Backend> ref;  // qr_q by cuSOLVER's geqrf / orgqr matrix by matrix
  ASSERT_NO_FATAL_FAILURE(cuda_backend_with("DION_QR_BATCHED", "0", &ref));
  std::unique_ptr<Backend> one_cta;  // the panels one CTA per matrix
  ASSERT_NO_FATAL_FAILURE(cuda_backend_with("DION_QR_PANEL_CLUSTER", "0", &one_cta));
  int major = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  bool clusters_differ = false;
  int optin = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
  struct Shape {
    int64_t p, r, B;
  } shapes[] = {{16, 16, 2}, {60, 20, 3}, {200, 200, 2}, {700, 260, 2}, {768, 768, 1}, {1800, 150, 2}, {3000, 130, 1}};
  std::set<int> widths;
  for (const Shape& s : shapes) {
    const int nb = kernels::householder_panel_width(s.p, optin);
    SCOPED_TRACE(testing::Message() << s.p << " x " << s.r << " batch " << s.B << ", panel width " << nb);
    widths.insert(nb);
    Mat a = Mat::padded(s.p, s.r, s.B);
    a.fill([&] { return gauss(); });
    if (s.p < 2 * s.r) shift_diagonal(a);
    Mat c = Mat::padded(s.p, s.r, s.B), o = Mat::padded(s.p, s.r, s.B);
    c.h = o.h = a.h;
    c.sync();
    o.sync();
    cuda->qr_q(a.D());
    ref->qr_q(c.D());
    one_cta->qr_q(o.D());
    host->qr_q(a.H());
    const std::vector<float> q = a.dev(), qc = c.dev(), qo = o.dev();
    EXPECT_LT(orthonormality_error(q, a), 1e-5);
    EXPECT_TRUE(close(a.h, q, 0.0, 1e-4)) << "against the host";
    EXPECT_TRUE(close(qc, q, 0.0, 1e-4)) << "against cuSOLVER";
    EXPECT_TRUE(close(qo, q, 0.0, 1e-4)) << "against the panels one CTA per matrix";
    clusters_differ = clusters_differ || !same_bits(qo, q);
  }
  if (optin >= 200 * 1024) EXPECT_TRUE(widths.count(32) && widths.count(16)) << "both panel widths were meant to run";
  if (major >= 9) EXPECT_TRUE(clusters_differ) << "the clustered panels did not run";
}

// Degenerate columns: where x below the diagonal is zero, larfg's tau is 0
// and the reflector is I (a zero matrix gives Q = I exactly; a first column
// 4 e_1 gives tau_1 = 0 in an otherwise full-rank matrix); a matrix of rank
// 100 of 256 still gives an orthonormal Q (its last columns are rounding
// in any implementation: only orthogonality is compared). Batched with
// full-rank neighbours: each matrix is factored on its own. And the same
// input gives the same bits twice.
TEST_F(OpsTest, QrQBatchedDegenerateAndDeterministic) {
  std::unique_ptr<Backend> ref;  // qr_q by cuSOLVER's geqrf / orgqr matrix by matrix
  ASSERT_NO_FATAL_FAILURE(cuda_backend_with("DION_QR_BATCHED", "0", &ref));
  const int64_t p = 300, r = 140;
  Mat a = Mat::padded(p, r, 3);
  a.fill([&] { return gauss(); });
  for (int64_t i = 0; i < p; ++i)
    for (int64_t j = 0; j < r; ++j) a.at(0, i, j) = 0.0f;  // matrix 0: zeros
  for (int64_t i = 0; i < p; ++i) a.at(1, i, 0) = i == 0 ? 4.0f : 0.0f;  // matrix 1: first column 4 e_1
  a.sync();
  Mat c = Mat::padded(p, r, 3), again = Mat::padded(p, r, 3);
  c.h = again.h = a.h;
  c.sync();
  again.sync();
  cuda->qr_q(a.D());
  cuda->qr_q(again.D());
  ref->qr_q(c.D());
  host->qr_q(a.H());
  const std::vector<float> q = a.dev();
  for (int64_t i = 0; i < p; ++i)
    for (int64_t j = 0; j < r; ++j)
      ASSERT_EQ(q[static_cast<size_t>(a.stride * 0 + i * a.ld + j)], i == j ? 1.0f : 0.0f) << i << ", " << j;
  EXPECT_LT(orthonormality_error(q, a), 1e-5);
  EXPECT_TRUE(close(a.h, q, 0.0, 1e-4)) << "against the host";
  EXPECT_TRUE(close(c.dev(), q, 0.0, 1e-4)) << "against cuSOLVER";
  const std::vector<float> q2 = again.dev();
  EXPECT_EQ(0, std::memcmp(q.data(), q2.data(), q.size() * sizeof(float))) << "two runs";

  // Rank 100 of 256: A = X Y.
  const int64_t n = 256, k = 100;
  Mat d = Mat::padded(n, n, 2);
  for (int64_t b = 0; b < 2; ++b) {
    std::vector<float> x(static_cast<size_t>(n * k)), y(static_cast<size_t>(k * n));
    for (auto& v : x) v = gauss();
    for (auto& v : y) v = gauss();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t l = 0; l < k; ++l) acc += static_cast<double>(x[i * k + l]) * y[l * n + j];
        d.at(b, i, j) = static_cast<float>(acc);
      }
  }
  d.sync();
  cuda->qr_q(d.D());
  EXPECT_LT(orthonormality_error(d.dev(), d), 1e-5) << "rank 100 of 256";
}

// Tiny and huge columns: LAPACK's larfg rescales a column whose norm is
// below the smallest normal float, where 1 / (alpha - beta) would overflow a
// float (a momentum decayed over thousands of steps gives such a P), and
// the batched QR's panel sums its dots in float, whose squares underflow or
// overflow there; it forms such a column's reflector in float64 instead.
// Matrix 0 is Gaussian times 1e-40 (subnormal entries), matrix 1 Gaussian
// with its fourth column times 1e-41, matrix 2 Gaussian times 1e-30 (tiny
// but normal), matrix 3 times 1e30 (huge: its squares overflow a float).
// Every Q is finite and orthonormal (the subnormal ones carry only their
// inputs' 10 to 13 bits, so they are not compared with another
// implementation), and matrices 2 and 3 equal the host's (LAPACK) as
// closely as a well-scaled matrix's. Both panel widths: 300 rows take
// panels of 32, 1800 rows panels of 16 (on Hopper).
TEST_F(OpsTest, QrQBatchedTinyColumns) {
  int optin = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
  std::set<int> widths;
  for (const auto& [p, r] : {std::pair<int64_t, int64_t>{300, 140}, {1800, 40}}) {
    const int nb = kernels::householder_panel_width(p, optin);
    SCOPED_TRACE(testing::Message() << p << " x " << r << ", panel width " << nb);
    widths.insert(nb);
    Mat a = Mat::padded(p, r, 4);
    a.fill([&] { return gauss(); });
    for (int64_t i = 0; i < p; ++i)
      for (int64_t j = 0; j < r; ++j) {
        a.at(0, i, j) *= 1e-40f;
        if (j == 3) a.at(1, i, j) *= 1e-41f;
        a.at(2, i, j) *= 1e-30f;
        a.at(3, i, j) *= 1e30f;
      }
    a.sync();
    cuda->qr_q(a.D());
    host->qr_q(a.H());
    const std::vector<float> q = a.dev();
    for (int64_t b = 0; b < 4; ++b) {
      SCOPED_TRACE(testing::Message() << "matrix " << b);
      Mat one = Mat::padded(p, r, 1);
      for (int64_t i = 0; i < p; ++i)
        for (int64_t j = 0; j < r; ++j) {
          const float v = q[static_cast<size_t>(b * a.stride + i * a.ld + j)];
          ASSERT_TRUE(std::isfinite(v)) << i << ", " << j;
          one.at(0, i, j) = v;
        }
      EXPECT_LT(orthonormality_error(one.h, one), 1e-5);
    }
    for (int64_t b = 2; b < 4; ++b) {
      double worst = 0;
      for (int64_t i = 0; i < p; ++i)
        for (int64_t j = 0; j < r; ++j) {
          const size_t e = static_cast<size_t>(b * a.stride + i * a.ld + j);
          worst = std::max(worst, static_cast<double>(std::fabs(q[e] - a.h[e])));
        }
      EXPECT_LT(worst, 1e-4) << "matrix " << b << " against the host";
    }
  }
  if (optin >= 200 * 1024) EXPECT_TRUE(widths.count(32) && widths.count(16)) << "both panel widths were meant to run";
}

// Backend::gram: the CUDA backend sums S products over row chunks when the
// batch's products are too few to fill the device (S = 16 for 4096 x 64, 2
// for 1000 x 40 on an H100); a padded A is one product. From r = 256 on only
// the blocks on and below the block diagonal are formed, and the sum writes
// the others as their mirrors (4 x 4 blocks and S = 4 for 2048 x 512, 2 x 2
// blocks and S = 1 for 256 x 256, 2 x 2 and S = 2 for 1000 x 384;
// ops_linalg_triangle_blocks runs the smaller ones with 2 x 2 blocks where r
// is a multiple of 16). At FP32 on Hopper the 3xTF32 kernel forms only its
// output tiles that hold the lower triangle (6 of 9 at r = 384, 10 of 16 at
// r = 512) and the sum mirrors it. Each
// against the host's A^T A (one fp32 GEMM), relative to the largest entry
// (a diagonal one, about p): fp32 sums of p terms (the split only reorders
// them), whose rounding in sequential order is about eps sqrt(p) of the
// diagonal (2e-6 at p = 4096; blocked sums less): 1e-5; TF32 inputs, each
// term off by up to 2^-10 relative with a random sign, about 2^-10 / sqrt(p)
// of the diagonal (6e-5 at p = 300): 2e-4.
TEST_F(OpsTest, GramMatchesHost) {
  struct Shape {
    int64_t p, r, B;
    bool padded;
  } shapes[] = {{4096, 64, 2, false}, {1000, 40, 3, false}, {300, 40, 2, true}, {2048, 512, 1, false},
                {256, 256, 2, false}, {1000, 384, 2, false}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(testing::Message() << s.p << " x " << s.r << " batch " << s.B << (s.padded ? " padded" : ""));
    Mat a = s.padded ? Mat::padded(s.p, s.r, s.B) : Mat(s.p, s.r, s.r, s.p * s.r, s.B);
    a.fill([&] { return gauss(); });
    for (dion_matmul_precision_t prec : {DION_MATMUL_FP32, DION_MATMUL_TF32}) {
      Mat g = Mat::padded(s.r, s.r, s.B, 2, 1);
      g.fill([] { return 5.0f; });
      cuda->gram(a.D(), g.D(), prec);
      host->gram(a.H(), g.H(), DION_MATMUL_FP32);
      const std::vector<float> got = g.dev();
      EXPECT_TRUE(close(g.h, got, 0.0, (prec == DION_MATMUL_FP32 ? 1e-5 : 2e-4) * max_abs(g.h)))
          << (prec == DION_MATMUL_FP32 ? "fp32" : "tf32");
      EXPECT_EQ(got[s.r], kPad) << "the padding after row 0 was written";
      // From r = 256 on the blocks above the block diagonal are their
      // mirrors' transposes: the result is symmetric bit for bit.
      if (s.r >= 256) {
        int64_t asym = 0;
        for (int64_t b = 0; b < s.B; ++b)
          for (int64_t i = 0; i < s.r; ++i)
            for (int64_t j = 0; j < i; ++j)
              asym += std::memcmp(&got[static_cast<size_t>(b * g.stride + i * g.ld + j)],
                                  &got[static_cast<size_t>(b * g.stride + j * g.ld + i)], sizeof(float)) != 0;
        EXPECT_EQ(asym, 0) << "elements whose mirror differs";
      }
    }
  }
}

// SPD test matrices: X^T X / n + I, well conditioned.
void fill_spd(Mat& m, std::mt19937& rng) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int64_t n = m.rows;
  std::vector<double> x(n * n);
  for (int64_t b = 0; b < m.batch; ++b) {
    for (auto& v : x) v = g(rng);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = i == j ? 1.0 : 0.0;
        for (int64_t l = 0; l < n; ++l) s += x[l * n + i] * x[l * n + j] / n;
        m.at(b, i, j) = static_cast<float>(s);
      }
  }
  m.sync();
}

TEST_F(OpsTest, CholeskyAndFailures) {
  // Both factorizations (with_each_cholesky: the backend's own of 64-column
  // blocks, and cuSOLVER's potrfBatched, potrf per matrix for a batch of
  // one) and the fix-up after them, on n = 12, 40, 150 and 1100, and n =
  // 200 and 700 (a last block column of 60) with failures both early and
  // late (a blocked factorization meets them in its first and last block
  // column: the first failure must be the one reported).
  with_each_cholesky(cuda, [&] {
    struct Shape {
      int64_t n, B;
    } shapes[] = {{12, 5}, {150, 3}, {40, 1}, {200, 4}, {700, 4}, {1100, 2}};
    for (const Shape& s : shapes) {
      SCOPED_TRACE(testing::Message() << "n " << s.n << " batch " << s.B);
      Mat a = Mat::padded(s.n, s.n, s.B);
      fill_spd(a, rng);
      if (s.B >= 3) {
        a.at(1, 5, 5) = -1000.0f;  // indefinite
        a.at(2, 0, 0) = NAN;       // non-finite
        if (s.n >= 100 && s.B >= 4) {
          a.at(3, s.n - 60, s.n - 60) = -1000.0f;  // indefinite in the last block column
          a.at(1, s.n - 60, s.n - 60) = -1000.0f;  // and after matrix 1's first failure
        }
        a.sync();
      }
      Dev<int32_t> dinfo(std::vector<int32_t>(s.B, -7));
      std::vector<int32_t> hinfo(s.B, -7);
      cuda->cholesky_upper(a.D(), dinfo.p());
      host->cholesky_upper(a.H(), hinfo.data());
      const std::vector<int32_t> di = dinfo.get();
      const std::vector<float> u = a.dev();
      for (int64_t b = 0; b < s.B; ++b) {
        const bool bad = (s.B >= 3 && (b == 1 || b == 2)) || (s.n >= 100 && s.B >= 4 && b == 3);
        EXPECT_EQ(hinfo[b] != 0, bad) << "host, matrix " << b;
        EXPECT_EQ(di[b] != 0, bad) << "cuda, matrix " << b << " info " << di[b];
        // The indefinite ones: potrf's index, 1 + the first pivot that is not
        // positive, LAPACK's on the host (whose spotrf passes a NaN pivot, so
        // the host flags the NaN matrix by its diagonal instead).
        if (bad && b != 2) EXPECT_EQ(di[b], hinfo[b]) << "matrix " << b;
        if (b == 2 && bad) EXPECT_EQ(di[b], 1) << "the NaN is the first pivot";
        for (int64_t i = 0; i < s.n; ++i)
          for (int64_t j = 0; j < i; ++j) EXPECT_EQ(u[b * a.stride + i * a.ld + j], 0.0f);
        if (bad) continue;
        std::vector<float> hb(a.h.begin() + b * a.stride, a.h.begin() + b * a.stride + s.n * a.ld);
        std::vector<float> db(u.begin() + b * a.stride, u.begin() + b * a.stride + s.n * a.ld);
        EXPECT_TRUE(close(hb, db, 0.0, 1e-4 * max_abs(hb))) << "matrix " << b;
      }
      // Padding untouched.
      EXPECT_EQ(u[a.ld - 1], kPad);
    }
  });
}

TEST_F(OpsTest, TrsmRightUpper) {
  const int64_t n = 12, rows = 40, B = 3;
  Mat u = Mat::padded(n, n, B);
  fill_spd(u, rng);
  std::vector<int32_t> info(B);
  host->cholesky_upper(u.H(), info.data());
  u.sync();
  for (bool shared_u : {false, true}) {
    SCOPED_TRACE(shared_u ? "one U for the batch" : "one U per matrix");
    Mat uu = Mat::padded(n, n, B);
    uu.h = u.h;
    if (shared_u) uu.stride = 0;
    uu.sync();
    Mat b = Mat::padded(rows, n, B, 3, 2);
    b.fill([&] { return gauss(); });
    // Out of place (into a batch of another padding) on both backends first:
    // the same values as in place, the input left as it was.
    Mat y = Mat::padded(rows, n, B, 1, 7), yh = Mat::padded(rows, n, B, 1, 7);
    cuda->trsm_right_upper(uu.D(), b.D(), y.D(), DION_MATMUL_FP32);
    host->trsm_right_upper(uu.H(), b.H(), yh.H(), DION_MATMUL_FP32);
    EXPECT_TRUE(b.dev() == b.h) << "the out-of-place solve wrote its input";
    cuda->trsm_right_upper(uu.D(), b.D());
    host->trsm_right_upper(uu.H(), b.H());
    EXPECT_TRUE(close(b.h, b.dev(), 0.0, 1e-4 * max_abs(b.h)));
    const std::vector<float> yd = y.dev(), bd = b.dev();
    for (int64_t m = 0; m < B; ++m)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < n; ++j) {
          ASSERT_EQ(yd[m * y.stride + i * y.ld + j], bd[m * b.stride + i * b.ld + j]) << m << " " << i << " " << j;
          ASSERT_EQ(yh.h[m * y.stride + i * y.ld + j], b.h[m * b.stride + i * b.ld + j]) << m << " " << i << " " << j;
        }
  }
  // Batch of one: the plain cublasStrsm path.
  Mat b1 = Mat::padded(rows, n, 1);
  b1.fill([&] { return gauss(); });
  Mat u1 = Mat::padded(n, n, 1);
  u1.h.assign(u.h.begin(), u.h.begin() + u1.h.size());
  u1.sync();
  cuda->trsm_right_upper(u1.D(), b1.D());
  host->trsm_right_upper(u1.H(), b1.H());
  EXPECT_TRUE(close(b1.h, b1.dev(), 0.0, 1e-4 * max_abs(b1.h)));
}

// Dense B at least as tall as U (rows >= n, n >= 32) takes the CUDA backend's explicit-inverse
// path (square, 2n + 5 and 4n + 5 rows here): U^{-1} by blocked recursion (diagonal blocks of at most 64 solved,
// the rest GEMMs), then the product with it (by 4 block columns for n = 512 at
// FP32, tri_product; ops_linalg_triangle_blocks takes 2 block columns for every
// n that is a multiple of 16 and every precision). n = L 2^k with L <= 64 runs by levels (one
// batched call per depth): n = 64 is a single block, 96 is 2 x 48, 200 is
// 4 x 50, 192 is 4 x 48 and 512 is 8 x 64 (Dion's r for gpt-1.3b); 150 is not
// of that form (150 -> 75 + 75 -> 37 + 38) and takes the recursion, as
// does 1100 (275 x 4), which at FP32 takes the inverse below 4 n rows only
// where the products run at 3xTF32 (on Hopper; elsewhere cuBLAS's trsm,
// the same bound). U's strictly lower part holds NaN:
// neither backend may read it. U = 2 I + an upper part of norm about 0.3, so
// cond(U) is below 2 and the normwise error of X = B U^{-1} is that of the
// products: fp32 (relative 2^-24 per operation, n terms) within 1e-5, and
// TF32 (operands rounded to 2^-11) within 4 * 2^-11 * cond(U) < 4e-3.
TEST_F(OpsTest, TrsmRightUpperByInverse) {
  const int64_t B = 3;
  for (int64_t n : {64, 96, 150, 192, 200, 512, 1100}) {
    for (int64_t rows : {n, 2 * n + 5, 4 * n + 5}) {
      for (bool shared_u : {false, true}) {
        for (dion_matmul_precision_t prec : {DION_MATMUL_FP32, DION_MATMUL_TF32, DION_MATMUL_BF16}) {
          SCOPED_TRACE("n " + std::to_string(n) + ", rows " + std::to_string(rows) +
                       (shared_u ? ", one U" : ", one U per matrix") + ", precision " +
                       std::to_string(static_cast<int>(prec)));
          Mat u = Mat::padded(n, n, B);
          if (shared_u) u.stride = 0;
          const double off_scale = 0.3 / std::sqrt(static_cast<double>(n));
          for (int64_t b = 0; b < (shared_u ? 1 : B); ++b)
            for (int64_t i = 0; i < n; ++i)
              for (int64_t j = 0; j < n; ++j)
                u.at(b, i, j) = i == j ? 2.0f : i < j ? static_cast<float>(off_scale * gauss()) : NAN;
          u.sync();
          Mat x(rows, n, n, rows * n, B);  // dense: the inverse path's layout
          x.fill([&] { return gauss(); });
          std::vector<float> want = x.h;
          MatBatch wh{want.data(), rows, n, n, rows * n, B};
          host->trsm_right_upper(u.H(), wh);
          // Out of place (the product written straight into y) first: the same
          // bits as in place, the input left as it was.
          Mat y(rows, n, n, rows * n, B);
          cuda->trsm_right_upper(u.D(), x.D(), y.D(), prec);
          EXPECT_TRUE(x.dev() == x.h) << "the out-of-place solve wrote its input";
          cuda->trsm_right_upper(u.D(), x.D(), prec);
          const std::vector<float> got = x.dev();
          EXPECT_TRUE(y.dev() == got) << "out of place differs from in place";
          double num = 0, den = 0;
          for (size_t i = 0; i < want.size(); ++i) {
            ASSERT_TRUE(std::isfinite(got[i])) << "element " << i;
            num += std::pow(static_cast<double>(got[i]) - want[i], 2);
            den += std::pow(static_cast<double>(want[i]), 2);
          }
          const double rel = std::sqrt(num / den);
          EXPECT_LT(rel, prec == DION_MATMUL_FP32 ? 1e-5 : 4e-3) << "normwise relative error " << rel;
        }
      }
    }
  }
}

// trsm_right_upper_many: the solves of two parts (2 and 3 matrices of
// different row counts) against factors that lie in one batch of 5, on the
// explicit-inverse path (all inverses at once, then a product per part), at
// FP32 and TF32; each part against the host's solve of its own matrices
// within TrsmRightUpperByInverse's bounds, the inputs left as they were.
// With every part's `precondition` set, the TF32 solve forms the inverses
// with TF32 GEMMs (n = 96 and 256: one and two levels of them above the
// diagonal blocks), within the same TF32 bound (cond(U) < 2 here: the
// inverse's error is of the order of the product's own TF32 rounding of
// it), and not the same bits as without; at FP32 the flag changes nothing.
TEST_F(OpsTest, TrsmRightUpperManyMatchesHostPerPart) {
  for (int64_t n : {64, 96, 256}) {
    for (dion_matmul_precision_t prec : {DION_MATMUL_FP32, DION_MATMUL_TF32}) {
      SCOPED_TRACE("n " + std::to_string(n) + ", precision " + std::to_string(static_cast<int>(prec)));
      const int64_t nu = 5;
      Mat u(n, n, n, n * n, nu);
      const double off_scale = 0.3 / std::sqrt(static_cast<double>(n));
      for (int64_t b = 0; b < nu; ++b)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j)
            u.at(b, i, j) = i == j ? 2.0f : i < j ? static_cast<float>(off_scale * gauss()) : NAN;
      u.sync();
      const int64_t rows[2] = {3 * n, 6 * n}, count[2] = {2, 3}, first[2] = {0, 2};
      std::vector<Mat> in, out;
      for (int p = 0; p < 2; ++p) {
        in.emplace_back(rows[p], n, n, rows[p] * n, count[p]);
        in.back().fill([&] { return gauss(); });
        out.emplace_back(rows[p], n, n, rows[p] * n, count[p]);
      }
      std::vector<float> plain[2];
      for (bool pre : {false, true}) {
        SCOPED_TRACE(pre ? "precondition" : "plain");
        std::vector<Backend::TrsmPart> parts;
        for (int p = 0; p < 2; ++p) parts.push_back(Backend::TrsmPart{in[p].D(), out[p].D(), first[p], nullptr, pre});
        cuda->trsm_right_upper_many(u.D(), parts.data(), 2, prec);
        for (int p = 0; p < 2; ++p) {
          EXPECT_TRUE(in[p].dev() == in[p].h) << "part " << p << ": the input was written";
          std::vector<float> want = in[p].h;
          host->trsm_right_upper(ConstMatBatch(u.h.data() + first[p] * n * n, n, n, n, n * n, count[p]),
                                 MatBatch{want.data(), rows[p], n, n, rows[p] * n, count[p]});
          const std::vector<float> got = out[p].dev();
          double num = 0, den = 0;
          for (size_t i = 0; i < want.size(); ++i) {
            ASSERT_TRUE(std::isfinite(got[i])) << "part " << p << " element " << i;
            num += std::pow(static_cast<double>(got[i]) - want[i], 2);
            den += std::pow(static_cast<double>(want[i]), 2);
          }
          EXPECT_LT(std::sqrt(num / den), prec == DION_MATMUL_FP32 ? 1e-5 : 4e-3) << "part " << p;
          if (!pre) {
            plain[p] = got;
          } else if (prec == DION_MATMUL_FP32 || n == 64) {  // n = 64: one diagonal block, no GEMM
            EXPECT_TRUE(got == plain[p]) << "part " << p << ": the flag changed an inverse without TF32 GEMMs";
          } else {
            EXPECT_FALSE(got == plain[p]) << "part " << p << ": the TF32 inverse gave the fp32 one's bits";
          }
        }
      }
    }
  }
}

// Parts given in bf16 (TrsmPart::in_bf16: Dion's P as its bf16 collectives
// left it): at precision BF16 the CUDA backend multiplies them by the
// inverses rounded to bf16, within a normwise 2^-7 of the host's fp32 solve
// of their widening (the inverse's rounding, 2^-9 per element, times
// cond(U) < 2 here, with a factor 2 to spare); at TF32 they are widened and
// solved as fp32 inputs (TrsmRightUpperByInverse's TF32 bound); the host
// backend's default widens and solves them exactly as their widening. A
// part in fp32 beside them keeps its fp32 path (FP32-bound).
TEST_F(OpsTest, TrsmRightUpperManyTakesBf16Parts) {
  const int64_t n = 64, nu = 5;
  Mat u(n, n, n, n * n, nu);
  const double off_scale = 0.3 / std::sqrt(static_cast<double>(n));
  for (int64_t b = 0; b < nu; ++b)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) u.at(b, i, j) = i == j ? 2.0f : i < j ? static_cast<float>(off_scale * gauss()) : NAN;
  u.sync();
  const int64_t rows[2] = {4 * n + 8, 6 * n}, count[2] = {2, 3}, first[2] = {0, 2};
  // part 0 in bf16, part 1 in fp32
  std::vector<uint16_t> x16(static_cast<size_t>(rows[0] * n * count[0]));
  for (auto& v : x16) v = float_to_bf16(gauss());
  std::vector<float> x0(x16.size());
  for (size_t i = 0; i < x16.size(); ++i) x0[i] = bf16_to_float(x16[i]);
  Dev<uint16_t> d16(x16);
  Mat in1(rows[1], n, n, rows[1] * n, count[1]);
  in1.fill([&] { return gauss(); });
  auto host_solve = [&](const std::vector<float>& x, int p) {
    std::vector<float> want = x;
    host->trsm_right_upper(ConstMatBatch(u.h.data() + first[p] * n * n, n, n, n, n * n, count[p]),
                           MatBatch{want.data(), rows[p], n, n, rows[p] * n, count[p]});
    return want;
  };
  auto rel = [](const std::vector<float>& got, const std::vector<float>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (!std::isfinite(got[i])) return 1e30;
      num += std::pow(static_cast<double>(got[i]) - want[i], 2);
      den += std::pow(static_cast<double>(want[i]), 2);
    }
    return std::sqrt(num / den);
  };
  const std::vector<float> want0 = host_solve(x0, 0), want1 = host_solve(in1.h, 1);
  for (dion_matmul_precision_t prec : {DION_MATMUL_BF16, DION_MATMUL_TF32}) {
    SCOPED_TRACE("precision " + std::to_string(static_cast<int>(prec)));
    Mat out0(rows[0], n, n, rows[0] * n, count[0]), out1(rows[1], n, n, rows[1] * n, count[1]);
    // part 0's fp32 input: NaN, which must not be read
    Mat nan0(rows[0], n, n, rows[0] * n, count[0]);
    nan0.fill([] { return NAN; });
    const Backend::TrsmPart parts[2] = {{nan0.D(), out0.D(), first[0], d16.p()}, {in1.D(), out1.D(), first[1]}};
    cuda->trsm_right_upper_many(u.D(), parts, 2, prec);
    EXPECT_LT(rel(out0.dev(), want0), prec == DION_MATMUL_BF16 ? std::ldexp(1.0, -7) : 4e-3) << "the bf16 part";
    EXPECT_LT(rel(out1.dev(), want1), 4e-3) << "the fp32 part";
  }
  // The host backend's default: the widening, solved.
  std::vector<float> hout(x0.size(), NAN), hnan(x0.size(), NAN);
  const Backend::TrsmPart hp{ConstMatBatch(hnan.data(), rows[0], n, n, rows[0] * n, count[0]),
                             MatBatch{hout.data(), rows[0], n, n, rows[0] * n, count[0]}, first[0], x16.data()};
  host->trsm_right_upper_many(u.H(), &hp, 1, DION_MATMUL_BF16);
  EXPECT_TRUE(hout == want0) << "the host default differs from the solve of the widened input";
}

// orth_fallback_bf16: the same bits as orth_fallback on the widened P0
// (rank-deficient and full-rank matrices, one left alone by its info).
TEST_F(OpsTest, OrthFallbackBf16MatchesWidened) {
  const int64_t p = 100, r = 40, B = 3;
  std::vector<uint16_t> x16(static_cast<size_t>(B * p * r));
  for (auto& v : x16) v = float_to_bf16(gauss());
  for (int64_t i = 0; i < p; ++i) {  // matrix 2: rank deficient
    x16[static_cast<size_t>((2 * p + i) * r + 3)] = x16[static_cast<size_t>((2 * p + i) * r + 1)];
    x16[static_cast<size_t>((2 * p + i) * r + 5)] = 0;
  }
  Mat p0(p, r, r, p * r, B);
  for (size_t i = 0; i < x16.size(); ++i) p0.h[i] = bf16_to_float(x16[i]);
  p0.sync();
  Dev<uint16_t> d16(x16);
  Mat a(p, r, r, p * r, B), b(p, r, r, p * r, B);
  a.fill([] { return 5.0f; });
  b.fill([] { return 5.0f; });
  Dev<int32_t> info(std::vector<int32_t>{1, 0, 2});
  cuda->orth_fallback(a.D(), p0.D(), info.p());
  cuda->orth_fallback_bf16(b.D(), d16.p(), info.p());
  const std::vector<float> ga = a.dev(), gb = b.dev();
  EXPECT_TRUE(ga == gb) << "orth_fallback_bf16 differs from orth_fallback on the widened input";
  EXPECT_EQ(gb[static_cast<size_t>(p * r)], 5.0f) << "matrix 1 (info 0) must be left alone";
  EXPECT_NE(gb[0], 5.0f) << "matrix 0 (info 1) must be replaced";
}

// max over columns of || P P^T p0_j - p0_j || / ||p0_j||: P's span holds P0's columns.
double span_error(const std::vector<float>& p, const Mat& p0, int64_t b) {
  double worst = 0;
  for (int64_t j = 0; j < p0.cols; ++j) {
    std::vector<double> c(p0.cols, 0.0);
    double n0 = 0;
    for (int64_t i = 0; i < p0.rows; ++i) n0 += std::pow(p0.h[b * p0.stride + i * p0.ld + j], 2);
    if (n0 == 0) continue;
    for (int64_t q = 0; q < p0.cols; ++q)
      for (int64_t i = 0; i < p0.rows; ++i)
        c[q] += static_cast<double>(p[b * p0.stride + i * p0.ld + q]) * p0.h[b * p0.stride + i * p0.ld + j];
    double e = 0;
    for (int64_t i = 0; i < p0.rows; ++i) {
      double v = p0.h[b * p0.stride + i * p0.ld + j];
      for (int64_t q = 0; q < p0.cols; ++q) v -= p[b * p0.stride + i * p0.ld + q] * c[q];
      e += v * v;
    }
    worst = std::max(worst, std::sqrt(e / n0));
  }
  return worst;
}

TEST_F(OpsTest, OrthFallback) {
  // r = 40 > 32: several column chunks of the kernel's projections.
  const int64_t p = 100, r = 40, B = 4;
  Mat p0 = Mat::padded(p, r, B);
  p0.fill([&] { return gauss(); });
  for (int64_t i = 0; i < p; ++i) {  // matrix 2: rank deficient
    p0.at(2, i, 3) = 2.0f * p0.at(2, i, 1) + p0.at(2, i, 2);
    p0.at(2, i, 5) = 0.0f;
    p0.at(2, i, 7) = p0.at(2, i, 0);
    p0.at(2, i, 39) = p0.at(2, i, 38);
  }
  for (int64_t i = 0; i < p; ++i)  // matrix 3: zero, with a NaN column
    for (int64_t j = 0; j < r; ++j) p0.at(3, i, j) = j == 4 ? NAN : 0.0f;
  p0.sync();
  Mat P = Mat::padded(p, r, B);
  P.fill([] { return 5.0f; });
  const std::vector<int32_t> info = {0, 3, 1, 2};
  Dev<int32_t> dinfo(info);
  cuda->orth_fallback(P.D(), p0.D(), dinfo.p());
  host->orth_fallback(P.H(), p0.H(), info.data());
  const std::vector<float> d = P.dev();
  for (int64_t i = 0; i < p; ++i)  // matrix 0 (info 0) untouched
    for (int64_t j = 0; j < r; ++j) EXPECT_EQ(d[i * P.ld + j], 5.0f);
  for (int64_t b = 1; b < B; ++b) {
    Mat one = Mat::padded(p, r, 1);
    one.stride = P.stride;
    std::vector<float> slice(d.begin() + b * P.stride, d.begin() + b * P.stride + p * P.ld);
    one.batch = 1;
    EXPECT_LT(orthonormality_error(slice, one), 1e-5) << "matrix " << b;
    if (b < 3) EXPECT_LT(span_error(d, p0, b), 1e-4) << "matrix " << b;
  }
  // The full-rank matrix has one orthonormal basis built column by column:
  // Q of its QR with a positive diagonal, whatever the method (host: Householder).
  std::vector<float> h1(P.h.begin() + P.stride, P.h.begin() + P.stride + p * P.ld);
  std::vector<float> d1(d.begin() + P.stride, d.begin() + P.stride + p * P.ld);
  Mat shape1 = Mat::padded(p, r, 1);
  shape1.h = h1;
  EXPECT_TRUE(close(align_columns(shape1, d1), d1, 0.0, 1e-4));
  // In place (P aliasing P0).
  Mat q = Mat::padded(p, r, 1);
  q.h.assign(p0.h.begin() + p0.stride, p0.h.begin() + p0.stride + q.h.size());
  q.sync();
  Dev<int32_t> one_info(std::vector<int32_t>{1});
  cuda->orth_fallback(q.D(), q.D(), one_info.p());
  const std::vector<float> qd = q.dev();
  EXPECT_TRUE(close(d1, std::vector<float>(qd.begin(), qd.begin() + d1.size()), 0.0, 1e-6));
}

// A Dion-sized fallback: checks the result and reports the time (the
// fallback runs only for matrices whose Cholesky failed).
TEST_F(OpsTest, OrthFallbackLarge) {
  const int64_t p = 4096, r = 256, B = 2;
  Mat p0(p, r, r, p * r, B);
  p0.fill([&] { return gauss(); });
  Mat P(p, r, r, p * r, B);
  Dev<int32_t> info(std::vector<int32_t>{1, 1});
  cuda->orth_fallback(P.D(), p0.D(), info.p());  // warm-up (scratch)
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  cudaEventRecord(t0);
  cuda->orth_fallback(P.D(), p0.D(), info.p());
  cudaEventRecord(t1);
  ASSERT_EQ(cudaEventSynchronize(t1), cudaSuccess);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  std::printf("orth_fallback %lld x %lld, batch %lld: %.2f ms\n", static_cast<long long>(p),
              static_cast<long long>(r), static_cast<long long>(B), ms);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  Mat one(p, r, r, p * r, 1);
  EXPECT_LT(orthonormality_error(P.dev(), one), 1e-5);
}

// Reports the time of the batched cuBLAS/cuSOLVER paths against one call
// per matrix (the backend's batch-of-one path), on Dion-like shapes. Nothing
// is asserted but that both give the same numbers.
TEST_F(OpsTest, BatchedVersusLoopTimings) {
  auto time_ms = [](auto&& f) {
    f();  // warm-up
    cudaEvent_t t0, t1;
    cudaEventCreate(&t0);
    cudaEventCreate(&t1);
    cudaEventRecord(t0);
    f();
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    float ms = 0;
    cudaEventElapsedTime(&ms, t0, t1);
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    return ms;
  };
  for (int64_t n : {32, 128, 256, 512}) {
    const int64_t rows = 8192, B = 24;
    Mat u(n, n, n, n * n, B);
    fill_spd(u, rng);
    Dev<int32_t> info(static_cast<size_t>(B));
    Mat uc(n, n, n, n * n, B);
    const float chol_batched = time_ms([&] {
      cudaMemcpy(uc.d.p(), u.d.p(), u.h.size() * 4, cudaMemcpyDeviceToDevice);
      cuda->cholesky_upper(uc.D(), info.p());
    });
    const float chol_loop = time_ms([&] {
      cudaMemcpy(uc.d.p(), u.d.p(), u.h.size() * 4, cudaMemcpyDeviceToDevice);
      for (int64_t b = 0; b < B; ++b) cuda->cholesky_upper(MatBatch{uc.d.p() + b * n * n, n, n, n, 0, 1}, info.p() + b);
    });
    Mat x(rows, n, n, rows * n, B);
    x.fill([&] { return gauss(); });
    Mat y(rows, n, n, rows * n, B);
    const float trsm_batched = time_ms([&] {
      cudaMemcpy(y.d.p(), x.d.p(), x.h.size() * 4, cudaMemcpyDeviceToDevice);
      cuda->trsm_right_upper(uc.D(), y.D());
    });
    const std::vector<float> yb = y.dev();
    const float trsm_loop = time_ms([&] {
      cudaMemcpy(y.d.p(), x.d.p(), x.h.size() * 4, cudaMemcpyDeviceToDevice);
      for (int64_t b = 0; b < B; ++b)
        cuda->trsm_right_upper(ConstMatBatch(uc.d.p() + b * n * n, n, n, n, 0, 1),
                               MatBatch{y.d.p() + b * rows * n, rows, n, n, 0, 1});
    });
    EXPECT_TRUE(close(yb, y.dev(), 1e-5, 1e-5));
    std::printf("n %4lld, batch %lld: cholesky batched %.3f ms, loop %.3f ms; trsm (%lld rows) batched %.3f ms, "
                "loop %.3f ms\n",
                static_cast<long long>(n), static_cast<long long>(B), chol_batched, chol_loop,
                static_cast<long long>(rows), trsm_batched, trsm_loop);
  }
}

// A sequence of ops, run eagerly and replayed from a captured CUDA graph, must
// give the same bits (the ops are deterministic, allocate nothing and never
// wait once warmed up).
TEST_F(OpsTest, GraphCaptureMatchesEager) {
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  cuda->set_stream(s);
  const int64_t p = 64, r = 16, B = 3;
  Mat m = Mat::padded(p, 48, B), q = Mat::padded(48, r, B), P = Mat::padded(p, r, B), P0 = Mat::padded(p, r, B);
  Mat G = Mat::padded(r, r, B), Q2 = Mat::padded(p, r, B), U8 = Mat::padded(8, 48, B);
  m.fill([&] { return gauss(); });
  U8.fill([&] { return gauss(); });
  q.fill([&] { return gauss(); });
  const std::vector<float> m_init = m.h;
  Dev<int32_t> info(B);
  Dev<float> scores(static_cast<size_t>(B * p));
  Dev<int32_t> idx(static_cast<size_t>(B * 8));
  const GroupScalars gs{0.01, 0.1, 0.9, 0.99, 1, 0};
  Dev<GroupScalars> dgs(std::vector<GroupScalars>{gs});
  const PhiloxKey key{7, kRngSketch, 0, 0};
  Dev<int64_t> step(std::vector<int64_t>{3});
  auto run = [&] {
    cuda->randn(Q2.d.p(), B, p, r, 0, 0, r, key, nullptr, step.p(), 1.0f);  // into a scratch matrix
    cuda->gemm(false, false, 1.0f, m.D(), q.D(), 0.0f, P.D(), DION_MATMUL_FP32);
    cuda->copy(P0.d.p(), P.d.p(), P.h.size() * sizeof(float));
    cuda->gemm(true, false, 1.0f, P.D(), P.D(), 0.0f, G.D(), DION_MATMUL_FP32);
    cuda->cholesky_upper(G.D(), info.p());
    cuda->trsm_right_upper(G.D(), P.D());
    cuda->orth_fallback(P.D(), P0.D(), info.p());
    cuda->qr_q(P0.D());
    cuda->frob_normalize(m.D(), 1.0f, 1e-7f);
    cuda->col_normalize(q.D(), 1e-7f);
    cuda->slice_l1(m.D(), kRows, scores.p());
    cuda->topk(scores.p(), B, p, 8, idx.p());
    cuda->add_slices(m.D(), kRows, idx.p(), 8, U8.D(), dgs.p(), -1.0f);
    cuda->apply_update(m.d.p(), m.d.p(), static_cast<int64_t>(m.h.size()), dgs.p(), 1.0f, true);
  };
  auto reset = [&] {
    m.d.put(m_init);
    q.sync();
  };
  run();  // warm-up: scratch grows here
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  reset();
  run();
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const std::vector<float> eager_m = m.dev(), eager_P = P.dev(), eager_P0 = P0.dev(), eager_Q2 = Q2.dev();
  const std::vector<int32_t> eager_idx = idx.get();
  reset();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  try {
    run();
  } catch (const Error& e) {
    cudaStreamEndCapture(s, &graph);
    FAIL() << "capture failed: " << e.what();
  }
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_TRUE(same_bits(eager_m, m.dev()));
  EXPECT_TRUE(same_bits(eager_P, P.dev()));
  EXPECT_TRUE(same_bits(eager_P0, P0.dev()));
  EXPECT_TRUE(same_bits(eager_Q2, Q2.dev()));
  EXPECT_TRUE(same_bits(eager_idx, idx.get()));
  // The step is read on the device: a replay at another step draws other numbers.
  step.put({4});
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_NE(Q2.dev()[0], eager_Q2[0]);
  // Growing scratch during a capture is refused with a clear error.
  Mat big = Mat::padded(2048, 2048, 8, 0, 0);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  try {
    cuda->frob_normalize(big.D(), 1.0f, 1e-7f);
    ADD_FAILURE() << "scratch grew during a capture";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), DION_ERROR_INVALID_USAGE);
    EXPECT_NE(std::string(e.what()).find("captured"), std::string::npos) << e.what();
  }
  cudaGraph_t g2 = nullptr;
  cudaStreamEndCapture(s, &g2);
  if (g2) cudaGraphDestroy(g2);
  (void)cudaGetLastError();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cuda->set_stream(nullptr);
  cudaStreamDestroy(s);
}

void expect_rejected(const void* p, size_t bytes, size_t align, const std::string& fragment) {
  try {
    cuda_check_pointer(p, 0, bytes, align, "dion_add_group: tensor 'w' (tensors[0]): param");
    ADD_FAILURE() << "accepted; expected: " << fragment;
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), DION_ERROR_INVALID_ARGUMENT);
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("dion_add_group: tensor 'w' (tensors[0]): param", 0), 0u) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
  }
}

TEST_F(OpsTest, CheckPointer) {
  std::vector<float> host_mem(256);
  expect_rejected(host_mem.data(), 1024, 4, "is host memory, expected device memory of CUDA device 0");
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 1024), cudaSuccess);
  expect_rejected(pinned, 1024, 4, "is host memory, expected device memory of CUDA device 0");
  cudaFreeHost(pinned);
  expect_rejected(nullptr, 4, 4, "NULL");

  Dev<float> d(256);  // 1024 bytes
  EXPECT_NO_THROW(cuda_check_pointer(d.p(), 0, 1024, 16, "x"));
  EXPECT_NO_THROW(cuda_check_pointer(d.p() + 128, 0, 512, 4, "x"));
  expect_rejected(reinterpret_cast<const char*>(d.p()) + 2, 4, 4, "not aligned to 4 bytes");
  expect_rejected(d.p(), 1028, 4, "1028 bytes needed");
  expect_rejected(d.p() + 128, 516, 4, "only 512 bytes");

  void* managed = nullptr;
  ASSERT_EQ(cudaMallocManaged(&managed, 1024), cudaSuccess);
  EXPECT_NO_THROW(cuda_check_pointer(managed, 0, 1024, 4, "x"));
  cudaFree(managed);

  int count = 0;
  cudaGetDeviceCount(&count);
  if (count > 1) {
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    Dev<float> other(16);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    expect_rejected(other.p(), 64, 4, "is on CUDA device 1, expected 0");
  }
}

TEST_F(OpsTest, BadDeviceIsRejected) {
  int count = 0;
  cudaGetDeviceCount(&count);
  for (int dev : {-1, count}) {
    try {
      delete make_cuda_backend(dev);
      ADD_FAILURE() << "device " << dev << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), DION_ERROR_INVALID_ARGUMENT) << e.what();
    }
  }
}

}  // namespace
}  // namespace dion_ops_test
