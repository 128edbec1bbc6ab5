// SPDX-License-Identifier: MIT
// The megabatch-family harness (Muon, NorMuon, Dion2, NorDion2 on the
// meshes) shared by tests/mpi/test_mpi_megabatch.cpp (host backend, MPI
// communicators) and tests/nccl/test_nccl_megabatch.cpp (CUDA backend, NCCL
// communicators): the same layouts, tensors, single-process references,
// float64 emulation and tolerances on both (see test_mpi_megabatch.cpp for
// what is asserted and why). Parameters and gradients live in the backend's
// memory (g_env's hooks); states are read into host memory. The including
// file defines g_rank, g_size and g_env (ShardEnv, in shard_env.hpp) and
// fills g_env in main, before the tests run.
#pragma once
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "../reference/ref_muon.h"
#include "../scoped_env.h"
#include "dion_mpi.h"
#include "shard_env.hpp"

namespace {

// DION_TEST_VERBOSE=1 prints every comparison.
bool verbose() {
  static const bool v = std::getenv("DION_TEST_VERBOSE") && std::atoi(std::getenv("DION_TEST_VERBOSE"));
  return v;
}

// The gradient replica w sees at step s for tensor k, global logical element i
// (row-major over the global shape), and the initial parameter.
float grad_of(int w, int s, int k, int64_t i) {
  return hash_uniform(2000 + 37 * w + 7919 * s + 104729 * k, static_cast<uint64_t>(i));
}
float avg_grad(int R, int s, int k, int64_t i) {
  double a = 0;
  for (int w = 0; w < R; ++w) a += grad_of(w, s, k, i);
  return static_cast<float>(a / R);
}
float init_of(int k, int64_t i) { return 0.1f * hash_uniform(9 + k, static_cast<uint64_t>(i)); }

std::vector<Layout> layouts() {
  switch (g_size) {
    case 2:
      return {{1, 2, 1}, {1, 1, 2}, {2, 1, 1}};
    case 4:
      return {{1, 4, 1}, {1, 1, 4}, {1, 2, 2}, {2, 2, 1}};
    case 8:
      return {{2, 2, 2}, {1, 8, 1}};
    default:
      return {{1, g_size, 1}};
  }
}

std::string layout_name(const Layout& L) {
  return "R" + std::to_string(L.R) + "O" + std::to_string(L.O) + "I" + std::to_string(L.I);
}

// The shard of mesh 0 (outer: FSDP chunks) or 1 (inner: even split).
void shard_of(int mesh, int64_t full, int W, int q, int64_t* off, int64_t* ext) {
  if (mesh == 0)
    outer_shard(full, W, q, off, ext);
  else
    inner_shard(full, W, q, off, ext);
}

// One tensor: global shape, layout, and the dim each shard mesh splits (-1: none).
struct Spec {
  const char* name;
  std::vector<int64_t> shape;
  bool col_major;
  int outer_dim, inner_dim;
};

const std::vector<Spec>& specs(bool flatten) {
  // Two 18 x 12 make a batch of two; "experts" is sharded on its batch dim
  // over the outer mesh (no communication there) and on its rows over the
  // inner one; the two "plain" are replicated (case B over the replicate
  // mesh).
  static const std::vector<Spec> plain = {
      {"a", {18, 12}, false, 0, 1},         {"b", {18, 12}, false, 0, 1},
      {"tall", {24, 10}, false, 1, 0},      {"wide", {10, 28}, false, 0, -1},
      {"batched", {2, 12, 16}, false, 1, 2}, {"experts", {4, 10, 6}, false, 0, 1},
      {"colmajor", {16, 12}, true, 1, 0},  {"plain", {8, 6}, false, -1, -1},
      {"plain2", {8, 6}, false, -1, -1},
  };
  // Flattened to shape[0] x prod(rest): rows over the outer mesh and the
  // (strided) last dim over the inner one; a contiguous column block (dim 1)
  // over the outer mesh and the rows over the inner one; a 2-D tensor
  // (flatten changes nothing).
  static const std::vector<Spec> flat = {
      {"f3", {6, 4, 5}, false, 0, 2},
      {"f3b", {6, 4, 5}, false, 0, 2},
      {"fcols", {8, 6, 3}, false, 1, 0},
      {"f2", {12, 9}, false, 1, 0},
  };
  return flatten ? flat : plain;
}

struct Config {
  const char* name;
  dion_algorithm_t algo;
  int nesterov;
  dion_selection_scope_t scope;
  int flatten;
};

void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

int64_t prod(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t e : v) p *= e;
  return p;
}

