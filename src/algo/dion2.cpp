// SPDX-License-Identifier: MIT
// Dion2 (spec §5): orthogonalize only the fraction of rows (or columns) of
// the momentum with the largest L1 norms.
//   M += G;  I = top-k slices of M by L1 norm, k = max(1, ceil(fraction * N));
//   S = M[I];  M[I] = ef_decay * S;  X = (1 - lr wd) X;  X[I] -= lr_adj orth(S)
// Slices are rows when the matrix is wide or square, columns when it is tall
// (the shorter dim is selected, so orth works on k x long). NorDion2 always
// selects rows (neurons), uses mu as the decay and normalises the selected
// rows with the "variance_neuron" state (spec §6.2).
//
// On matrices sharded over a multi-rank mesh (megabatch.hpp) the selection
// scope matters:
//  - global: every rank sends its whole shard of M to the matrix's owner,
//    which selects, decays and orthogonalizes exactly as one device would on
//    the whole matrix (so the result does not depend on the layout), and
//    sends back M and the update (zero outside the selected slices). The
//    selected dim is the single-device one; the reference selects along the
//    shard dim instead, which differs for a matrix sharded along its longer
//    dim.
//  - local (default, spec §5.3's sharded path): every rank selects among the
//    slices of its own shard of the selected dim, k = min(cap, its slices)
//    with cap = max(1, ceil(fraction ceil(N / W))) (W: that mesh's size), and
//    only the selected slices travel; the owner orthogonalizes their union
//    (the reference's zero padding to W cap slices changes nothing, spec §1.2
//    (i)). Dion2 selects along the sharded dim (the outer mesh's for a matrix
//    sharded over both meshes), NorDion2 rows. Beyond the reference: a
//    matrix also sharded over the other mesh sums its slices' L1 norms over
//    that mesh, so all of a slice's pieces select alike; and NorDion2 on a
//    matrix whose rows are whole (sharded along its columns only, which the
//    reference refuses) has one shard of the rows, so local is global there.
//  NorDion2's normalization runs on the owner over all the selected rows of
//  the matrix (the reference normalizes each rank's rows after the return,
//  with a per-shard Frobenius rescale), like NorMuon's.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "megabatch.hpp"
#include "pipeline.hpp"

namespace dion {

namespace {

// How a batch of tensor t is selected and moved.
struct Dion2Plan {
  MbPlan mb;
  bool whole = false;  // the owners select on whole matrices
  bool rows = true;    // logical rows are selected, else logical columns
  int sel = -1;        // local scope on a sharded matrix: the level sharding the selected dim
};

Dion2Plan dion2_plan(const Optimizer* opt, const Group& g, const Tensor& t, int64_t slots) {
  const bool nor = g.opt.algorithm == DION_ALGO_NORDION2, flatten = g.opt.flatten != 0;
  Dion2Plan p;
  p.mb = megabatch_plan(opt, t, flatten, slots);
  p.rows = nor || t.geom.m <= t.geom.n;  // the single-device rule
  if (!p.mb.sharded()) return p;         // whole matrices on every rank: local is global
  if (g.opt.selection_scope == DION_SELECTION_GLOBAL) {
    p.whole = true;
    return p;
  }
  if (nor) {
    for (int l = 0; l < p.mb.levels; ++l)
      if (is_row_dim(t, flatten, p.mb.lv[l].tdim)) p.sel = l;
    if (p.sel < 0) p.whole = true;  // the rows are whole: one shard of them
  } else {
    p.sel = p.mb.levels - 1;  // the outer mesh's level when there are two
    p.rows = is_row_dim(t, flatten, p.mb.lv[p.sel].tdim);
  }
  const int other = p.mb.levels == 2 ? 1 - p.sel : -1;
  if (p.sel >= 0 && other >= 0 && is_row_dim(t, flatten, p.mb.lv[other].tdim) == p.rows)
    fail(DION_ERROR_NOT_SUPPORTED,
         "%s with selection_scope local and flatten on a tensor whose dims %d and %d both index the flattened "
         "matrix's columns and are sharded over multi-rank meshes: use selection_scope global",
         g.opt.algorithm == DION_ALGO_NORDION2 ? "nordion2" : "dion2", p.mb.lv[0].tdim, p.mb.lv[1].tdim);
  return p;
}

struct Sel {
  Axis axis;    // storage axis of the selected slices
  int64_t N;    // slices per matrix
  int64_t len;  // length of a slice
  int64_t k;    // slices selected per matrix
  int64_t cap;  // local scope, sharded: every rank selects min(cap, its slices)
};

// The selection on (srows x scols) storage matrices: the local shard's or,
// for whole-matrix selection, the whole matrix's.
Sel selection(const dion_group_options_t& o, const Dion2Plan& p, const Tensor& t, int64_t srows, int64_t scols) {
  Sel s;
  s.axis = (p.rows != t.geom.storage_transposed) ? kRows : kCols;
  s.N = s.axis == kRows ? srows : scols;
  s.len = s.axis == kRows ? scols : srows;
  // k in double arithmetic, as the reference computes it.
  double n = static_cast<double>(s.N);
  if (p.sel >= 0) {
    const int64_t W = p.mb.lv[p.sel].size, global = p.rows ? t.geom.m : t.geom.n;
    n = static_cast<double>((global + W - 1) / W);
  }
  s.cap = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(o.fraction * n)));
  s.k = std::min(s.N, s.cap);
  return s;
}

