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
// without conversion passes. The input is normalised in fp32 and rounded to
// bf16 in one pass (frob_normalize_bf16: the bits of frob_normalize and a
// store, without writing the normalised fp32 x, which nothing reads), and
// the result widened back into x (or, with bf16_result, left in bf16 for a
// caller that reads it there); every product is rounded to bf16. The CUDA
// backend only: the host's reference arithmetic stays fp32.
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
  MatBatch cur = X, nxt = Y;
  for (int it = 0; it < o.ortho_steps; ++it) {
    const Coeffs& k = table[std::min(it, 4)];
    be.gemm_bf16(tall, !tall, 1.0f, cur, cur, 0.0f, A);
    be.copy(B.p, A.p, sizeof(uint16_t) * static_cast<size_t>(ns));
    be.gemm_bf16(false, false, static_cast<float>(k.c), A, A, static_cast<float>(k.b), B);
    // X' = a X + B X = (a I + B) X: the a X term goes into B's diagonal (a
    // rounding of the small s x s matrix) instead of into a copy of X as C
    // of the last product, which would move the whole s x l matrix once more.
    be.add_diag_bf16(B, static_cast<float>(k.a));
    if (tall)
      be.gemm_bf16(false, false, 1.0f, cur, B, 0.0f, nxt);
    else
      be.gemm_bf16(false, false, 1.0f, B, cur, 0.0f, nxt);
    std::swap(cur, nxt);
  }
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
  const bool pe = o.orthogonalizer == DION_ORTHO_POLAR_EXPRESS;
  const Coeffs* table = pe ? kPolarExpress : kNewtonSchulz;
  const int ntab = 5;
  const float factor = pe ? static_cast<float>(kPolarExpressSafety) : 1.0f;
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

}  // namespace dion