// Offset of logical coords c in a dense buffer of dims e (row-major, or
// column-major for a 2-D COL_MAJOR buffer).
int64_t at(const std::vector<int64_t>& c, const std::vector<int64_t>& e, bool col_major) {
  if (col_major) return c[1] * e[0] + c[0];
  int64_t i = 0;
  for (size_t d = 0; d < e.size(); ++d) i = i * e[d] + c[d];
  return i;
}

// Calls f(c) for every coords c of dims e, in row-major order.
void for_each_coord(const std::vector<int64_t>& e, const std::function<void(const std::vector<int64_t>&)>& f) {
  if (prod(e) == 0) return;
  std::vector<int64_t> c(e.size(), 0);
  while (true) {
    f(c);
    int d = static_cast<int>(e.size()) - 1;
    while (d >= 0 && ++c[static_cast<size_t>(d)] == e[static_cast<size_t>(d)]) c[static_cast<size_t>(d--)] = 0;
    if (d < 0) return;
  }
}

std::vector<int64_t> plus(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::vector<int64_t> s(a.size());
  for (size_t d = 0; d < a.size(); ++d) s[d] = a[d] + b[d];
  return s;
}

struct Local {
  std::vector<int64_t> off, ext;       // per tensor dim
  std::vector<float> x, g;             // dense in the tensor's layout over ext
  float *dx = nullptr, *dg = nullptr;  // device copies (CUDA backend)
};

using OptRun = OptRunOf<Local>;

bool matrix_dim(const Spec& sp, bool flatten, int d) {
  const int nd = static_cast<int>(sp.shape.size());
  return d >= 0 && ((flatten && nd >= 3) || d >= nd - 2);
}
bool row_dim(const Spec& sp, bool flatten, int d) {
  const int nd = static_cast<int>(sp.shape.size());
  return d == ((flatten && nd >= 3) ? 0 : nd - 2);
}

dion_group_options_t group_options(const Config& c) {
  dion_group_options_t go;
  dion_group_options_init(&go, c.algo);
  go.lr = 0.02;
  go.weight_decay = 0.01;
  go.nesterov = c.nesterov;
  go.selection_scope = c.scope;
  go.flatten = c.flatten;
  return go;
}

void build(OptRun& run, const Grid& G, const Config& c, bool distributed) {
  dion_options_t o = mesh_options(G);
  o.seed = 7;
  if (!distributed) o.replicate_comm = o.outer_comm = o.inner_comm = nullptr;
  ASSERT_EQ(dion_create(&run.opt, &o), DION_SUCCESS) << dion_last_error(nullptr);
  const auto& S = specs(c.flatten != 0);
  run.loc.resize(S.size());
  std::vector<dion_tensor_t> ts(S.size());
  for (size_t k = 0; k < S.size(); ++k) {
    const Spec& sp = S[k];
    Local& l = run.loc[k];
    l.ext = sp.shape;
    l.off.assign(sp.shape.size(), 0);
    dion_tensor_t& t = ts[k];
    dion_tensor_init(&t);
    t.name = sp.name;
    t.param_dtype = DION_DTYPE_FP32;
    t.layout = sp.col_major ? DION_LAYOUT_COL_MAJOR : DION_LAYOUT_ROW_MAJOR;
    t.ndim = static_cast<int32_t>(sp.shape.size());
    for (size_t d = 0; d < sp.shape.size(); ++d) t.shape[d] = sp.shape[d];
    if (distributed && G.L.O > 1 && sp.outer_dim >= 0) {
      const size_t d = static_cast<size_t>(sp.outer_dim);
      outer_shard(sp.shape[d], G.L.O, G.o, &l.off[d], &l.ext[d]);
      t.outer_shard_dim = sp.outer_dim;
      t.outer_offset = l.off[d];
      t.outer_extent = l.ext[d];
    }
    if (distributed && G.L.I > 1 && sp.inner_dim >= 0) {
      const size_t d = static_cast<size_t>(sp.inner_dim);
      inner_shard(sp.shape[d], G.L.I, G.i, &l.off[d], &l.ext[d]);
      t.inner_shard_dim = sp.inner_dim;
      t.inner_offset = l.off[d];
      t.inner_extent = l.ext[d];
    }
    l.x.resize(static_cast<size_t>(std::max<int64_t>(prod(l.ext), 1)));
    l.g.resize(l.x.size());
    for_each_coord(l.ext, [&](const std::vector<int64_t>& cc) {
      l.x[static_cast<size_t>(at(cc, l.ext, sp.col_major))] =
          init_of(static_cast<int>(k), at(plus(cc, l.off), sp.shape, false));
    });
    t.param = l.x.data();
    t.grad = l.g.data();
    if (g_env.alloc) {
      l.dx = static_cast<float*>(g_env.alloc(sizeof(float) * l.x.size()));
      l.dg = static_cast<float*>(g_env.alloc(sizeof(float) * l.g.size()));
      g_env.h2d(l.dx, l.x.data(), sizeof(float) * l.x.size());
      t.param = l.dx;
      t.grad = l.dg;
    }
  }
  const dion_group_options_t go = group_options(c);
  ASSERT_EQ(dion_add_group(run.opt, &go, ts.data(), ts.size(), nullptr), DION_SUCCESS) << dion_last_error(run.opt);
}

