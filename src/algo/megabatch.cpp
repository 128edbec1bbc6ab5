// SPDX-License-Identifier: MIT
// The megabatch engine (spec §7.3): see megabatch.hpp.
#include "megabatch.hpp"

#include <algorithm>

namespace dion {

MbPlan megabatch_plan(const Optimizer* opt, const Tensor& t, bool flatten, int64_t slots) {
  MbPlan p;
  const bool flat = flatten && t.ndim >= 3;
  for (int mesh : {1, 0}) {  // inner first, then outer
    const std::vector<int64_t>& ext = t.shard_ext[mesh];
    if (ext.empty()) continue;  // not sharded over a multi-rank mesh
    const int32_t d = mesh ? t.inner_shard_dim : t.outer_shard_dim;
    if (!flat && d < t.ndim - 2) continue;  // batch-sharded: every rank has its own whole matrices
    MbLevel& L = p.lv[p.levels++];
    L.mesh = mesh;
    L.tdim = d;
    L.size = static_cast<int32_t>(ext.size());
    if (opt) {
      L.comm = mesh ? opt->inner.get() : opt->outer.get();
      DION_REQUIRE(L.comm && L.comm->size() == L.size, DION_ERROR_INTERNAL,
                   "megabatch: tensor '%s' has %d shards over the %s mesh of %d ranks", t.name.c_str(), L.size,
                   mesh ? "inner" : "outer", L.comm ? L.comm->size() : 1);
      L.rank = L.comm->rank();
    }
  }
  if (p.levels == 0 && opt && opt->rep && slots > 1) {
    MbLevel& L = p.lv[p.levels++];
    L.comm = opt->rep.get();
    L.size = L.comm->size();
    L.rank = L.comm->rank();
  }
  return p;
}

int64_t max_local_extent(const Tensor& t, int d) {
  int64_t e = t.local_shape[d];
  const int32_t sd[2] = {t.outer_shard_dim, t.inner_shard_dim};
  for (int s = 0; s < 2; ++s)
    if (sd[s] == d && !t.shard_ext[s].empty()) e = *std::max_element(t.shard_ext[s].begin(), t.shard_ext[s].end());
  return e;
}

int64_t max_local_numel(const Tensor& t) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= max_local_extent(t, d);
  return n;
}

int64_t max_local_batch(const Tensor& t, bool flatten) {
  if (flatten && t.ndim >= 3) return 1;
  int64_t b = 1;
  for (int d = 0; d < t.ndim - 2; ++d) b *= max_local_extent(t, d);
  return b;
}

int64_t MbPiece::extent(int l, int q) const {
  return std::min(cap[l], mult[l] * (*ext[l])[static_cast<size_t>(q)]);
}

int64_t MbPiece::numel() const {
  int64_t n = 1;
  for (int d = 0; d < nd; ++d) n *= dims[d];
  return n;
}

MbPiece matrix_piece(const Tensor& t, const MbPlan& plan, bool flatten) {
  MbPiece p;
  const bool flat = flatten && t.ndim >= 3;
  if (flat) {
    p.nd = t.ndim;
    for (int d = 0; d < t.ndim; ++d) p.dims[d] = t.local_shape[d];
  } else {
    p.nd = 2;
    p.dims[0] = t.geom.srows;
    p.dims[1] = t.geom.scols;
  }
  for (int l = 0; l < plan.levels; ++l) {
    const MbLevel& L = plan.lv[l];
    if (L.tdim < 0) continue;
    // Non-flat: the matrix dim in storage order (a COL_MAJOR matrix stores its logical rows as columns).
    p.axis[l] = flat ? L.tdim : ((L.tdim - (t.ndim - 2)) ^ (t.geom.storage_transposed ? 1 : 0));
    p.ext[l] = &t.shard_ext[L.mesh];
  }
  return p;
}

MbPiece neuron_piece(const Tensor& t, const MbPlan& plan, bool flatten) {
  MbPiece p;
  const bool flat = flatten && t.ndim >= 3;
  p.nd = 1;
  p.dims[0] = t.local_shape[flat ? 0 : t.ndim - 2];
  for (int l = 0; l < plan.levels; ++l) {
    const MbLevel& L = plan.lv[l];
    if (L.tdim < 0 || !is_row_dim(t, flatten, L.tdim)) continue;
    p.axis[l] = 0;
    p.ext[l] = &t.shard_ext[L.mesh];
  }
  return p;
}