// Local scope: the piece of the selected slices S (k x len, or len x k) of
// one matrix, sharded along the selected slices over the selecting mesh and
// along their length over the other one.
MbPiece selected_piece(const Dion2Plan& p, const Tensor& t, bool flatten, const Sel& s) {
  MbPiece sp = matrix_piece(t, p.mb, flatten);
  if (flatten && t.ndim >= 3 && !p.rows) {
    // Columns of a flattened tensor: one dim of k columns; the selecting
    // mesh's shard holds mult columns per index of its dim, the other mesh
    // (if any) shards the rows (dim 0).
    int64_t mult = 1;
    for (int d = 1; d < t.ndim; ++d)
      if (p.sel < 0 || d != p.mb.lv[p.sel].tdim) mult *= t.local_shape[d];
    sp.nd = 2;
    sp.dims[0] = t.local_shape[0];
    sp.dims[1] = s.k;
    for (int l = 0; l < p.mb.levels; ++l)
      if (sp.axis[l] >= 0) sp.axis[l] = l == p.sel ? 1 : 0;
    if (p.sel >= 0) sp.mult[p.sel] = mult;
  } else {
    sp.dims[flatten && t.ndim >= 3 ? 0 : s.axis] = s.k;
  }
  if (p.sel >= 0) sp.cap[p.sel] = s.cap;
  return sp;
}

// NorDion2, local scope: the variances of the selected rows.
MbPiece selected_neuron_piece(const Dion2Plan& p, const Tensor& t, const Sel& s) {
  MbPiece vp;
  vp.nd = 1;
  vp.dims[0] = s.k;
  if (p.sel >= 0) {
    vp.axis[p.sel] = 0;
    vp.ext[p.sel] = &t.shard_ext[p.mb.lv[p.sel].mesh];
    vp.cap[p.sel] = s.cap;
  }
  return vp;
}

MatBatch mat(float* p, int64_t rows, int64_t cols, int64_t batch) { return {p, rows, cols, cols, rows * cols, batch}; }