void fill_grads(OptRun& run, const Grid& G, const Config& c, int step, bool distributed) {
  const auto& S = specs(c.flatten != 0);
  for (size_t k = 0; k < S.size(); ++k) {
    Local& l = run.loc[k];
    for_each_coord(l.ext, [&](const std::vector<int64_t>& cc) {
      const int64_t gi = at(plus(cc, l.off), S[k].shape, false);
      l.g[static_cast<size_t>(at(cc, l.ext, S[k].col_major))] =
          distributed ? grad_of(G.r, step, static_cast<int>(k), gi) : avg_grad(G.L.R, step, static_cast<int>(k), gi);
    });
  }
}

// ---- the float64 emulation of the local (per-shard) selection ----

// Which mesh selects, for Dion2/NorDion2 with selection_scope local on a
// tensor sharded along a matrix dim: Dion2 along the outer mesh's matrix dim
// (else the inner's), NorDion2 along the rows. `mesh` < 0: nothing to
// emulate (the single-process run is the reference).
struct EmuSel {
  int mesh = -1;
  int tdim = -1;
  bool rows = true;
};

EmuSel emu_sel(const Config& c, const Spec& sp, const Layout& L) {
  EmuSel e;
  if ((c.algo != DION_ALGO_DION2 && c.algo != DION_ALGO_NORDION2) || c.scope != DION_SELECTION_LOCAL) return e;
  const bool f = c.flatten != 0;
  const bool om = L.O > 1 && matrix_dim(sp, f, sp.outer_dim), im = L.I > 1 && matrix_dim(sp, f, sp.inner_dim);
  if (c.algo == DION_ALGO_NORDION2) {
    if (om && row_dim(sp, f, sp.outer_dim)) e.mesh = 0;
    if (im && row_dim(sp, f, sp.inner_dim)) e.mesh = 1;
  } else if (om || im) {
    e.mesh = om ? 0 : 1;
  }
  if (e.mesh < 0) return e;
  e.tdim = e.mesh == 0 ? sp.outer_dim : sp.inner_dim;
  e.rows = row_dim(sp, f, e.tdim);
  return e;
}

struct Emu {
  std::vector<double> x, m, v;  // logical row-major over the global shape (v: one per matrix row)
};