namespace {

int64_t first_slot(int64_t slots, int32_t W, int32_t q) { return slots * q / W; }

struct Geom {
  int64_t first = 0, count = 0;
  int64_t P = 1, Q = 1, full = 0, in_piece = 0, out_piece = 0;
};

// Level l for mesh rank q (q < 0: bounds over every rank) of a buffer whose
// piece entering the level has dims `dims` (updated to the piece leaving it).
Geom level_geom(const MbPlan& plan, const MbPiece& p, int l, int64_t slots, int32_t q, int64_t* dims) {
  const MbLevel& L = plan.lv[l];
  Geom g;
  g.first = q < 0 ? 0 : first_slot(slots, L.size, q);
  g.count = q < 0 ? (slots + L.size - 1) / L.size : first_slot(slots, L.size, q + 1) - g.first;
  g.in_piece = 1;
  for (int d = 0; d < p.nd; ++d) g.in_piece *= dims[d];
  const int a = p.axis[l];
  if (a < 0) {
    g.out_piece = g.in_piece;
    return g;
  }
  for (int d = 0; d < a; ++d) g.P *= dims[d];
  for (int d = a + 1; d < p.nd; ++d) g.Q *= dims[d];
  for (int32_t r = 0; r < L.size; ++r) g.full += p.extent(l, r);
  dims[a] = g.full;
  g.out_piece = g.P * g.full * g.Q;
  return g;
}

}  // namespace

MbPiece largest_piece(const MbPlan& plan, const MbPiece& piece) {
  MbPiece p = piece;
  for (int l = 0; l < plan.levels; ++l)
    if (piece.axis[l] >= 0) {
      int64_t mx = 0;
      for (int32_t r = 0; r < plan.lv[l].size; ++r) mx = std::max(mx, piece.extent(l, r));
      p.dims[piece.axis[l]] = mx;
    }
  return p;
}

MbSizes megabatch_sizes(const MbPlan& plan, const MbPiece& piece, int64_t slots) {
  MbSizes s;
  s.whole = largest_piece(plan, piece);
  for (int l = 0; l < plan.levels; ++l) {
    const Geom g = level_geom(plan, piece, l, slots, -1, s.whole.dims);
    if (piece.axis[l] >= 0) s.ws_floats += 2 * ws_floats(g.count * g.out_piece);
    slots = g.count;
  }
  s.owned = slots;
  return s;
}

void Unshard::send(float* local) {
  std::vector<int64_t>& cd = opt_.coll_idx;  // capacity reserved at dion_create
  whole_ = piece_;
  float* in = local;
  int64_t slots = slots_;
  for (int l = 0; l < plan_.levels; ++l) {
    if (l > 0) in = paste_level(l - 1);
    const MbLevel& L = plan_.lv[l];
    const int a = piece_.axis[l];
    DION_REQUIRE(a < 0 || whole_.dims[a] == piece_.extent(l, L.rank), DION_ERROR_INTERNAL,
                 "megabatch: a piece's extent (%lld) is not its shard's (%lld)",
                 static_cast<long long>(a < 0 ? 0 : whole_.dims[a]), static_cast<long long>(piece_.extent(l, L.rank)));
    const Geom g = level_geom(plan_, piece_, l, slots, L.rank, whole_.dims);
    Lv& v = lv_[l];
    v.slots = slots;
    v.first = g.first;
    v.count = g.count;
    v.P = g.P;
    v.Q = g.Q;
    v.full = g.full;
    v.in_piece = g.in_piece;
    if (a < 0) {
      v.out = in + g.first * g.in_piece;  // replicated: the owned range, in place
    } else {
      v.out = opt_.ws.take(g.count * g.out_piece);
      v.stage = opt_.ws.take(g.count * g.out_piece);
      // To owner q: my pieces of its slots (contiguous in `in`); from rank q:
      // its pieces of my slots, staged by source rank.
      const int32_t W = L.size;
      cd.assign(4 * static_cast<size_t>(W), 0);
      int64_t off = 0;
      for (int32_t q = 0; q < W; ++q) {
        const size_t i = static_cast<size_t>(q);
        cd[i] = (first_slot(slots, W, q + 1) - first_slot(slots, W, q)) * g.in_piece;
        cd[W + i] = first_slot(slots, W, q) * g.in_piece;
        cd[2 * W + i] = g.count * g.P * piece_.extent(l, q) * g.Q;
        cd[3 * W + i] = g.count * g.P * off * g.Q;
        off += piece_.extent(l, q);
      }
      L.comm->all_to_all_v(in, cd.data(), cd.data() + W, v.stage, cd.data() + 2 * W, cd.data() + 3 * W);
    }
    slots = g.count;
  }
  owned_ = slots;
}