// The local path's selection (on this rank's shard, or on whole matrices),
// on the typed M and G (no fp32 copy of M + G): local_scores takes the
// scores (the pre-pass's, dion2_family_prepass, where it ran, else the
// slices' L1 norms of M + G), the indices and S from the workspace, and
// reduces the norms over the other mesh where a matrix is sharded over both
// (every piece of a slice must see the slice's whole norm, so that the
// ranks of that mesh select alike); local_select takes the top k and, in
// one more pass, M <- M + G with the selected slices decayed (error
// feedback on them only) and S <- those slices before the decay (of dtype
// sdt; sums: their squares' parts, nullable).
struct LocalSel {
  float* scores;
  int32_t* idx;
  MatBatch S;
};
LocalSel local_scores(Optimizer& opt, const Batch& bt, const Dion2Plan& p, const Sel& s) {
  const Tensor& t = bt.t;
  const int64_t B = t.geom.batch * bt.count;
  LocalSel ls;
  ls.scores = bt.pre ? const_cast<float*>(bt.pre) : opt.ws.take(B * s.N);
  ls.idx = reinterpret_cast<int32_t*>(opt.ws.take(B * s.k));
  ls.S = s.axis == kRows ? mat(opt.ws.take(B * s.k * s.len), s.k, s.len, B)
                         : mat(opt.ws.take(B * s.k * s.len), s.len, s.k, B);
  if (!bt.pre)
    opt.backend->momentum_l1_multi(bt.list, bt.count, t.geom.batch, t.geom.srows, t.geom.scols, s.axis, ls.scores,
                                   nullptr);
  if (p.sel >= 0 && p.mb.levels == 2) p.mb.lv[1 - p.sel].comm->all_reduce(ls.scores, B * s.N, ReduceOp::kSum);
  return ls;
}
void local_select(Optimizer& opt, const dion_group_options_t& o, const Batch& bt, const Sel& s, const LocalSel& ls,
                  dion_dtype_t sdt, double* sums) {
  const Tensor& t = bt.t;
  const int64_t B = t.geom.batch * bt.count;
  if (B <= 0 || s.k <= 0) return;
  const float decay = static_cast<float>(o.algorithm == DION_ALGO_NORDION2 ? o.mu : o.ef_decay);
  opt.backend->topk(ls.scores, B, s.N, s.k, ls.idx);
  opt.backend->select_momentum_multi(bt.list, bt.count, t.geom.batch, t.geom.srows, t.geom.scols, s.axis, ls.idx,
                                     s.k, decay, ls.S, sdt, opt.skip_flag(), sums);
}

// NorDion2 on the local path: the selected rows' variances travel with them
// (compact) to the owners of the slices Sw, which normalize them, and are
// written back in place: V[I] = 0, then V[I] += the new values (exact).
// With Sb (Sw's bf16 orthogonalization, read where it lies; no meshes)
// only the statistics are taken (neuron_scales: no pass writes the
// normalised slices), their scales into `scales` for the update.
void normalize_selected(Optimizer& opt, const dion_group_options_t& o, const Batch& bt, const Dion2Plan& p,
                        const Sel& s, const int32_t* idx, MatBatch Sw, const void* Sb = nullptr,
                        double* scales = nullptr) {
  Backend& be = *opt.backend;
  const Tensor& t = bt.t;
  const int64_t B = t.geom.batch * bt.count;
  const StateBuf& Vs = state_of(opt, t, 1);
  float* V = load_ws(opt, bt, kState1, Vs.numel);
  MatBatch Vm = mat(V, s.N, 1, B), Vsel = mat(opt.ws.take(B * s.k), s.k, 1, B);
  if (B > 0 && s.k > 0) be.gather_slices(Vm, kRows, idx, s.k, Vsel);
  Unshard uv(opt, p.mb, selected_neuron_piece(p, t, s), B);
  float* Vo = uv.forward(Vsel.p);
  if (Sb)
    be.neuron_scales(Sw.batch, Sw.rows, Sw.cols, s.axis, Sb, Vo, uv.whole().dims[0], static_cast<float>(o.muon_beta2),
                     scales);
  else
    be.neuron_normalize(Sw, s.axis, Vo, uv.whole().dims[0], static_cast<float>(o.muon_beta2), nullptr);
  uv.backward(Vsel.p);
  if (B > 0 && s.k > 0) {
    be.scale_slices(Vm, kRows, idx, s.k, 0.0f);
    be.add_slices(Vm, kRows, idx, s.k, Vsel, nullptr, 1.0f);
  }
  store_ws(opt, bt, kState1, V, Vs.numel);
}