void emu_step(Emu& e, const Spec& sp, const Config& c, const Layout& L, const EmuSel& es, int k, int step) {
  const bool f = c.flatten != 0;
  const dionref::MatrixView mv = dionref::matrix_view(sp.shape, f);
  const int64_t rows = mv.rows, cols = mv.cols, per = rows * cols;
  for (size_t i = 0; i < e.m.size(); ++i) e.m[i] += avg_grad(L.R, step, k, static_cast<int64_t>(i));
  const int W = es.mesh == 0 ? L.O : L.I;
  // Slice j's index along the sharded dim: j itself for rows or a matrix's
  // columns; a flattened tensor's column j has coords over shape[1:].
  int64_t inner = 1;
  if (!es.rows && f && sp.shape.size() >= 3)
    for (size_t d = static_cast<size_t>(es.tdim) + 1; d < sp.shape.size(); ++d) inner *= sp.shape[d];
  const int64_t dim = sp.shape[static_cast<size_t>(es.tdim)];
  const int64_t N = es.rows ? rows : cols, len = es.rows ? cols : rows;
  const double fraction = 0.25;
  const double per_rank = static_cast<double>((N + W - 1) / W);
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(fraction * per_rank)));
  const double decay = 0.95;  // ef_decay (Dion2) and mu (NorDion2), both at their defaults
  const double lr = 0.02, wd = 0.01, lr_adj = lr * std::sqrt(static_cast<double>(rows) / static_cast<double>(cols));
  for (int64_t b = 0; b < mv.batch; ++b) {
    auto idx = [&](int64_t sl, int64_t el) {
      return static_cast<size_t>(b * per + (es.rows ? sl * cols + el : el * cols + sl));
    };
    std::vector<double> l1(static_cast<size_t>(N), 0.0);
    for (int64_t sl = 0; sl < N; ++sl)
      for (int64_t el = 0; el < len; ++el) l1[static_cast<size_t>(sl)] += std::fabs(e.m[idx(sl, el)]);
    std::vector<int64_t> sel;
    for (int q = 0; q < W; ++q) {
      int64_t off = 0, ext = 0;
      shard_of(es.mesh, sp.shape[static_cast<size_t>(es.tdim)], W, q, &off, &ext);
      std::vector<int64_t> mine;
      for (int64_t j = 0; j < N; ++j)
        if ((j / inner) % dim >= off && (j / inner) % dim < off + ext) mine.push_back(j);
      std::stable_sort(mine.begin(), mine.end(),
                       [&](int64_t a, int64_t z) { return l1[static_cast<size_t>(a)] > l1[static_cast<size_t>(z)]; });
      const int64_t kq = std::min<int64_t>(cap, static_cast<int64_t>(mine.size()));
      sel.insert(sel.end(), mine.begin(), mine.begin() + kq);
    }
    std::sort(sel.begin(), sel.end());
    const int64_t K = static_cast<int64_t>(sel.size());
    dionref::Matrix<double> s = es.rows ? dionref::Matrix<double>(K, cols) : dionref::Matrix<double>(rows, K);
    for (int64_t j = 0; j < K; ++j)
      for (int64_t el = 0; el < len; ++el) {
        double& mv_el = e.m[idx(sel[static_cast<size_t>(j)], el)];
        (es.rows ? s(j, el) : s(el, j)) = mv_el;
        mv_el *= decay;
      }
    dionref::Matrix<double> o = dionref::orthogonalize(dionref::Ortho::kPolarExpress, s, 5, 1e-8);
    if (c.algo == DION_ALGO_NORDION2) dionref::neuron_normalize(o, e.v, b * rows, sel, 0.95, dionref::Dtype::kF32);
    for (int64_t i = 0; i < per; ++i) e.x[static_cast<size_t>(b * per + i)] *= 1.0 - lr * wd;
    for (int64_t j = 0; j < K; ++j)
      for (int64_t el = 0; el < len; ++el)
        e.x[idx(sel[static_cast<size_t>(j)], el)] -= lr_adj * (es.rows ? o(j, el) : o(el, j));
  }
}

// ---- comparisons ----

// Relative difference of a state's local shard from the reference's value at
// the same global coords (want: global logical coords -> value); -1 if the
// shard is empty.
double state_diff(const dion_state_info_t& di, const std::vector<float>& got,
                  const std::function<double(const std::vector<int64_t>&)>& want) {
  const std::vector<int64_t> ext(di.local_shape, di.local_shape + di.ndim);
  const std::vector<int64_t> off(di.local_offset, di.local_offset + di.ndim);
  std::vector<double> a, b;
  for_each_coord(ext, [&](const std::vector<int64_t>& cc) {
    a.push_back(got[static_cast<size_t>(at(cc, ext, di.layout == DION_LAYOUT_COL_MAJOR))]);
    b.push_back(want(plus(cc, off)));
  });
  return a.empty() ? -1 : rel_diff(a, b);
}