float* Unshard::paste_level(int l) {
  const Lv& v = lv_[l];
  if (piece_.axis[l] < 0) return v.out;
  // Paste rank q's pieces at its offset along the sharded dim: the count * P
  // rows of each piece are ext * Q wide, full * Q apart.
  int64_t off = 0;
  for (int32_t q = 0; q < plan_.lv[l].size; ++q) {
    const int64_t e = piece_.extent(l, q);
    opt_.backend->copy2d(v.out + off * v.Q, sizeof(float) * static_cast<size_t>(v.full * v.Q),
                         v.stage + v.count * v.P * off * v.Q, sizeof(float) * static_cast<size_t>(e * v.Q),
                         sizeof(float) * static_cast<size_t>(e * v.Q), static_cast<size_t>(v.count * v.P));
    off += e;
  }
  return v.out;
}

float* Unshard::paste() { return plan_.levels > 0 ? paste_level(plan_.levels - 1) : nullptr; }

float* Unshard::forward(float* local) {
  send(local);
  return plan_.levels > 0 ? paste() : local;
}

// Level l's counts for the way back: cd[0..W) and cd[W..2W) this rank's
// pieces of every owner's slots (counts, displacements in the level's
// input), cd[2W..3W) and cd[3W..4W) the owned slots' pieces by destination.
void Unshard::back_counts(int l) {
  std::vector<int64_t>& cd = opt_.coll_idx;
  const Lv& v = lv_[l];
  const int32_t W = plan_.lv[l].size;
  cd.assign(4 * static_cast<size_t>(W), 0);
  int64_t off = 0;
  for (int32_t q = 0; q < W; ++q) {
    const size_t i = static_cast<size_t>(q);
    cd[i] = (first_slot(v.slots, W, q + 1) - first_slot(v.slots, W, q)) * v.in_piece;
    cd[W + i] = first_slot(v.slots, W, q) * v.in_piece;
    if (piece_.axis[l] >= 0) {
      const int64_t e = piece_.extent(l, q);
      cd[2 * W + i] = v.count * v.P * e * v.Q;
      cd[3 * W + i] = v.count * v.P * off * v.Q;
      off += e;
    }
  }
}

void Unshard::cut_level(int l, float* local) {
  Backend& be = *opt_.backend;
  const Lv& v = lv_[l];
  if (piece_.axis[l] < 0) {
    float* dst = l == 0 ? local : lv_[l - 1].out;
    float* mine = dst + v.first * v.in_piece;
    if (mine != v.out) be.copy(mine, v.out, sizeof(float) * static_cast<size_t>(v.count * v.in_piece));
    return;
  }
  // Cut each owned slot back into the ranks' pieces, staged by destination.
  int64_t off = 0;
  for (int32_t q = 0; q < plan_.lv[l].size; ++q) {
    const int64_t e = piece_.extent(l, q);
    be.copy2d(v.stage + v.count * v.P * off * v.Q, sizeof(float) * static_cast<size_t>(e * v.Q), v.out + off * v.Q,
              sizeof(float) * static_cast<size_t>(v.full * v.Q), sizeof(float) * static_cast<size_t>(e * v.Q),
              static_cast<size_t>(v.count * v.P));
    off += e;
  }
}

void Unshard::send_level_back(int l, float* local) {
  std::vector<int64_t>& cd = opt_.coll_idx;
  const MbLevel& L = plan_.lv[l];
  const Lv& v = lv_[l];
  float* dst = l == 0 ? local : lv_[l - 1].out;
  const int32_t W = L.size;
  back_counts(l);
  if (piece_.axis[l] < 0)
    L.comm->all_gather_v(dst + v.first * v.in_piece, dst, cd.data(), cd.data() + W);
  else
    L.comm->all_to_all_v(v.stage, cd.data() + 2 * W, cd.data() + 3 * W, dst, cd.data(), cd.data() + W);
}

void Unshard::cut(float* local) {
  if (plan_.levels > 0) cut_level(plan_.levels - 1, local);
}

void Unshard::send_back(float* local) {
  for (int l = plan_.levels - 1; l >= 0; --l) {
    if (l < plan_.levels - 1) cut_level(l, local);
    send_level_back(l, local);
  }
}

void Unshard::backward(float* local) {
  cut(local);
  send_back(local);
}

}  // namespace dion