// The local path's update: X = (1 - lr wd) X; X[I] -= lr lr_mult S on the
// typed params, in one pass (S of dtype dt: fp32, or the iteration's bf16;
// scales: NorDion2's normalisation of S, from normalize_selected).
void update_selected(Optimizer& opt, const Group& g, const Batch& bt, const Sel& s, const int32_t* idx,
                     ConstMatBatch S, dion_dtype_t dt, const double* scales = nullptr) {
  const Tensor& t = bt.t;
  const int64_t B = t.geom.batch * bt.count;
  const double lr_mult = adjusted_lr(g.opt, 1.0, t.geom.m, t.geom.n);  // from the FULL matrix shape
  opt.backend->decay_add_slices_multi(bt.list, bt.count, t.geom.batch, t.geom.srows, t.geom.scols, s.axis, idx,
                                      B > 0 ? s.k : 0, S, dt, scales, g.scalars, static_cast<float>(-lr_mult),
                                      opt.skip_flag());
}

}  // namespace

size_t dion2_family_workspace(const Group& g, const Tensor& t, int64_t count) {
  // Rank-independent (megabatch.hpp): the largest shard of any rank.
  const bool nor = g.opt.algorithm == DION_ALGO_NORDION2, flatten = g.opt.flatten != 0;
  const int64_t N = max_local_numel(t) * count, B = max_local_batch(t, flatten) * count;
  const Dion2Plan p = dion2_plan(nullptr, g, t, B);
  const int64_t rows = max_local_extent(t, flatten && t.ndim >= 3 ? 0 : t.ndim - 2);  // variances per matrix
  const MbPiece mp = largest_piece(p.mb, matrix_piece(t, p.mb, flatten));
  if (p.whole) {
    // M, the update (G and X stay in their typed buffers); the exchange of
    // M; on the owner the scores, indices and selected slices of its whole
    // matrices.
    const MbSizes u = megabatch_sizes(p.mb, matrix_piece(t, p.mb, flatten), B);
    const Sel s = selection(g.opt, p, t, u.whole.rows(), u.whole.cols());
    const int64_t c = u.owned;
    size_t w = 2 * ws_floats(N) + u.ws_floats + ws_floats(c * s.N) + ws_floats(c * s.k) + ws_floats(c * s.k * s.len);
    w += orthogonalize_ws_floats(s.axis == kRows ? s.k : s.len, s.axis == kRows ? s.len : s.k, c);
    if (nor) w += ws_floats(B * rows) + megabatch_sizes(p.mb, neuron_piece(t, p.mb, flatten), B).ws_floats;
    return w;
  }
  // The local scores, indices and selected slices (M, G and X stay in their
  // typed buffers); their exchange and orthogonalization.
  const Sel s = selection(g.opt, p, t, mp.rows(), mp.cols());
  const MbSizes u = megabatch_sizes(p.mb, selected_piece(p, t, flatten, s), B);
  size_t w = ws_floats(B * s.N) + ws_floats(B * s.k) + ws_floats(B * s.k * s.len) + u.ws_floats;
  if (p.mb.levels == 0) w += ws_floats(2 * B * Backend::select_parts_max(mp.rows(), mp.cols()));  // S's sums
  w += orthogonalize_ws_floats(u.whole.rows(), u.whole.cols(), u.owned);
  if (nor)  // V, its selected rows and their exchange; the scales (doubles) for a bf16 result
    w += ws_floats(B * rows) + ws_floats(B * s.k) + megabatch_sizes(p.mb, selected_neuron_piece(p, t, s), B).ws_floats +
         ws_floats(Backend::neuron_scales_floats(B, s.k));
  return w;
}