// The bytes a Muon step hands to mesh `mesh` (DION_MESH_*) when at most one
// shard mesh has several ranks: the non-finite flag's all-reduce (4 bytes),
// the replicate mesh's gradient average, and per batch (the tensors of one
// shape and sharding, B matrices on this rank) crossing the mesh: on a shard
// mesh one all_to_all_v of this rank's B pieces and one of its owned whole
// matrices; on the replicate mesh, for matrices whole on every rank and
// B > 1, the all-gather of its owned matrices. A rank q of W owns slots
// [q B / W, (q+1) B / W).
uint64_t muon_bytes(const Grid& G, const Config& c, int mesh) {
  const Layout& L = G.L;
  const bool f = c.flatten != 0;
  const int W = mesh == DION_MESH_REPLICATE ? L.R : mesh == DION_MESH_OUTER ? L.O : L.I;
  const int q = mesh == DION_MESH_REPLICATE ? G.r : mesh == DION_MESH_OUTER ? G.o : G.i;
  std::map<std::string, std::pair<int64_t, std::pair<int64_t, int64_t>>> batches;  // key -> (B, (piece, whole))
  uint64_t bytes = 4;
  for (const Spec& sp : specs(f)) {
    const size_t nd = sp.shape.size();
    std::vector<int64_t> off(nd, 0), ext = sp.shape;
    const size_t od = static_cast<size_t>(sp.outer_dim), id = static_cast<size_t>(sp.inner_dim);
    if (L.O > 1 && sp.outer_dim >= 0) outer_shard(sp.shape[od], L.O, G.o, &off[od], &ext[od]);
    if (L.I > 1 && sp.inner_dim >= 0) inner_shard(sp.shape[id], L.I, G.i, &off[id], &ext[id]);
    if (mesh == DION_MESH_REPLICATE) bytes += 4u * static_cast<uint64_t>(prod(ext));
    const bool om = L.O > 1 && matrix_dim(sp, f, sp.outer_dim), im = L.I > 1 && matrix_dim(sp, f, sp.inner_dim);
    if (mesh == DION_MESH_REPLICATE ? (om || im) : !(mesh == DION_MESH_OUTER ? om : im)) continue;
    const size_t mat = f && nd >= 3 ? 0 : nd - 2;  // the dims of one matrix: [mat, nd)
    int64_t batch = 1, piece = 1, whole = 1;
    for (size_t d = 0; d < nd; ++d) {
      (d < mat ? batch : piece) *= ext[d];
      if (d >= mat) whole *= sp.shape[d];
    }
    std::string key;
    for (int64_t e : sp.shape) key += std::to_string(e) + "x";
    key += std::to_string(sp.col_major) + std::to_string(sp.outer_dim) + std::to_string(sp.inner_dim);
    auto& bt = batches[key];
    bt.first += batch;
    bt.second = {piece, whole};
  }
  for (const auto& kv : batches) {
    const int64_t B = kv.second.first, count = (q + 1) * B / W - q * B / W;
    if (mesh == DION_MESH_REPLICATE) {
      if (B > 1) bytes += 4u * static_cast<uint64_t>(count * kv.second.second.second);
    } else {
      bytes += 4u * static_cast<uint64_t>(B * kv.second.second.first + count * kv.second.second.second);
    }
  }
  return bytes;
}

class Megabatch : public ::testing::TestWithParam<Config> {};

