// SPDX-License-Identifier: MIT
// The Muon family's orthogonalizing iteration on bf16 matrices (matmul
// precision BF16 on the CUDA backend), in two forms of one polynomial:
//
//   classic  A = X X^T, B = a I + b A + c A A, X <- B X, every step
//   Gram     R = X X^T once per phase; per step Q = a I + b R + c R R,
//            P <- Q P, R <- Q R Q; X <- P X at the phase's end (Dao et
//            al.'s Gram Newton-Schulz), the phases split by restarts
//
// (tall X: X^T X, X B and X P^T, s = min(rows, cols), l = max). The two are the
// same polynomial in exact arithmetic. Per matrix and per K steps in p phases
// the classic form costs 4 K s^2 l + 2 K s^3 FLOPs and the Gram form 4 p s^2
// l + 2 (4 K - 3 p) s^3, fewer wherever l > 1.5 s, whatever p. At K = 5:
// restarts after steps 1 and 3 (p = 3) 12 s^2 l + 22 s^3, after step 2 alone
// (p = 2) 8 s^2 l + 28 s^3, against 20 s^2 l + 10 s^3.
// Their bf16 roundings differ: bench/numerics/ns_precision.py measures them
// against float64 (docs/benchmarks.md, seventh session). Without a restart
// the Gram form drifts (spurious growth of R's eigenvalues: distances to
// float64 up to 37 x the classic form's); restarted after step 2 it stayed
// within about 3 x, after step 3 alone it blew up on small matrices, after
// steps 1 and 3 within 1.7 x (its first phase is one classic step, which
// lifts the small singular values before R is iterated on).
// Only a backend and bf16 buffers: the host suite runs both forms through
// the host backend's bf16 ops.
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
  // The Gram form's restarts: bit k set, X and R are formed again after
  // step k (before step index k; bits 0 and >= steps are ignored).
  uint32_t gram_restarts = 0;
};

// The classic form. X (the bf16 start) and Y: rows x cols dense; A and B: s x
// s dense. Returns the buffer holding the bf16 result (X's or Y's); X may be
// overwritten.
MatBatch newton_schulz_bf16(Backend& be, const NsPlan& p, MatBatch X, MatBatch Y, MatBatch A, MatBatch B);

// The Gram form's default restarts: after steps 1 and 3 (the measurements
// above; DION_NS_GRAM_RESTARTS chooses others, docs/ENV.md).
constexpr uint32_t kNsGramRestarts = (1u << 1) | (1u << 3);

// The Gram form: X, Y as above; R, Q, P, T: s x s dense. Returns the buffer
// holding the result (X's or Y's); X may be overwritten. A first phase of one
// step (a restart after step 1, as by default) runs as the classic step, R
// and Q serving as its A and B.
MatBatch newton_schulz_gram_bf16(Backend& be, const NsPlan& p, MatBatch X, MatBatch Y, MatBatch R, MatBatch Q,
                                 MatBatch P, MatBatch T);

// One shape class of a run of the Gram form over several (one short side
// s): its plan (table, steps and restarts those of every class; tall and a
// raw start's sums its own), X and Y as above.
struct NsGramClass {
  NsPlan plan;
  MatBatch X, Y;
};

// The Gram form of n classes at once: R, Q, P, T s x s dense, batch the
// classes' total, class c's matrices after those of the classes before it.
// The s x s products and shifts run once over all of them, so that small
// batches (a GPT block's qkv, fc1 and fc2 share s = d) fill the device;
// out[c] receives the buffer holding class c's result.
void newton_schulz_gram_bf16_classes(Backend& be, const NsGramClass* cls, int n, MatBatch R, MatBatch Q, MatBatch P,
                                     MatBatch T, MatBatch* out);

// Where the Gram form is taken: l >= 2 s (it needs fewer FLOPs from l =
// 1.5 s on; the s x s products run slower than the s x l ones, hence the
// margin).
inline bool ns_gram_pays(int64_t rows, int64_t cols) {
  const int64_t s = rows < cols ? rows : cols, l = rows < cols ? cols : rows;
  return l >= 2 * s;
}

// Where a group's classes run the Gram form together (muon.cpp's lockstep
// step): the Gram form at s < 1024, where the s x s products are whole (the
// backend forms them by blocks from s = 1024 on) and one class's batch fills
// the device poorly (gpt-160m: 432 tiles of 128 x 128 at s = 768 and 12
// matrices, 3.3 waves of an H200's 132 SMs).
inline bool ns_lockstep_pays(int64_t rows, int64_t cols) {
  return ns_gram_pays(rows, cols) && (rows < cols ? rows : cols) < 1024;
}

}  // namespace dion