void dion2_family_step(Optimizer& opt, Group& g, const Batch& bt, bool nor) {
  Backend& be = *opt.backend;
  const dion_group_options_t& o = g.opt;
  const Tensor& t = bt.t;
  const bool flatten = o.flatten != 0;
  const int64_t n = t.numel_local, T = bt.count;
  const int64_t B = t.geom.batch * T;  // matrices in the batch
  const Dion2Plan p = dion2_plan(&opt, g, t, B);
  const float decay = static_cast<float>(nor ? o.mu : o.ef_decay);
  const double lr_mult = adjusted_lr(o, 1.0, t.geom.m, t.geom.n);  // from the FULL matrix shape
  if (p.whole) {
    // M += G (no decay here) into fp32 workspace, in one pass over the typed
    // M and G (Backend::momentum_multi with mu = 1); it travels to the owners.
    float* M = opt.ws.take(n * T);
    be.momentum_multi(bt.list, T, n, 1.0f, 1.0f, false, false, M, DION_DTYPE_FP32, opt.skip_flag(), nullptr);
    Unshard um(opt, p.mb, matrix_piece(t, p.mb, flatten), B);
    float* Mo = um.forward(M);
    const int64_t c = um.count(), wr = um.whole().rows(), wc = um.whole().cols();
    MatBatch Mw = mat(Mo, wr, wc, c);
    const Sel s = selection(o, p, t, wr, wc);
    float* scores = opt.ws.take(c * s.N);
    int32_t* idx = reinterpret_cast<int32_t*>(opt.ws.take(c * s.k));
    MatBatch S = s.axis == kRows ? mat(opt.ws.take(c * s.k * s.len), s.k, s.len, c)
                                 : mat(opt.ws.take(c * s.k * s.len), s.len, s.k, c);
    if (c > 0) {
      be.slice_l1(Mw, s.axis, scores);
      be.topk(scores, c, s.N, s.k, idx);
      be.gather_slices(Mw, s.axis, idx, s.k, S);
      be.scale_slices(Mw, s.axis, idx, s.k, decay);  // error feedback on the selected slices only
    }
    um.backward(M);
    store_ws(opt, bt, kState0, M, n);
    orthogonalize(opt, o, S);
    if (nor) {
      const StateBuf& Vs = state_of(opt, t, 1);
      float* V = load_ws(opt, bt, kState1, Vs.numel);
      Unshard uv(opt, p.mb, neuron_piece(t, p.mb, flatten), B);
      float* Vo = uv.forward(V);
      be.neuron_normalize(S, s.axis, Vo, s.N, static_cast<float>(o.muon_beta2), idx);
      uv.backward(V);
      store_ws(opt, bt, kState1, V, Vs.numel);
    }
    // The update: the orthogonalized slices in place, zero elsewhere.
    be.zero(Mo, sizeof(float) * static_cast<size_t>(c * wr * wc));
    if (c > 0) be.add_slices(Mw, s.axis, idx, s.k, S, nullptr, 1.0f);
    float* W = opt.ws.take(n * T);
    um.backward(W);
    be.apply_update_multi(bt.list, T, n, W, DION_DTYPE_FP32, g.scalars, static_cast<float>(lr_mult), false,
                          opt.skip_flag());
    return;
  }

  // Selection on this rank's shard (or whole matrices), on the typed M and
  // G (no fp32 copy of M + G): the slices' L1 norms of M + G, then in one
  // more pass M <- M + G with the selected slices decayed (error feedback on
  // them only), and S <- those slices before the decay.
  const int64_t per = t.geom.batch, srows = t.geom.srows, scols = t.geom.scols;
  const Sel s = selection(o, p, t, srows, scols);
  LocalSel ls = local_scores(opt, bt, p, s);
  int32_t* idx = ls.idx;
  MatBatch S = ls.S;
  // Without meshes S is orthogonalized where it is selected: the selection
  // pass also sums its squares (so the bf16 iteration's normalisation reads S
  // once, not twice).
  FrobParts sums;
  if (p.mb.levels == 0 && B > 0 && s.k > 0) {
    sums.nparts = be.select_momentum_parts(T, per, srows, scols);
    if (sums.nparts > Backend::select_parts_max(srows, scols)) sums.nparts = 0;
    if (sums.nparts > 0) sums.parts = reinterpret_cast<const double*>(opt.ws.take(2 * B * sums.nparts));
  }
  // NorDion2 reads the bf16 result where it lies (below) unless
  // DION_NORDION2_SCALES is 0 (read at each step): then, as before, the
  // result is widened into S and normalised there.
  const bool bf16_result = !nor || env_on("DION_NORDION2_SCALES");
  // Dion2 and NorDion2 without meshes, bf16 iteration: S is selected
  // straight into bf16 (half the bytes) and the iteration starts from it
  // unnormalised (its first step scales the small Gram matrices by the
  // selection's sums), so no pass reads S to normalise and round it.
  // DION_DION2_BF16_SLICES=0 keeps S in fp32 (read at each step).
  const bool bf16_slices = bf16_result && sums.nparts > 0 && o.matmul_precision == DION_MATMUL_BF16 &&
                           !be.host_memory() && env_on("DION_DION2_BF16_SLICES");
  local_select(opt, o, bt, s, ls, bf16_slices ? DION_DTYPE_BF16 : DION_DTYPE_FP32, const_cast<double*>(sums.parts));
  Unshard us(opt, p.mb, selected_piece(p, t, flatten, s), B);
  float* So = us.forward(S.p);
  MatBatch Sw = mat(So, us.whole().rows(), us.whole().cols(), us.count());
  // Without meshes a bf16 orthogonalization's result stays bf16 and the
  // update reads it there (no widening pass; the same values, bf16 widening
  // is exact). NorDion2 then takes only its neuron statistics, and the
  // update normalises the slices as it reads them (the bits of
  // neuron_normalize on the widened result up to the order of the sums of
  // squares; no pass writes the normalised slices).
  const void* Sb = nullptr;
  if (bf16_slices)
    orthogonalize_bf16_unnormalised(opt, o, Sw, sums, &Sb);
  else
    orthogonalize(opt, o, Sw, bf16_result && p.mb.levels == 0 ? &Sb : nullptr, sums);
  double* scales = nullptr;
  if (nor) {
    if (Sb) scales = reinterpret_cast<double*>(opt.ws.take(Backend::neuron_scales_floats(Sw.batch, Sw.rows)));
    normalize_selected(opt, o, bt, p, s, idx, Sw, Sb, scales);
  }
  us.backward(S.p);
  const ConstMatBatch Su = Sb ? ConstMatBatch(static_cast<const float*>(Sb), S.rows, S.cols, S.cols, S.rows * S.cols, B)
                              : ConstMatBatch(S);
  update_selected(opt, g, bt, s, idx, Su, Sb ? DION_DTYPE_BF16 : DION_DTYPE_FP32, scales);
}

