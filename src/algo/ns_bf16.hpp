// SPDX-License-Identifier: MIT
// The Muon family's orthogonalizing iteration on bf16 matrices (matmul
// precision BF16 on the CUDA backend), in two forms of one polynomial:
//
//   classic  A = X X^T, B = a I + b A + c A A, X <- B X, every step
//   Gram     R = X X^T once; per step Q = a I + b R + c R R, P <- Q P,
//            R <- Q R Q; X <- P X once at the end (Dao et al.'s Gram
//            Newton-Schulz), restarted after step kNsGramRestart: there X =
//            P X is formed and R formed again from it
//
// (X^T X and X B for tall X, s = min(rows, cols), l = max). The two are the
// same polynomial in exact arithmetic. Per matrix and per 5 steps the classic
// form costs 20 s^2 l + 10 s^3 FLOPs and the Gram form with its restart 8 s^2
// l + 28 s^3, fewer where l >= 2 s. Its bf16 roundings differ:
// bench/numerics/ns_precision.py measures both against float64
// (docs/benchmarks.md); without the restart the Gram form drifts (spurious
// growth of R's eigenvalues), with it it stays within about 3 x of the
// classic form's distance to float64, closer than the classic form on some
// matrices. Only a backend and bf16 buffers: the host suite runs both forms
// through the host backend's bf16 ops.
#pragma once
#include <cstdint>

#include "../core/backend.hpp"

namespace dion {

struct NsCoeffs {
  double a, b, c;
};

// What one run of the iteration takes.
struct NsPlan {
  const NsCoeffs* table;  // the step's (a, b, c): table[min(step, ntab - 1)]
  int ntab;
  int steps;
  float factor, eps;  // the start's normalisation: inv = 1 / (factor ||X||_F + eps)
  bool tall;          // rows > cols: the Gram matrices are X^T X and the products X B
  // raw start: X is unnormalised, parts[b * nparts .. + nparts) the partial
  // sums of ||X[b]||_F^2; the first step scales the small s x s matrices by
  // inv instead of X. Null: X is normalised already (its norm at most 1).
  const double* parts = nullptr;
  int64_t nparts = 0;
};

// The classic form. X (the bf16 start) and Y: rows x cols dense; A and B: s x
// s dense. Returns the buffer holding the bf16 result (X's or Y's); X may be
// overwritten.
MatBatch newton_schulz_bf16(Backend& be, const NsPlan& p, MatBatch X, MatBatch Y, MatBatch A, MatBatch B);

// The Gram form's restart: after this many steps X is formed and R formed
// again from it. bench/numerics/ns_precision.py (docs/benchmarks.md): with
// none the bf16 Gram form drifts (distances to float64 up to 37 x the
// classic form's); after step 2 it stayed within 3.1 x on every matrix
// tried; after step 3 (the same FLOPs) it was closer on some large matrices
// but blew up on small ones (--m 32 --n 128 --coeffs polar-express --seed 2,
// singular values spread over 1e-3: 0.75 with singular values up to 5.0,
// against 0.14 after step 2 and 0.11 for the classic form).
constexpr int kNsGramRestart = 2;

// The Gram form: X, Y as above; R, Q, P, T: s x s dense. Returns the buffer
// holding the result (X's or Y's); X may be overwritten.
MatBatch newton_schulz_gram_bf16(Backend& be, const NsPlan& p, MatBatch X, MatBatch Y, MatBatch R, MatBatch Q,
                                 MatBatch P, MatBatch T);

// Where the Gram form needs fewer FLOPs: l >= 2 s (8 s^2 l + 28 s^3 against
// 20 s^2 l + 10 s^3 at 5 steps: equal at l = 1.5 s; the s x s products run
// slower than the s x l ones, hence the margin).
inline bool ns_gram_pays(int64_t rows, int64_t cols) {
  const int64_t s = rows < cols ? rows : cols, l = rows < cols ? cols : rows;
  return l >= 2 * s;
}

}  // namespace dion
