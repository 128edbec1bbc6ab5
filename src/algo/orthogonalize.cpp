// SPDX-License-Identifier: MIT
// Muon-family orthogonalizers (spec §1.2), computed in fp32 on whole batches.
//
// Both are odd matrix polynomials applied after a Frobenius normalisation:
//   X <- X / (f * ||X||_F + eps);  repeat: A = X X^T, B = b A + c A^2, X = a X + B X
// using the smaller Gram matrix (X^T X and X B for tall X), which is the same
// polynomial; zero rows/columns stay zero (property (i) of §1.2).
#include <algorithm>
#include <cstdint>
#include <utility>

#include "common.hpp"

namespace dion {

namespace {

struct Coeffs {
  double a, b, c;
};

// Polar Express (Amsel et al., arXiv 2505.16932), 5 polynomials tuned for
// safety factor 2e-2 and cushion 2, as used by microsoft/dion's polar_express.
constexpr Coeffs kPolarExpress[] = {
    {8.156554524902461, -22.48329292557795, 15.878769915207462},
    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
};
constexpr double kPolarExpressSafety = 1.02;  // ||X|| is inflated by 2% before the first polynomial

// Quintic Newton-Schulz with 5 tuned iterations (microsoft/dion newton_schulz_triton.py).
constexpr Coeffs kNewtonSchulz[] = {
    {4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037},
    {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012},
};

// The iteration on bf16 matrices with fp32 accumulation, as microsoft/dion
// runs it: half the memory traffic of fp32 operands and bf16 tensor cores
// without conversion passes; every product is rounded to bf16. The CUDA
// backend only: the host's reference arithmetic stays fp32.
// The start X is bf16. raw null: X is normalised (its norm at most 1).
// raw given: X is unnormalised, the normalised start being inv X with inv =
// 1 / (factor ||X||_F + eps) from raw's partial sums; the first step scales
// its small s x s matrices instead of X (A = inv^2 X X^T, then (a I + B)
// inv), so X is never rewritten. Returns the bf16 result (X's buffer or Y's).
MatBatch newton_schulz_bf16(Backend& be, const dion_group_options_t& o, MatBatch X, MatBatch Y, MatBatch A, MatBatch B,
                            const Coeffs* table, bool tall, const FrobParts* raw, float factor) {
  MatBatch cur = X, nxt = Y;
  for (int it = 0; it < o.ortho_steps; ++it) {
    const Coeffs& k = table[std::min(it, 4)];
    const bool scale = raw && it == 0;
    const float eps = static_cast<float>(o.epsilon);
    // A and B are symmetric: the backend may form only the blocks on and
    // below the diagonal of each (bs > 0), and mirror_bf16 completes them:
    // A's with B's C (A's lower blocks: B = b A + c A A) in the same pass,
    // B's with a's shift (below) where no first-step scaling follows.
    // The first step's scale (A = inv^2 X X^T, then (a I + B) inv) is
    // applied by the mirrors where the products were formed by blocks, in
    // their pass, else by ns_shift_bf16.
    const FrobScale sc2{scale ? raw->parts : nullptr, scale ? raw->nparts : 0, factor, eps, 2};
    const FrobScale sc1{sc2.parts, sc2.nparts, factor, eps, 1};
    const int64_t bs_a = be.gemm_bf16_lower(tall, !tall, 1.0f, cur, cur, 0.0f, A);
    if (bs_a > 0) {
      be.mirror_bf16(A, bs_a, 0.0f, &B, scale ? &sc2 : nullptr);
      const int64_t bs_b =
          be.gemm_bf16_lower(false, false, static_cast<float>(k.c), A, A, static_cast<float>(k.b), B);
      // B holds only A's lower blocks where A was formed by blocks: the same
      // square, aligned buffers are then formed by blocks of the same size.
      DION_REQUIRE(bs_b == bs_a, DION_ERROR_INTERNAL, "newton_schulz_bf16: the block sizes differ");
      // X' = a X + B X = (a I + B) X: the a X term goes into B's diagonal (a
      // rounding of the small s x s matrix) instead of into a copy of X as C
      // of the last product, which would move the whole s x l matrix once more.
      be.mirror_bf16(B, bs_b, static_cast<float>(k.a), nullptr, scale ? &sc1 : nullptr);
    } else if (scale) {
      // Whole products, the first step: B = inv (b A + a I) and A <- inv^2
      // A in one pass, with a copy inv^3 A as the product's left operand
      // (in nxt, which the last product overwrites after), so the product
      // B = c A3 A + B leaves inv (a I + b A + c A A) of the scaled A.
      MatBatch A3{nxt.p, A.rows, A.rows, A.rows, A.rows * A.rows, A.batch};
      be.ns_shift_bf16(A, B, static_cast<float>(k.b), static_cast<float>(k.a), &sc1, A3.p);
      be.gemm_bf16(false, false, static_cast<float>(k.c), A3, A, 1.0f, B);
    } else {
      // Whole products: B = c A A + b A read from A (no copy of A into B),
      // then a I on B's diagonal.
      be.gemm_bf16_out(false, false, static_cast<float>(k.c), A, A, static_cast<float>(k.b), A, B);
      be.add_diag_bf16(B, static_cast<float>(k.a));
    }
    if (tall)
      be.gemm_bf16(false, false, 1.0f, cur, B, 0.0f, nxt);
    else
      be.gemm_bf16(false, false, 1.0f, B, cur, 0.0f, nxt);
    std::swap(cur, nxt);
  }
  return cur;  // ortho_steps >= 1 (dion_add_group checks it): a raw start was scaled
}

const Coeffs* coeffs_of(const dion_group_options_t& o, float* factor) {
  const bool pe = o.orthogonalizer == DION_ORTHO_POLAR_EXPRESS;
  *factor = pe ? static_cast<float>(kPolarExpressSafety) : 1.0f;
  return pe ? kPolarExpress : kNewtonSchulz;
}

// The input is normalised in fp32 and rounded to bf16 in one pass
// (frob_normalize_bf16: the bits of frob_normalize and a store, without
// writing the normalised fp32 x, which nothing reads), and the result
// widened back into x (or, with bf16_result, left in bf16 for a caller that
// reads it there).
void orthogonalize_bf16(Optimizer& opt, const dion_group_options_t& o, MatBatch x, const Coeffs* table, bool tall,
                        int64_t s, float factor, const void** bf16_result, FrobParts given) {
  Backend& be = *opt.backend;
  const int64_t nx = x.rows * x.cols * x.batch, ns = s * s * x.batch;
  // bf16 buffers carved from the fp32 workspace (two elements per float).
  auto half = [&](int64_t n) { return opt.ws.take((n + 1) / 2); };
  MatBatch X{half(nx), x.rows, x.cols, x.cols, x.rows * x.cols, x.batch};
  MatBatch Y{half(nx), x.rows, x.cols, x.cols, x.rows * x.cols, x.batch};
  MatBatch A{half(ns), s, s, s, s * s, x.batch};
  MatBatch B{half(ns), s, s, s, s * s, x.batch};
  // x may have ld > cols: convert row by row only when it is dense.
  DION_REQUIRE(x.ld == x.cols && x.stride == x.rows * x.cols, DION_ERROR_INTERNAL,
               "orthogonalize_bf16: the input must be dense");
  if (given.parts)
    be.frob_normalize_bf16_parts(x, given.parts, given.nparts, factor, static_cast<float>(o.epsilon), X.p);
  else
    be.frob_normalize_bf16(x, factor, static_cast<float>(o.epsilon), X.p);
  const MatBatch cur = newton_schulz_bf16(be, o, X, Y, A, B, table, tall, nullptr, factor);
  if (bf16_result)
    *bf16_result = cur.p;  // the caller reads the bf16 result: no widening pass
  else
    be.load(x.p, cur.p, DION_DTYPE_BF16, nx);
}

}  // namespace

size_t orthogonalize_ws_floats(int64_t rows, int64_t cols, int64_t batch) {
  int64_t s = std::min(rows, cols);
  return ws_floats(s * s * batch) * 2 + ws_floats(rows * cols * batch);
}

void orthogonalize(Optimizer& opt, const dion_group_options_t& o, MatBatch x, const void** bf16_result,
                   FrobParts given) {
  Backend& be = *opt.backend;
  if (bf16_result) *bf16_result = nullptr;
  if (x.batch == 0 || x.rows == 0 || x.cols == 0) return;
  float factor;
  const Coeffs* table = coeffs_of(o, &factor);
  const int ntab = 5;
  const bool tall = x.rows > x.cols;
  const int64_t s = tall ? x.cols : x.rows;
  if (o.matmul_precision == DION_MATMUL_BF16 && !be.host_memory()) {
    orthogonalize_bf16(opt, o, x, table, tall, s, factor, bf16_result, given);
    return;
  }
  be.frob_normalize(x, factor, static_cast<float>(o.epsilon));
  MatBatch A{opt.ws.take(s * s * x.batch), s, s, s, s * s, x.batch};
  MatBatch B{opt.ws.take(s * s * x.batch), s, s, s, s * s, x.batch};
  MatBatch Y{opt.ws.take(x.rows * x.cols * x.batch), x.rows, x.cols, x.cols, x.rows * x.cols, x.batch};
  MatBatch cur = x, nxt = Y;
  const dion_matmul_precision_t prec = o.matmul_precision;
  for (int it = 0; it < o.ortho_steps; ++it) {
    const Coeffs& k = table[std::min(it, ntab - 1)];
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
  Backend& be = *opt.backend;
  *bf16_result = nullptr;
  if (xb.batch == 0 || xb.rows == 0 || xb.cols == 0) return;
  DION_REQUIRE(sums.parts && sums.nparts > 0, DION_ERROR_INTERNAL, "orthogonalize_bf16_unnormalised: no sums given");
  DION_REQUIRE(xb.ld == xb.cols && xb.stride == xb.rows * xb.cols, DION_ERROR_INTERNAL,
               "orthogonalize_bf16_unnormalised: the input must be dense");
  float factor;
  const Coeffs* table = coeffs_of(o, &factor);
  const bool tall = xb.rows > xb.cols;
  const int64_t s = tall ? xb.cols : xb.rows, nx = xb.rows * xb.cols * xb.batch, ns = s * s * xb.batch;
  auto half = [&](int64_t n) { return opt.ws.take((n + 1) / 2); };
  MatBatch Y{half(nx), xb.rows, xb.cols, xb.cols, xb.rows * xb.cols, xb.batch};
  MatBatch A{half(ns), s, s, s, s * s, xb.batch};
  MatBatch B{half(ns), s, s, s, s * s, xb.batch};
  *bf16_result = newton_schulz_bf16(be, o, xb, Y, A, B, table, tall, &sums, factor).p;
}

}  // namespace dion