// ---- The pipelined group step (pipeline.hpp) ----
// On the local path with one exchange level: A the selection (S), S and K
// the selected slices' exchange and way back, O their orthogonalization
// (and NorDion2's normalisation, its variances exchanged inside), X the
// update of the selected slices. The whole-matrix path (global scope) and
// two-level plans are stepped whole.

namespace {

bool dion2_piped(const Optimizer& opt, const Group& g, const Batch& bt) {
  const Dion2Plan p = dion2_plan(&opt, g, bt.t, bt.t.geom.batch * bt.count);
  return !p.whole && p.mb.levels == 1;
}

const PipelineKind kDion2Pipeline{dion2_piped, dion2_family_workspace};

}  // namespace

size_t dion2_group_workspace(const Optimizer& opt, const Group& g) {
  return pipeline_group_workspace(opt, g, kDion2Pipeline);
}

bool dion2_family_step_group(Optimizer& opt, Group& g, bool nor) {
  const PipelineBuckets* pb = pipeline_begin(opt, g, kDion2Pipeline);
  if (!pb) return false;
  const std::vector<Batch>& batches = pb->batches;
  const dion_group_options_t& o = g.opt;
  const bool flatten = o.flatten != 0;
  struct Run {
    Dion2Plan p;
    Sel s{};
    LocalSel ls{};
  };
  thread_local std::vector<Run> runs;
  runs.assign(batches.size(), Run{});
  PipelineExchanges ex(opt, batches.size());
  auto start = [&](size_t i, bool piped) {  // A, then S deferred
    const Batch& bt = batches[i];
    if (!piped) {
      dion2_family_step(opt, g, bt, nor);
      return;
    }
    const Tensor& t = bt.t;
    const int64_t B = t.geom.batch * bt.count;
    Run& u = runs[i];
    u.p = dion2_plan(&opt, g, t, B);
    u.s = selection(o, u.p, t, t.geom.srows, t.geom.scols);
    u.ls = local_scores(opt, bt, u.p, u.s);
    local_select(opt, o, bt, u.s, u.ls, DION_DTYPE_FP32, nullptr);
    ex.send(i, u.p.mb, selected_piece(u.p, t, flatten, u.s), B, u.ls.S.p);
  };
  auto middle = [&](size_t i) {  // O, then K deferred
    Run& u = runs[i];
    const MatBatch Sw = ex.received(i);
    orthogonalize(opt, o, Sw);
    if (nor) normalize_selected(opt, o, batches[i], u.p, u.s, u.ls.idx, Sw);
    ex.send_back(i, u.ls.S.p);
  };
  auto finish = [&](size_t i) {  // X, once K is done
    Run& u = runs[i];
    ex.wait_back(i);
    update_selected(opt, g, batches[i], u.s, u.ls.idx, ConstMatBatch(u.ls.S), DION_DTYPE_FP32);
  };
  run_pipeline(*pb, start, middle, finish);
  return true;
}

