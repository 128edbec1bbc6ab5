// SPDX-License-Identifier: MIT
// Muon-family orthogonalizers (spec §1.2), computed in fp32 on whole batches.
//
// Both are odd matrix polynomials applied after a Frobenius normalisation:
//   X <- X / (f * ||X||_F + eps);  repeat: A = X X^T, B = b A + c A^2, X = a X + B X
// using the smaller Gram matrix (X^T X and X B for tall X), which is the same
// polynomial; zero rows/columns stay zero (property (i) of §1.2).
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <utility>
#include <vector>

#include "common.hpp"
#include "ns_bf16.hpp"

namespace dion {

namespace {

// Polar Express (Amsel et al., arXiv 2505.16932), 5 polynomials tuned for
// safety factor 2e-2 and cushion 2, as used by microsoft/dion's polar_express.
constexpr NsCoeffs kPolarExpress[] = {
    {8.156554524902461, -22.48329292557795, 15.878769915207462},
    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
};
constexpr double kPolarExpressSafety = 1.02;  // ||X|| is inflated by 2% before the first polynomial

// Quintic Newton-Schulz with 5 tuned iterations (microsoft/dion newton_schulz_triton.py).
constexpr NsCoeffs kNewtonSchulz[] = {
    {4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037},
    {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012},
};

// Both tables hold 5 steps' coefficients; later steps reuse the last.
constexpr int kTableLength = 5;
static_assert(std::size(kPolarExpress) == kTableLength && std::size(kNewtonSchulz) == kTableLength);

const NsCoeffs* coeffs_of(const dion_group_options_t& o, float* factor) {
  const bool pe = o.orthogonalizer == DION_ORTHO_POLAR_EXPRESS;
  *factor = pe ? static_cast<float>(kPolarExpressSafety) : 1.0f;
  return pe ? kPolarExpress : kNewtonSchulz;
}

// The bf16 iteration's plan for X (the bf16 start, dense; unnormalised
// where raw gives its sums), no restarts.
NsPlan bf16_plan(const dion_group_options_t& o, const NsCoeffs* table, float factor, const MatBatch& X, FrobParts raw) {
  return NsPlan{table, kTableLength,     o.ortho_steps, factor, static_cast<float>(o.epsilon), X.rows > X.cols,
                raw.parts, raw.nparts};
}

// A dense bf16 buffer shaped like X, carved from the workspace (two
// elements per float).
MatBatch bf16_like(Optimizer& opt, const MatBatch& X) {
  return MatBatch{opt.ws.take((X.rows * X.cols * X.batch + 1) / 2), X.rows, X.cols, X.cols, X.rows * X.cols, X.batch};
}

// The bf16 iteration from X (as bf16_plan), its other buffers carved from
// the workspace: the Gram form where it needs fewer FLOPs (ns_gram_pays)
// and DION_NS_GRAM is not 0, else the classic form. Returns the result's buffer.
MatBatch bf16_iteration(Optimizer& opt, const dion_group_options_t& o, MatBatch X, const NsCoeffs* table, float factor,
                        FrobParts raw) {
  const int64_t s = std::min(X.rows, X.cols);
  const MatBatch Y = bf16_like(opt, X);
  auto square = [&]() { return bf16_like(opt, MatBatch{nullptr, s, s, s, s * s, X.batch}); };
  NsPlan plan = bf16_plan(o, table, factor, X, raw);
  if (ns_gram_on() && ns_gram_pays(X.rows, X.cols)) {
    plan.gram_restarts = ns_gram_restarts(kNsGramRestarts);
    const MatBatch R = square(), Q = square(), P = square(), T = square();
    return newton_schulz_gram_bf16(*opt.backend, plan, X, Y, R, Q, P, T);
  }
  const MatBatch A = square(), B = square();
  return newton_schulz_bf16(*opt.backend, plan, X, Y, A, B);
}

// The input is normalised in fp32 and rounded to bf16 in one pass
// (frob_normalize_bf16: the bits of frob_normalize and a store, without
// writing the normalised fp32 x, which nothing reads), and the result
// widened back into x (or, with bf16_result, left in bf16 for a caller that
// reads it there).
void orthogonalize_bf16(Optimizer& opt, const dion_group_options_t& o, MatBatch x, const NsCoeffs* table, float factor,
                        const void** bf16_result, FrobParts given) {
  Backend& be = *opt.backend;
  const int64_t nx = x.rows * x.cols * x.batch;
  const MatBatch X = bf16_like(opt, x);
  // x may have ld > cols: convert row by row only when it is dense.
  DION_REQUIRE(x.ld == x.cols && x.stride == x.rows * x.cols, DION_ERROR_INTERNAL,
               "orthogonalize_bf16: the input must be dense");
  if (given.parts)
    be.frob_normalize_bf16_parts(x, given.parts, given.nparts, factor, static_cast<float>(o.epsilon), X.p);
  else
    be.frob_normalize_bf16(x, factor, static_cast<float>(o.epsilon), X.p);
  const MatBatch cur = bf16_iteration(opt, o, X, table, factor, FrobParts{});
  if (bf16_result)
    *bf16_result = cur.p;  // the caller reads the bf16 result: no widening pass
  else
    be.load(x.p, cur.p, DION_DTYPE_BF16, nx);
}

}  // namespace

size_t orthogonalize_ws_floats(int64_t rows, int64_t cols, int64_t batch) {
  const int64_t s = std::min(rows, cols), nx = rows * cols * batch, ns = s * s * batch;
  // The fp32 iteration's A, B, Y; the bf16 one's X, Y and two s x s buffers
  // (four for the Gram form), each of bf16 elements in half as many floats.
  const size_t f32 = ws_floats(ns) * 2 + ws_floats(nx);
  const size_t bf16 = ws_floats((nx + 1) / 2) * 2 + ws_floats((ns + 1) / 2) * (ns_gram_pays(rows, cols) ? 4 : 2);
  return std::max(f32, bf16);
}

void orthogonalize(Optimizer& opt, const dion_group_options_t& o, MatBatch x, const void** bf16_result,
                   FrobParts given) {
  Backend& be = *opt.backend;
  if (bf16_result) *bf16_result = nullptr;
  if (x.batch == 0 || x.rows == 0 || x.cols == 0) return;
  float factor;
  const NsCoeffs* table = coeffs_of(o, &factor);
  const bool tall = x.rows > x.cols;
  const int64_t s = tall ? x.cols : x.rows;
  if (o.matmul_precision == DION_MATMUL_BF16 && !be.host_memory()) {
    orthogonalize_bf16(opt, o, x, table, factor, bf16_result, given);
    return;
  }
  be.frob_normalize(x, factor, static_cast<float>(o.epsilon));
  MatBatch A{opt.ws.take(s * s * x.batch), s, s, s, s * s, x.batch};
  MatBatch B{opt.ws.take(s * s * x.batch), s, s, s, s * s, x.batch};
  MatBatch Y{opt.ws.take(x.rows * x.cols * x.batch), x.rows, x.cols, x.cols, x.rows * x.cols, x.batch};
  MatBatch cur = x, nxt = Y;
  const dion_matmul_precision_t prec = o.matmul_precision;
  for (int it = 0; it < o.ortho_steps; ++it) {
    const NsCoeffs& k = table[std::min(it, kTableLength - 1)];
    // A = X^T X (tall) or X X^T (wide)
    be.gemm(tall, !tall, 1.0f, cur, cur, 0.0f, A, prec);
    // B = b A + c A A
    be.copy(B.p, A.p, sizeof(float) * static_cast<size_t>(s * s * x.batch));
    be.gemm(false, false, static_cast<float>(k.c), A, A, static_cast<float>(k.b), B, prec);
    // X' = a X + X B (tall) or a X + B X (wide)
    be.copy(nxt.p, cur.p, sizeof(float) * static_cast<size_t>(x.rows * x.cols * x.batch));
    if (tall)
      be.gemm(false, false, 1.0f, cur, B, static_cast<float>(k.a), nxt, prec);
    else
      be.gemm(false, false, 1.0f, B, cur, static_cast<float>(k.a), nxt, prec);
    std::swap(cur, nxt);
  }
  if (cur.p != x.p) be.copy(x.p, cur.p, sizeof(float) * static_cast<size_t>(x.rows * x.cols * x.batch));
}

void orthogonalize_bf16_unnormalised(Optimizer& opt, const dion_group_options_t& o, MatBatch xb, FrobParts sums,
                                      const void** bf16_result) {
  *bf16_result = nullptr;
  if (xb.batch == 0 || xb.rows == 0 || xb.cols == 0) return;
  DION_REQUIRE(sums.parts && sums.nparts > 0, DION_ERROR_INTERNAL, "orthogonalize_bf16_unnormalised: no sums given");
  DION_REQUIRE(xb.ld == xb.cols && xb.stride == xb.rows * xb.cols, DION_ERROR_INTERNAL,
               "orthogonalize_bf16_unnormalised: the input must be dense");
  float factor;
  const NsCoeffs* table = coeffs_of(o, &factor);
  *bf16_result = bf16_iteration(opt, o, xb, table, factor, sums).p;
}

size_t orthogonalize_classes_ws_floats(int64_t s, int64_t total_batch, const int64_t* elems, int n) {
  size_t w = 4 * ws_floats((s * s * total_batch + 1) / 2);  // R, Q, P, T
  for (int c = 0; c < n; ++c) w += ws_floats((elems[c] + 1) / 2);  // each class's Y
  return w;
}

void orthogonalize_bf16_classes(Optimizer& opt, const dion_group_options_t& o, const MatBatch* xb,
                                const FrobParts* sums, int n, const void** results) {
  DION_REQUIRE(n >= 1, DION_ERROR_INTERNAL, "orthogonalize_bf16_classes: no class");
  float factor;
  const NsCoeffs* table = coeffs_of(o, &factor);
  const uint32_t restarts = ns_gram_restarts(kNsGramRestarts);
  const int64_t s = std::min(xb[0].rows, xb[0].cols);
  thread_local std::vector<NsGramClass> cls;  // capacity kept: a steady-state step allocates nothing
  thread_local std::vector<MatBatch> out;
  cls.clear();
  int64_t total = 0;
  for (int c = 0; c < n; ++c) {
    const MatBatch& x = xb[c];
    DION_REQUIRE(x.ld == x.cols && x.stride == x.rows * x.cols && sums[c].parts && sums[c].nparts > 0,
                 DION_ERROR_INTERNAL, "orthogonalize_bf16_classes: a start is not dense or has no sums");
    NsPlan plan = bf16_plan(o, table, factor, x, sums[c]);
    plan.gram_restarts = restarts;
    cls.push_back(NsGramClass{plan, x, bf16_like(opt, x)});
    total += x.batch;
  }
  auto square = [&]() { return bf16_like(opt, MatBatch{nullptr, s, s, s, s * s, total}); };
  const MatBatch R = square(), Q = square(), P = square(), T = square();
  out.assign(static_cast<size_t>(n), MatBatch{});
  newton_schulz_gram_bf16_classes(*opt.backend, cls.data(), n, R, Q, P, T, out.data());
  for (int c = 0; c < n; ++c) results[c] = out[static_cast<size_t>(c)].p;
}

}  // namespace dion
