// SPDX-License-Identifier: MIT
// The Muon family's bf16 iteration, classic and Gram forms (ns_bf16.hpp).
#include "ns_bf16.hpp"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "../core/error.hpp"

namespace dion {

namespace {

const NsCoeffs& coeffs_at(const NsPlan& p, int it) { return p.table[std::min(it, p.ntab - 1)]; }

// Q = a I + b R + c R R from a whole R (no blocks): the product reads R as its
// C (no copy of R into Q), then a I on Q's diagonal.
void shift_whole(Backend& be, const NsCoeffs& k, MatBatch R, MatBatch Q) {
  be.gemm_bf16_out(false, false, static_cast<float>(k.c), R, R, static_cast<float>(k.b), R, Q);
  be.add_diag_bf16(Q, static_cast<float>(k.a));
}

// A = X X^T (tall: X^T X) and, where the backend formed A by blocks (bs > 0),
// B = a I + b A + c A A by blocks too: only the blocks on and below the
// diagonal of each are formed and mirror_bf16 completes them, A's with B's
// C (A's lower blocks) in the same pass, B's with a's shift. With sa, A is
// scaled in its mirror's pass (the first step from a raw start), with sb, B.
// Returns bs; 0 where A was formed whole (B is then not formed).
int64_t gram_and_shift_by_blocks(Backend& be, bool tall, MatBatch X, MatBatch A, MatBatch B, const NsCoeffs& k,
                                 const FrobScale* sa, const FrobScale* sb) {
  const int64_t bs_a = be.gemm_bf16_lower(tall, !tall, 1.0f, X, X, 0.0f, A);
  if (bs_a == 0) return 0;
  be.mirror_bf16(A, bs_a, 0.0f, &B, sa);
  const int64_t bs_b = be.gemm_bf16_lower(false, false, static_cast<float>(k.c), A, A, static_cast<float>(k.b), B);
  // B holds only A's lower blocks where A was formed by blocks: the same
  // square, aligned buffers are then formed by blocks of the same size.
  DION_REQUIRE(bs_b == bs_a, DION_ERROR_INTERNAL, "the bf16 iteration: the block sizes differ");
  // X' = a X + B X = (a I + B) X: the a X term goes into B's diagonal (a
  // rounding of the small s x s matrix) instead of into a copy of X as C
  // of the last product, which would move the whole s x l matrix once more.
  be.mirror_bf16(B, bs_b, static_cast<float>(k.a), nullptr, sb);
  return bs_a;
}

}  // namespace

// The iteration on bf16 matrices with fp32 accumulation, as microsoft/dion
// runs it: half the memory traffic of fp32 operands and bf16 tensor cores
// without conversion passes; every product is rounded to bf16.
// A raw start is scaled in its first step's small s x s matrices (A = inv^2
// X X^T, then (a I + B) inv), so X is never rewritten.
MatBatch newton_schulz_bf16(Backend& be, const NsPlan& p, MatBatch X, MatBatch Y, MatBatch A, MatBatch B) {
  MatBatch cur = X, nxt = Y;
  const bool tall = p.tall;
  for (int it = 0; it < p.steps; ++it) {
    const NsCoeffs& k = coeffs_at(p, it);
    const bool scale = p.parts && it == 0;
    // A and B are symmetric: the backend may form only the blocks on and
    // below the diagonal of each. The first step's scale (A = inv^2 X X^T,
    // then (a I + B) inv) is applied by the mirrors where the products were
    // formed by blocks, in their pass, else by ns_shift_bf16.
    const FrobScale sc2{scale ? p.parts : nullptr, scale ? p.nparts : 0, p.factor, p.eps, 2};
    const FrobScale sc1{sc2.parts, sc2.nparts, p.factor, p.eps, 1};
    if (gram_and_shift_by_blocks(be, tall, cur, A, B, k, scale ? &sc2 : nullptr, scale ? &sc1 : nullptr) == 0) {
      if (scale) {
        // Whole products, the first step: B = inv (b A + a I) and A <-
        // inv^2 A in one pass, with a copy inv^3 A as the product's left
        // operand (in nxt, which the last product overwrites after), so the
        // product B = c A3 A + B leaves inv (a I + b A + c A A) of the scaled A.
        MatBatch A3{nxt.p, A.rows, A.rows, A.rows, A.rows * A.rows, A.batch};
        be.ns_shift_bf16(A, B, static_cast<float>(k.b), static_cast<float>(k.a), &sc1, A3.p);
        be.gemm_bf16(false, false, static_cast<float>(k.c), A3, A, 1.0f, B);
      } else {
        shift_whole(be, k, A, B);
      }
    }
    if (tall)
      be.gemm_bf16(false, false, 1.0f, cur, B, 0.0f, nxt);
    else
      be.gemm_bf16(false, false, 1.0f, B, cur, 0.0f, nxt);
    std::swap(cur, nxt);
  }
  return cur;  // steps >= 1 (dion_add_group checks ortho_steps): a raw start was scaled
}

// The Gram form. Per phase (the steps between restarts, p.gram_restarts):
// R = X X^T by the same (possibly blocked) product as the classic form's A;
// each step Q_k = a I + b R + c R R, P = Q_k ... Q_1, and, where the phase
// has a further step, R <- Q_k R Q_k (two whole products through T); at the
// phase's end X <- P X (tall X: X P^T, which is X Q_1 ... Q_k, the Q's being
// symmetric, so that wide and tall classes share their s x s products).
// The buffers trade roles instead of being copied: P takes the phase's first
// Q, T the product that becomes the new P.
// A raw start: where the first phase is Gram (no restart after step 1), its
// R is scaled to inv^2 R (in the mirror's pass where it was formed by
// blocks, else by frob_scale_bf16), its Q's are then those of the
// normalised start, and P is scaled by inv before its product with the raw X.
// Several classes (one s): everything that reads a class's X or its start's
// sums runs per class on its slices of R, Q and P; the s x s products and
// shifts run once over the whole buffers.
void newton_schulz_gram_bf16_classes(Backend& be, const NsGramClass* cls, int n, MatBatch R, MatBatch Q, MatBatch P,
                                     MatBatch T, MatBatch* out) {
  DION_REQUIRE(n >= 1, DION_ERROR_INTERNAL, "the Gram form: no class");
  struct Lane {
    MatBatch cur, nxt;
    int64_t first;  // the class's first matrix in R, Q, P and T
    bool raw;       // cur is still the unnormalised start
  };
  thread_local std::vector<Lane> lanes;  // capacity kept: a steady-state step allocates nothing
  lanes.clear();
  const NsPlan& p = cls[0].plan;
  int64_t first = 0;
  for (int c = 0; c < n; ++c) {
    const NsPlan& q = cls[c].plan;
    DION_REQUIRE(q.table == p.table && q.ntab == p.ntab && q.steps == p.steps && q.gram_restarts == p.gram_restarts &&
                     std::min(cls[c].X.rows, cls[c].X.cols) == R.rows,
                 DION_ERROR_INTERNAL, "the Gram form: classes of different iterations or short sides");
    lanes.push_back(Lane{cls[c].X, cls[c].Y, first, q.parts != nullptr});
    first += cls[c].X.batch;
  }
  DION_REQUIRE(first == R.batch && R.batch == Q.batch && R.batch == P.batch && R.batch == T.batch,
               DION_ERROR_INTERNAL, "the Gram form: the s x s buffers do not hold the classes' matrices");
  auto slice = [&](MatBatch m, int c) {
    const Lane& l = lanes[static_cast<size_t>(c)];
    return MatBatch{reinterpret_cast<float*>(reinterpret_cast<uint16_t*>(m.p) + l.first * m.stride), m.rows, m.cols,
                    m.ld, m.stride, cls[c].X.batch};
  };
  auto scale = [&](int c, int power) {
    const NsPlan& q = cls[c].plan;
    return FrobScale{q.parts, q.nparts, q.factor, q.eps, power};
  };
  bool have_p = false;  // P holds this phase's product of Q's
  auto restart_at = [&](int it) { return it > 0 && it < 32 && ((p.gram_restarts >> it) & 1u); };
  int it0 = 0;
  if (p.steps > 1 && restart_at(1)) {
    // A first phase of one step is the classic step (the same products:
    // R = X X^T, Q_1 from it, X <- Q_1 X), which scales a raw start inside
    // its shift and mirror passes instead of in two passes of its own over R
    // and P.
    for (int c = 0; c < n; ++c) {
      Lane& l = lanes[static_cast<size_t>(c)];
      NsPlan one = cls[c].plan;
      one.steps = 1;
      const MatBatch x = l.cur, y = l.nxt;
      l.cur = newton_schulz_bf16(be, one, x, y, slice(R, c), slice(Q, c));
      l.nxt = l.cur.p == x.p ? y : x;
      l.raw = false;
    }
    it0 = 1;
  }
  // cur <- P cur (tall: cur P^T), ending the phase.
  auto apply = [&]() {
    for (int c = 0; c < n; ++c) {
      Lane& l = lanes[static_cast<size_t>(c)];
      const MatBatch pc = slice(P, c);
      if (l.raw) {
        const FrobScale sc1 = scale(c, 1);
        be.frob_scale_bf16(pc, sc1, 0.0f);
      }
      if (cls[c].plan.tall)
        be.gemm_bf16(false, true, 1.0f, l.cur, pc, 0.0f, l.nxt);
      else
        be.gemm_bf16(false, false, 1.0f, pc, l.cur, 0.0f, l.nxt);
      std::swap(l.cur, l.nxt);
      l.raw = false;
    }
    have_p = false;
  };
  for (int it = it0; it < p.steps; ++it) {
    const NsCoeffs& k = coeffs_at(p, it);
    const bool restart = restart_at(it) && it > it0;
    if (restart) apply();
    if (it == it0 || restart) {
      // The phase's Gram matrices and first Q, per class as the classic form
      // forms A and B (blocks where the backend forms them, mirrored); the
      // Q's of those formed whole in one shift over all of them.
      bool all_whole = true, any_whole = false;
      thread_local std::vector<char> whole;
      whole.assign(static_cast<size_t>(n), 0);
      for (int c = 0; c < n; ++c) {
        const Lane& l = lanes[static_cast<size_t>(c)];
        const FrobScale sc2 = scale(c, 2);
        const MatBatch rc = slice(R, c);
        if (gram_and_shift_by_blocks(be, cls[c].plan.tall, l.cur, rc, slice(Q, c), k, l.raw ? &sc2 : nullptr,
                                     nullptr) == 0) {
          if (l.raw) be.frob_scale_bf16(rc, sc2, 0.0f);
          whole[static_cast<size_t>(c)] = 1;
        }
        all_whole = all_whole && whole[static_cast<size_t>(c)];
        any_whole = any_whole || whole[static_cast<size_t>(c)];
      }
      if (all_whole)
        shift_whole(be, k, R, Q);
      else if (any_whole)
        for (int c = 0; c < n; ++c)
          if (whole[static_cast<size_t>(c)]) shift_whole(be, k, slice(R, c), slice(Q, c));
    } else {
      shift_whole(be, k, R, Q);
    }
    // P <- Q_k P: the phase's first Q_k becomes P (Q then names the old
    // P's buffer), a later one's product goes to T, which becomes P (T then
    // names the old P's). Either way T is free after.
    const bool first_q = !have_p;
    if (first_q) {
      std::swap(P, Q);
      have_p = true;
    } else {
      be.gemm_bf16(false, false, 1.0f, Q, P, 0.0f, T);
      std::swap(P, T);
    }
    if (it + 1 < p.steps && !restart_at(it + 1)) {
      // R <- Q_k R Q_k through T (R is not read by the second product).
      const MatBatch qk = first_q ? P : Q;
      be.gemm_bf16(false, false, 1.0f, qk, R, 0.0f, T);
      be.gemm_bf16(false, false, 1.0f, T, qk, 0.0f, R);
    }
  }
  apply();
  for (int c = 0; c < n; ++c) out[c] = lanes[static_cast<size_t>(c)].cur;
}

MatBatch newton_schulz_gram_bf16(Backend& be, const NsPlan& p, MatBatch X, MatBatch Y, MatBatch R, MatBatch Q,
                                 MatBatch P, MatBatch T) {
  const NsGramClass c{p, X, Y};
  MatBatch out = X;
  newton_schulz_gram_bf16_classes(be, &c, 1, R, Q, P, T, &out);
  return out;
}

}  // namespace dion