void dion2_family_check(const Group& g, const Tensor& t) { dion2_plan(nullptr, g, t, 1); }

// Without meshes the selection's L1 norms of M + G are taken in the pass
// that checks the gradients for NaN/Inf (Algorithm::prepass), so a step
// reads G once less: the norms read no state that the step has written yet
// (nothing is written before every bucket is checked) and, without meshes,
// no gradient is averaged in between. DION_DION2_PREPASS=0 turns it off (read
// at dion_add_group).
size_t dion2_family_prepass_floats(const Optimizer& opt, const Group& g, const Tensor& t, int64_t count) {
  if (!env_on("DION_DION2_PREPASS") || opt.has_meshes()) return 0;
  const int64_t B = t.geom.batch * count;
  const Dion2Plan p = dion2_plan(nullptr, g, t, B);
  if (p.whole || p.mb.levels != 0) return 0;
  return static_cast<size_t>(B * selection(g.opt, p, t, t.geom.srows, t.geom.scols).N);
}

void dion2_family_prepass(Optimizer& opt, Group& g, const Batch& bt, float* out, int32_t* nonfinite) {
  const Tensor& t = bt.t;
  const Dion2Plan p = dion2_plan(&opt, g, t, t.geom.batch * bt.count);
  const Sel s = selection(g.opt, p, t, t.geom.srows, t.geom.scols);
  opt.backend->momentum_l1_multi(bt.list, bt.count, t.geom.batch, t.geom.srows, t.geom.scols, s.axis, out, nonfinite);
}

namespace {
void init_state(Optimizer& opt, Group& g, Tensor& t) {
  dion2_family_check(g, t);
  add_momentum(opt, g, t);
}
void step(Optimizer& opt, Group& g, const Batch& b) { dion2_family_step(opt, g, b, false); }
bool step_group(Optimizer& opt, Group& g) { return dion2_family_step_group(opt, g, false); }
}  // namespace

extern const Algorithm kDion2 = {"dion2", false, init_state, dion2_family_workspace, step, step_group,
                                 dion2_group_workspace, dion2_family_prepass_floats, dion2_family_prepass};

}  // namespace dion