TEST_P(Megabatch, EqualsSingleProcessOnTheGlobalMatrices) {
  const Config c = GetParam();
  const auto& S = specs(c.flatten != 0);
  const bool normalizes = c.algo == DION_ALGO_NORMUON || c.algo == DION_ALGO_NORDION2;
  for (const Layout& L : layouts()) {
    SCOPED_TRACE("layout " + layout_name(L));
    Grid G(L);
    OptRun dist, ref;
    build(dist, G, c, true);
    build(ref, G, c, false);
    if (HasFatalFailure()) return;
    std::vector<EmuSel> es(S.size());
    std::vector<Emu> emu(S.size());
    for (size_t k = 0; k < S.size(); ++k) {
      es[k] = emu_sel(c, S[k], L);
      if (es[k].mesh < 0) continue;
      const int64_t n = prod(S[k].shape);
      const dionref::MatrixView mv = dionref::matrix_view(S[k].shape, c.flatten != 0);
      emu[k].m.assign(static_cast<size_t>(n), 0.0);
      emu[k].v.assign(static_cast<size_t>(mv.batch * mv.rows), 0.0);
      for (int64_t i = 0; i < n; ++i) emu[k].x.push_back(init_of(static_cast<int>(k), i));
    }
    std::vector<std::vector<float>> x0(S.size());
    for (size_t k = 0; k < S.size(); ++k) x0[k] = dist.loc[k].x;
    for (int s = 0; s < 3; ++s) {
      fill_grads(dist, G, c, s, true);
      fill_grads(ref, G, c, s, false);
      ASSERT_EQ(dist.step(), DION_SUCCESS) << dion_last_error(dist.opt);
      ASSERT_EQ(ref.step(), DION_SUCCESS) << dion_last_error(ref.opt);
      for (size_t k = 0; k < S.size(); ++k)
        if (es[k].mesh >= 0) emu_step(emu[k], S[k], c, L, es[k], static_cast<int>(k), s);
    }
    // Traffic: the shard meshes carry the all-to-alls, beyond the 4-byte
    // non-finite flag (exactly the documented split for Muon on one mesh).
    uint64_t bytes[3] = {0, 0, 0};
    for (int m = 0; m < 3; ++m)
      ASSERT_EQ(dion_get_comm_bytes(dist.opt, static_cast<dion_mesh_t>(m), &bytes[m], nullptr), DION_SUCCESS);
    // Over the world (a rank whose shards are all empty and that owns no
    // slot moves only the flag).
    unsigned long long sum[3] = {0, 0, 0};
    for (int m = 0; m < 3; ++m) sum[m] = bytes[m];
    MPI_Allreduce(MPI_IN_PLACE, sum, 3, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (L.O > 1) {
      EXPECT_GT(sum[DION_MESH_OUTER], 4u * static_cast<unsigned>(g_size)) << "outer mesh";
    }
    if (L.I > 1) {
      EXPECT_GT(sum[DION_MESH_INNER], 4u * static_cast<unsigned>(g_size)) << "inner mesh";
    }
    if (c.algo == DION_ALGO_MUON && (L.O == 1 || L.I == 1)) {
      for (int m = 0; m < 3; ++m) {
        const int W = m == DION_MESH_REPLICATE ? L.R : m == DION_MESH_OUTER ? L.O : L.I;
        if (W > 1) {
          EXPECT_EQ(bytes[m], muon_bytes(G, c, m)) << "the volume on mesh " << m;
        }
      }
    } else if (L.R > 1) {
      // At least the gradient average and the flag.
      uint64_t grads = 4;
      for (const Local& l : dist.loc) grads += 4u * static_cast<uint64_t>(prod(l.ext));
      EXPECT_GE(bytes[DION_MESH_REPLICATE], grads) << "replicate mesh";
    }
    double worst = 0;
    for (size_t k = 0; k < S.size(); ++k) {
      const Spec& sp = S[k];
      SCOPED_TRACE(std::string("tensor ") + sp.name + (es[k].mesh >= 0 ? " (vs the float64 emulation)" : ""));
      const double tol = es[k].mesh >= 0 ? 2e-4 : 1e-4;
      const Local& l = dist.loc[k];
      // the reference's value at global logical coords, for a stored buffer
      auto ref_at = [&](const std::vector<float>& buf, const std::vector<int64_t>& gshape, bool cm) {
        return [&buf, gshape, cm](const std::vector<int64_t>& gc) {
          return static_cast<double>(buf[static_cast<size_t>(at(gc, gshape, cm))]);
        };
      };
      // parameters: the update X - X0
      std::vector<double> du, dr;
      for_each_coord(l.ext, [&](const std::vector<int64_t>& cc) {
        const int64_t li = at(cc, l.ext, sp.col_major);
        const std::vector<int64_t> gc = plus(cc, l.off);
        const int64_t gi = at(gc, sp.shape, false);
        du.push_back(static_cast<double>(l.x[static_cast<size_t>(li)]) - x0[k][static_cast<size_t>(li)]);
        const double want = es[k].mesh >= 0 ? emu[k].x[static_cast<size_t>(gi)]
                                             : ref.loc[k].x[static_cast<size_t>(at(gc, sp.shape, sp.col_major))];
        dr.push_back(want - init_of(static_cast<int>(k), gi));
      });
      if (!du.empty()) {
        const double d = rel_diff(du, dr);
        if (verbose()) std::printf("[%d] %s %s %s x %.3g\n", g_rank, c.name, layout_name(L).c_str(), sp.name, d);
        worst = std::max(worst, d);
        EXPECT_LT(d, tol) << "parameter update";
      }
      std::vector<const char*> names = {"momentum"};
      if (normalizes) names.push_back("variance_neuron");
      for (const char* name : names) {
        dion_state_info_t di, ri;
        const std::vector<float> ds = read_state(dist.opt, static_cast<int32_t>(k), name, &di);
        const std::vector<float> rs = read_state(ref.opt, static_cast<int32_t>(k), name, &ri);
        ASSERT_EQ(di.ndim, ri.ndim);
        const std::vector<int64_t> gshape(ri.global_shape, ri.global_shape + ri.ndim);
        std::function<double(const std::vector<int64_t>&)> want;
        if (es[k].mesh >= 0) {
          const std::vector<double>& v = std::string(name) == "momentum" ? emu[k].m : emu[k].v;
          want = [&v, gshape](const std::vector<int64_t>& gc) { return v[static_cast<size_t>(at(gc, gshape, false))]; };
        } else {
          want = ref_at(rs, gshape, ri.layout == DION_LAYOUT_COL_MAJOR);
        }
        const double d = state_diff(di, ds, want);
        if (d < 0) continue;
        if (verbose()) std::printf("[%d] %s %s %s %s %.3g\n", g_rank, c.name, layout_name(L).c_str(), sp.name, name, d);
        worst = std::max(worst, d);
        EXPECT_LT(d, tol) << name;
      }
    }
    if (g_rank == 0) RecordProperty("worst_rel_diff_" + layout_name(L), std::to_string(worst));
  }
}

const Config kConfigs[] = {
    {"Muon", DION_ALGO_MUON, 0, DION_SELECTION_LOCAL, 0},
    {"Muon_nesterov", DION_ALGO_MUON, 1, DION_SELECTION_LOCAL, 0},
    {"NorMuon", DION_ALGO_NORMUON, 1, DION_SELECTION_LOCAL, 0},
    {"Dion2_local", DION_ALGO_DION2, 0, DION_SELECTION_LOCAL, 0},
    {"Dion2_global", DION_ALGO_DION2, 0, DION_SELECTION_GLOBAL, 0},
    {"NorDion2_local", DION_ALGO_NORDION2, 0, DION_SELECTION_LOCAL, 0},
    {"NorDion2_global", DION_ALGO_NORDION2, 0, DION_SELECTION_GLOBAL, 0},
    {"Muon_flatten", DION_ALGO_MUON, 1, DION_SELECTION_LOCAL, 1},
    {"NorMuon_flatten", DION_ALGO_NORMUON, 0, DION_SELECTION_LOCAL, 1},
    {"Dion2_local_flatten", DION_ALGO_DION2, 0, DION_SELECTION_LOCAL, 1},
    {"Dion2_global_flatten", DION_ALGO_DION2, 0, DION_SELECTION_GLOBAL, 1},
    {"NorDion2_local_flatten", DION_ALGO_NORDION2, 0, DION_SELECTION_LOCAL, 1},
};

INSTANTIATE_TEST_SUITE_P(All, Megabatch, ::testing::ValuesIn(kConfigs),
                         [](const ::testing::TestParamInfo<Config>& i) { return std::string(i.param.name); });

// The Muon family's pipelined group step (src/algo/pipeline.hpp): the
// buckets with one exchange level stepped as momentum or selection +
// exchange | orthogonalization + way back | update, bucket i + 1's exchange
// and bucket i's way back deferred on the comm stream while bucket i is
// orthogonalized; the others stepped whole in between. For Muon, NorMuon,
// and Dion2 and NorDion2 with local selection (their neuron statistics
// exchanged inside the pipeline) on every layout, 3 steps: the same
// parameters and states as the bucket-by-bucket step
// (DION_MEGABATCH_PIPELINE=0), bit for bit on the host backend (each bucket
// sees the same operations and collectives, only in another order between
// buckets) and within 1e-6 relative on the GPU (the same kernels, on other
// workspace addresses); and, where two or more buckets have one level (the
// pipeline runs), more workspace reserved than bucket by bucket.
TEST(MegabatchPipeline, EqualsBucketByBucket) {
  for (const Config& c : {Config{"Muon", DION_ALGO_MUON, 1, DION_SELECTION_LOCAL, 0},
                          Config{"NorMuon", DION_ALGO_NORMUON, 1, DION_SELECTION_LOCAL, 0},
                          Config{"Dion2_local", DION_ALGO_DION2, 0, DION_SELECTION_LOCAL, 0},
                          Config{"NorDion2_local", DION_ALGO_NORDION2, 0, DION_SELECTION_LOCAL, 0}}) {
    const auto& S = specs(false);
    for (const Layout& L : layouts()) {
      SCOPED_TRACE(std::string(c.name) + ", layout " + layout_name(L));
      Grid G(L);
      OptRun run[2];
      uint64_t ws[2] = {0, 0};
      for (int off = 0; off < 2; ++off) {
        {
          std::optional<ScopedEnv> pipeline;
          if (off) pipeline.emplace("DION_MEGABATCH_PIPELINE", "0");
          build(run[off], G, c, true);
          for (int s = 0; s < 3 && !HasFatalFailure(); ++s) {
            fill_grads(run[off], G, c, s, true);
            ASSERT_EQ(run[off].step(), DION_SUCCESS) << dion_last_error(run[off].opt);
          }
        }
        if (HasFatalFailure()) return;
        uint64_t state_bytes = 0;
        ASSERT_EQ(dion_get_memory_usage(run[off].opt, &state_bytes, &ws[off]), DION_SUCCESS);
      }
      const bool host = g_env.backend == DION_BACKEND_HOST;
      for (size_t k = 0; k < S.size(); ++k) {
        SCOPED_TRACE(std::string("tensor ") + S[k].name);
        const std::vector<float>&a = run[0].loc[k].x, &b = run[1].loc[k].x;
        if (host) {
          EXPECT_TRUE(a == b) << "parameters differ";
        } else {
          EXPECT_LT(rel_diff(std::vector<double>(a.begin(), a.end()), std::vector<double>(b.begin(), b.end())), 1e-6);
        }
        for (const char* name : {"momentum", "variance_neuron"}) {
          const bool normalizes = c.algo == DION_ALGO_NORMUON || c.algo == DION_ALGO_NORDION2;
          if (!normalizes && std::string(name) == "variance_neuron") continue;
          dion_state_info_t i0, i1;
          const std::vector<float> s0 = read_state(run[0].opt, static_cast<int32_t>(k), name, &i0);
          const std::vector<float> s1 = read_state(run[1].opt, static_cast<int32_t>(k), name, &i1);
          if (host) {
            EXPECT_TRUE(s0 == s1) << name << " differs";
          } else {
            EXPECT_LT(rel_diff(std::vector<double>(s0.begin(), s0.end()), std::vector<double>(s1.begin(), s1.end())),
                      1e-6)
                << name;
          }
        }
      }
      // One-level buckets: the 2-D tensors sharded over the one shard mesh
      // (with a single shard mesh), or the replicated ones split over the
      // replicate mesh (several of a shape). On a device backend with a
      // replicate mesh the replicate gradient average is overlapped with the
      // buckets (replicate_grad_sync is on by default), and that pipeline
      // steps these groups bucket by bucket instead (src/algo/pipeline.hpp),
      // so no pipeline workspace is reserved there.
      const bool one_shard_mesh = (L.O > 1) != (L.I > 1);
      const char* ov = std::getenv("DION_OVERLAP");
      const bool overlapped_sync = !host && L.R > 1 && !(ov && std::string(ov) == "0");
      if (one_shard_mesh && !overlapped_sync) {
        EXPECT_GT(ws[0], ws[1]) << "the pipelined step's workspace was not reserved";
      }
    }
  }
}

// The one sharding the local selection cannot follow (flatten, the selected
// columns' dim and another column dim sharded over the two meshes) fails
// dion_add_group on every rank with NOT_SUPPORTED naming the tensor; the
// global scope takes it.
TEST(MegabatchErrors, LocalSelectionOverTwoColumnDimsIsNotSupported) {
  for (const Layout& L : layouts()) {
    if (L.O < 2 || L.I < 2) continue;
    SCOPED_TRACE("layout " + layout_name(L));
    Grid G(L);
    for (dion_selection_scope_t scope : {DION_SELECTION_LOCAL, DION_SELECTION_GLOBAL}) {
      dion_options_t o = mesh_options(G);
      dion_optimizer_t opt = nullptr;
      ASSERT_EQ(dion_create(&opt, &o), DION_SUCCESS) << dion_last_error(nullptr);
      int64_t off1 = 0, ext1 = 0, off2 = 0, ext2 = 0;
      outer_shard(6, L.O, G.o, &off1, &ext1);
      inner_shard(8, L.I, G.i, &off2, &ext2);
      Buf x(4 * ext1 * ext2, 0.1f), g(4 * ext1 * ext2, 0.01f);
      dion_tensor_t t;
      dion_tensor_init(&t);
      t.name = "two_column_dims";
      t.param = x.ptr();
      t.grad = g.ptr();
      t.ndim = 3;
      t.shape[0] = 4;
      t.shape[1] = 6;
      t.shape[2] = 8;
      t.outer_shard_dim = 1;
      t.outer_offset = off1;
      t.outer_extent = ext1;
      t.inner_shard_dim = 2;
      t.inner_offset = off2;
      t.inner_extent = ext2;
      Config c{"x", DION_ALGO_DION2, 0, scope, 1};
      const dion_group_options_t go = group_options(c);
      const dion_status_t st = dion_add_group(opt, &go, &t, 1, nullptr);
      if (scope == DION_SELECTION_LOCAL) {
        EXPECT_EQ(st, DION_ERROR_NOT_SUPPORTED);
        const std::string msg = dion_last_error(opt);
        EXPECT_NE(msg.find("two_column_dims"), std::string::npos) << msg;
        EXPECT_NE(msg.find("selection_scope global"), std::string::npos) << msg;
        int32_t count = -1;
        EXPECT_EQ(dion_tensor_count(opt, &count), DION_SUCCESS);
        EXPECT_EQ(count, 0);
      } else {
        EXPECT_EQ(st, DION_SUCCESS) << dion_last_error(opt);
        EXPECT_EQ(dion_step(opt, nullptr), DION_SUCCESS) << dion_last_error(opt);
      }
      dion_destroy(opt);
    }
  }
}

}  // namespace
